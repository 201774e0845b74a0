"""Many threads reading byte ranges of files into host memory, reporting as they finish.

:class:`ParallelReader` owns a thread pool. :meth:`ParallelReader.submit` takes a
list of :class:`ReadRequest` and returns a :class:`ReadHandle` at once; the
handle's :meth:`~ReadHandle.completed` iterator yields each request's ``tag`` as
soon as its bytes have landed (in completion order), so the caller can start
the host→device copy of a chunk while later chunks are still being read.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nostall.errors import ArgumentError, ClosedError
from nostall.store.base import ReadBackend

__all__ = ["ParallelReader", "ReadHandle", "ReadRequest", "cpu_count"]

# Marks a request skipped after cancellation: neither a success nor the failure.
_SKIPPED = object()


@dataclass(frozen=True)
class ReadRequest:
    """Read ``length`` bytes at ``offset`` of ``file`` into the memory ``dest(cancel)`` returns.

    ``dest`` is called on the reader thread right before the read, so a request
    whose buffer is still busy (a staging slot whose copy has not finished) can
    wait there without blocking the caller; it gets the handle's cancel event and
    returns ``None`` if that is set while it waits (the request is then skipped). At
    least ``expected`` bytes must arrive (the rest may fall past end of file, for
    aligned direct reads). ``then``, if given, runs on the reader thread with the
    request's memory once its bytes have landed and before the request counts as
    complete (the loader hashes them there, while they are hot in the CPU's caches).
    """

    file: ReadBackend
    offset: int
    length: int
    expected: int
    dest: Callable[[threading.Event], memoryview | None]
    tag: Any = None
    then: Callable[[memoryview], None] | None = None


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ReadHandle:
    """The in-flight reads of one :meth:`ParallelReader.submit` call."""

    def __init__(self, count: int):
        self._count = count
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: list[Future] = []
        self.cancel_event = threading.Event()

    def completed(self) -> Iterator[Any]:
        """Yield each request's tag as its bytes land; raise the first failure.

        On failure (or if the consumer stops early) the remaining reads are
        cancelled and waited for before this returns, so no thread still writes
        into the destination memory afterwards.
        """
        remaining = self._count
        try:
            while remaining:
                tag, error = self._queue.get()
                remaining -= 1
                if error is _SKIPPED:
                    continue
                if error is not None:
                    raise error
                yield tag
        finally:
            if remaining:
                self.cancel()

    def wait(self) -> None:
        """Wait for every read; raise the first failure."""
        for _ in self.completed():
            pass

    def cancel(self) -> None:
        """Stop reads that have not started, and wait for the ones running."""
        self.cancel_event.set()
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                f.exception()  # waits; errors were already delivered through the queue


class ParallelReader:
    """A pool of reader threads, owned by the caller; :meth:`close` joins them.

    ``threads`` defaults to the number of usable CPUs, capped at 16: our H200
    host reads its page cache at 46.7 GB/s with 8 threads and 6.7 GB/s with one.

    >>> reader = ParallelReader(threads=4)
    >>> reader.close()
    """

    def __init__(self, *, threads: int | None = None):
        self.threads = threads if threads is not None else min(16, cpu_count())
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads <= 0:
            raise ArgumentError(f"threads must be a positive integer, got {self.threads!r}")
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.threads, thread_name_prefix="nostall-read"
        )

    def submit(self, requests: Sequence[ReadRequest]) -> ReadHandle:
        """Queue the requests (read roughly in the given order); return their handle."""
        if self._pool is None:
            raise ClosedError("the reader is closed")
        handle = ReadHandle(len(requests))
        for r in requests:
            handle._futures.append(self._pool.submit(_run, r, handle))
        return handle

    def close(self) -> None:
        """Join the threads. Idempotent."""
        if self._pool is not None:
            # A reader thread that drops the last reference to a loader runs its
            # finalizer, and so this close: it cannot join itself.
            inside = threading.current_thread().name.startswith("nostall-read")
            self._pool.shutdown(wait=not inside, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> ParallelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(r: ReadRequest, handle: ReadHandle) -> None:
    if handle.cancel_event.is_set():
        handle._queue.put((r.tag, _SKIPPED))
        return
    try:
        dest = r.dest(handle.cancel_event)
        if dest is None:  # gave up waiting for its buffer: the load was cancelled
            handle._queue.put((r.tag, _SKIPPED))
            return
        r.file.read_exact(dest[: r.length], r.offset, r.expected, cancel=handle.cancel_event)
        if r.then is not None and not handle.cancel_event.is_set():
            r.then(dest[: r.length])
    except BaseException as e:
        handle.cancel_event.set()
        handle._queue.put((r.tag, e))
    else:
        handle._queue.put((r.tag, _SKIPPED if handle.cancel_event.is_set() else None))
