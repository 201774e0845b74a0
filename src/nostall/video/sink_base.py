"""The frame sinks' common parts: :class:`FrameSink` (the contract: check, count, close
or abort), :class:`NullSink`, and the atomic file sink every file format builds on
(a temporary beside the target, renamed into place on close, removed on any failure).
The formats and the path rules are in :mod:`nostall.video.sinks`."""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import os
import secrets
import shutil
import weakref
from types import TracebackType
from typing import Any

import numpy as np

from nostall.errors import SinkError

__all__ = ["AtomicSink", "FrameSink", "NullSink"]

log = logging.getLogger("nostall.video.sinks")

_OPEN, _FAILED, _CLOSED, _ABORTED = "open", "failed", "closed", "aborted"


class FrameSink(abc.ABC):
    """Destination for a stream of uint8 RGB frames.

    Contract (the streaming pipeline relies on it; calls come from one thread, in order):

    * ``write(frames)`` takes C-contiguous uint8 ``(t, H, W, 3)``. The caller reuses the
      buffer as soon as ``write`` returns, so a sink never keeps a reference to it. The
      first write fixes ``H`` and ``W``; a later write of another size raises
      :class:`SinkError` and leaves the sink usable. OS errors (disk full, EIO) surface
      as :class:`SinkError` with the ``OSError`` as ``__cause__``; after one, the sink only
      accepts ``abort()`` (``close()`` aborts and raises).
    * ``close()`` finishes the output and renames it into place. Idempotent. A file sink
      that received no frames raises :class:`SinkError` (and removes its temporary).
    * ``abort()`` discards the output; nothing remains under the final name or the
      temporary name. Idempotent; does nothing after a successful ``close()``.
    * As a context manager, a clean exit closes and an exception aborts.
    * ``write`` after ``close``/``abort`` raises :class:`SinkError`.
    * An existing file at the final path is replaced, atomically, at ``close()``.
    * Sinks are not thread-safe: drive each one from a single thread.

    Example (``close`` keeps the output, ``abort`` leaves nothing)::

        >>> import tempfile
        >>> from nostall.video.sinks import NpySink
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     kept, dropped = NpySink(f"{tmp}/kept.npy"), NpySink(f"{tmp}/dropped.npy")
        ...     for sink in (kept, dropped):
        ...         sink.write(np.zeros((2, 16, 16, 3), np.uint8))
        ...     kept.close(), dropped.abort(), os.listdir(tmp)
        (None, None, ['kept.npy'])
    """

    # File sinks cannot produce a valid file without knowing the frame size.
    _requires_frames = True

    def __init__(self) -> None:
        self._state = _OPEN
        self._size: tuple[int, int] | None = None  # (H, W)
        self._frames_written = 0

    @property
    def path(self) -> str | None:
        """The final output path (``None`` for sinks that write no file)."""
        return None

    @property
    def frames_written(self) -> int:
        """Frames accepted so far."""
        return self._frames_written

    @property
    def frame_size(self) -> tuple[int, int] | None:
        """``(H, W)`` fixed by the first write, ``None`` before it."""
        return self._size

    @property
    def closed(self) -> bool:
        """True once ``close()`` or ``abort()`` has run."""
        return self._state in (_CLOSED, _ABORTED)

    def write(self, frames: np.ndarray) -> None:
        """Append uint8 ``(t, H, W, 3)`` frames. The buffer may be reused on return.

        Example::

            >>> NullSink().write(np.zeros((1, 480, 832, 3), np.uint8))
        """
        if self._state != _OPEN:
            raise SinkError(self._not_open_reason("write"), path=self.path)
        self._check_frames(frames)
        t, h, w, _ = frames.shape
        if self._size is None:
            self._check_size(h, w)
        elif (h, w) != self._size:
            raise SinkError(
                f"frame size changed from {self._size[0]}x{self._size[1]} (H x W, fixed by the "
                f"first write) to {h}x{w}; a sink holds one video of one size: open another sink "
                f"for frames of a different size",
                path=self.path,
            )
        if t == 0:
            return
        first = self._frames_written
        try:
            if self._size is None:
                self._start(h, w)
                self._size = (h, w)
            self._write(np.ascontiguousarray(frames))
        except self._io_errors() as e:
            self._state = _FAILED
            raise SinkError(
                f"writing frames {first}..{first + t - 1} failed: {e}; {_fix_for(e)}. The "
                f"sink takes only abort() now, which removes the partial output",
                path=self.path,
            ) from e
        except BaseException:
            # Whatever happened, the output may now be inconsistent.
            self._state = _FAILED
            raise
        self._frames_written += t

    def close(self) -> None:
        """Finish the output and move it to its final name. Idempotent (example: the class's)."""
        if self._state == _CLOSED:
            return
        if self._state == _ABORTED:
            raise SinkError("close() after abort(): the output was discarded", path=self.path)
        if self._state == _FAILED:
            self.abort()
            raise SinkError(
                "close() after a failed write: the partial output was removed", path=self.path
            )
        if self._requires_frames and self._frames_written == 0:
            self.abort()
            raise SinkError(
                "no frames were written, so there is no video to finish (the temporary "
                "output was removed); write at least one frame before close()",
                path=self.path,
            )
        try:
            self._finish()
        except self._io_errors() as e:
            self._state = _FAILED
            self.abort()
            raise SinkError(
                f"finishing the output failed: {e}; {_fix_for(e)}. The partial output was removed",
                path=self.path,
            ) from e
        except BaseException:
            self._state = _FAILED
            self.abort()
            raise
        self._state = _CLOSED

    def abort(self) -> None:
        """Discard the output: remove the temporary file or folder. Idempotent.

        Does nothing after a successful ``close()`` (the finished output is kept). Example:
        the class's.
        """
        if self._state in (_CLOSED, _ABORTED):
            return
        self._state = _ABORTED
        self._discard()

    def __enter__(self) -> FrameSink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif self._state in (_OPEN, _FAILED):
            self.close()

    def __repr__(self) -> str:
        where = f"{self.path!r}, " if self.path is not None else ""
        return f"{type(self).__name__}({where}frames_written={self._frames_written}, state={self._state!r})"

    def _not_open_reason(self, op: str) -> str:
        if self._state == _FAILED:
            return f"{op}() after a failed write; call abort() to clean up"
        return f"{op}() on a sink that was already {self._state}"

    def _check_frames(self, frames: Any) -> None:
        if not isinstance(frames, np.ndarray):
            raise SinkError(
                f"frames must be a numpy uint8 array (t, H, W, 3), got {type(frames).__name__}; "
                f"move tensors to the host first (tensor.cpu().numpy())",
                path=self.path,
            )
        if frames.dtype != np.uint8:
            raise SinkError(
                f"frames must be uint8, got {frames.dtype} with shape {frames.shape}; convert "
                f"decoded video with nostall.video.frames.to_uint8_frames",
                path=self.path,
            )
        if frames.ndim != 4 or frames.shape[3] != 3:
            raise SinkError(
                f"frames must have shape (t, H, W, 3), got {frames.shape}; wrap a single "
                f"(H, W, 3) frame as frames[None]",
                path=self.path,
            )
        if frames.shape[1] == 0 or frames.shape[2] == 0:
            raise SinkError(f"frames have an empty image: shape {frames.shape}", path=self.path)

    # Hooks for concrete sinks.

    def _io_errors(self) -> tuple[type[BaseException], ...]:
        """Exception types that mean 'the output could not be written'."""
        return (OSError,)

    def _check_size(self, height: int, width: int) -> None:
        """Reject a frame size on the first write (raise SinkError); nothing written yet."""
        return None

    @abc.abstractmethod
    def _start(self, height: int, width: int) -> None:
        """Prepare for frames of this size (first non-empty write only)."""

    @abc.abstractmethod
    def _write(self, frames: np.ndarray) -> None:
        """Write C-contiguous uint8 (t, H, W, 3) frames; never keep a reference to them."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """Complete the output and move it to its final name."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Release handles and remove partial output; best effort, called once."""


