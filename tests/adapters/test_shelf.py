"""The shelf: LoRAs read once per file identity, kept in one pool block each within a byte
budget (least recently used dropped first), a LoRA still held keeping its bytes."""

from __future__ import annotations

import gc
import itertools
import os

import pytest
import torch
from safetensors.torch import save_file

from nostall.adapters import Shelf, lora_bytes
from nostall.errors import UnknownModel


def _write(folder, name: str, seed: int, rank: int = 4) -> str:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(3):
        tensors[f"transformer.blocks.{i}.lin.lora_A.weight"] = torch.randn(rank, 64, generator=g)
        tensors[f"transformer.blocks.{i}.lin.lora_B.weight"] = torch.randn(32, rank, generator=g)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.safetensors")
    save_file(tensors, path)
    return path


@pytest.fixture
def loras(tmp_path):
    folder = tmp_path / "loras"
    for i, name in enumerate(("a", "b", "c")):
        _write(folder, name, i)
    return str(folder)


def _factors(lora) -> list[torch.Tensor]:
    return [t for x in lora.layers for t in (x.down, x.up)]


def test_loras_are_kept_in_the_pool_and_read_once_per_file(loras):
    shelf = Shelf(loras, 64 << 20)
    a = shelf.get("a", "FluxPipeline")
    assert shelf.get("a", "FluxPipeline") is a  # kept: not read again
    pool = shelf._pool
    start = pool.arena.tensor.data_ptr()
    for t in _factors(a):  # every factor views the pool's memory
        assert start <= t.data_ptr() < start + pool.capacity
    assert shelf.nbytes() == a.nbytes and lora_bytes(loras) == 3 * os.path.getsize(
        os.path.join(loras, "a.safetensors")
    )
    os.utime(os.path.join(loras, "a.safetensors"), ns=(1, 1))  # the file changed identity
    assert shelf.get("a", "FluxPipeline") is not a
    shelf.close()


def test_the_least_recently_used_go_first_and_a_held_lora_keeps_its_bytes(loras):
    shelf = Shelf(loras, 4 << 20)  # two 2 MiB blocks: two LoRAs at a time
    a = shelf.get("a", "FluxPipeline")
    want = [t.clone() for t in _factors(a)]
    b_ptr = shelf.get("b", "FluxPipeline").layers[0].down.data_ptr()  # kept, not held here
    shelf.get("a", "FluxPipeline")  # a used last: b goes for c
    c = shelf.get("c", "FluxPipeline")
    assert c.layers[0].down.data_ptr() == b_ptr  # in b's block
    assert shelf.get("a", "FluxPipeline") is a
    del c
    shelf.get("b", "FluxPipeline")  # c, used before a, goes
    assert shelf.get("a", "FluxPipeline") is a
    shelf.get("b", "FluxPipeline")
    shelf.get("c", "FluxPipeline")  # a goes first but is held here, so b goes too
    assert shelf.get("a", "FluxPipeline") is not a  # read again into c's old block
    # a was dropped by the shelf but is still held here: its block was not reused
    assert all(torch.equal(t, w) for t, w in zip(_factors(a), want, strict=True))
    held = shelf._pool.stats(hugepages=False)
    del a
    gc.collect()
    assert shelf._pool.stats(hugepages=False).free > held.free  # the last holder let go
    shelf.close()


def test_a_lora_larger_than_the_budget_is_read_each_time(loras):
    shelf = Shelf(loras, 1 << 20)  # below one block
    a = shelf.get("a", "FluxPipeline")
    assert shelf.get("a", "FluxPipeline") is not a and shelf.nbytes() == 0
    assert shelf._pool is None  # nothing pinned for it
    no_budget = Shelf(loras)
    assert no_budget.get("a", "FluxPipeline").nbytes == a.nbytes


def test_close_while_a_lora_is_held_leaves_its_memory_readable(loras):
    shelf = Shelf(loras, 64 << 20)
    a = shelf.get("a", "FluxPipeline")
    want = [t.clone() for t in _factors(a)]
    shelf.close()
    assert all(torch.equal(t, w) for t, w in zip(_factors(a), want, strict=True))
    with pytest.raises(UnknownModel, match="did you mean a"):
        shelf.get("aa", "FluxPipeline")


def test_a_kept_loras_factors_lie_apart_in_its_one_block(loras):
    shelf = Shelf(loras, 64 << 20)
    a = shelf.get("a", "FluxPipeline")
    assert a.flat is not None and a.flat.dtype == torch.uint8
    assert Shelf(loras).get("a", "FluxPipeline").flat is None  # read each time: no block
    start, end = a.flat.data_ptr(), a.flat.data_ptr() + a.flat.numel()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in _factors(a))
    assert all(start <= lo and hi <= end for lo, hi in spans)  # one copy moves them all
    assert all(hi <= lo2 for (_, hi), (lo2, _) in itertools.pairwise(spans))  # apart
    assert all(t.is_contiguous() and t.data_ptr() % 512 == 0 for t in _factors(a))
    shelf.close()
