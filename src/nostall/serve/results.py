"""What a job hands back (:class:`Result`), and the PNG encoding that settles an image
job's future off the worker thread, so the device starts the next job meanwhile.

Encoding a 512² PNG takes tens of milliseconds of CPU (zlib; Pillow lets go of the GIL
while it compresses). Done on the worker thread it is time the GPU waits between two
jobs; here a small pool of threads does it while the worker thread already issues the
next job's kernels.

>>> from concurrent.futures import Future
>>> from PIL import Image
>>> settler = Settler()
>>> fut = Future()
>>> settler.settle(fut, Result(b"", "image/png", {}, {}, image=Image.new("RGB", (8, 8))))
>>> fut.result(timeout=10).body[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
>>> settler.close()
"""

from __future__ import annotations

import io
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Result", "Settler"]


@dataclass
class Result:
    """What a job produced: ``body`` (PNG or MP4 bytes), its phases and the switch.
    ``image``: an image job's PIL image until :class:`Settler` has encoded it into
    ``body`` (then ``None``)."""

    body: bytes
    media_type: str
    phases: dict[str, float]
    switch: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    image: Any = field(default=None, repr=False)


class Settler:
    """Settles job futures: a result with an image once its PNG is encoded (on one of
    ``threads`` threads), any other at once. Owns its threads; :meth:`close` waits for
    the encodings under way, so no future it was given is left unsettled."""

    def __init__(self, threads: int = 2):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="nostall-png")

    def settle(self, future: Future, result: Result) -> None:
        if result.image is None:
            future.set_result(result)
            return
        try:
            self._pool.submit(_encode, future, result)
        except RuntimeError:  # closed (a job finishing after shutdown): encode here
            _encode(future, result)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _encode(future: Future, result: Result) -> None:
    t = time.perf_counter()
    try:
        buf = io.BytesIO()
        result.image.save(buf, format="PNG")
    except BaseException as e:  # the job fails with what the encoder said
        future.set_exception(e)
        return
    result.body, result.image = buf.getvalue(), None
    result.phases["png"] = time.perf_counter() - t
    future.set_result(result)
