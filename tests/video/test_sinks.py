"""Frame sinks: content, order, atomic rename, cleanup, and error reporting."""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import textwrap
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")

from nostall.errors import SinkError  # noqa: E402
from nostall.video.sinks import (  # noqa: E402
    FrameSink,
    Mp4Sink,
    NpySink,
    NullSink,
    PngSink,
    Y4mSink,
    check_sink_path,
    sink_for_path,
)

H, W = 48, 64


def _frames(n: int, h: int = H, w: int = W) -> np.ndarray:
    """uint8 (n, h, w, 3) whose content encodes the index: grey level and block position."""
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        out[i] = 10 + 20 * i
        out[i, 8:24, 4 * i : 4 * i + 16] = (255 - 20 * i, 40, 200)
    return out


def _read_av(path: Path) -> tuple[np.ndarray, SimpleNamespace]:
    # The stream's properties are read while the container is open: PyAV 19 refuses
    # them after close ("Container is not open").
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        info = SimpleNamespace(
            frames=stream.frames,
            average_rate=stream.average_rate,
            duration=stream.duration,
            time_base=stream.time_base,
        )
    return np.stack(frames), info


def _read_png(folder: Path) -> np.ndarray:
    names = sorted(os.listdir(folder))
    assert names == [f"frame_{i:06d}.png" for i in range(len(names))]
    return np.stack([np.asarray(Image.open(folder / n).convert("RGB")) for n in names])


# kind -> (make sink in folder, final name, read back, max abs error per pixel)
KINDS = {
    "mp4": (
        lambda d: Mp4Sink(d / "out.mp4", fps=16, crf=12),
        "out.mp4",
        lambda p: _read_av(p)[0],
        None,
    ),
    "npy": (lambda d: NpySink(d / "out.npy"), "out.npy", np.load, 0),
    "y4m": (lambda d: Y4mSink(d / "out.y4m", fps=16), "out.y4m", lambda p: _read_av(p)[0], 3),
    "png": (lambda d: PngSink(d / "out"), "out", _read_png, 0),
}


