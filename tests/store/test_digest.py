"""Content digests: every data byte, whatever the read chunking; file identities."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from nostall.store.digest import LEAF_BYTES, DataHasher, FileIdentity, hash_file_data


def _feed(data: bytes, start: int, end: int, cuts: list[int], shuffle: bool) -> str:
    h = DataHasher(start, end)
    edges = [0, *sorted(cuts), len(data)]
    pieces = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
    if shuffle:
        random.Random(0).shuffle(pieces)  # reader threads land chunks in any order
    for a, b in pieces:
        h.feed(a, memoryview(data)[a:b])
    return h.digest()


def test_the_digest_depends_on_the_bytes_not_the_chunking():
    data = os.urandom(3 * LEAF_BYTES + 12345)
    start, end = 8 + 777, len(data) - 100
    whole = _feed(data, start, end, [], False)
    assert _feed(data, start, end, [LEAF_BYTES, 2 * LEAF_BYTES], True) == whole
    # cuts inside leaves (a chunk ending at a pinned registration's edge)
    assert _feed(data, start, end, [4096, LEAF_BYTES + 8192, 2 * LEAF_BYTES + 1], True) == whole
    flipped = bytearray(data)
    flipped[start + LEAF_BYTES + 5] ^= 1
    assert _feed(bytes(flipped), start, end, [], False) != whole
    # bytes outside the data section do not count
    outside = bytearray(data)
    outside[0] ^= 1
    outside[-1] ^= 1
    assert _feed(bytes(outside), start, end, [], False) == whole
    # the section's bounds do
    assert _feed(data, start + 1, end, [], False) != whole


def test_a_digest_with_bytes_missing_is_an_error():
    h = DataHasher(0, 2 * LEAF_BYTES)
    h.feed(0, memoryview(bytes(LEAF_BYTES)))
    with pytest.raises(RuntimeError, match="never fed"):
        h.digest()


def test_hash_file_data_matches_the_streaming_digest(tmp_path):
    data = os.urandom(LEAF_BYTES + 999)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert hash_file_data(str(path), 100, len(data), block=1 << 20) == _feed(
        data, 100, len(data), [], False
    )


def test_an_empty_data_section_has_a_digest():
    assert DataHasher(8, 8).digest() == DataHasher(8, 8).digest()


def test_identity_changes_with_an_in_place_rewrite(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    before = FileIdentity.stat(str(path))
    with open(path, "r+b") as f:
        f.write(b"x")
    assert FileIdentity.stat(str(path)) != before
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, before.mtime_ns))  # mtime put back: ctime still moved
    assert FileIdentity.stat(str(path)) != before
