"""The digest index: remembered across processes, and never in the way when it breaks."""

from __future__ import annotations

import logging
import sqlite3

from nostall.store.digest import FileIdentity
from nostall.store.digest_index import FILENAME, DigestIndex, default_cache_dir


def _ident(n: int) -> FileIdentity:
    return FileIdentity(1, n, 10, 20, 30)


def test_digests_survive_a_new_index_and_follow_identity(tmp_path):
    a = DigestIndex(tmp_path)
    a.put(_ident(1), "/m/a", "d1")
    assert a.persistent and a.get(_ident(1)) == "d1"
    b = DigestIndex(tmp_path)
    assert b.get(_ident(1)) == "d1"
    assert b.get(FileIdentity(1, 1, 10, 20, 31)) is None  # the file changed: unknown
    b.put(FileIdentity(1, 1, 10, 20, 31), "/m/a", "d2")  # replaces its own row
    assert DigestIndex(tmp_path).get(_ident(1)) is None
    # huge device/inode numbers (some network filesystems) fit
    big = FileIdentity(2**64 - 1, 2**63 + 5, 1, 2, 3)
    b.put(big, "/m/b", "d3")
    assert DigestIndex(tmp_path).get(big) == "d3"


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NOSTALL_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_dir() == str(tmp_path / "x")
    monkeypatch.delenv("NOSTALL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "nostall")


def test_a_corrupt_index_is_moved_aside_and_rebuilt_said_once(tmp_path, caplog):
    (tmp_path / FILENAME).write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING, logger="nostall.store.digest_index"):
        index = DigestIndex(tmp_path)
    assert index.persistent
    index.put(_ident(1), "/m/a", "d1")
    assert DigestIndex(tmp_path).get(_ident(1)) == "d1"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "corrupt" in said[0] and "rebuilt" in said[0]
    assert any(p.name.startswith(FILENAME + ".corrupt-") for p in tmp_path.iterdir())


def test_an_unwritable_folder_is_bypassed_said_once(tmp_path, caplog):
    # A folder that cannot exist (under a regular file): refused even to root, as a
    # read-only or full filesystem would refuse it.
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING, logger="nostall.store.digest_index"):
        index = DigestIndex(tmp_path / "file" / "sub")
        index.put(_ident(1), "/m/a", "d1")
        index.put(_ident(2), "/m/b", "d2")
    assert not index.persistent and index.get(_ident(1)) == "d1"  # in memory still
    assert len(caplog.records) == 1 and "memory only" in caplog.records[0].getMessage()


def test_a_write_that_fails_later_is_bypassed_said_once(tmp_path, caplog, monkeypatch):
    index = DigestIndex(tmp_path)

    class Broken:
        def execute(self, *a):
            raise sqlite3.OperationalError("disk I/O error")

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def close(self):
            pass

    index._db = Broken()
    with caplog.at_level(logging.WARNING, logger="nostall.store.digest_index"):
        index.put(_ident(1), "/m/a", "d1")
        index.put(_ident(2), "/m/b", "d2")
    assert index.get(_ident(2)) == "d2" and not index.persistent
    assert len(caplog.records) == 1 and "disk I/O error" in caplog.records[0].getMessage()


# A writer process: 150 rows from argv[2] on, into the index in argv[1], once told to go.
_WRITER = """
import sys
from nostall.store.digest import FileIdentity
from nostall.store.digest_index import DigestIndex
index, start = DigestIndex(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
for n in range(start, start + 150):
    index.put(FileIdentity(1, n, 10, 20, 30), f"/m/{n}", f"d{n}")
"""


def test_two_processes_writing_at_once_lose_nothing(tmp_path, fork_python):
    # Processes of their own (forked by the conftest's fixture), started together.
    procs = [fork_python(_WRITER, str(tmp_path), str(k * 1000)) for k in range(2)]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        p.communicate(timeout=60)
        assert p.returncode == 0
    index = DigestIndex(tmp_path)
    assert all(
        index.get(_ident(k * 1000 + n)) == f"d{k * 1000 + n}" for k in range(2) for n in range(150)
    )


def test_a_row_edited_by_hand_fails_its_checksum_and_is_dropped_said_once(tmp_path, caplog):
    index = DigestIndex(tmp_path)
    index.put(_ident(1), "/m/a", "d1")
    index.put(_ident(2), "/m/b", "d2")
    index.close()
    with sqlite3.connect(tmp_path / FILENAME) as db:  # b's row now claims a's digest
        db.execute("UPDATE digests SET digest = 'd1' WHERE ino = 2")
    with caplog.at_level(logging.WARNING, logger="nostall.store.digest_index"):
        fresh = DigestIndex(tmp_path)
        assert fresh.get(_ident(2)) is None and fresh.get(_ident(2)) is None
        assert fresh.get(_ident(1)) == "d1"  # its neighbours are kept
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'/m/b'" in said[0] and "checksum" in said[0]
    with sqlite3.connect(tmp_path / FILENAME) as db:
        assert db.execute("SELECT count(*) FROM digests WHERE ino = 2").fetchone() == (0,)
    fresh.put(_ident(2), "/m/b", "d2")  # hashed again when next read: a good row
    assert DigestIndex(tmp_path).get(_ident(2)) == "d2"
