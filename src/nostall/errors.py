"""The exceptions nostall raises.

Every error nostall raises on purpose derives from :class:`NostallError`, so a
service can catch the whole family with one ``except`` clause and still tell the
cases apart by type (never by message text)::

    NostallError
    ├── ArgumentError            a bad argument or option value (also a ``ValueError``)
    │   └── AdapterError         a LoRA or ControlNet that does not fit its base
    ├── CheckpointError          a checkpoint on disk is malformed or missing pieces
    │   ├── ModelMismatchError   the tensors do not fit the module they are loaded into
    │   └── FileChanged          a file changed on disk while (or since) nostall read it
    ├── ReadError                the operating system refused or failed a read
    │   └── RemoteError          object storage refused or failed (credentials, bucket, server)
    ├── PoolExhausted            the pinned host pool cannot hold a request
    ├── BusyError                a pool cannot close: blocks are still held by loads
    ├── DeviceError              the requested device is unusable (no CUDA, bad index)
    ├── ClosedError              a pool, loader or pipeline was used after ``close()``
    ├── UnknownModel             the model cache has no pipeline of that name
    ├── BudgetExceeded           a cache tier cannot hold what a switch needs
    ├── UnsupportedError         a model class, library version or mode nostall cannot drive
    │   ├── UnsupportedBackend   the file system refuses a read strategy (``O_DIRECT``)
    │   └── DegradedError        an explicit request could only run degraded (``strict=True``)
    ├── LatentsError             latents of the wrong rank, channels, dtype, device or values
    ├── SinkError                a frame sink failed (disk full, closed, bad path)
    ├── ServeError               the service refused, dropped or could not reach a job
    │   ├── QueueFull            the worker's queue is full (HTTP 429)
    │   ├── ShuttingDown         the worker is shutting down (HTTP 503)
    │   ├── Cancelled            the client went away before its job started
    │   ├── DeviceBusy           the device ran out of memory for a job twice (HTTP 503)
    │   └── EmbeddingUnavailable the embedding service did not answer
    └── InternalError            an invariant inside nostall broke: a bug (also a ``RuntimeError``)

Messages name the file, the tensor and the numbers involved, and say how to fix
the problem. Each exception keeps the pieces as attributes (``path``, ``tensor``)
for programs that want them.

An explicit request that can only run degraded (``read_mode="direct"`` on a file
system that refuses ``O_DIRECT``, ``mode="exact"`` on a decoder exact cannot run)
runs the fallback and says so in the result it returns (``LoadStats.degraded``,
``DecodeResult.degraded``); with ``strict=True`` it raises :class:`DegradedError`
instead.
"""

from __future__ import annotations

import os

__all__ = [
    "AdapterError",
    "ArgumentError",
    "BudgetExceeded",
    "BusyError",
    "Cancelled",
    "CheckpointError",
    "ClosedError",
    "DegradedError",
    "DeviceBusy",
    "DeviceError",
    "EmbeddingUnavailable",
    "FileChanged",
    "InternalError",
    "LatentsError",
    "ModelMismatchError",
    "NostallError",
    "PoolExhausted",
    "QueueFull",
    "ReadError",
    "RemoteError",
    "ServeError",
    "ShuttingDown",
    "SinkError",
    "UnknownModel",
    "UnsupportedBackend",
    "UnsupportedError",
]


class NostallError(Exception):
    """Root of every exception nostall raises on purpose."""

    def __reduce__(self):
        # Ray and multiprocessing pickle errors between processes, and the default
        # reduction calls cls(*args), which loses (or fails on) keyword-only attributes
        # such as QueueFull.retry_after or UnknownModel.available.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[NostallError], args: tuple, state: dict) -> NostallError:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class ArgumentError(NostallError, ValueError):
    """An argument or option has a value nostall cannot use (``threads=0``, an unknown
    read mode, a pool larger than the machine's memory).

    Also a ``ValueError``, so code written against the standard convention still
    catches it.

    Attributes:
        field: the argument or request field at fault, when one is named (a service
            answers it as the field of its 422).
        allowed: what that field may be (a range, a list of choices, a rule), when known.
    """

    def __init__(self, message: str, *, field: str | None = None, allowed: object = None):
        self.field = field
        self.allowed = allowed
        super().__init__(message)


class AdapterError(ArgumentError):
    """A LoRA or ControlNet asked for does not fit the pipeline it was asked on: a
    component or layer the base lacks, or other shapes (an adapter for another model).
    The message names the adapter and its first layer (or config field) at fault.

    Attributes:
        path: the LoRA file.
        layer: its first layer at fault (``role.module``).
        shapes: ``(lora_shape, base_shape)`` when the shapes differ, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        layer: str | None = None,
        shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        field: str = "loras",
    ):
        self.path = os.fspath(path) if path is not None else None
        self.layer, self.shapes = layer, shapes
        super().__init__(message, field=field)


class CheckpointError(NostallError):
    """A checkpoint is malformed, truncated, or missing a file or tensor.

    Attributes:
        path: the file the problem was found in (``None`` when not file-specific).
        tensor: the tensor name involved, when there is one.
    """

    def __init__(
        self, message: str, *, path: str | os.PathLike | None = None, tensor: str | None = None
    ):
        self.path = os.fspath(path) if path is not None else None
        self.tensor = tensor
        where = []
        if self.path is not None:
            where.append(self.path)
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class ModelMismatchError(CheckpointError):
    """The checkpoint's tensors do not fit the module: keys or shapes differ.

    Attributes:
        missing: parameter/buffer names the module needs and the checkpoint lacks.
        unexpected: tensor names the checkpoint has and the module does not use.
        mismatched: ``(name, checkpoint_shape, module_shape)`` for shape conflicts.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None,
    ):
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])
        self.mismatched = list(mismatched or [])
        super().__init__(message, path=path)


