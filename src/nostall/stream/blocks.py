"""The repeated blocks of a module: what partial residency streams, one block at a time.

A diffusers or transformers model keeps its repeated layers in ``nn.ModuleList``\\ s:
FLUX's ``transformer_blocks`` and ``single_transformer_blocks``, SD3's
``transformer_blocks``, Wan's ``blocks``, a UNet's ``down_blocks`` and ``up_blocks``, T5's
``encoder.block``, CLIP's ``text_model.encoder.layers``. :func:`find_blocks` finds the
outermost such lists (a list inside a block stays part of that block) in the order the
``forward`` of every model named above runs them: registration order, except that
siblings named ``down…``, ``mid…``, ``up…`` run in that order (a UNet registers its
``mid_block`` last).
Everything else (embeddings, norms, a UNet's ``mid_block``, projections) is the
module's *rest*: it stays on the device.

A block whose parameters are shared with another block or with the rest (tied
weights) is left out: streaming it would overwrite what another layer reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

__all__ = ["Block", "find_blocks"]

# A UNet (and a VAE's encoder and decoder) registers ``down_blocks``, ``up_blocks`` and
# then ``mid_block``, and runs them down, mid, up: siblings so named go in that order.
_RANK = {"down": 0, "mid": 1, "up": 2}


@dataclass(frozen=True, eq=False)
class Block:
    """One repeated block: its qualified ``name`` in the module, the ``module``, its
    parameters' qualified names (as in ``state_dict``) and their bytes."""

    name: str
    module: nn.Module
    params: tuple[str, ...]
    nbytes: int


def find_blocks(module: nn.Module) -> list[Block]:
    """The blocks of ``module`` in the order its forward runs them (see the module):
    the entries of each outermost ``nn.ModuleList`` whose every entry holds parameters
    (a list holding a parameterless layer, as ``to_out = [Linear, Dropout]``, is a
    layer's parts, not blocks: the walk goes on inside it). Empty when it has none."""
    found: list[tuple[tuple, str, nn.Module]] = []

    def walk(prefix: str, sub: nn.Module, key: tuple) -> None:
        for at, (name, child) in enumerate(sub.named_children()):
            qual = f"{prefix}{name}"
            here = (*key, _RANK.get(name.split("_")[0], 1), at)
            if (
                isinstance(child, nn.ModuleList)
                and len(child) > 0
                and all(any(True for _ in e.parameters()) for e in child)
            ):
                for i, entry in enumerate(child):
                    found.append(((*here, i), f"{qual}.{i}", entry))
                continue
            walk(qual + ".", child, here)

    walk("", module, ())
    found.sort(key=lambda f: f[0])
    owners: dict[int, int] = {}  # id(parameter) -> how many places hold it
    for _, p in module.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    blocks = []
    for _, name, sub in found:
        named = list(sub.named_parameters(remove_duplicate=False))
        if not named:
            continue
        inside: dict[int, int] = {}
        for _, p in named:
            inside[id(p)] = inside.get(id(p), 0) + 1
        if any(owners[k] != n for k, n in inside.items()):
            continue  # tied to something outside the block
        seen: set[int] = set()
        params, nbytes = [], 0
        for pname, p in named:
            params.append(f"{name}.{pname}")
            if id(p) not in seen:
                seen.add(id(p))
                nbytes += p.numel() * p.element_size()
        blocks.append(Block(name, sub, tuple(params), nbytes))
    return blocks
