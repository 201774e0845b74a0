"""The ring (nostall.stream.ring) on the CPU: blocks streamed through fewer buffers than
blocks compute what the resident module computes, call after call; with a fake pair of
streams, every copy into a buffer is ordered after the compute of the block that used
it last, every block waits for its own copy, and after the first call nothing misses."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nostall.stream.ring import BlockRing, CpuStreams


class Toy(nn.Module):
    def __init__(self, n=5, width=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _streamed(model: Toy, depth: int, streams):
    """``model`` with every block's weights viewing one of ``depth`` buffers, the
    ring copying them in from host copies; the ring."""
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    buffers = torch.zeros(depth, max(sizes))
    copies = []
    for k, b in enumerate(model.blocks):
        at, pairs = 0, []
        for p in b.parameters():
            n = p.numel()
            host = p.detach().clone().reshape(-1)
            view = buffers[k % depth, at : at + n]
            pairs.append((view, host))
            p.data = view.view(p.shape)  # the block's weights view its buffer for good
            at += n
        copies.append(pairs)
    ring = BlockRing(list(model.blocks), copies, depth, streams)
    ring.install()
    return ring


@pytest.mark.parametrize("n, depth", [(5, 1), (5, 2), (5, 3), (6, 3), (2, 3)])
def test_streamed_blocks_compute_what_resident_ones_do_call_after_call(n, depth):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    want = Toy(n)(x)
    model = Toy(n)
    ring = _streamed(model, depth, CpuStreams())
    for _ in range(3):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    per_block = ring.nbytes_of(0)
    # the first buffers primed; then per call one copy per block that shares its
    # buffer (a buffer only one block uses keeps it: with n <= depth, all of them)
    sharing = sum(1 for k in range(n) if (k % depth) + depth < n or k >= depth)
    assert ring.copied_bytes == (min(n, depth) + 3 * sharing) * per_block
    assert ring.misses == 1  # the cold first block only


class _Event:
    def __init__(self, kind, block=None, ended=0):
        self.kind, self.block, self.ended = kind, block, ended


class Fake:
    """Streams that record on one timeline: copies land at once (a CPU); a mark says
    how many block forwards had ended when it was recorded."""

    def __init__(self):
        self.timeline: list[tuple] = []
        self.ended = 0
        self.block_of: dict[int, int] = {}  # id(a block's copies) -> the block

    def issue(self, copies, after):
        for dst, src in copies:
            dst.copy_(src)
        k = self.block_of[id(copies)]
        self.timeline.append(("issue", k, after))
        return _Event("copy", block=k)

    def wait(self, event):
        self.timeline.append(("wait", event))

    def mark(self):
        return _Event("mark", ended=self.ended)


def _replay(timeline, depth):
    """Check the ordering on ``timeline``: every copy into a buffer after a mark that
    saw its last user's forward end; every forward right after a wait for its own copy."""
    holder: dict[int, int] = {}  # buffer -> the block last copied there
    used_at: dict[int, int] = {}  # block -> the count of ended forwards after its last
    ended = 0
    for i, what in enumerate(timeline):
        if what[0] == "issue":
            _, k, after = what
            prev = holder.get(k % depth)
            if prev is not None:
                assert prev in used_at, f"block {prev}'s copy overwritten before it ran"
                marks = [e for e in after if e.kind == "mark"]
                assert marks, "a copy ordered after nothing"
                seen = max(m.ended for m in marks)
                assert seen >= used_at.pop(prev), f"copy of {k} before {prev} ended"
            holder[k % depth] = k
        elif what[0] == "start":
            _, k = what
            before = timeline[i - 1]
            assert before[0] == "wait" and before[1].block == k, f"block {k} ran unwaited"
            assert holder[k % depth] == k, f"block {k} ran on another block's weights"
        elif what[0] == "end":
            ended += 1
            used_at[what[1]] = ended


@pytest.mark.parametrize("n, depth", [(7, 3), (6, 2), (5, 1)])
def test_every_copy_waits_for_the_last_user_of_its_buffer_and_every_block_for_its_copy(n, depth):
    model = Toy(n)
    fake = Fake()
    for k, b in enumerate(model.blocks):  # before the ring's: ends are known to its marks

        def end(m, a, o, k=k):
            fake.ended += 1
            fake.timeline.append(("end", k))

        b.register_forward_hook(end)
    ring = _streamed(model, depth, fake)
    fake.block_of = {id(c): k for k, c in enumerate(ring.copies)}
    for k, b in enumerate(model.blocks):  # after the ring's: right after its wait
        b.register_forward_pre_hook(lambda m, a, k=k: fake.timeline.append(("start", k)))
    x = torch.randn(2, 8)
    want = Toy(n)(x)
    for _ in range(3):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    _replay(fake.timeline, depth)
    assert ring.misses == 1
    issues = [w for w in fake.timeline if w[0] == "issue"]
    sharing = sum(1 for k in range(n) if (k % depth) + depth < n or k >= depth)
    assert len(issues) == depth + 3 * sharing  # primed, then one per sharing block per call


def test_a_call_cut_short_leaves_the_next_one_right():
    model, depth = Toy(6), 2
    ring = _streamed(model, depth, CpuStreams())
    x = torch.randn(2, 8)
    want = Toy(6)(x)
    boom = model.blocks[3].register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x)
    boom.remove()
    for _ in range(2):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    assert ring.misses >= 2  # (the call after the cut found its blocks not there)
