"""The host-wide shared pool: bytes and index across processes, dead processes, a bad index."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import threading
import time

import pytest
import torch

from nostall.errors import (
    ArgumentError,
    BusyError,
    ClosedError,
    DeviceError,
    PoolExhausted,
    UnsupportedError,
)
from nostall.memory import SharedPool
from nostall.memory.shared import segment_path
from nostall.memory.shared_index import process_id

MiB = 1 << 20

# A second process driven line by line: each request is Python source run in one namespace
# (``out`` is sent back as JSON), so a test interleaves two processes step by step.
PEER = r"""
import json, sys
ns = {}
for line in sys.stdin:
    ns.pop("out", None)
    try:
        exec(json.loads(line), ns)
        reply = {"out": ns.get("out")}
    except BaseException as e:
        reply = {"error": type(e).__name__, "message": str(e)}
    print(json.dumps(reply), flush=True)
"""


class Peer:
    """Another process (forked by ``fork_python``, the conftest's fixture), driven by PEER."""

    def __init__(self, fork_python):
        self.proc = fork_python(PEER)
        self("import torch; from nostall.memory import SharedPool")

    def send(self, code: str) -> None:
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()

    def reply(self):
        line = self.proc.stdout.readline()
        assert line, f"the peer died (exit status {self.proc.poll()})"
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"in the peer: {reply['error']}: {reply['message']}")
        return reply["out"]

    def __call__(self, code: str):
        self.send(code)
        return self.reply()

    def kill(self) -> None:
        """SIGKILL, left unreaped: a zombie, which the pool must count as dead."""
        self.proc.kill()
        deadline = time.monotonic() + 10
        # The leader turns zombie while its other threads still exit, holding the process's
        # descriptors (its file locks): wait until they are gone too.
        while process_id(self.proc.pid) is not None or _threads(self.proc.pid) > 1:
            assert time.monotonic() < deadline, "the killed peer never stopped"
            time.sleep(0.01)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def peer(fork_python):
    p = Peer(fork_python)
    yield p
    p.close()


@pytest.fixture
def new_peer(fork_python):
    """``new_peer()``: a Peer of the test's own, closed at its end."""
    peers = []

    def make() -> Peer:
        peers.append(Peer(fork_python))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


@pytest.fixture
def open_pool(tmp_path):
    """Opens pools under the test's folder (``name`` "t") and closes them at the end."""
    pools = []

    def make(capacity=32 * MiB, **kw) -> SharedPool:
        pools.append(SharedPool(kw.pop("name", "t"), capacity, root=tmp_path, **kw))
        return pools[-1]

    yield make
    for p in pools:
        p.close(timeout=1)


def _index(root) -> dict:
    return json.loads(pathlib.Path(segment_path("t", str(root)) + ".index").read_text())


