"""Third-party warnings shown once: diffusers and transformers repeat theirs per switch, per
component or per call. And never a user's prompt: diffusers' pipelines log the part of a
prompt their tokenizer cut (a served prompt may be kilobytes of a user's text); the
filter puts its length in its place, and caps any library record at
:data:`MAX_MESSAGE` characters.

diffusers and transformers log to handlers of their own (their library loggers do not
propagate to the root logger), so a filter on the root logger's handlers never sees
their records; :class:`LibraryWarningsOnce` puts its filter on those handlers too, and
wraps :func:`warnings.showwarning` (the warnings module's own once-per-line registry is
reset whenever any code changes the warning filters, which libraries do per call).

>>> quiet = LibraryWarningsOnce()
>>> with quiet:  # doctest: +SKIP
...     pipe.vae.to(torch.float32)  # diffusers' "should be kept in float32": said once
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from typing import Any

__all__ = ["LIBRARIES", "MAX_MESSAGE", "LibraryWarningsOnce", "Once", "redact"]

LIBRARIES = ("diffusers", "transformers")
MAX_MESSAGE = 500  # characters of a library's log record; the rest is cut
# diffusers' "The following part of your input was truncated because CLIP can only handle
# sequences up to 77 tokens: ['<the rest of the prompt>']" (and its T5 sibling)
_CUT_PROMPT = re.compile(r"(part of your input was truncated because .*? tokens): ?(.*)\Z", re.S)


def redact(message: str) -> str:
    """``message`` without the prompt text a library quoted in it, and at most
    :data:`MAX_MESSAGE` characters.

    >>> redact("The following part of your input was truncated because CLIP can only "
    ...        "handle sequences up to 77 tokens: ['a very long prompt']")
    'The following part of your input was truncated because CLIP can only handle sequences up to 77 tokens: [22 characters of the prompt, not logged]'
    """
    m = _CUT_PROMPT.search(message)
    if m is not None:
        message = f"{message[: m.end(1)]}: [{len(m.group(2))} characters of the prompt, not logged]"
    if len(message) > MAX_MESSAGE:
        message = f"{message[:MAX_MESSAGE]}… [{len(message) - MAX_MESSAGE} more characters]"
    return message


class Once(logging.Filter):
    """A handler filter letting each distinct warning (logger, message) through once;
    errors always pass. ``names``: only records of these loggers (and their children)
    are held to once, and :func:`redact`-ed; ``None``: every record."""

    def __init__(self, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.names = names
        self.suppressed = 0  # records held back so far
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if self.names is not None and not any(
            record.name == n or record.name.startswith(n + ".") for n in self.names
        ):
            return True
        said = getattr(record, "nostall_once", None)
        if said is not None:  # the same record at another handler: the same answer
            return said
        text = record.getMessage()
        if self.names is not None:  # (a library's record: no prompt text, bounded)
            cleaned = redact(text)
            if cleaned != text:
                record.msg, record.args, text = cleaned, None, cleaned
        key = (record.name, text)
        with self._lock:
            said = key not in self._seen
            self._seen.add(key)
            self.suppressed += not said
        record.nostall_once = said
        return said


class LibraryWarningsOnce:
    """Each distinct warning once while installed: the log records of ``libraries``
    (on every handler of their loggers and of the root logger) and Python warnings (each
    text once, whichever module or line raised it).

    Owned by whoever creates it (a worker, the CLI): :meth:`install` as often as wanted
    (it also reaches handlers added since), :meth:`remove` when done; ``with`` does both.
    What was seen is remembered across installs, so a warning said by one job is not
    said again by the next.
    """

    def __init__(self, libraries: tuple[str, ...] = LIBRARIES) -> None:
        self.filter = Once(libraries)
        self._shown: set[tuple[type, str]] = set()
        self._handlers: list[logging.Handler] = []
        # what showed warnings when this was first installed: fixed, so chains of owners
        # only ever point at earlier ones and never loop
        self._next: Any = None
        self._lock = threading.Lock()

    @property
    def suppressed(self) -> int:
        """Log records held back so far (repeated Python warnings are not counted)."""
        return self.filter.suppressed

    def install(self) -> None:
        with self._lock:
            for name in ("", *self.filter.names):
                for h in logging.getLogger(name).handlers:
                    if self.filter not in h.filters:
                        h.addFilter(self.filter)
                        self._handlers.append(h)
            if self._next is None:
                self._next = warnings.showwarning
            if warnings.showwarning != self._show:
                warnings.showwarning = self._show

    def remove(self) -> None:
        with self._lock:
            for h in self._handlers:
                h.removeFilter(self.filter)
            self._handlers.clear()
            # Only while ours is the one in place: an owner that wrapped ours later still
            # calls it, and it passes everything on.
            if self._next is not None and warnings.showwarning == self._show:
                warnings.showwarning = self._next

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        key = (category, str(message))
        with self._lock:
            if key in self._shown:
                return
            self._shown.add(key)
        self._next(message, category, filename, lineno, file, line)

    def __enter__(self) -> LibraryWarningsOnce:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
