"""The host budget holds the components and the LoRA pool: a LoRA budget given alone grows
the default host budget; one that leaves the components nothing is refused."""

from __future__ import annotations

import pytest

import nostall
from nostall.errors import ArgumentError


def test_a_lora_budget_given_alone_grows_the_default_host_budget(tmp_path):
    from nostall.synthetic import write_store

    write_store(tmp_path, ("flux",))
    plain = nostall.ModelCache(tmp_path, device="cpu", cache_dir=False)
    more = nostall.ModelCache(tmp_path, device="cpu", cache_dir=False, lora_budget=64 << 20)
    try:
        assert plain.stats().lora_budget == 0  # no loras folder: no LoRA pool
        assert more.stats().lora_budget == 64 << 20
        assert more.stats().host_budget == plain.stats().host_budget  # the components' share
    finally:
        plain.close()
        more.close()
    with pytest.raises(ArgumentError, match=r"lora_budget=.* leaves nothing"):
        nostall.ModelCache(tmp_path, device="cpu", host_budget=32 << 20, lora_budget=32 << 20)
    with pytest.raises(ArgumentError, match="activation_reserve=-1"):
        nostall.ModelCache(tmp_path, device="cpu", activation_reserve=-1)