def _write_index(root, doc) -> None:
    with open(segment_path("t", str(root)) + ".index", "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))


def test_a_block_written_in_one_process_is_a_hit_in_another(tmp_path, peer, open_pool):
    peer(
        f"pool = SharedPool('t', 32 << 20, root={str(tmp_path)!r})\n"
        "b = pool.allocate(3 << 20, key=('ckpt', 1))\n"
        "b.tensor[:1000] = torch.arange(1000) % 251"
    )
    pool = open_pool()
    # Still being written: invisible to every other process, but its room is taken.
    assert pool.lookup(("ckpt", 1)) is None and pool.cached_keys() == []
    s = pool.stats()
    assert (s.in_use, s.cached, s.free, s.blocks) == (4 * MiB, 0, 28 * MiB, 1)
    assert peer("b.release(); out = b.released") is True
    hit = pool.lookup(("ckpt", 1))
    assert hit is not None and (hit.offset, hit.nbytes, hit.size) == (0, 3 * MiB, 4 * MiB)
    assert torch.equal(hit.tensor[:1000], torch.arange(1000) % 251)
    assert bytes(hit.view()[:3]) == bytes([0, 1, 2])
    assert pool.stats().in_use == 4 * MiB  # held here now
    hit.release()
    assert pool.cached_keys() == [("ckpt", 1)]
    s = pool.stats(hugepages=False)
    # The model cache's host tier reads the pool as: cached blocks + free == capacity.
    assert s.cached + s.free == pool.capacity and s.in_use == 0 and s.requested == 3 * MiB
    assert peer("pool.close(); pool.close(); out = torch.cuda.is_initialized()") is False


def test_the_loader_reads_once_per_host(tmp_path, peer, open_pool, ckpt_file, tensors):
    # The real loader, unchanged: the peer's load reads the file into the shared pool; this
    # process's load of the same file is a memory-cache hit served from the peer's bytes.
    out = peer(
        "from nostall.transfer.loader import Loader\n"
        f"pool = SharedPool('t', 32 << 20, root={str(tmp_path)!r}, keep=True)\n"
        f"with Loader() as loader: r = loader.load({str(ckpt_file)!r}, pool=pool)\n"
        "pool.close()\n"
        "out = r.stats.scenario"
    )
    assert out == "read"
    from nostall.transfer.loader import Loader

    pool = open_pool()
    with Loader() as loader:
        r = loader.load(ckpt_file, pool=pool)
    assert r.stats.scenario == "memory-cache hit"
    assert r.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(r.tensors[name], t), name
    assert pool.stats().in_use == 0  # the hit's hold was given back


def test_a_killed_holder_and_a_killed_writer_leak_nothing(tmp_path, open_pool, new_peer):
    peer = new_peer()
    w_offset = peer(
        f"pool = SharedPool('t', 32 << 20, root={str(tmp_path)!r})\n"
        "a = pool.allocate(8 << 20, key='a'); a.tensor.fill_(1); a.release()\n"
        "held = pool.lookup('a')\n"
        "w = pool.allocate(8 << 20, key='w'); w.tensor.fill_(2)\n"
        "out = w.offset"
    )
    pool = open_pool()
    s = pool.stats()
    assert (s.in_use, s.cached, s.free) == (16 * MiB, 0, 16 * MiB)
    assert pool.evict("a") == 0  # held by the peer
    peer.kill()  # SIGKILL with a reader's hold and a half-written block
    s = pool.stats()  # the next transaction drops the dead process
    assert (s.in_use, s.cached, s.free, s.blocks) == (0, 8 * MiB, 24 * MiB, 1)
    assert pool.cached_keys() == ["a"] and pool.lookup("w") is None
    assert _index(tmp_path)["attached"] == {process_id(os.getpid()): 1}
    # The half-written block's bytes are reused; the dead reader's entry is evictable.
    big = pool.allocate(24 * MiB)
    assert big.offset == w_offset == 8 * MiB
    big.release()
    assert pool.evict("a") == 8 * MiB


def test_lru_eviction_across_processes_never_evicts_a_held_entry(tmp_path, peer, open_pool):
    peer(
        f"pool = SharedPool('t', 32 << 20, root={str(tmp_path)!r})\n"
        "for k in 'abc': pool.allocate(8 << 20, key=k).release()"
    )
    pool = open_pool()
    pool.lookup("a").release()  # "a" is now the most recently used
    peer("held = pool.lookup('b')")  # "b" is the least recently used, but held
    d = pool.allocate(16 * MiB, key="d")  # evicts "c": the LRU entry nobody holds
    assert sorted(pool.cached_keys()) == ["a", "b"]
    with pytest.raises(PoolExhausted, match="cannot hold") as info:
        pool.allocate(16 * MiB, key="e")  # evicting "a" would not be enough
    assert (info.value.requested, info.value.in_use, info.value.capacity) == (
        16 * MiB,
        24 * MiB,
        32 * MiB,
    )
    assert "2 process(es)" in str(info.value)
    assert sorted(pool.cached_keys()) == ["a", "b"]  # a failed allocation evicts nobody
    d.release()
    peer("held.release()")
    assert pool.cached_keys() == ["a", "d", "b"]  # least recently used first
    peer("pool.close()")


def test_no_eviction_when_the_caller_drives_it(open_pool):
    pool = open_pool(evict=False)
    pool.allocate(24 * MiB, key="x").release()
    with pytest.raises(PoolExhausted, match=r"pool\.evict"):
        pool.allocate(16 * MiB)
    assert pool.evict() == 24 * MiB
    pool.allocate(16 * MiB).release()


def test_concurrent_processes_never_share_bytes(tmp_path, peer, open_pool):
    # Both processes carve, fill and publish ten blocks each at the same time.
    fill = (
        "for i in range(10):\n"
        "    b = pool.allocate(2 << 20, key=({who!r}, i))\n"
        "    b.tensor.fill_({v} + i)\n"
        "    b.release()\n"
    )
    peer(f"pool = SharedPool('t', 64 << 20, root={str(tmp_path)!r})")
    peer.send(fill.format(who="peer", v=100))
    pool = open_pool(64 * MiB)
    exec(fill.format(who="main", v=0), {"pool": pool})
    peer.reply()
    for who, v in (("peer", 100), ("main", 0)):
        for i in range(10):
            b = pool.lookup((who, i))
            assert b is not None and b.tensor.eq(v + i).all(), (who, i)
            b.release()
    assert pool.stats().free == 24 * MiB
    peer("pool.close()")


@pytest.mark.parametrize(
    "corrupt",
    [
        "{not json",
        b"\xff\xfe",
        "",
        '{"format": 1}',
        "overlap",
        "capacity",
        "boot",
    ],
)
def test_a_corrupt_index_is_rebuilt_with_a_warning(tmp_path, open_pool, caplog, corrupt):
    with open_pool(keep=True) as pool:
        pool.allocate(4 * MiB, key="a").release()
        pool.allocate(4 * MiB, key="b").release()
    doc = _index(tmp_path)
    if corrupt == "overlap":
        doc["entries"]["1"]["offset"] = 2 * MiB
    elif corrupt == "capacity":
        doc["capacity"] = 64 * MiB
    elif corrupt == "boot":
        doc["boot"] = "an earlier boot"
    else:
        doc = corrupt
    path = segment_path("t", str(tmp_path)) + ".index"
    if isinstance(doc, dict):
        doc = json.dumps(doc)
    with open(path, "wb") as f:
        f.write(doc if isinstance(doc, bytes) else doc.encode())
    with caplog.at_level(logging.WARNING):
        pool = open_pool()
    assert "rebuilding it" in caplog.text and path in caplog.text
    assert pool.cached_keys() == [] and pool.stats().free == pool.capacity
    pool.allocate(32 * MiB, key="c").release()  # the whole segment is usable again
    assert pool.cached_keys() == ["c"]


def test_an_index_of_another_host_is_refused_until_destroyed(tmp_path, open_pool):
    open_pool(keep=True).close()
    doc = _index(tmp_path)
    doc["host"] = "another-host"
    _write_index(tmp_path, doc)
    with pytest.raises(ArgumentError, match="'another-host'") as info:
        open_pool()
    assert info.value.field == "root" and "destroy" in str(info.value)
    assert SharedPool.destroy("t", root=tmp_path) is True
    assert os.listdir(tmp_path) == []
    assert SharedPool.destroy("t", root=tmp_path) is False
    open_pool().allocate(1).release()


def test_an_index_of_another_format_in_use_is_refused(tmp_path, open_pool, caplog):
    pool = open_pool()
    doc = _index(tmp_path)
    doc["format"] = 2  # another nostall version's workers, one of them this process
    _write_index(tmp_path, doc)
    with pytest.raises(UnsupportedError, match="format 2"):
        pool.stats()
    doc["attached"] = {"99999999-1": 1}  # nobody alive uses it: rebuilt
    _write_index(tmp_path, doc)
    with caplog.at_level(logging.WARNING):
        assert pool.stats().blocks == 0
    assert "rebuilding it" in caplog.text


def test_a_reused_pid_is_not_taken_for_the_process_that_died(tmp_path, open_pool):
    pool = open_pool()
    pool.allocate(4 * MiB, key="k").release()
    held = pool.lookup("k")
    me = process_id(os.getpid())
    pid, start = me.split("-")
    # The same pid with another start time: a new process that got a dead one's pid.
    text = json.dumps(_index(tmp_path))
    _write_index(tmp_path, text.replace(f'"{me}"', f'"{pid}-{int(start) + 1}"'))
    s = pool.stats()
    assert (s.in_use, s.cached) == (0, 4 * MiB)
    assert pool.evict("k") == 4 * MiB
    held.release()  # its entry is gone: nothing to give back, nothing raised


def test_destroy_refuses_while_another_process_has_it_open(tmp_path, peer):
    peer(f"pool = SharedPool('t', 8 << 20, root={str(tmp_path)!r}, keep=True)")
    with pytest.raises(BusyError, match="close them first") as info:
        SharedPool.destroy("t", root=tmp_path)
    assert f" {peer.proc.pid}-" in str(info.value)  # names the process
    peer("pool.close()")
    assert SharedPool.destroy("t", root=tmp_path) is True
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["", "a/b", "../up", ".hidden", "a b", "x" * 101, None, 7])
def test_bad_names_are_argument_errors(tmp_path, name):
    with pytest.raises(ArgumentError, match="name") as info:
        SharedPool(name, 8 * MiB, root=tmp_path)
    assert info.value.field == "name"
    assert os.listdir(tmp_path) == []


