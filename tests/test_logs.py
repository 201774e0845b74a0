"""Third-party warnings once: log records of the libraries' own handlers, Python warnings."""

from __future__ import annotations

import logging
import warnings

from nostall.logs import LibraryWarningsOnce, Once


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _logger(name: str, *handlers: logging.Handler) -> logging.Logger:
    """A library-style logger: handlers of its own, not propagating to the root."""
    log = logging.getLogger(name)
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in handlers:
        log.addHandler(h)
    return log


def test_once_lets_each_warning_through_once_at_every_handler_and_errors_always():
    first, second = _Collect(), _Collect()
    once = Once(("fakelib",))
    for h in (first, second):
        h.addFilter(once)
    lib = _logger("fakelib", first, second)
    other = _logger("otherlib", first)
    try:
        for _ in range(3):
            logging.getLogger("fakelib.models").warning("kept in float32")
            lib.error("an error each time")
            other.warning("not held to once")
        logging.getLogger("fakelib.models").warning("another text")
        for h in (first, second):  # both handlers got the first of each
            assert h.messages.count("kept in float32") == 1
            assert h.messages.count("an error each time") == 3
            assert h.messages.count("another text") == 1
        assert first.messages.count("not held to once") == 3
        assert once.suppressed == 2
    finally:
        for h in (first, second):
            lib.removeHandler(h)
        other.removeHandler(first)


def test_library_warnings_once_installs_on_the_library_handlers_and_removes_cleanly():
    collect = _Collect()
    lib = _logger("fakelib2", collect)
    said: list[str] = []
    before = warnings.showwarning
    try:
        warnings.showwarning = lambda m, *a, **k: said.append(str(m))
        own = warnings.showwarning
        quiet = LibraryWarningsOnce(("fakelib2",))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(2):  # the seen texts are remembered across installs
                with quiet:
                    for _ in range(3):
                        lib.warning("should be kept in float32")
                        warnings.warn("deprecated thing", FutureWarning, stacklevel=1)
                assert collect.filters == [] and warnings.showwarning == own
            lib.warning("should be kept in float32")  # not installed: said again
        assert collect.messages == ["should be kept in float32"] * 2
        assert said == ["deprecated thing"]
        assert quiet.suppressed == 5
    finally:
        warnings.showwarning = before
        lib.removeHandler(collect)


def test_owners_that_wrap_each_other_never_loop():
    said: list[str] = []
    before = warnings.showwarning
    try:
        warnings.showwarning = lambda m, *a, **k: said.append(str(m))
        a, b = LibraryWarningsOnce(("x",)), LibraryWarningsOnce(("x",))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            a.install()
            b.install()  # wraps a's
            a.remove()  # b's stays in place and still passes on through a's
            a.install()  # a in place again, its next fixed at its first install
            warnings.warn("one", UserWarning, stacklevel=1)
            warnings.warn("one", UserWarning, stacklevel=1)
            b.remove()
            a.remove()
            warnings.warn("two", UserWarning, stacklevel=1)
        assert said == ["one", "two"]
    finally:
        warnings.showwarning = before


def test_a_prompt_a_library_quotes_never_reaches_the_log_and_records_are_bounded():
    seen = _Collect()
    quiet = LibraryWarningsOnce(("fakelib2",))
    lib = _logger("fakelib2", seen)
    prompt = "a lighthouse at dusk, " * 400  # 8.8 KB of a user's text
    try:
        with quiet:
            lib.warning(
                "The following part of your input was truncated because CLIP can only handle "
                "sequences up to 77 tokens: %s",
                [prompt],
            )
            lib.warning("x" * 5000)
    finally:
        lib.handlers.clear()
    assert len(seen.messages) == 2
    cut, long = seen.messages
    assert "lighthouse" not in cut and "characters of the prompt, not logged" in cut
    assert cut.startswith("The following part of your input was truncated because CLIP")
    assert len(long) < 600 and long.endswith("[4500 more characters]")
