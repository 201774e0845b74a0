"""The repeated blocks of real diffusers and transformers modules (nostall.stream.blocks)."""

from __future__ import annotations

import pytest
import torch.nn as nn

from nostall.stream.blocks import find_blocks

pytest.importorskip("diffusers")


def _module(store, sub):
    from nostall.assemble import build_empty, resolve_model_class

    folder = str(store / sub)
    return build_empty(resolve_model_class(folder), folder, dtype=None)


def test_the_blocks_of_each_kind_of_module_in_the_order_they_run(store):
    names = {
        "flux/transformer": ["transformer_blocks.0", "single_transformer_blocks.0"],
        "flux/text_encoder_2": ["encoder.block.0", "encoder.block.1"],
        "flux/text_encoder": ["text_model.encoder.layers.0", "text_model.encoder.layers.1"],
        # a UNet registers mid_block last and runs it between down and up
        "sdxl/unet": [
            "down_blocks.0",
            "down_blocks.1",
            "mid_block.attentions.0",
            "mid_block.resnets.0",
            "mid_block.resnets.1",
            "up_blocks.0",
            "up_blocks.1",
        ],
    }
    for sub, want in names.items():
        blocks = find_blocks(_module(store, sub))
        got = [b.name.removeprefix("text_model.") for b in blocks]
        assert got == [w.removeprefix("text_model.") for w in want], sub
        for b in blocks:
            assert b.nbytes > 0 and all(p.startswith(b.name + ".") for p in b.params)


def test_a_layers_parts_are_not_blocks_and_tied_blocks_stay():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_out = nn.ModuleList([nn.Linear(4, 4), nn.Dropout()])  # parts of a layer
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.head = nn.Linear(4, 4)
            self.head.weight = self.layers[2].weight  # tied: layer 2 cannot stream

    assert [b.name for b in find_blocks(M())] == ["layers.0", "layers.1"]