def test_bad_arguments_are_typed_errors(tmp_path, monkeypatch):
    from nostall.memory import pool as pool_mod

    for capacity in (0, -1, 1.5, True):
        with pytest.raises(ArgumentError, match="capacity"):
            SharedPool("t", capacity, root=tmp_path)
    with pytest.raises(ArgumentError, match="not a folder"):
        SharedPool("t", 8 * MiB, root=tmp_path / "missing")
    monkeypatch.setattr(pool_mod, "memory_limit", lambda: (1 << 60, "machine"))
    monkeypatch.setattr(pool_mod, "memory_available", lambda: None)
    with pytest.raises(ArgumentError, match="exceeds the file system"):
        SharedPool("t", 1 << 50, root=tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="device=None"):
        SharedPool("t", 8 * MiB, root=tmp_path, device="cuda")
    with SharedPool("t", 8 * MiB, root=tmp_path) as pool, pytest.raises(ArgumentError, match="key"):
        pool.allocate(1, key=object())  # another process could not rebuild it


def test_close_is_idempotent_and_use_after_close_is_refused(open_pool, tmp_path):
    pool = open_pool(keep=True)
    pool.allocate(4 * MiB, key="k").release()
    pool.close()
    pool.close()
    with pytest.raises(ClosedError):
        pool.allocate(1)
    with pytest.raises(ClosedError):
        pool.lookup("k")
    assert pool.evict() == 0 and pool.cached_keys() == [] and pool.stats().free == 0
    assert "state=closed" in repr(pool)
    assert _index(tmp_path)["attached"] == {}  # kept: the segment and its entry stay
    assert open_pool().cached_keys() == ["k"]


