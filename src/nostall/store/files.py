"""Opening the files a checkpoint is made of, and parsing their JSON, without surprises.

A path can name something other than a regular file: ``open()`` on a FIFO blocks
until a writer appears, and ``/dev/zero`` or ``/dev/urandom`` never end. JSON from
disk can nest deeply enough to exhaust Python's recursion limit, or carry an integer
literal too long for ``int()``. Both helpers turn those into a
:class:`~nostall.CheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import sys
from typing import BinaryIO

from nostall.errors import CheckpointError
from nostall.store.base import require_regular

__all__ = ["open_regular", "parse_json"]


def open_regular(path: str, *, what: str) -> BinaryIO:
    """Open ``path`` for binary reading; refuse anything but a regular file.

    The type is checked with ``os.stat`` before opening, so a FIFO or a device is
    never opened, and again on the descriptor, which is opened non-blocking in case
    the path was swapped for a FIFO in between. ``OSError`` propagates for the
    caller to word; a non-regular file raises :class:`~nostall.CheckpointError`.

    >>> with open_regular("model.safetensors", what="safetensors file") as f:  # doctest: +SKIP
    ...     prefix = f.read(8)
    """
    require_regular(os.stat(path).st_mode, path, what=what)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0))
    try:
        require_regular(os.fstat(fd).st_mode, path, what=what)
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def parse_json(raw: bytes, *, what: str, fix: str, path: str) -> object:
    """Decode UTF-8 JSON from ``raw``; any failure is a :class:`~nostall.CheckpointError`.

    ``what`` names the document in the message (``"shard index"``), ``fix`` says
    what to do about it.

    >>> parse_json(b'{"a": 1}', what="config", fix="re-save it", path="config.json")
    {'a': 1}
    """
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} is not valid UTF-8: {e}; {fix}", path=path) from e
    except RecursionError as e:
        raise CheckpointError(
            f"{what} nests JSON arrays or objects deeper than Python's parser can follow "
            f"(recursion limit {sys.getrecursionlimit()}); no real {what} does: {fix}",
            path=path,
        ) from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} is not valid JSON: {e}; {fix}", path=path) from e
    except ValueError as e:
        # int() refuses literals longer than sys.get_int_max_str_digits() (4300 by
        # default, Python >= 3.11 and 3.10.7), and json.loads lets that ValueError out.
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise CheckpointError(
            f"{what} holds an integer literal longer than {limit} digits, which Python "
            f"refuses to parse; no real {what} does: {fix}",
            path=path,
        ) from e
