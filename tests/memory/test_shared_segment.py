"""The shared pool's segment files: the default root, names, listing a root's segments."""

from __future__ import annotations

import os

import pytest
from test_shared_pool import Peer

from nostall.errors import ArgumentError
from nostall.memory import SharedPool
from nostall.memory.shared import default_root, segment_path
from nostall.memory.shared_index import process_id

MiB = 1 << 20


def test_the_default_root_is_the_environments_or_dev_shm(monkeypatch, tmp_path):
    monkeypatch.delenv("NOSTALL_SHM_DIR", raising=False)
    assert default_root() == "/dev/shm"
    monkeypatch.setenv("NOSTALL_SHM_DIR", str(tmp_path))
    assert default_root() == str(tmp_path)
    with SharedPool("t", 2 * MiB, keep=True) as pool:
        assert pool.root == str(tmp_path)
    assert [s.name for s in SharedPool.segments()] == ["t"]
    assert SharedPool.destroy("t") is True


@pytest.mark.parametrize("suffix", [".index", ".lock", ".keep", ".procs", ".tmp"])
def test_a_name_that_would_collide_with_another_names_files_is_refused(tmp_path, suffix):
    with pytest.raises(ArgumentError, match="not ending in") as info:
        segment_path(f"t{suffix}", str(tmp_path))
    assert info.value.field == "name"


def test_segments_lists_each_segment_with_who_has_it_open(tmp_path, fork_python):
    peer = Peer(fork_python)
    try:
        peer(
            f"pool = SharedPool('busy', 16 << 20, root={str(tmp_path)!r})\n"
            "b = pool.allocate(4 << 20, key='k'); b.tensor.fill_(1); b.release()"
        )
        with SharedPool("idle", 8 * MiB, root=tmp_path, keep=True):
            pass
        open(segment_path("gone", str(tmp_path)) + ".lock", "w").close()  # a crash's leftover
        busy, gone, idle = SharedPool.segments(root=tmp_path)
        assert (busy.name, busy.capacity, busy.entries, busy.in_use, busy.keep) == (
            "busy",
            16 * MiB,
            1,
            True,
            False,
        )
        assert busy.processes == (process_id(peer.proc.pid),)
        assert 4 * MiB <= busy.allocated < 16 * MiB  # the pages of its one block
        assert busy.path == segment_path("busy", str(tmp_path))
        assert (idle.name, idle.capacity, idle.in_use, idle.processes, idle.keep) == (
            "idle",
            8 * MiB,
            False,
            (),
            True,
        )
        assert (gone.name, gone.capacity, gone.entries, gone.in_use) == ("gone", 0, None, False)
        assert SharedPool.destroy("gone", root=tmp_path) is True
        assert SharedPool.destroy("idle", root=tmp_path) is True
        peer("pool.close()")
        assert os.listdir(tmp_path) == []
        assert SharedPool.segments(root=tmp_path) == []
    finally:
        peer.close()


def test_segments_of_a_missing_root_is_an_argument_error(tmp_path):
    with pytest.raises(ArgumentError, match="not a folder"):
        SharedPool.segments(root=tmp_path / "missing")
