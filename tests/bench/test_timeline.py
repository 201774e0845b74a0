"""Utilisation and timelines from chrome traces (synthetic traces, no GPU needed)."""

from __future__ import annotations

import json

import pytest

from nostall.bench.timeline import load_trace, plot_timelines, union_busy


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def _trace(tmp_path, events):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return load_trace(str(path))


def test_union_busy_merges_overlaps_and_clips():
    ivs = [(0, 10), (5, 15), (20, 30), (29, 31), (50, 60)]
    assert union_busy(ivs, 0, 100) == 15 + 11 + 10
    assert union_busy(ivs, 8, 25) == 7 + 5
    assert union_busy([], 0, 10) == 0


def test_kernels_copies_and_device_ops_are_told_apart(tmp_path):
    tr = _trace(
        tmp_path,
        [
            _x("kernel", "conv", 0, 40),
            _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 40, 10),
            _x("gpu_memset", "Memset (Device)", 50, 5),
            _x("kernel", "conv", 60, 40),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 100, 30),
            _x("gpu_user_annotation", "nostall.chunk.0", 0, 50),
            _x("user_annotation", "nostall.chunk.0", -5, 20),
            _x("user_annotation", "nostall.write", 110, 30),
        ],
    )
    assert tr.whole() == (0, 100)
    assert tr.utilisation(0, 100) == pytest.approx(0.80)  # kernels only
    assert tr.busy(0, 100) == pytest.approx(0.95)  # + DtoD and memset, never DtoH
    assert tr.copies == [(100, 130)] and tr.writes == [(110, 140)]
    assert tr.chunks == {0: (0, 50)} and tr.cpu_chunks == {0: (-5, 15)}


def test_steady_window_spans_two_chunks_in_the_middle(tmp_path):
    events = []
    for k in range(6):
        events += [
            _x("kernel", "k", 100 * k, 90),
            _x("gpu_user_annotation", f"nostall.chunk.{k}", 100 * k, 95),
        ]
    tr = _trace(tmp_path, events)
    assert tr.steady_window() == (200, 400)
    assert tr.utilisation(*tr.steady_window()) == pytest.approx(0.9)


def test_chunks_from_launches_when_the_gpu_projection_is_missing(tmp_path):
    tr = _trace(
        tmp_path,
        [
            _x("user_annotation", "nostall.chunk.0", 0, 10),
            _x("user_annotation", "nostall.chunk.1", 10, 10),
            _x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=1),
            _x("cuda_runtime", "cudaLaunchKernel", 12, 1, correlation=2),
            _x("kernel", "a", 30, 10, correlation=1),
            _x("kernel", "b", 45, 10, correlation=2),
        ],
    )
    assert tr.chunks == {0: (30, 40), 1: (45, 55)}


def test_writer_log_is_anchored_at_the_first_chunk(tmp_path):
    tr = _trace(tmp_path, [_x("kernel", "k", 0, 10), _x("cpu_op", "nostall.chunk.0", 1000, 5)])
    tr.add_writes_from_log([(1, 0.001, 0.002), (4, 0.010, 0.0125)])
    assert tr.writes == [(2000, 3000), (11000, 13500)]
    bare = _trace(tmp_path, [_x("kernel", "k", 0, 10)])
    with pytest.raises(ValueError, match=r"nostall\.chunk\.0"):
        bare.add_writes_from_log([(1, 0.0, 0.1)])


def test_timeline_picture_is_written(tmp_path):
    events = []
    for k in range(5):
        events += [
            _x("kernel", "k", 1000 * k, 900),
            _x("gpu_user_annotation", f"nostall.chunk.{k}", 1000 * k, 950),
            _x("gpu_memcpy", "Memcpy DtoH", 1000 * k + 900, 20),
        ]
    tr = _trace(tmp_path, events)
    out = tmp_path / "timeline.png"
    plot_timelines({"decode-only": tr, "async": tr}, str(out), title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_longest_gaps_say_what_the_host_was_doing(tmp_path):
    tr = _trace(
        tmp_path,
        [
            _x("kernel", "gemm", 0, 100),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 100, 400),  # not busy
            _x("kernel", "norm", 500, 50),
            _x("gpu_memset", "Memset (Device)", 560, 10),
            _x("kernel", "conv", 600, 100),
            _x("cpu_op", "aten::_local_scalar_dense", 120, 300),
            _x("cuda_runtime", "cudaStreamSynchronize", 130, 280),
            _x("cpu_op", "aten::conv3d", 575, 20),
        ],
    )
    a, b = tr.whole()
    gaps = tr.gaps(a, b)
    assert [(g["at_ms"], g["ms"], g["after"], g["before"]) for g in gaps] == [
        (0.1, 0.4, "gemm", "norm"),
        (0.57, 0.03, "Memset (Device)", "conv"),
        (0.55, 0.01, "norm", "Memset (Device)"),
    ]
    assert gaps[0]["host"] == [
        "aten::_local_scalar_dense (0.30 ms)",
        "cudaStreamSynchronize (0.28 ms)",
    ]
    assert gaps[1]["host"] == ["aten::conv3d (0.02 ms)"]
    assert sum(g["ms"] for g in gaps) == pytest.approx((b - a) * (1 - tr.busy(a, b)) / 1e3)
    assert tr.gaps(a, b, top=1) == gaps[:1]