def test_close_gives_up_holds_left_open(open_pool, tmp_path, caplog):
    pool = open_pool(keep=True)
    pool.allocate(4 * MiB, key="k").release()
    held, writing = pool.lookup("k"), pool.allocate(4 * MiB, key="w")
    with caplog.at_level(logging.WARNING):
        pool.close(timeout=0)
    assert "2 block(s) still held" in caplog.text
    other = open_pool()
    s = other.stats()
    assert (s.in_use, s.cached, other.cached_keys()) == (0, 4 * MiB, ["k"])
    held.release()
    writing.release()  # too late to publish: close() freed it
    assert other.cached_keys() == ["k"]


def test_invalidate_frees(open_pool):
    pool = open_pool()
    b = pool.allocate(4 * MiB, key="k")
    b.invalidate()
    b.release()
    b.release()  # a second release does nothing
    assert pool.lookup("k") is None and pool.stats().blocks == 0
    # A reader's invalidate: nobody is served the entry again; freed once let go.
    pool.allocate(4 * MiB, key="k").release()
    hit = pool.lookup("k")
    hit.invalidate()
    assert pool.lookup("k") is None and pool.stats().in_use == 4 * MiB
    hit.release()
    assert pool.stats().blocks == 0


def test_a_newer_entry_replaces_the_older_of_the_same_key(open_pool):
    pool = open_pool()
    old = pool.allocate(4 * MiB, key="k")
    old.release()
    reader = pool.lookup("k")
    new = pool.allocate(4 * MiB, key="k")
    new.release()
    hit = pool.lookup("k")
    assert hit.offset == new.offset != old.offset
    assert pool.stats().blocks == 2  # the old copy lives while its reader reads it
    reader.release()
    hit.release()
    assert pool.stats().blocks == 1 and pool.cached_keys() == ["k"]


class _GateEvent:
    """A stand-in for a CUDA event whose copy ends when the test says so."""

    def __init__(self):
        self.gate = threading.Event()

    def query(self):
        return self.gate.is_set()

    def synchronize(self):
        self.gate.wait(10)


def test_release_gives_the_hold_up_only_after_the_fenced_copies(open_pool):
    pool = open_pool()
    b = pool.allocate(4 * MiB, key="k")
    event = _GateEvent()
    b.fence(event)  # a copy still reads the block
    t = threading.Thread(target=b.release)
    t.start()
    time.sleep(0.1)
    assert t.is_alive() and pool.stats().in_use == 4 * MiB and pool.cached_keys() == []
    event.gate.set()
    t.join(5)
    assert pool.cached_keys() == ["k"] and pool.stats().in_use == 0


