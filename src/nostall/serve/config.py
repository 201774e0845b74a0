"""What the services are configured with: one frozen config each, checked once when made.

* :class:`WorkerConfig`: a generation worker (:class:`~nostall.serve.worker.Worker`):
  its model cache's :class:`~nostall.cache.config.CacheConfig`, its queue, limits,
  schedule and device-budget options.
* :class:`EmbedConfig`: the embedding service
  (:class:`~nostall.serve.embed.EmbeddingService`).

``nostall serve``, ``nostall fleet`` and ``nostall embed-server`` build these from their
flags; Python callers build them, or pass their fields as keyword arguments to the
service (``Worker(models, device="cpu", max_queue=4)``), which builds one. A bad value
is an :class:`~nostall.ArgumentError` naming the field, the value and the fix, before
anything is read or started.

>>> WorkerConfig.from_kwargs(device="cpu", max_queue=4).cache.device
'cpu'
>>> WorkerConfig(max_queue=0)
Traceback (most recent call last):
nostall.errors.ArgumentError: max_queue=0: give a whole number of jobs >= 1
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from nostall.cache.config import CacheConfig, check_count, check_seconds, resolve_config
from nostall.errors import ArgumentError
from nostall.serve.requests import Limits
from nostall.serve.schedule import Policy

__all__ = ["CacheConfig", "EmbedConfig", "WorkerConfig", "check_http_url"]

_CACHE_FIELDS = frozenset(f.name for f in fields(CacheConfig))


def check_http_url(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is ``None`` or an ``http(s)://host[:port][/path]`` URL."""
    if value is None:
        return
    from urllib.parse import urlsplit

    if not isinstance(value, str):
        raise ArgumentError(f"{name}={value!r}: give an http(s) URL", field=name)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError as e:
        raise ArgumentError(f"{value!r} is not a URL ({e})", field=name) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ArgumentError(
            f"{value!r} is not an http(s) URL; give e.g. http://127.0.0.1:8001", field=name
        )


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}={value!r}: give True or False", field=name)


@dataclass(frozen=True)
class WorkerConfig:
    """How a generation worker runs (its store and a shared device budget aside).

    Attributes:
        cache: its model cache's (:class:`~nostall.cache.config.CacheConfig`: device,
            budgets, dtype, variant, watermark, wait, digest folder, LoRA budget, host
            tier). The device tier's default is what the worker's device budget leaves
            (``gpu_budget``, if given, is claimed from it), and ``activation_reserve``
            defaults to the budget's activation reserve.
        max_queue: jobs allowed to wait (the running one not counted); more get
            :class:`~nostall.QueueFull` (HTTP 429).
        limits: what any request may ask for (:class:`~nostall.serve.requests.Limits`).
        prepare: at start, do the first switch's one-time work for every pipeline
            (:meth:`ModelCache.prepare <nostall.ModelCache.prepare>`).
        prefetch: move the next queued job's pipeline while the current one runs.
        preempt: pause a job running alone at a denoising step for a queued image job
            of another pipeline that would otherwise miss its SLO, when that is worth
            its switch (:mod:`nostall.serve.schedule`); the paused job resumes where it
            stopped, its output unchanged.
        recent: finished jobs the status page lists.
        embed_url: an embedding service (``nostall embed-server``) that encodes FLUX,
            SDXL and SD3 prompts; the pipelines are then switched in without their text
            encoders.
        reserve: device bytes kept for activations by the budget the worker makes
            (default: the peaks measured, remembered beside the digest index).
        external: device bytes another process declared on this device (an embedding
            service there): left out of the budget the worker makes.
        schedule: how the queue may reorder and batch jobs
            (:class:`~nostall.serve.schedule.Policy`).
        lora_room: device bytes for the base copies of the weights fused LoRAs change
            (without them those wait in host memory and each LoRA switch copies them back).
        video_dir: where generated videos and their jobs' index are kept (default
            ``<cache>/videos``, beside the digest index).
        video_max_bytes: the generated videos kept at most (oldest removed first;
            ``None``: no cap).
    """

    cache: CacheConfig = field(default_factory=CacheConfig)
    max_queue: int = 16
    limits: Limits = field(default_factory=Limits)
    prepare: bool = True
    prefetch: bool = True
    preempt: bool = True
    recent: int = 50
    embed_url: str | None = None
    reserve: int | None = None
    external: int = 0
    schedule: Policy = field(default_factory=Policy)
    lora_room: int = 0
    video_dir: str | os.PathLike | None = None
    video_max_bytes: int | None = 20 << 30

    def __post_init__(self) -> None:
        for name, value, kind in (
            ("cache", self.cache, CacheConfig),
            ("limits", self.limits, Limits),
            ("schedule", self.schedule, Policy),
        ):
            if not isinstance(value, kind):
                raise ArgumentError(
                    f"{name}={value!r}: give a {kind.__name__} (or leave it out: the defaults)",
                    field=name,
                )
        check_count("max_queue", self.max_queue, least=1, unit="jobs", optional=False)
        check_count("recent", self.recent, unit="jobs", optional=False)
        _check_flag("prepare", self.prepare)
        _check_flag("prefetch", self.prefetch)
        _check_flag("preempt", self.preempt)
        check_http_url("embed_url", self.embed_url)
        check_count("video_max_bytes", self.video_max_bytes, least=1, unit="bytes")
        if self.video_dir is not None and not isinstance(self.video_dir, (str, os.PathLike)):
            raise ArgumentError(f"video_dir={self.video_dir!r}: give a folder", field="video_dir")
        check_count("reserve", self.reserve)
        check_count("external", self.external, optional=False)
        check_count("lora_room", self.lora_room, optional=False)

    @classmethod
    def from_kwargs(cls, **options: Any) -> WorkerConfig:
        """A config from flat keyword arguments, the model cache's among them
        (``device="cpu", gpu_budget=..., max_queue=4``), as :class:`Worker` takes them."""
        given = {k: options.pop(k) for k in list(options) if k in _CACHE_FIELDS}
        cache = options.pop("cache", None)
        options["cache"] = resolve_config(CacheConfig, cache, given, "Worker")
        return resolve_config(cls, None, options, "Worker")


