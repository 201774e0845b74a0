"""Fusions on plain modules: the weights are base + Σ weight·scale·B@A, the base comes back
bit for bit, and callers wanting other LoRAs take turns (all modules or none: no deadlock
over two shared modules)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nostall.adapters import Fusions, Lora, LoraLayer
from nostall.errors import BusyError


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.lin = torch.nn.Linear(8, 6)
    return m


def _lora(name: str, role: str, seed: int, scale: float = 0.5) -> Lora:
    g = torch.Generator().manual_seed(seed)
    layer = LoraLayer(role, "lin", torch.randn(2, 8, generator=g), torch.randn(6, 2, generator=g),
                      scale)  # fmt: skip
    return Lora(name, f"/{name}.safetensors", "FluxPipeline", (layer,))


def test_fused_weights_and_the_base_back_bit_for_bit():
    m = _module(0)
    base = m.lin.weight.detach().clone()
    a, b = _lora("a", "transformer", 1), _lora("b", "transformer", 2, scale=2.0)
    f = Fusions()
    f.leave(f.enter({"transformer": m}, [(a, 0.8), (b, 0.4)]))
    want = base + 0.8 * 0.5 * a.layers[0].up @ a.layers[0].down
    want += 0.4 * 2.0 * b.layers[0].up @ b.layers[0].down
    assert torch.allclose(m.lin.weight, want, atol=1e-6)
    f.leave(f.enter({"transformer": m}, [(b, 1.0)]))  # straight from one set to another
    assert torch.allclose(m.lin.weight, base + 2.0 * b.layers[0].up @ b.layers[0].down, atol=1e-6)
    f.leave(f.enter({"transformer": m}, []))
    assert torch.equal(m.lin.weight, base)


def test_callers_wanting_other_loras_on_two_shared_modules_take_turns():
    m1, m2 = _module(0), _module(1)
    mods = {"text_encoder": m1, "transformer": m2}
    x = [(_lora("x", "transformer", 3), 1.0), (_lora("x1", "text_encoder", 4), 1.0)]
    y = [(_lora("y", "transformer", 5), 1.0)]
    f = Fusions()
    first = f.enter(mods, x)
    same = f.enter(mods, x)  # the same state: enters at once
    order: list[str] = []

    def other():
        f.leave(f.enter(dict(reversed(list(mods.items()))), y))
        order.append("y")

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not order  # waits for both holders of x
    f.leave(same)
    time.sleep(0.1)
    assert not order
    order.append("x left")
    f.leave(first)
    t.join(10)
    assert order == ["x left", "y"]


def test_a_module_held_too_long_is_a_busy_error_naming_it():
    m = _module(0)
    f = Fusions(wait_s=0.2)
    held = f.enter({"transformer": m}, [(_lora("a", "transformer", 1), 1.0)])
    with pytest.raises(BusyError, match="Module stayed in use"):
        f.enter({"transformer": m}, [])
    f.leave(held)
    f.leave(f.enter({"transformer": m}, []))  # free again


def test_without_room_on_the_device_the_base_copies_wait_in_host_memory():
    m = _module(0)
    base = m.lin.weight.detach().clone()
    asked: list[int] = []

    def room(device: torch.device, nbytes: int) -> bool:
        asked.append(nbytes)
        return False

    a = _lora("a", "transformer", 1)
    near, far = Fusions(), Fusions(room=room)
    twin = _module(0)
    far.leave(far.enter({"transformer": m}, [(a, 0.8)]))
    near.leave(near.enter({"transformer": twin}, [(a, 0.8)]))
    assert asked == [m.lin.weight.nbytes]  # what the new copies need, asked once
    assert torch.equal(m.lin.weight, twin.lin.weight)
    (copy,) = far._states[id(m)].base.values()
    assert copy.data_ptr() != m.lin.weight.data_ptr()  # a copy, even on a CPU
    assert far.base_bytes() == {"cpu": m.lin.weight.nbytes}
    far.leave(far.enter({"transformer": m}, []))
    assert torch.equal(m.lin.weight, base) and far.base_bytes() == {}


def test_the_fused_kernel_is_for_gpus_only():
    from nostall.adapters.kernels import fused_addmm

    w = torch.randn(8, 8, dtype=torch.bfloat16)
    out = torch.zeros_like(w)
    assert not fused_addmm(w, w[:, :2], w[:2], 1.0, out) and not out.any()


def _launch_test_weights(n: int):
    """``n`` CPU weights with one LoRA part each, and two parts for the last."""
    out = []
    for i in range(n):
        m = _module(i)
        parts = [(_lora(f"l{i}", "transformer", 10 + i).layers[0], 1.0)]
        if i == n - 1:
            parts.append((_lora("extra", "transformer", 99).layers[0], 0.5))
        w = m.lin.weight
        out.append((w, w.detach().clone(), parts))
    return out


def test_first_parts_launch_chunk_by_chunk_and_later_parts_after_them(monkeypatch):
    import nostall.adapters.fuse as fuse

    launched: list[list[int]] = []
    monkeypatch.setattr(fuse, "launch_group",
                        lambda t, p=None: launched.append(t.ptrs[:, 1].tolist()) or True)  # fmt: skip
    uploads = fuse.Uploads([], lambda d: None)
    waits: list[tuple] = []
    monkeypatch.setattr(uploads, "wait", lambda dev, key: waits.append(key))
    weights = _launch_test_weights(4)
    launches = fuse._Launches(uploads)
    chunks = [0, 0, 1, 1]
    for j, (w, base, parts) in enumerate(weights):
        for i, _ in enumerate(parts):
            key = (i, 0, chunks[j], "float32", "cpu")
            launches.add(key, (base, 10 * j + i, 0, 1.0, w, 2), (w, base, parts))
        if j == 2:  # the next chunk came: the first chunk's launch went at once
            assert launched == [[0, 10]] and waits == [(0, 0)]
    launches.finish()
    assert launched == [[0, 10], [20, 30], [31]]  # the last weight's second part last
    assert waits == [(0, 0), (0, 1), (0, 1)] and launches.groups == {}


def test_a_kernel_that_fails_first_is_replaced_weight_by_weight(monkeypatch, caplog):
    import nostall.adapters.fuse as fuse
    import nostall.adapters.kernels as kernels

    def broken(tables, ptrs=None):
        raise RuntimeError("no compiler (simulated)")

    monkeypatch.setattr(fuse, "launch_group", broken)
    monkeypatch.setattr(kernels, "_AVAILABLE", True)
    uploads = fuse.Uploads([], lambda d: None)
    monkeypatch.setattr(uploads, "wait", lambda dev, key: None)
    weights = _launch_test_weights(3)
    want = []
    for _, base, parts in weights:
        delta = sum(wt * x.scale * x.up @ x.down for x, wt in parts)
        want.append(base + delta)
    launches = fuse._Launches(uploads)
    for j, (w, base, parts) in enumerate(weights):
        for i, _ in enumerate(parts):
            launches.add((i, 0, j, "float32", "cpu"), (base, 0, 0, 1.0, w, 2), (w, base, parts))
    launches.finish()
    assert caplog.text.count("fusing weight by weight") == 1 and not kernels.available()
    for (w, _, _), expect in zip(weights, want, strict=True):
        assert torch.allclose(w, expect, atol=1e-5)


def test_a_plan_replays_the_launches_with_the_factors_new_address(monkeypatch):
    import nostall.adapters.fuse as fuse

    calls: list[tuple[list[int], list[list[int]] | None]] = []
    monkeypatch.setattr(fuse, "launch_group", lambda t, p=None: calls.append(
        (t.ptrs.tolist(), None if p is None else p.tolist())) or True)  # fmt: skip
    uploads = fuse.Uploads([], lambda d: None)
    block = {"at": 1000}
    monkeypatch.setattr(uploads, "wait", lambda dev, key: None)
    monkeypatch.setattr(uploads, "device_base", lambda dev, i: block["at"])
    weights = _launch_test_weights(2)
    launches = fuse._Launches(uploads)
    for j, (w, base, parts) in enumerate(weights):
        for i, _ in enumerate(parts):
            launches.add((i, 0, j, "float32", "cpu"), (base, 1000 + 10 * j + i, 1500 + j, 1.0, w, 2),
                         (w, base, parts))  # fmt: skip
    launches.finish()
    assert launches.plannable() and len(calls) == 3
    st = fuse._State(torch.nn.Module())
    plan = fuse._Plan.of(st, uploads, launches)
    first = [ptrs for ptrs, _ in calls]
    calls.clear()
    block["at"] = 5000  # the next switch's copy of the block is elsewhere
    plan.run(uploads)
    assert [tables for tables, _ in calls] == first  # the same launches, same tables
    for (_, moved), rows in zip(calls, first, strict=True):
        for got, row in zip(moved, rows, strict=True):  # (base, up, down, out)
            assert got == [row[0], row[1] + 4000, row[2] + 4000, row[3]]
    st.generation += 1  # the base copies changed: the plan is void
    assert not plan.valid(st, uploads)
