"""What a :class:`~nostall.ModelCache` is configured with: one frozen :class:`CacheConfig`,
checked once when it is made.

Everything a cache takes besides its store and an injected loader lives here, so a CLI,
a worker (:class:`~nostall.serve.config.WorkerConfig` holds one) and a Python caller
describe a cache the same way, and a bad value is refused before a byte is read, with an
:class:`~nostall.ArgumentError` naming the field, the value and what to give instead.

>>> CacheConfig(device="cpu", gpu_budget=1 << 30).watermark
0.95
>>> CacheConfig(watermark=1.5)
Traceback (most recent call last):
nostall.errors.ArgumentError: watermark=1.5: give a fraction in (0, 1] of the device tier (0.95 by default)
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from nostall.errors import ArgumentError

__all__ = ["CacheConfig", "check_count", "check_seconds", "resolve_config"]

C = TypeVar("C")


def check_count(
    name: str, value: Any, *, least: int = 0, unit: str = "bytes", optional: bool = True
) -> None:
    """Refuse ``value`` unless it is a whole number (not a bool) ``>= least`` (or, when
    ``optional``, ``None``): an :class:`~nostall.ArgumentError` naming ``name`` and the
    value."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(
            f"{name}={value!r}: give a whole number of {unit} >= {least}",
            field=name,
            allowed={"min": least},
        )


def check_seconds(name: str, value: Any, *, finite: bool = False) -> None:
    """Refuse ``value`` unless it is a number of seconds ``>= 0`` (not NaN, not a bool;
    with ``finite``, not infinite)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value >= 0
        or (finite and not math.isfinite(value))
    ):
        what = "a finite number" if finite else "a number"
        raise ArgumentError(
            f"{name}={value!r}: give {what} of seconds >= 0", field=name, allowed={"min": 0}
        )


def resolve_config(cls: type[C], config: C | None, options: Mapping[str, Any], owner: str) -> C:
    """The config an object of ``owner`` runs with: ``config`` as given, or one of
    ``cls`` made from ``options`` (the keyword arguments its constructor took). Both at
    once are refused (:class:`~nostall.ArgumentError`: which would win is a guess); an
    unknown keyword is a ``TypeError`` naming the close ones, as Python's own is."""
    if config is not None:
        if options:
            raise ArgumentError(
                f"{owner}: config= and the keyword options {', '.join(sorted(options))} "
                "together; give the options inside the config "
                f"(dataclasses.replace(config, ...)) or leave config out",
                field="config",
            )
        if not isinstance(config, cls):
            raise ArgumentError(
                f"{owner}: config={config!r} is not a {cls.__name__}", field="config"
            )
        return config
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(names))
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    return cls(**options)


