"""The benchmarks' one timing helper: seconds and the result, the device's own keyword
passed through to what is timed."""

from __future__ import annotations

from nostall.bench.timing import timed


def test_timed_passes_a_device_keyword_through_to_the_function():
    # (gpu-check's smoke benchmark timed loader.load(path, device=dev) this way and got
    # "timed() got multiple values for argument 'device'")
    def load(path, *, device):
        return path, device

    s, out = timed("cpu", load, "a.safetensors", device="cuda:0")
    assert out == ("a.safetensors", "cuda:0") and s >= 0
    s, out = timed(None, load, "b", device="cpu")
    assert out == ("b", "cpu")
