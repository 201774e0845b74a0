"""The model cache's one config (:class:`~nostall.cache.config.CacheConfig`): checked once
when made, the same through keyword arguments or ``config=``, frozen; and a cache dropped
without ``close()`` gives back what it holds."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import threading

import pytest
import torch

import nostall
from nostall.cache.config import CacheConfig
from nostall.errors import ArgumentError

MB = 1 << 20


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("gpu_budget", 0, "gpu_budget=0"),
        ("gpu_budget", 1.5e9, "whole number of bytes"),
        ("host_budget", True, "host_budget=True"),
        ("activation_reserve", -1, ">= 0"),
        ("lora_budget", "1GB", "lora_budget='1GB'"),
        ("watermark", 0.0, "(0, 1]"),
        ("watermark", 1.01, "(0, 1]"),
        ("wait_s", -1, "wait_s=-1"),
        ("wait_s", float("nan"), "wait_s=nan"),
        ("dtype", torch.int8, "floating torch.dtype"),
        ("dtype", "bf16", "floating torch.dtype"),
        ("variant", "", "variant=''"),
        ("cache_dir", 3, "cache_dir=3"),
        ("host_tier", "global", "host_tier='global'"),
        ("device", 0, "device=0"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(field, value, says):
    with pytest.raises(ArgumentError) as e:
        CacheConfig(**{field: value})
    assert e.value.field == field and says in str(e.value), str(e.value)


def test_a_lora_budget_that_leaves_no_host_tier_is_refused():
    with pytest.raises(ArgumentError, match="leaves nothing of host_budget") as e:
        CacheConfig(host_budget=64 * MB, lora_budget=64 * MB)
    assert e.value.field == "lora_budget"


def test_the_config_is_frozen():
    c = CacheConfig(device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gpu_budget = 1  # type: ignore[misc]
    assert dataclasses.replace(c, gpu_budget=5).gpu_budget == 5  # checked again
    with pytest.raises(ArgumentError):
        dataclasses.replace(c, gpu_budget=0)


def test_keywords_and_config_make_the_same_cache_and_not_both(store, tmp_path):
    config = CacheConfig(
        device="cpu", gpu_budget=64 * MB, host_budget=64 * MB, watermark=0.5, wait_s=2.0,
        cache_dir=tmp_path, lora_budget=0,
    )  # fmt: skip
    with nostall.ModelCache(store, config=config) as a:
        assert a.config is config
        assert (a.watermark, a.wait_s, a.stats().lora_budget) == (0.5, 2.0, 0)
        assert a.store.index.path.startswith(str(tmp_path))  # the cache_dir reached the store
    kw = dataclasses.asdict(config)
    with nostall.ModelCache(store, **kw) as b:
        assert b.config == config
    with pytest.raises(ArgumentError, match="config= and the keyword options gpu_budget"):
        nostall.ModelCache(store, config=config, gpu_budget=1)
    with pytest.raises(TypeError, match="'gpu_budgt'; did you mean gpu_budget"):
        nostall.ModelCache(store, device="cpu", gpu_budgt=1)
    with pytest.raises(ArgumentError, match="watermark=2"):
        nostall.ModelCache(store, device="cpu", watermark=2)


def _prefetch_threads() -> int:
    return sum(t.name.startswith("nostall-prefetch") for t in threading.enumerate())


def test_a_cache_dropped_without_close_gives_back_its_tiers_and_thread(store, tmp_path):
    cache = nostall.ModelCache(
        store, device="cpu", gpu_budget=64 * MB, host_budget=64 * MB, cache_dir=tmp_path
    )
    with cache.use("sdxl"):
        pass
    cache.prefetch("flux").result(60)  # the prefetch thread runs
    before = _prefetch_threads()
    assert before >= 1
    finalizer, host, tier = cache._finalizer, cache._host, cache._tier
    assert tier.slots and finalizer.alive
    del cache
    gc.collect()
    assert not finalizer.alive  # it ran
    assert not tier.slots and tier._buffer is None  # the device tier given back
    assert host.pool.closed  # the host tier unpinned
    deadline = threading.Event()
    for _ in range(100):  # the thread was told to stop, not waited for
        if _prefetch_threads() < before:
            break
        deadline.wait(0.05)
    assert _prefetch_threads() < before


def test_a_closed_cache_leaves_nothing_for_its_finalizer(store, tmp_path):
    cache = nostall.ModelCache(store, device="cpu", gpu_budget=64 * MB, cache_dir=tmp_path)
    finalizer = cache._finalizer
    cache.close()
    assert not finalizer.alive


def test_a_cache_left_open_at_exit_ends_the_process_cleanly(tmp_path):
    """The finalizer does not run at interpreter exit (torch may be half torn down), and
    the cache does not touch CUDA on import: the process exits 0, nothing on stderr."""
    code = (
        "import sys, torch, nostall\n"
        f"c = nostall.ModelCache({str(tmp_path)!r}, device='cpu', gpu_budget=8 << 20,"
        " host_budget=64 << 20, cache_dir=False)\n"
        "assert not torch.cuda.is_initialized()\n"
        "sys.modules['__main__'].keep = c  # alive until the interpreter's end\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