@dataclass(frozen=True)
class EmbedConfig:
    """How the embedding service runs (its store and a shared device budget aside).

    Attributes:
        device: where the encoders run (``"cuda[:N]"`` or ``"cpu"``).
        dtype: the encoders' dtype (default: as stored).
        cache_bytes: the embedding cache's budget, keys and values alike (0: none kept).
        token_budget: a batch closes when its texts reach this many tokens (texts times
            ``max_length``)...
        max_wait_s: ...or this long after its first text arrived.
        max_length_cap: the longest ``max_length`` a request may ask (an encoder with
            position embeddings allows no more than it has).
        max_texts: texts per request.
        max_text_chars: characters per text (default 8192, about four times what T5's
            512 tokens cover in English; longer texts are refused, not cut).
        max_queue: texts waiting to be encoded (more: :class:`~nostall.QueueFull`); at
            least ``max_texts``, or a full request could never be queued.
    """

    device: str | torch.device = "cuda"
    dtype: torch.dtype | None = None
    cache_bytes: int = 1 << 30
    token_budget: int = 8192
    max_wait_s: float = 0.005
    max_length_cap: int = 1024
    max_texts: int = 256
    max_text_chars: int = 8192
    max_queue: int = 1024

    def __post_init__(self) -> None:
        if not isinstance(self.device, (str, torch.device)):
            raise ArgumentError(
                f"device={self.device!r}: give 'cuda', 'cuda:N' or 'cpu'", field="device"
            )
        if self.dtype is not None and (
            not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point
        ):
            raise ArgumentError(
                f"dtype={self.dtype!r}: give a floating torch.dtype or None (as stored)",
                field="dtype",
            )
        for name in (
            "cache_bytes",
            "token_budget",
            "max_length_cap",
            "max_texts",
            "max_text_chars",
            "max_queue",
        ):
            value = getattr(self, name)
            least = 0 if name == "cache_bytes" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ArgumentError(
                    f"{name}={value!r}: give a whole number >= {least}",
                    field=name,
                    allowed={"min": least},
                )
        if self.max_queue < self.max_texts:
            raise ArgumentError(
                f"max_queue={self.max_queue} < max_texts={self.max_texts}: a request of "
                "max_texts texts could never be queued; give max_queue >= max_texts",
                field="max_queue",
            )
        check_seconds("max_wait_s", self.max_wait_s, finite=True)