@dataclass(frozen=True)
class CacheConfig:
    """How a :class:`~nostall.ModelCache` runs (its store and loader aside).

    Attributes:
        device: where the pipelines run: ``"cuda[:N]"`` or ``"cpu"`` (then the device
            tier is ordinary memory the modules own; everything else is the same, so CI
            tests it all). Whether the machine has it is checked when the cache is made.
        gpu_budget: bytes of the device tier, allocated once at the first switch
            (default: 80% of the GPU's free memory then; on a CPU a quarter of the
            memory limit, reserved as address space and committed as it is written).
        host_budget: bytes of the host tier (default: what the store's weights take
            there, each distinct component once, at most half the memory limit: every
            pipeline's headers are read to size it. A CUDA cache pins the tier in the
            background from the start; a CPU cache's pages are committed as written).
        dtype: load floating weights in this dtype, keeping the modules a library keeps
            in float32 (as ``from_pretrained(torch_dtype=...)``); default: as stored.
        variant: weights variant (``"fp16"``) in every component folder.
        watermark: when a switch must evict from the device tier, it evicts idle
            components until the tier is at most this full after the switch (so the
            next switch or a prefetch finds room), or as far as idle components allow.
        wait_s: how long a switch waits for room held by pipelines in use elsewhere
            before :class:`~nostall.BudgetExceeded`.
        cache_dir: where the digest index lives (see :class:`~nostall.cache.Store`;
            ``False`` keeps digests in memory). Components are identified by a digest of
            every byte, computed as they are first read and remembered there. For a store
            in object storage (``models="s3://bucket/prefix"``), a folder given here is
            also the disk tier: weight files read from the bucket are kept there.
        activation_reserve: device bytes the base copies of fused LoRAs leave free (the
            weights a LoRA changes, kept to restore the base bit for bit: on the device
            while this much stays free beside them, else in host memory, restored over
            the link; default: a tenth of the GPU, at least 2 GiB).
        lora_budget: bytes of pinned host memory for LoRAs read (their factors, copied
            to the GPU at link speed when fused), taken from ``host_budget``; the least
            recently used go first (default: what ``<store>/loras`` holds, at most a
            quarter of the host budget).
        host_tier: ``"private"`` (default: this process's own pinned pool) or
            ``"shared:NAME"``: the host's one tier of that name, which every worker
            process of the host that names it maps (:class:`~nostall.memory.SharedPool`):
            a component one worker read is a memory hit for all, and ``host_budget`` is
            the host's (the first process sizes it).
        stream: a pipeline that cannot fit the device tier whole is served resident in
            part (:mod:`nostall.cache.partial`): its largest component keeps what fits of
            its repeated blocks on the device and streams the others from the host tier
            on every call (default). ``False``: such a switch fails with
            :class:`~nostall.BudgetExceeded`.
    """

    device: str | torch.device = "cuda"
    gpu_budget: int | None = None
    host_budget: int | None = None
    dtype: torch.dtype | None = None
    variant: str | None = None
    watermark: float = 0.95
    wait_s: float = 300.0
    cache_dir: str | os.PathLike | bool | None = None
    activation_reserve: int | None = None
    lora_budget: int | None = None
    host_tier: str | None = None
    stream: bool = True

    def __post_init__(self) -> None:
        from nostall.cache.host import parse_host_tier

        if not isinstance(self.device, (str, torch.device)):
            raise ArgumentError(
                f"device={self.device!r}: give 'cuda', 'cuda:N' or 'cpu'", field="device"
            )
        check_count("gpu_budget", self.gpu_budget, least=1)
        check_count("host_budget", self.host_budget, least=1)
        check_count("activation_reserve", self.activation_reserve)
        check_count("lora_budget", self.lora_budget)
        if self.dtype is not None and (
            not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point
        ):
            raise ArgumentError(
                f"dtype={self.dtype!r}: give a floating torch.dtype (torch.bfloat16, "
                "torch.float16, torch.float32) or None (as stored)",
                field="dtype",
            )
        if self.variant is not None and (
            not isinstance(self.variant, str) or not self.variant or os.sep in self.variant
        ):
            raise ArgumentError(
                f"variant={self.variant!r}: give the variant's name as in its weight files "
                "('fp16' for diffusion_pytorch_model.fp16.safetensors) or None",
                field="variant",
            )
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 < w <= 1.0:
            raise ArgumentError(
                f"watermark={w!r}: give a fraction in (0, 1] of the device tier (0.95 by default)",
                field="watermark",
                allowed={"min_exclusive": 0, "max": 1},
            )
        check_seconds("wait_s", self.wait_s)
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike, bool)):
            raise ArgumentError(
                f"cache_dir={self.cache_dir!r}: give a folder, or False to keep digests in memory",
                field="cache_dir",
            )
        parse_host_tier(self.host_tier)
        if (
            self.lora_budget is not None
            and self.host_budget is not None
            and self.lora_budget >= self.host_budget
        ):
            raise ArgumentError(
                f"lora_budget={self.lora_budget} leaves nothing of host_budget="
                f"{self.host_budget} for the pipelines' components; give a larger host "
                "budget or a smaller LoRA budget",
                field="lora_budget",
            )