class FileChanged(CheckpointError):
    """A file was rewritten, replaced or truncated while nostall read it, or since its
    header was read: its bytes may mix two versions, so none of them is used. Reading
    it again (a new switch, a new ``load``) reads the new version.
    """


class ReadError(NostallError):
    """The operating system failed a read (permissions, I/O error, vanished file)."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None):
        self.path = os.fspath(path) if path is not None else None
        super().__init__(f"{self.path}: {message}" if self.path else message)


class RemoteError(ReadError):
    """Object storage refused or failed a request: no credentials, no such bucket or
    object, access denied, or a server that stopped answering after the retries.

    ``path`` is the object's URL (``s3://bucket/key``). An object *replaced* while it was
    read is a :class:`FileChanged` instead, as for a local file.
    """


class PoolExhausted(NostallError):
    """The pinned host pool cannot hold a request, even after evicting idle entries.

    Attributes:
        requested: bytes asked for (after rounding to the pool's size class).
        capacity: the pool's byte budget.
        in_use: bytes held by live blocks that cannot be evicted.
        largest_free: the largest contiguous free run, in bytes.
    """

    def __init__(
        self, message: str, *, requested: int, capacity: int, in_use: int, largest_free: int
    ):
        self.requested = requested
        self.capacity = capacity
        self.in_use = in_use
        self.largest_free = largest_free
        super().__init__(message)


class BusyError(NostallError):
    """An object cannot close now: another thread still holds memory it owns.

    Raised by :meth:`nostall.PinnedPool.close` when blocks stay held past its
    timeout; the memory stays registered (safe) and ``close()`` may be called again.
    """


class DeviceError(NostallError):
    """The requested device cannot be used (no CUDA build or GPU, index out of range)."""


class ClosedError(NostallError):
    """An object that owns threads, streams or memory was used after ``close()``."""


class UnknownModel(NostallError):
    """The model cache's store has no pipeline of that name.

    Attributes:
        name: the name asked for.
        available: every name the store has.
        close: the names that look like it.
        left_out: why the store's folder of that name is not served as a pipeline (no
            ``model_index.json``, a dangling link), or ``None`` when there is no such folder.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str,
        available: list[str],
        close: list[str],
        left_out: str | None = None,
    ):
        self.name, self.available, self.close = name, list(available), list(close)
        self.left_out = left_out
        super().__init__(message)


class BudgetExceeded(NostallError):
    """A tier of the model cache cannot hold what a switch needs, even after evicting
    everything not in use.

    Attributes:
        tier: ``"gpu"`` (the device tier) or ``"host"``.
        requested: bytes the switch needed in that tier.
        budget: the tier's byte budget.
        in_use: bytes held by pipelines in use (or being prefetched).
    """

    def __init__(self, message: str, *, tier: str, requested: int, budget: int, in_use: int):
        self.tier, self.requested, self.budget, self.in_use = tier, requested, budget, in_use
        super().__init__(message)


class UnsupportedError(NostallError):
    """nostall cannot drive this object: another VAE class, an incompatible version of
    a library whose internals nostall relies on, or a mode the machine lacks."""


class UnsupportedBackend(UnsupportedError):
    """The file system refuses a read strategy for this file (``O_DIRECT`` on tmpfs,
    some FUSE and overlay mounts). ``read_mode="direct"`` falls back to buffered reads
    and records why; with ``strict=True`` the load raises :class:`DegradedError`."""


class DegradedError(UnsupportedError):
    """An explicit request could only run degraded, and the caller passed ``strict=True``.

    Without ``strict`` the fallback runs and the result records it (``degraded``).

    Attributes:
        requested: what was asked for (``"read_mode='direct'"``, ``"mode='exact'"``).
        fallback: what would have run instead (``"read_mode='buffered'"``).
        reason: why the request cannot be honoured.
    """

    def __init__(self, message: str, *, requested: str, fallback: str, reason: str):
        self.requested, self.fallback, self.reason = requested, fallback, reason
        super().__init__(message)


class LatentsError(NostallError):
    """Latents passed to a video decoder have the wrong rank, channels, dtype or device,
    or hold NaN/inf values."""


class SinkError(NostallError):
    """A frame sink failed: the folder is missing, the disk is full, it was closed."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None):
        self.path = os.fspath(path) if path is not None else None
        super().__init__(f"{self.path}: {message}" if self.path else message)


class ServeError(NostallError):
    """The generation or embedding service refused a job, dropped it, or was unreachable."""


class QueueFull(ServeError):
    """The worker's queue is full; retry later (HTTP 429).

    Attributes:
        retry_after: estimated seconds until the queue has room (``None``: no estimate).
    """

    def __init__(self, message: str, *, retry_after: float | None = None):
        self.retry_after = retry_after
        super().__init__(message)


class ShuttingDown(ServeError):
    """The worker is shutting down and takes no more work (HTTP 503)."""


class Cancelled(ServeError):
    """The client went away before the job started."""


class DeviceBusy(ServeError):
    """The device ran out of memory for a job, and again after the worker freed what it
    could and retried once: the job failed, the worker carries on (HTTP 503 with
    ``Retry-After``).

    Attributes:
        retry_after: seconds after which a retry may find the memory free.
    """

    def __init__(self, message: str, *, retry_after: float = 1.0):
        self.retry_after = retry_after
        super().__init__(message)


class EmbeddingUnavailable(ServeError):
    """The embedding service did not answer (after the retries), or answered 5xx."""


class InternalError(NostallError, RuntimeError):
    """An invariant inside nostall does not hold: a bug in nostall, never the caller's
    fault. Please report it with the message. Also a ``RuntimeError``."""
