"""The settler: image jobs' PNGs encoded off the worker thread, every future settled."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
from PIL import Image

from nostall.serve.results import Result, Settler


class _SlowImage:
    """Saves only once released: shows who waits for the encoding."""

    def __init__(self):
        self.release = threading.Event()
        self.thread = None

    def save(self, buf, format):
        self.thread = threading.current_thread().name
        assert self.release.wait(10)
        Image.new("RGB", (4, 4)).save(buf, format=format)


def test_settling_an_image_does_not_wait_for_its_png():
    settler = Settler()
    try:
        img, fut = _SlowImage(), Future()
        settler.settle(fut, Result(b"", "image/png", {}, {}, image=img))
        assert not fut.done()  # the caller (the worker thread) is free already
        img.release.set()
        result = fut.result(timeout=10)
        assert result.body.startswith(b"\x89PNG") and result.image is None
        assert img.thread.startswith("nostall-png") and result.phases["png"] >= 0
    finally:
        settler.close()


def test_a_result_without_an_image_settles_at_once():
    settler = Settler()
    fut = Future()
    settler.settle(fut, Result(b"mp4", "video/mp4", {}, {}))
    assert fut.result(timeout=0).body == b"mp4"
    settler.close()


def test_an_image_that_cannot_be_encoded_fails_its_job():
    class Broken:
        def save(self, buf, format):
            raise OSError("encoder broke")

    settler = Settler()
    fut = Future()
    settler.settle(fut, Result(b"", "image/png", {}, {}, image=Broken()))
    with pytest.raises(OSError, match="encoder broke"):
        fut.result(timeout=10)
    settler.close()


def test_close_leaves_no_future_unsettled_and_later_ones_still_settle():
    settler = Settler(threads=1)
    futs = [Future() for _ in range(8)]
    for f in futs:
        settler.settle(f, Result(b"", "image/png", {}, {}, image=Image.new("RGB", (64, 64))))
    settler.close()
    assert all(f.done() and f.result().body.startswith(b"\x89PNG") for f in futs)
    late = Future()  # a job that finished after shutdown: encoded on the caller's thread
    settler.settle(late, Result(b"", "image/png", {}, {}, image=Image.new("RGB", (8, 8))))
    assert late.result(timeout=0).body.startswith(b"\x89PNG")