@pytest.fixture(params=sorted(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def _make(kind: str, folder: Path) -> FrameSink:
    return KINDS[kind][0](folder)


def _write_reusing_one_buffer(sink: FrameSink, frames: np.ndarray, sizes: list[int]) -> None:
    # The pipeline reuses its host buffer right after write(): scribble over it to prove the
    # sink copied what it needed.
    buf = np.empty((max(sizes), *frames.shape[1:]), np.uint8)
    start = 0
    for t in sizes:
        buf[:t] = frames[start : start + t]
        sink.write(buf[:t])
        buf[:] = 255 - buf
        start += t


def test_frames_come_back_complete_and_in_order(kind, tmp_path):
    src = _frames(9)
    sink = _make(kind, tmp_path)
    _write_reusing_one_buffer(sink, src, [1, 4, 4])
    assert sink.frames_written == 9
    assert sink.frame_size == (H, W)
    sink.close()

    got = KINDS[kind][2](tmp_path / KINDS[kind][1])
    tol = KINDS[kind][3]
    assert got.shape == src.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(int) - src.astype(int))
    if tol is None:  # lossy: each decoded frame must be closest to its own source frame
        assert diff.mean() < 3
        err = np.abs(got[:, None].astype(int) - src[None].astype(int)).mean(axis=(2, 3, 4))
        assert err.argmin(axis=1).tolist() == list(range(9))
    else:
        assert diff.max() <= tol


def test_output_appears_under_final_name_only_at_close(kind, tmp_path):
    sink = _make(kind, tmp_path)
    sink.write(_frames(2))
    final = tmp_path / KINDS[kind][1]
    assert not os.path.lexists(final)
    entries = os.listdir(tmp_path)
    assert len(entries) == 1
    assert entries[0].startswith(f".{KINDS[kind][1]}.") and entries[0].endswith(".partial")
    assert os.path.join(tmp_path, entries[0]) == sink.temp_path
    sink.close()
    assert os.listdir(tmp_path) == [KINDS[kind][1]]
    sink.close()  # idempotent
    sink.abort()  # after a successful close: keeps the output
    assert os.listdir(tmp_path) == [KINDS[kind][1]]


def test_existing_output_is_replaced_only_at_close(tmp_path):
    # Readers see the old file or the new one, never a half-written mix.
    path = tmp_path / "clip.npy"
    np.save(path, np.zeros((1, 2, 2, 3), np.uint8))
    sink = NpySink(path)
    sink.write(_frames(3))
    assert np.load(path).shape == (1, 2, 2, 3)
    sink.close()
    np.testing.assert_array_equal(np.load(path), _frames(3))
    assert os.listdir(tmp_path) == ["clip.npy"]


def test_abort_removes_everything_and_is_idempotent(kind, tmp_path):
    sink = _make(kind, tmp_path)
    sink.write(_frames(3))
    sink.abort()
    assert os.listdir(tmp_path) == []
    sink.abort()
    with pytest.raises(SinkError, match="aborted"):
        sink.write(_frames(1))
    with pytest.raises(SinkError, match="abort"):
        sink.close()
    assert os.listdir(tmp_path) == []


def test_context_manager_closes_on_success_and_aborts_on_error(kind, tmp_path):
    with pytest.raises(RuntimeError, match="boom"), _make(kind, tmp_path) as sink:
        sink.write(_frames(2))
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []

    with _make(kind, tmp_path) as sink:
        sink.write(_frames(2))
    assert os.listdir(tmp_path) == [KINDS[kind][1]]
    assert sink.closed


def test_write_after_close_raises(kind, tmp_path):
    sink = _make(kind, tmp_path)
    sink.write(_frames(1))
    sink.close()
    with pytest.raises(SinkError, match="closed"):
        sink.write(_frames(1))


def test_close_without_frames_raises_and_cleans_up(kind, tmp_path):
    sink = _make(kind, tmp_path)
    with pytest.raises(SinkError, match="no frames"):
        sink.close()
    assert os.listdir(tmp_path) == []


def test_missing_parent_folder_is_reported(kind, tmp_path):
    missing = tmp_path / "not" / "there"
    with pytest.raises(SinkError, match=r"not/there.*does not exist.*makedirs") as excinfo:
        _make(kind, missing)
    assert excinfo.value.path is not None and "not/there" in excinfo.value.path
    assert os.listdir(tmp_path) == []


def test_size_change_is_refused_and_sink_stays_usable(kind, tmp_path):
    sink = _make(kind, tmp_path)
    sink.write(_frames(1))
    with pytest.raises(SinkError, match=rf"{H}x{W}.*{H}x{W // 2}"):
        sink.write(_frames(1, w=W // 2))
    sink.write(_frames(2)[1:])
    sink.close()
    assert sink.frames_written == 2
    assert KINDS[kind][2](tmp_path / KINDS[kind][1]).shape == (2, H, W, 3)


@pytest.mark.parametrize(
    ("frames", "pattern"),
    [
        (np.zeros((1, H, W, 3), np.float32), r"uint8.*float32"),
        (np.zeros((H, W, 3), np.uint8), r"\(t, H, W, 3\).*frames\[None\]"),
        (np.zeros((1, H, W, 4), np.uint8), r"\(t, H, W, 3\)"),
        ([[0]], r"numpy uint8 array.*list"),
    ],
)
def test_bad_frames_are_refused(tmp_path, frames, pattern):
    sink = NpySink(tmp_path / "out.npy")
    with pytest.raises(SinkError, match=pattern):
        sink.write(frames)
    sink.abort()


def test_failed_rename_at_close_leaves_nothing(kind, tmp_path, monkeypatch):
    def eio(src, dst):
        raise OSError(errno.EIO, "Input/output error", dst)

    sink = _make(kind, tmp_path)
    sink.write(_frames(2))
    monkeypatch.setattr(os, "replace", eio)
    with pytest.raises(SinkError, match="Input/output error") as excinfo:
        sink.close()
    assert isinstance(excinfo.value.__cause__, OSError)
    assert os.listdir(tmp_path) == []
    sink.abort()  # still safe


_DISK_FULL_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    import numpy as np
    from nostall.errors import SinkError
    from nostall.video.sinks import sink_for_path

    # Writes past RLIMIT_FSIZE fail with EFBIG, a real OS error on every write path
    # (ours, PIL's and FFmpeg's own I/O); SIGXFSZ would kill us instead.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(sys.argv[1])
    results = {}
    for path in sys.argv[2:]:
        folder = os.path.dirname(path.rstrip("/"))
        sink = sink_for_path(path, fps=16)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        rng = np.random.default_rng(0)
        result = {"where": None}
        try:
            for i in range(40):
                sink.write(rng.integers(0, 256, (1, 256, 256, 3), dtype=np.uint8))
            result["where"] = "close"
            sink.close()
        except SinkError as e:
            result["where"] = result["where"] or "write"
            result["errno"] = getattr(e.__cause__, "errno", None)
            result["message"] = str(e)
            if result["where"] == "write":
                try:
                    sink.write(np.zeros((1, 256, 256, 3), np.uint8))
                except SinkError as again:
                    result["second_write"] = str(again)
            sink.abort()
            sink.abort()
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        result["left"] = sorted(os.listdir(folder))
        results[path] = result
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def disk_full_results(tmp_path_factory: pytest.TempPathFactory, fork_python) -> dict[str, dict]:
    """Run every file sink into a 100 kB file-size limit, in one process of its own (forked
    by the conftest's fixture: the limit is never this process's)."""
    if sys.platform == "win32":
        pytest.skip("RLIMIT_FSIZE is POSIX")
    paths = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(f"full_{kind}")
        paths[kind] = str(folder / KINDS[kind][1]) + ("/" if kind == "png" else "")
    proc = fork_python(_DISK_FULL_SCRIPT, "100000", *paths.values(), stderr=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    by_path = json.loads(out.strip().splitlines()[-1])
    return {kind: by_path[path] for kind, path in paths.items()}


def test_disk_full_becomes_sink_error_and_leaves_nothing(kind, disk_full_results):
    result = disk_full_results[kind]
    assert result["where"] in ("write", "close"), result
    assert result["errno"] == errno.EFBIG, result
    assert "File too large" in result["message"]
    if result["where"] == "write":
        assert "failed write" in result["second_write"]
    assert result["left"] == []


# --- Mp4Sink ---------------------------------------------------------------------------


@pytest.mark.parametrize("fps", [16, 30, Fraction(24000, 1001)])
def test_mp4_has_exact_rate_and_frame_count(tmp_path, fps):
    path = tmp_path / "clip.mp4"
    with Mp4Sink(path, fps=fps, preset="ultrafast") as sink:
        sink.write(_frames(5))
        sink.write(_frames(7)[5:])
    frames, stream = _read_av(path)
    assert len(frames) == 7
    assert stream.frames == 7
    assert stream.average_rate == Fraction(fps)
    assert stream.duration * stream.time_base == Fraction(7) / Fraction(fps)


def test_mp4_is_bt709_tagged_and_colours_survive(tmp_path):
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (200, 50, 100)]
    src = np.stack([np.full((H, W, 3), c, np.uint8) for c in colours])
    path = tmp_path / "colours.mp4"
    with Mp4Sink(path, crf=10) as sink:
        sink.write(src)
    with av.open(str(path)) as container:
        frame = next(container.decode(video=0))
        assert (frame.colorspace, frame.color_range) == (1, 1)  # BT.709, limited range
    got, _ = _read_av(path)
    assert np.abs(got.astype(int) - src.astype(int)).max() <= 4


def test_mp4_rejects_odd_sizes_before_writing_anything(tmp_path):
    sink = Mp4Sink(tmp_path / "odd.mp4")
    with pytest.raises(SinkError, match=r"33x63.*odd.*even.*34x64"):
        sink.write(_frames(1, h=33, w=63))
    assert sink.frames_written == 0 and sink.frame_size is None
    sink.write(_frames(1))  # still usable with an even size
    sink.close()
    assert _read_av(tmp_path / "odd.mp4")[0].shape == (1, H, W, 3)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"preset": "turbo"}, r"preset 'turbo'.*veryfast"),
        ({"crf": 52}, r"crf.*0\.\.51"),
        ({"threads": -1}, r"threads.*>= 0"),
        ({"fps": 0}, r"fps.*positive"),
        ({"fps": -16}, r"fps.*positive"),
        ({"fps": math.nan}, r"fps.*finite"),
        ({"fps": math.inf}, r"fps.*finite"),
        ({"fps": "16"}, r"fps must be a number"),
    ],
)
def test_mp4_rejects_bad_options_without_creating_files(tmp_path, kwargs, pattern):
    with pytest.raises(SinkError, match=pattern):
        Mp4Sink(tmp_path / "x.mp4", **kwargs)
    assert os.listdir(tmp_path) == []


