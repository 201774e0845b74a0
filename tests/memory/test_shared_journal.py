"""Rebuilding a lost shared-pool index from the journals of the live processes."""

from __future__ import annotations

import json
import logging
import os

from nostall.memory.shared_index import Index, process_id
from nostall.memory.shared_journal import Hold, Journals

MiB = 1 << 20
ME = process_id(os.getpid())
PARENT = process_id(os.getppid())  # another live process
DEAD = "99999999-1"


def hold(id, offset, size=4 * MiB, *, epoch="e1", key="'k'", writing=False, count=1):
    return Hold(epoch, str(id), offset * MiB, size, size, key, writing, count)


def _recover(tmp_path, journals: dict[str, list[list[Hold]]], capacity=32 * MiB):
    """Write each process's journals (one list of holds per pool object), then recover."""
    j = Journals(str(tmp_path / "seg"))
    for proc, pools in journals.items():
        for holds in pools:
            j.new(proc).write(holds)
    index = Index(host="h", boot=None, capacity=capacity)
    pools, kept = j.recover(index)
    Index.from_json(json.loads(index.to_json()))  # every invariant holds
    return index, pools, kept, j


def test_holds_that_agree_keep_their_epoch_and_ids(tmp_path):
    index, pools, kept, _ = _recover(
        tmp_path,
        {
            ME: [[hold(3, 0, count=2), hold(5, 8, key=None, writing=True)], [hold(3, 0)]],
            PARENT: [[hold(3, 0), hold(4, 4, key="'x'")]],
        },
    )
    assert (pools, kept, index.epoch, index.next_id) == (3, 3, "e1", 6)
    assert index.attached == {ME: 2, PARENT: 1}
    read, other, writing = index.entries["3"], index.entries["4"], index.entries["5"]
    # Read while the index was lost: served to nobody, freed once the last holder lets go.
    assert (read.state, read.holders, read.key, read.offset) == (
        "retired",
        {ME: 3, PARENT: 1},
        "'k'",
        0,
    )
    assert (other.state, other.holders) == ("retired", {PARENT: 1})
    # Being written: its writer's release still publishes it.
    assert (writing.state, writing.writer, writing.holders) == ("writing", ME, {ME: 1})
    index.unhold("3", ME, 3)
    index.unhold("3", PARENT)
    assert "3" not in index.entries


def test_holds_that_disagree_keep_the_union_of_their_bytes_reserved(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        index, _, kept, _ = _recover(
            tmp_path,
            {
                # id 1 with two ranges; ids 2 and 3 overlapping; id 9 of another epoch
                ME: [[hold(1, 0), hold(2, 10, 6 * MiB), hold(9, 24, epoch="e0")]],
                PARENT: [[hold(1, 2), hold(3, 14), hold(7, 28)]],
            },
        )
    assert index.epoch == "e1" and kept == 4
    spans = sorted((e.offset // MiB, e.size // MiB, e.state, e.key) for e in index.entries.values())
    assert spans == [
        (0, 6, "retired", None),  # [0, 4) and [2, 6): one entry over both
        (10, 8, "retired", None),  # [10, 16) and [14, 18)
        (24, 4, "retired", None),  # another epoch's: no handle names it, kept all the same
        (28, 4, "retired", "'k'"),  # PARENT's own, agreed: keeps its id
    ]
    assert index.entries["7"].holders == {PARENT: 1}
    merged = next(e for e in index.entries.values() if e.offset == 0)
    assert merged.holders == {ME: 1, PARENT: 1}
    assert "bytes [0, 6291456) are in holds that disagree" in caplog.text
    # Merged entries get ids above every held one: a handle's release frees none of them,
    # only their holders' end does.
    assert sorted(int(i) for i in index.entries) == [7, 8, 9, 10]


def test_journals_of_dead_processes_are_deleted_and_bad_ones_ignored(tmp_path, caplog):
    j = Journals(str(tmp_path / "seg"))
    j.new(DEAD).write([hold(1, 0)])
    unreadable = j.new(PARENT)
    unreadable.write([])
    with open(unreadable.path, "w") as f:
        f.write("{oops")
    with caplog.at_level(logging.WARNING):
        index, pools, kept, _ = _recover(
            tmp_path, {ME: [[hold(2, 30), hold(3, 0, size=3 * MiB), hold(4, 4)]]}
        )
    assert [n.split(".")[0] for n in sorted(os.listdir(j.folder))] == sorted([ME, PARENT])
    assert pools == 2 and index.attached == {ME: 1, PARENT: 1}
    assert kept == 1 and list(index.entries) == ["4"]  # [30, 34) leaves 32 MiB; 3 MiB is off
    assert "cannot be read" in caplog.text and "do not fit the 33554432-byte segment" in caplog.text


def test_no_journal_no_entry(tmp_path):
    index, pools, kept, j = _recover(tmp_path, {})
    assert (pools, kept, index.entries, index.attached) == (0, 0, {}, {})
    assert j.live() == [] and j.remove() is False