class NullSink(FrameSink):
    """A sink that checks and counts frames and writes nothing (benchmarks, dry runs).

    Example::

        >>> sink = NullSink()
        >>> sink.write(np.zeros((5, 64, 64, 3), np.uint8))
        >>> sink.frames_written
        5
    """

    _requires_frames = False

    def _start(self, height: int, width: int) -> None:
        pass

    def _write(self, frames: np.ndarray) -> None:
        pass

    def _finish(self) -> None:
        pass

    def _discard(self) -> None:
        pass


class AtomicSink(FrameSink):
    """Writes to ``.{name}.{random}.partial`` beside ``path``; ``os.replace`` on close.

    No exception leaves the temporary behind, Ctrl-C (or SIGTERM raised as one, as
    ``nostall``'s CLI does) included: one raised while the sink is built removes it,
    and a sink dropped before anyone held it (an interrupt between its construction and
    its owner's ``try``) removes it when collected (a finalizer, detached once the
    output is renamed into place or discarded).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self._path = os.fspath(path)
        self._check_path(self._path)
        folder = os.path.dirname(os.path.abspath(self._path))
        name = os.path.basename(os.path.abspath(self._path))
        for _ in range(16):
            tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.partial")
            self._tmp = tmp
            # Registered before the file exists, so no instant of its life goes without.
            # atexit=False: at exit, AsyncFramePipeline still finishes submitted videos.
            self._finalizer = weakref.finalize(self, _remove_temporary, tmp)
            self._finalizer.atexit = False
            try:
                self._create_temp(tmp)
            except FileExistsError:  # (another sink's name: O_EXCL left it alone)
                self._finalizer.detach()
                continue
            except OSError as e:
                self._finalizer.detach()
                raise SinkError(
                    f"cannot create a temporary output in {folder!r}: {e}; check that the "
                    f"folder is writable and has free space",
                    path=self._path,
                ) from e
            except BaseException:  # an interrupt, maybe once the file was made
                self._finalizer()
                raise
            try:
                self._open_temp()
            except BaseException:
                self._discard()
                raise
            return
        raise SinkError(f"could not find a free temporary name in {folder!r}", path=self._path)

    @property
    def path(self) -> str:
        return self._path

    @property
    def temp_path(self) -> str:
        """Where the output is written until ``close()`` renames it to :attr:`path`."""
        return self._tmp

    @classmethod
    def _check_path(cls, path: str) -> None:
        """Raise SinkError if no output can be written at ``path``; creates nothing."""
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise SinkError(
                f"the folder {folder!r} does not exist; create it first "
                f"(os.makedirs({folder!r}, exist_ok=True)) or choose another output path",
                path=path,
            )
        cls._check_target(path)

    @classmethod
    def _check_target(cls, path: str) -> None:
        if os.path.isdir(path):
            raise SinkError(
                f"{path!r} is a folder, but {cls.__name__} writes one file; "
                f"give a file path inside it",
                path=path,
            )

    def _create_temp(self, tmp: str) -> None:
        # Exclusive create reserves the name; subclasses reopen it.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))

    def _open_temp(self) -> None:
        """Open what writes the temporary, once it exists (an exception discards it)."""

    def _remove_temp(self) -> None:
        os.unlink(self._tmp)

    def _finish(self) -> None:
        self._finish_temp()
        os.replace(self._tmp, self._path)
        self._finalizer.detach()

    def _discard(self) -> None:
        # The temporary is deleted next, so errors while closing it are moot.
        with contextlib.suppress(Exception):
            self._release()
        try:
            self._remove_temp()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise SinkError(
                f"could not remove the temporary output {self._tmp!r}: {e}; delete it by hand",
                path=self._path,
            ) from e
        self._finalizer.detach()

    @abc.abstractmethod
    def _finish_temp(self) -> None:
        """Flush and close the temporary output so it is complete."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Close open handles without finishing the output (may raise; ignored)."""


def _fix_for(e: BaseException) -> str:
    """What to do about the OS error ``e`` that stopped a write (a SinkError's advice)."""
    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "the disk (or the user's quota) is full: free space there, or write elsewhere"
    if code == errno.EFBIG:
        return "the file outgrew what its file system (or RLIMIT_FSIZE) allows: write elsewhere"
    return "free space or fix the device, or write elsewhere"


def _remove_temporary(tmp: str) -> None:
    """A dropped sink's finalizer: remove its temporary file or folder, if still there."""
    try:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)
        else:
            os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as e:  # (a finalizer cannot raise: said instead)
        log.warning("could not remove the temporary output %r: %s; delete it by hand", tmp, e)
