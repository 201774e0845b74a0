from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time

import pytest

from nostall.errors import ArgumentError, CheckpointError, ClosedError, DegradedError, ReadError
from nostall.store import ParallelReader, ReadRequest, open_backend
from nostall.store import backends as backends_mod
from nostall.store.backends import BufferedBackend, DirectBackend

from support import skip_unless_read_mode_runs


@pytest.fixture
def data_file(tmp_path):
    payload = os.urandom(3 * 1024 * 1024 + 1234)  # not a multiple of any block size
    path = tmp_path / "blob.bin"
    path.write_bytes(payload)
    return str(path), payload


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_backends_read_exact_bytes(data_file, mode):
    path, payload = data_file
    skip_unless_read_mode_runs(mode, os.path.dirname(path))
    with open_backend(path, mode, block_bytes=64 << 10) as r:
        assert r.name == mode and r.degraded is None  # the backend the case is named for
        buf = mmap.mmap(-1, len(payload) + 8192)  # page-aligned, room for the aligned tail
        mv = memoryview(buf)
        got = r.read_into(mv[: (len(payload) + 4095) // 4096 * 4096], 0)
        assert got == len(payload)
        assert bytes(mv[: len(payload)]) == payload
        mv.release()


def _refuse_direct_open(monkeypatch):
    def refuse(self, p):
        raise backends_mod.UnsupportedBackend("the file system refuses O_DIRECT (test)")

    monkeypatch.setattr(DirectBackend, "_open", refuse)


def test_direct_falls_back_with_a_logged_and_recorded_reason(data_file, monkeypatch, caplog):
    path, _ = data_file
    _refuse_direct_open(monkeypatch)
    with caplog.at_level(logging.WARNING), open_backend(path, "direct", block_bytes=1 << 20) as r:
        assert r.name == "buffered"
        said = r.degraded
    assert "direct I/O unavailable" in caplog.text and path in caplog.text
    assert said is not None and path in said and "refuses O_DIRECT (test)" in said
    assert "read_mode='direct'" in said and "read_mode='buffered'" in said


def test_direct_refused_with_strict_raises_and_leaks_no_descriptor(data_file, monkeypatch):
    path, _ = data_file
    _refuse_direct_open(monkeypatch)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(DegradedError, match="strict=True") as info:
        open_backend(path, "direct", block_bytes=1 << 20, strict=True)
    err = info.value
    assert err.requested == "read_mode='direct'" and err.fallback == "read_mode='buffered'"
    assert "refuses O_DIRECT (test)" in err.reason and path in str(err)
    assert isinstance(err.__cause__, backends_mod.UnsupportedBackend)
    assert set(os.listdir("/proc/self/fd")) == before


def test_direct_that_runs_is_not_degraded(data_file, monkeypatch):
    path, _ = data_file
    # tmp_path may be tmpfs (which refuses O_DIRECT): open without the flag instead.
    monkeypatch.setattr(DirectBackend, "_open", lambda self, p: os.open(p, os.O_RDONLY))
    with open_backend(path, "direct", block_bytes=1 << 20, strict=True) as r:
        assert r.name == "direct" and r.degraded is None


@pytest.mark.parametrize("mode", ["auto", "buffered"])
def test_modes_that_ask_for_no_direct_io_are_never_degraded(data_file, mode):
    path, _ = data_file
    with open_backend(path, mode, block_bytes=1 << 20, strict=True) as r:
        assert r.name == "buffered" and r.degraded is None


def test_direct_probe_refusal_falls_back(data_file, monkeypatch, caplog):
    path, _ = data_file
    real = os.preadv
    calls = {"n": 0}

    def einval_once(fd, bufs, off):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    monkeypatch.setattr(backends_mod.os, "preadv", einval_once)
    with caplog.at_level(logging.WARNING), open_backend(path, "direct", block_bytes=1 << 20) as r:
        assert isinstance(r, BufferedBackend)
        assert r.degraded is not None and "O_DIRECT read refused" in r.degraded
    calls["n"] = 0
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(DegradedError, match="O_DIRECT read refused"):
        open_backend(path, "direct", block_bytes=1 << 20, strict=True)
    assert set(os.listdir("/proc/self/fd")) == before  # the probed descriptor was closed


def test_unknown_mode_and_bad_block_size(data_file):
    path, _ = data_file
    with pytest.raises(ArgumentError, match="read mode"):
        open_backend(path, "mmap", block_bytes=1 << 20)
    with pytest.raises(ArgumentError, match="multiple of 4096"):
        open_backend(path, "buffered", block_bytes=1000)


def test_unreadable_file_is_a_read_error(tmp_path):
    path = tmp_path / "secret.bin"
    path.write_bytes(b"x" * 10)
    path.chmod(0)
    if os.geteuid() == 0:
        # root reads anything: simulate the refusal instead
        with pytest.raises(ReadError):
            open_backend(str(tmp_path / "missing.bin"), "buffered", block_bytes=4096)
        return
    with pytest.raises(ReadError, match="permission denied"):
        open_backend(str(path), "buffered", block_bytes=4096)


def test_io_error_mid_read_names_file_and_offset(data_file, monkeypatch):
    path, _payload = data_file

    def eio(fd, bufs, off):
        raise OSError(errno.EIO, "Input/output error")

    with open_backend(path, "buffered", block_bytes=1 << 20) as r:
        monkeypatch.setattr(os, "preadv", eio)
        with pytest.raises(ReadError, match="offset 0") as info:
            r.read_into(memoryview(bytearray(10)), 0)
        assert info.value.path == path


def test_file_shrinking_while_loading_is_caught(data_file):
    path, payload = data_file
    with (
        open_backend(path, "buffered", block_bytes=1 << 20) as r,
        pytest.raises(CheckpointError, match="truncated or replaced"),
    ):
        r.read_exact(memoryview(bytearray(100)), len(payload) - 10, 100)


def _requests(r, payload, buf, chunk, tags=None):
    mv = memoryview(buf)
    reqs = []
    for _i, a in enumerate(range(0, len(payload), chunk)):
        b = min(a + chunk, len(payload))
        reqs.append(ReadRequest(r, a, b - a, b - a, lambda cancel, a=a, b=b: mv[a:b], tag=(a, b)))
    return reqs


def test_parallel_reader_reports_every_chunk_once(data_file):
    path, payload = data_file
    buf = bytearray(len(payload))
    with (
        ParallelReader(threads=4) as reader,
        open_backend(path, "buffered", block_bytes=64 << 10) as r,
    ):
        reqs = _requests(r, payload, buf, 256 << 10)
        tags = list(reader.submit(reqs).completed())
    assert sorted(tags) == sorted(q.tag for q in reqs)
    assert bytes(buf) == payload


def test_parallel_reader_error_cancels_the_rest(data_file):
    path, payload = data_file
    buf = bytearray(len(payload))
    started = []

    with (
        ParallelReader(threads=2) as reader,
        open_backend(path, "buffered", block_bytes=64 << 10) as r,
    ):
        reqs = _requests(r, payload, buf, 64 << 10)

        def boom(cancel):
            raise ReadError("disk on fire", path=path)

        def slow(cancel, q=None):
            started.append(1)
            time.sleep(0.01)  # a slow read (the work itself): most are still queued at the failure
            return memoryview(bytearray(64 << 10))

        reqs[1] = ReadRequest(r, 0, 10, 10, boom, tag="bad")
        reqs[2:] = [ReadRequest(r, 0, 10, 10, slow, tag=i) for i in range(40)]
        handle = reader.submit(reqs)
        t = time.perf_counter()
        with pytest.raises(ReadError, match="disk on fire"):
            for _ in handle.completed():
                pass
        assert time.perf_counter() - t < 1.0
    assert len(started) < 40  # the queued reads were cancelled, not run


def test_dest_waiting_on_a_cancelled_handle_gives_up(data_file):
    path, _payload = data_file
    gate = threading.Event()

    def waits(cancel):
        while not cancel.is_set():
            if gate.wait(0.01):
                break
        return None

    def boom(cancel):
        raise ReadError("fail", path=path)

    with (
        ParallelReader(threads=2) as reader,
        open_backend(path, "buffered", block_bytes=64 << 10) as r,
    ):
        handle = reader.submit([ReadRequest(r, 0, 1, 1, waits), ReadRequest(r, 0, 1, 1, boom)])
        with pytest.raises(ReadError):
            handle.wait()


def test_closed_reader(data_file):
    reader = ParallelReader(threads=1)
    reader.close()
    reader.close()
    with pytest.raises(ClosedError):
        reader.submit([])
    with pytest.raises(ValueError):
        ParallelReader(threads=0)


# ---- O_DIRECT alignment after short reads. tmp_path may refuse O_DIRECT (tmpfs), so
# DirectBackend's logic runs on a plain descriptor; os.preadv records every request.


def _address(mv: memoryview) -> int:
    c = ctypes.c_char.from_buffer(mv)
    try:
        return ctypes.addressof(c)
    finally:
        del c


@pytest.fixture
def direct_on_plain_fd(monkeypatch):
    monkeypatch.setattr(DirectBackend, "_open", lambda self, path: os.open(path, os.O_RDONLY))


def _recording_preadv(monkeypatch, cut=None):
    """Replace os.preadv; ``cut(offset, length)`` may return a shorter count to read."""
    real = os.preadv
    calls = []

    def preadv(fd, bufs, offset):
        (buf,) = bufs
        calls.append((offset, len(buf), _address(buf)))
        want = cut(offset, len(buf)) if cut else None
        return real(fd, [buf[:want]] if want is not None else [buf], offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _aligned_read(r, size):
    buf = mmap.mmap(-1, (size + 4095) // 4096 * 4096)  # page-aligned
    mv = memoryview(buf)
    got = r.read_into(mv, 0)
    return got, bytes(mv[:got]), mv, buf


def test_direct_short_read_mid_file_stays_aligned(
    data_file, direct_on_plain_fd, monkeypatch, caplog
):
    path, payload = data_file
    block = 64 << 10
    mid = 5 * block
    state = {"cut": False}

    def cut(offset, length):
        if offset == mid and not state["cut"]:
            state["cut"] = True
            return 3 * 4096 + 123  # short and off the alignment
        return None

    with DirectBackend(path, block_bytes=block) as r:
        calls = _recording_preadv(monkeypatch, cut)
        with caplog.at_level(logging.WARNING):
            got, data, mv, _buf = _aligned_read(r, len(payload))
        mv.release()
    assert state["cut"]
    assert got == len(payload) and data == payload
    after = calls[[c[0] for c in calls].index(mid) + 1 :]
    assert after, "the read went on after the short one"
    base = calls[0][2]
    for offset, length, address in after:
        assert offset % 4096 == 0 and length % 4096 == 0 and (address - base) % 4096 == 0
    assert after[0][0] == mid + 3 * 4096  # the aligned part was kept, the rest read again
    assert "mid-file" in caplog.text and path in caplog.text


def test_direct_read_stops_at_the_unaligned_end_of_file(data_file, direct_on_plain_fd, monkeypatch):
    path, payload = data_file  # 3 MiB + 1234 bytes: the last read is short and unaligned
    with DirectBackend(path, block_bytes=64 << 10) as r:
        calls = _recording_preadv(monkeypatch)
        got, data, mv, _buf = _aligned_read(r, len(payload))
        mv.release()
    assert got == len(payload) and data == payload
    assert all(off % 4096 == 0 and n % 4096 == 0 for off, n, _ in calls)
    assert calls[-1][0] == len(payload) // (64 << 10) * (64 << 10)  # no read after the tail


@pytest.mark.timeout(10)
def test_direct_reads_that_never_reach_the_alignment_fail_cleanly(
    data_file, direct_on_plain_fd, monkeypatch
):
    path, payload = data_file
    with DirectBackend(path, block_bytes=64 << 10) as r:
        calls = _recording_preadv(monkeypatch, lambda offset, length: 100 if offset else None)
        with pytest.raises(ReadError, match="read_mode='buffered'") as info:
            _aligned_read(r, len(payload))
    assert info.value.path == path
    assert all(off % 4096 == 0 and n % 4096 == 0 for off, n, _ in calls)


def test_buffered_short_reads_are_retried(data_file, monkeypatch):
    path, payload = data_file
    with BufferedBackend(path, block_bytes=64 << 10) as r:
        _recording_preadv(monkeypatch, lambda offset, length: 777)
        got, data, mv, _buf = _aligned_read(r, len(payload))
        mv.release()
    assert got == len(payload) and data == payload


# ---- special files: refused before they are opened


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_special_files_are_refused(tmp_path, mode):
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)  # open() would block until a writer appears
    with pytest.raises(CheckpointError, match="FIFO") as info:
        open_backend(str(fifo), mode, block_bytes=4096)
    assert info.value.path == str(fifo)
    if os.path.exists("/dev/zero"):
        with pytest.raises(CheckpointError, match="character device"):
            open_backend("/dev/zero", mode, block_bytes=4096)