def test_target_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "clip.mp4").mkdir()
    with pytest.raises(SinkError, match="is a folder"):
        Mp4Sink(tmp_path / "clip.mp4")
    assert os.listdir(tmp_path) == ["clip.mp4"]


# --- interrupts and dropped sinks: the temporary never outlives them ---------------------


@pytest.mark.parametrize("make", [Mp4Sink, Y4mSink])
def test_an_interrupt_while_pyav_opens_the_temporary_leaves_nothing(tmp_path, monkeypatch, make):
    """Ctrl-C (or SIGTERM raised as one, as the CLI does) lands once the temporary exists
    and before the constructor returns: the sink removes it before the interrupt goes on."""

    def interrupted(*a, **kw):
        assert [n for n in os.listdir(tmp_path) if n.endswith(".partial")]  # it exists now
        raise KeyboardInterrupt

    monkeypatch.setattr(av, "open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make(tmp_path / "clip.mp4" if make is Mp4Sink else tmp_path / "clip.y4m", fps=16)
    assert os.listdir(tmp_path) == []


def test_a_sink_dropped_unclosed_removes_its_temporary_when_collected(kind, tmp_path):
    """An interrupt between a sink's construction and its owner's ``try`` leaves it held by
    no one: once collected, nothing of it remains. A closed sink's output stays."""
    import gc

    sink = _make(kind, tmp_path)
    sink.write(_frames(2))
    assert len(os.listdir(tmp_path)) == 1  # its temporary
    del sink
    gc.collect()
    assert os.listdir(tmp_path) == []
    sink = _make(kind, tmp_path)
    sink.write(_frames(2))
    sink.close()
    del sink
    gc.collect()
    assert os.listdir(tmp_path) == [KINDS[kind][1]]


# --- Y4mSink / NpySink / PngSink / NullSink ----------------------------------------------


def test_y4m_rate_and_odd_sizes(tmp_path):
    path = tmp_path / "clip.y4m"
    src = np.random.default_rng(0).integers(0, 256, (3, 17, 33, 3), dtype=np.uint8)
    with Y4mSink(path, fps=Fraction(24000, 1001)) as sink:
        sink.write(src)
    assert path.read_bytes().startswith(b"YUV4MPEG2 W33 H17 F24000:1001")
    got, stream = _read_av(path)
    assert stream.average_rate == Fraction(24000, 1001)
    assert got.shape == src.shape
    assert np.abs(got.astype(int) - src.astype(int)).max() <= 3


def test_npy_loads_normally_and_memory_mapped(tmp_path):
    path = tmp_path / "clip.npy"
    src = np.random.default_rng(0).integers(0, 256, (1000, 2, 4, 3), dtype=np.uint8)
    with NpySink(path) as sink:
        for start in range(0, 1000, 7):
            sink.write(src[start : start + 7])
    np.testing.assert_array_equal(np.load(path), src)
    mapped = np.load(path, mmap_mode="r")
    assert mapped.shape == src.shape and mapped.offset % 64 == 0
    np.testing.assert_array_equal(mapped, src)


def test_npy_accepts_non_contiguous_frames(tmp_path):
    path = tmp_path / "clip.npy"
    big = _frames(4, w=2 * W)
    with NpySink(path) as sink:
        sink.write(big[:, :, ::2])
    np.testing.assert_array_equal(np.load(path), big[:, :, ::2])


def test_png_refuses_a_non_empty_folder_and_replaces_an_empty_one(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "frame_000000.png").write_bytes(b"stale")
    with pytest.raises(SinkError, match="already holds files"):
        PngSink(tmp_path / "old")
    (tmp_path / "a_file").write_bytes(b"x")
    with pytest.raises(SinkError, match="not a folder"):
        PngSink(tmp_path / "a_file")

    (tmp_path / "empty").mkdir()
    with PngSink(tmp_path / "empty/") as sink:
        sink.write(_frames(2))
    np.testing.assert_array_equal(_read_png(tmp_path / "empty"), _frames(2))
    assert sorted(os.listdir(tmp_path)) == ["a_file", "empty", "old"]


def test_null_sink_counts_and_checks(tmp_path):
    sink = NullSink()
    assert sink.path is None
    sink.write(_frames(3))
    sink.write(_frames(1))
    with pytest.raises(SinkError, match="size changed"):
        sink.write(_frames(1, h=H // 2))
    assert sink.frames_written == 4
    sink.close()
    with pytest.raises(SinkError, match="closed"):
        sink.write(_frames(1))
    with NullSink() as empty:
        pass
    assert empty.frames_written == 0 and empty.closed


# --- sink_for_path -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("clip.mp4", Mp4Sink),
        ("CLIP.MP4", Mp4Sink),
        ("clip.npy", NpySink),
        ("clip.y4m", Y4mSink),
        ("frames/", PngSink),
        ("frames", PngSink),
        ("existing.mp4/", PngSink),
    ],
)
def test_sink_for_path_picks_by_suffix(tmp_path, name, expected):
    if name == "existing.mp4/":
        (tmp_path / "existing.mp4").mkdir()
    sink = sink_for_path(str(tmp_path / name), fps=24)
    try:
        assert type(sink) is expected
        assert os.path.basename(sink.path) == name.rstrip("/")
    finally:
        sink.abort()
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    assert leftovers == []


def test_sink_for_path_existing_folder_without_slash(tmp_path):
    (tmp_path / "out.mp4").mkdir()
    sink = sink_for_path(tmp_path / "out.mp4")
    assert type(sink) is PngSink
    sink.abort()


@pytest.mark.parametrize("name", ["out.mp4", "frames/", "frames"])
def test_check_sink_path_refuses_a_frames_folder_where_one_file_is_wanted(tmp_path, name):
    """``frames_folder=False`` (a served video job: one MP4): an existing folder, even one
    named ``out.mp4``, a trailing ``/`` and no suffix all mean PNG frames; refused, naming
    the path and the fix. A file path passes."""
    (tmp_path / "out.mp4").mkdir()
    check_sink_path(str(tmp_path / name))  # PNG frames: fine where a folder may be
    with pytest.raises(SinkError, match="one video file is written here") as e:
        check_sink_path(str(tmp_path / name), frames_folder=False)
    assert e.value.path == str(tmp_path / name) and "remove or rename" in str(e.value)
    check_sink_path(str(tmp_path / "clip.mp4"), frames_folder=False)
    assert os.listdir(tmp_path) == ["out.mp4"]


def test_sink_for_path_devnull_and_errors(tmp_path):
    assert type(sink_for_path(os.devnull)) is NullSink
    with pytest.raises(SinkError, match=r"'\.avi'.*\.mp4.*\.npy.*\.y4m.*PNG"):
        sink_for_path(tmp_path / "clip.avi")
    with pytest.raises(SinkError, match="crf"):
        sink_for_path(tmp_path / "clip.mp4", crf=99)  # options reach the sink
    with pytest.raises(SinkError, match="fps"):
        sink_for_path(tmp_path / "clip.npy", fps=0)
    assert os.listdir(tmp_path) == []


def _setup_targets(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.png").write_bytes(b"")
    (tmp_path / "file").write_bytes(b"")


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("clip.avi", {}),
        ("missing/clip.mp4", {}),
        ("missing/frames/", {}),
        ("clip.mp4", {"crf": 52}),
        ("clip.mp4", {"crf": math.nan}),
        ("clip.mp4", {"preset": "warp"}),
        ("clip.mp4", {"threads": -1}),
        ("clip.y4m", {"fps": 0}),
        ("clip.npy", {"fps": -math.inf}),
        ("full", {}),  # a PNG folder that already holds files
        ("file/", {}),  # a PNG folder path that is a file
    ],
)
def test_check_sink_path_refuses_what_sink_for_path_refuses_and_creates_nothing(
    tmp_path, name, options
):
    _setup_targets(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SinkError) as checked:
        check_sink_path(str(tmp_path / name), **options)
    with pytest.raises(SinkError) as opened:
        sink_for_path(str(tmp_path / name), **options)
    assert str(checked.value) == str(opened.value)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", ["clip.mp4", "clip.npy", "clip.y4m", "frames/", "frames"])
def test_check_sink_path_accepts_what_sink_for_path_accepts(tmp_path, name):
    assert check_sink_path(str(tmp_path / name), fps=24, crf=0) is None
    assert os.listdir(tmp_path) == []
    sink_for_path(str(tmp_path / name), fps=24, crf=0).abort()