def test_a_capacity_that_disagrees(tmp_path, open_pool, caplog):
    first = open_pool(16 * MiB, keep=True)
    with caplog.at_level(logging.WARNING):
        second = open_pool(32 * MiB)  # open elsewhere: the existing segment is used
    assert second.capacity == 16 * MiB and "using it as it is" in caplog.text
    first.allocate(4 * MiB, key="k").release()
    first.close()
    second.close()
    with caplog.at_level(logging.WARNING):
        third = open_pool(32 * MiB)  # nobody has it open: recreated at the new size
    assert third.capacity == 32 * MiB and "recreating" in caplog.text
    assert third.cached_keys() == [] and os.path.getsize(third.path) == 32 * MiB
    assert third.keep  # the mark is the name's: it outlives the segment it was given with


class _FakeCudart:
    def __init__(self):
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_each_process_registers_its_own_mapping_without_zeroing_it(open_pool, monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    cpu = open_pool(64 * MiB, slab_bytes=16 * MiB)
    b = cpu.allocate(20 * MiB, key="k")
    b.tensor.fill_(9)
    b.release()
    assert fake.registered == []  # no device: no CUDA call
    for name, value in [
        ("is_available", lambda: True),
        ("device_count", lambda: 1),
        ("current_device", lambda: 0),
        ("set_device", lambda i: None),
        ("device", lambda i: contextlib.nullcontext()),
    ]:
        monkeypatch.setattr(torch.cuda, name, value)
    gpu = open_pool(64 * MiB, slab_bytes=16 * MiB, device="cuda:0")
    assert gpu.wait_pinned(timeout=30)
    base = gpu.arena.address
    assert [(p - base, n, f) for p, n, f in fake.registered] == [
        (i * 16 * MiB, 16 * MiB, 1)
        for i in range(4)  # portable, slab by slab
    ]
    assert gpu.stats(hugepages=False).pinned == 64 * MiB
    hit = gpu.lookup("k")
    assert hit.tensor.eq(9).all()  # pinning committed the pages, never zeroed them
    assert [(a, b) for a, b in hit.split(0, hit.size)] == [(0, 16 * MiB), (16 * MiB, 20 * MiB)]
    hit.release()
    gpu.close()
    assert sorted(fake.unregistered) == [p for p, _, _ in fake.registered]


def test_a_full_file_system_is_pool_exhausted_not_sigbus(open_pool, monkeypatch):
    from nostall.memory import host

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    pool = open_pool()
    monkeypatch.setattr(host, "_fallocate", full)
    with pytest.raises(PoolExhausted, match="no room"):
        pool.allocate(4 * MiB, key="k")
    assert pool.stats().blocks == 0  # the entry went with the error


@pytest.mark.cuda
def test_a_cuda_pool_registers_the_shared_pages():
    # In /dev/shm, as in service: Linux lets CUDA pin tmpfs pages for long, not a disk
    # file's (FOLL_LONGTERM on file-backed mappings is refused since 6.5).
    name = f"test-cuda-{os.getpid()}"
    pools = []
    try:
        # Two pool objects stand for two processes: each registers its own mapping.
        pools += [SharedPool(name, 32 * MiB, device="cuda") for _ in range(2)]
        _registers_the_shared_pages(*pools)
    finally:
        for p in pools:
            p.close(timeout=1)
        SharedPool.destroy(name, force=True)


def _registers_the_shared_pages(writer, reader):
    assert writer.wait_pinned(timeout=60) and reader.wait_pinned(timeout=60)
    b = writer.allocate(4 * MiB, key="k")
    assert b.tensor.is_pinned()
    b.tensor.copy_(torch.arange(4 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8))
    b.release()
    hit = reader.lookup("k")
    on_gpu = hit.tensor.to("cuda", non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    hit.fence(event)
    hit.release()  # waits for the copy
    again = writer.lookup("k")
    assert torch.equal(on_gpu.cpu(), again.tensor)
    again.release()
    assert reader.stats(hugepages=False).pinned == reader.capacity


def test_a_handle_from_before_a_rebuilt_index_touches_nothing_after_it(tmp_path, open_pool):
    pool = open_pool()
    pool.allocate(4 * MiB, key="old").release()
    stale = pool.lookup("old")  # entry id 0
    _write_index(tmp_path, "garbage")
    fresh = pool.allocate(4 * MiB, key="new")  # entry id 0 again, in a new index
    fresh.release()
    stale.invalidate()
    stale.release()
    assert pool.cached_keys() == ["new"] and pool.stats().blocks == 1


# ---- a damaged index never costs a holder its bytes (issue #28) ------------------------

# The holder: three 14 MiB blocks of a 48 MiB pool, filled with 7000s and held: two
# published and looked up again, the third still being written.
HOLD = (
    "pool = SharedPool('t', 48 << 20, root={root!r})\n"
    "held = []\n"
    "for k in ('a', 'b', 'c'):\n"
    "    b = pool.allocate(14 << 20, key=k)\n"
    "    b.tensor.view(torch.int32).fill_(7000)\n"
    "    if k != 'c':\n"
    "        b.release()\n"
    "        b = pool.lookup(k)\n"
    "    held.append(b)\n"
    "out = [b.offset for b in held]"
)
READ = "out = [b.tensor.view(torch.int32).eq(7000).all().item() for b in held]"


def _damage(root, how: str) -> None:
    path = segment_path("t", str(root)) + ".index"
    if how == "garbage":  # as a crash or a full disk can leave it
        pathlib.Path(path).write_bytes(os.urandom(300))
    elif how == "deleted":
        os.unlink(path)
    else:  # a valid-looking empty index of another capacity
        doc = _index(root)
        doc.update(capacity=20 * MiB, entries={}, attached={}, next_id=0, epoch="0" * 16)
        _write_index(root, doc)


def _exits_cleanly(p: Peer) -> None:
    p.proc.stdin.close()
    assert p.proc.wait(30) == 0  # no SIGBUS, no error on the way out


@pytest.mark.parametrize("damage", ["garbage", "deleted", "other capacity"])
def test_a_damaged_index_never_changes_a_held_block(tmp_path, open_pool, caplog, damage, new_peer):
    holder = new_peer()
    offsets = holder(HOLD.format(root=str(tmp_path)))
    assert offsets == [0, 14 * MiB, 28 * MiB]
    _damage(tmp_path, damage)
    with caplog.at_level(logging.WARNING):
        other = open_pool(20 * MiB)  # asks for less: attaches to the 48 MiB in use
    assert other.capacity == 48 * MiB and "using it as it is" in caplog.text
    assert os.path.getsize(other.path) == 48 * MiB
    mine = []
    with pytest.raises(PoolExhausted):
        for i in range(24):  # every byte the pool hands out, held until it is full
            mine.append(other.allocate(2 * MiB, key=("other", i)))
            mine[-1].tensor.fill_(1)
    assert [b.offset for b in mine] == [42 * MiB, 44 * MiB, 46 * MiB]
    for b in mine:
        b.release()
    assert holder(READ) == [True, True, True]
    # The holder's handles still name their entries: the writer's release publishes.
    holder("for b in held: b.release()")
    hit = other.lookup("c")
    assert hit is not None and hit.tensor.view(torch.int32).eq(7000).all()
    hit.release()
    assert other.lookup("a") is None  # read while the index was lost: not served again
    _exits_cleanly(holder)
    assert other.stats().free == 42 * MiB - 14 * MiB  # a, b freed; c cached


def test_after_a_rebuild_no_process_rebuilds_again(tmp_path, open_pool, caplog, new_peer):
    # Two workers, the index damaged, a third with a smaller budget: the servers.
    count = (
        "import logging\n"
        "class Count(logging.Handler):\n"
        "    n = 0\n"
        "    def emit(self, r): Count.n += 'rebuilding it' in r.getMessage()\n"
        "logging.getLogger('nostall').addHandler(Count())\n"
    )
    work = "for i in range(5): pool.stats(); pool.lookup('a'); pool.allocate(1).release()\n"
    peers = [new_peer(), new_peer()]
    for p in peers:
        p(count + f"pool = SharedPool('t', 48 << 20, root={str(tmp_path)!r})")
    peers[0]("held = pool.allocate(14 << 20, key='a'); held.release(); held = pool.lookup('a')")
    _write_index(tmp_path, "garbage")
    with caplog.at_level(logging.WARNING):
        third = open_pool(20 * MiB)
        for p in peers:
            p(work)
        exec(work, {"pool": third})
    rebuilds = [caplog.text.count("rebuilding it")] + [p("out = Count.n") for p in peers]
    assert sum(rebuilds) == 1, rebuilds
    assert _index(tmp_path)["capacity"] == 48 * MiB
    assert peers[0]("out = held.tensor.numel()") == 14 * MiB


@pytest.mark.parametrize("keep", [False, True])
def test_a_view_that_outlived_its_pool_never_faults(tmp_path, keep, new_peer):
    # A pool closed with a block still held: the view stays mapped. Removing the segment
    # (the last pool left) or recreating it at another capacity (kept) gives the next pool
    # a new file; the old one is never truncated under the view.
    p = new_peer()
    out = p(
        f"pool = SharedPool('t', 16 << 20, root={str(tmp_path)!r}{', keep=True' * keep})\n"
        "b = pool.allocate(14 << 20, key='k'); view = b.tensor; view.fill_(7)\n"
        "pool.close(timeout=0)\n"
        f"again = SharedPool('t', 4 << 20, root={str(tmp_path)!r})\n"
        "out = [again.capacity, view.eq(7).all().item()]"
    )
    assert out == [4 * MiB, True]
    _exits_cleanly(p)


def test_a_segment_in_use_that_cannot_be_mapped_is_refused(tmp_path, peer, monkeypatch):
    from nostall.memory import pool as pool_mod

    peer(f"pool = SharedPool('t', 48 << 20, root={str(tmp_path)!r})")
    monkeypatch.setattr(pool_mod, "memory_limit", lambda: (40 * MiB, "cgroup"))
    with pytest.raises(BusyError) as info:
        SharedPool("t", 20 * MiB, root=tmp_path)
    assert f"{48 * MiB} bytes" in str(info.value) and f"{20 * MiB} bytes" in str(info.value)
    assert f" {peer.proc.pid}-" in str(info.value)
    assert peer("pool.close(); out = 1") == 1
    assert os.listdir(tmp_path) == []


# ---- who removes a segment ---------------------------------------------------------------


def test_the_last_pool_to_close_removes_the_segment(tmp_path, peer, open_pool):
    peer(f"pool = SharedPool('t', 8 << 20, root={str(tmp_path)!r})")
    pool = open_pool(8 * MiB)
    pool.allocate(1, key="k").release()
    pool.close()
    assert os.path.exists(pool.path)  # the peer has it open
    assert peer("out = pool.cached_keys()") == ["k"]
    peer("pool.close()")
    assert os.listdir(tmp_path) == []


def test_a_kept_segment_outlives_its_last_pool(tmp_path, open_pool):
    with open_pool(keep=True) as pool:
        pool.allocate(1, key="k").release()
    with open_pool() as again:  # keep=False now: the mark stays until destroy
        assert again.keep and again.cached_keys() == ["k"]
    assert os.path.exists(segment_path("t", str(tmp_path)))
    assert SharedPool.destroy("t", root=tmp_path) is True
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("then", ["reopen", "destroy"])
def test_a_killed_last_holder_leaves_files_the_next_open_reuses(
    tmp_path, open_pool, then, new_peer
):
    p = new_peer()
    p(
        f"pool = SharedPool('t', 8 << 20, root={str(tmp_path)!r})\n"
        "pool.allocate(1, key='k').release(); held = pool.lookup('k')"
    )
    p.kill()
    path = segment_path("t", str(tmp_path))
    assert os.path.exists(path) and os.listdir(path + ".procs")  # nobody ran to clean
    if then == "destroy":
        assert SharedPool.destroy("t", root=tmp_path) is True  # nobody has it open
    else:
        pool = open_pool(8 * MiB)
        assert pool.cached_keys() == ["k"] and pool.stats().in_use == 0
        assert os.listdir(path + ".procs") == [os.path.basename(pool._book.journal.path)]
        pool.close()
    assert os.listdir(tmp_path) == []


def test_a_pool_whose_segment_was_destroyed_by_force_is_closed(tmp_path, open_pool):
    pool = open_pool()
    held = pool.allocate(4 * MiB, key="k")
    assert SharedPool.destroy("t", root=tmp_path, force=True) is True
    fresh = open_pool()  # a new segment, another file
    with pytest.raises(ClosedError, match="removed while this process had it open"):
        pool.allocate(1)
    held.release()  # harmless
    pool.close()
    fresh.allocate(1, key="x").release()
    assert fresh.cached_keys() == ["x"] and os.path.exists(fresh.path)
