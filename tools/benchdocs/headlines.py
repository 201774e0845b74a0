"""The headline figures: one per capability, nostall beside its peer in the same run.

Each :class:`Headline` reads its two figures from one record; :mod:`benchdocs.index`
keeps, per headline, the latest run that measured both, and :func:`headlines_block`
renders the README's ``<!-- bench:headlines -->`` table from the index.

Example::

    >>> index = {"headlines": {"switch": {
    ...     "what": "a switch", "nostall": 0.5, "peer": 5.0, "peer_name": "diffusers",
    ...     "unit": "s", "ratio": 10.0, "run": "switch-abc1234-2026-12-01.json",
    ...     "commit": "abc1234", "date": "2026-12-01T10:00:00+00:00"}}}
    >>> from benchdocs.markdown import Doc
    >>> print(headlines_block(Doc({}, index, "README.md")))
    | what | nostall | peer | ratio | run |
    | --- | --- | --- | --- | --- |
    | a switch | **0.50 s** | 5.00 s (diffusers) | **10×** | [`abc1234` 2026-12-01](docs/bench/runs/switch-abc1234-2026-12-01.json) |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchdocs.markdown import Doc, run_cell, table

__all__ = ["HEADLINES", "Headline", "figures", "headlines_block"]


def _get(d: Any, *keys: Any) -> Any:
    """``d[k1][k2]…``, or ``None`` where a key is missing."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _least(xs: list[Any]) -> float | None:
    xs = [x for x in xs if isinstance(x, int | float) and x > 0]
    return min(xs) if xs else None


@dataclass(frozen=True)
class Headline:
    """``figures(record)`` → ``(nostall, peer)`` when the record measured both, else ``None``.
    ``lower_is_better``: seconds (the ratio is peer / nostall); else a rate (nostall / peer)."""

    key: str
    bench: str
    what: str
    peer_name: str
    unit: str
    figures: Callable[[dict[str, Any]], tuple[float | None, float | None]]
    lower_is_better: bool = True


def _switch(r: dict) -> tuple[float | None, float | None]:
    ours = _get(r, "memory-hit", "bf16", "switch", "total_s") or _get(
        r, "nostall", "flux_whole_from_host", "switch", "total_s"
    )
    peers = _get(r, "diffusers", "diffusers_from_pretrained_to") or _get(
        r, "peers", "diffusers_from_pretrained_to"
    )
    peer = _least([x.get("switch_s") for x in peers or [] if x.get("pipeline") == "flux"])
    return ours, peer


def _load(scenario: str) -> Callable[[dict], tuple[float | None, float | None]]:
    def figures(r: dict) -> tuple[float | None, float | None]:
        recs = [x for x in r.get("records") or [] if x.get("scenario") == scenario]
        ours = _least([x["seconds"] for x in recs if x.get("method", "").startswith("nostall (")])
        peer = _least([x["seconds"] for x in recs if x.get("method") == "safetensors load_file"])
        return ours, peer

    return figures


def _decode(r: dict) -> tuple[float | None, float | None]:
    modes = _get(r, "results", "bf16", "modes") or {}
    return _get(modes, "fast", "decode_only", "mean"), _get(modes, "eager", "decode_only", "mean")


def _lora(r: dict) -> tuple[float | None, float | None]:
    return _get(r, "nostall", "switch", "64", "switch_s"), _get(
        r, "peer", "ranks", "64", "hotswap_s"
    )


def _serve(r: dict) -> tuple[float | None, float | None]:
    res = r.get("results") or {}
    ours = _get(res, "stream-batched", "throughput_per_s") or _get(
        res, "stream", "throughput_per_s"
    )
    return ours, _get(res, "peer", "throughput_per_s")


def _fp8(r: dict) -> tuple[float | None, float | None]:
    fwd = _get(r, "results", "forward") or {}
    return _get(fwd, "fp8_eager_s"), _get(fwd, "torchao", "eager_s")


def _remote(r: dict) -> tuple[float | None, float | None]:
    slow = _get(r, "results", "throttled") or {}
    return _get(slow, "nostall", "to_resident_s"), _get(slow, "boto3", "to_resident_s")


HEADLINES: tuple[Headline, ...] = (
    Headline(
        "switch",
        "switch",
        "FLUX.1-dev pipeline switch (33.7 GB), host-tier hit",
        'diffusers `from_pretrained` + `.to("cuda")`',
        "s",
        _switch,
    ),
    Headline(
        "load-page-cache",
        "load",
        "FLUX transformer (23.8 GB) to the GPU, page cache warm",
        "safetensors `load_file`",
        "s",
        _load("page-cache"),
    ),
    Headline(
        "load-cold",
        "load",
        "FLUX transformer (23.8 GB) to the GPU, cold",
        "safetensors `load_file`",
        "s",
        _load("cold"),
    ),
    Headline(
        "decode",
        "decode",
        'Wan 2.1 VAE decode, 161 frames at 720p bf16, `mode="fast"`',
        "diffusers `vae.decode`",
        "s",
        _decode,
    ),
    Headline(
        "lora",
        "adapters",
        "LoRA switch on FLUX, rank 64",
        "diffusers + PEFT hotswap",
        "s",
        _lora,
    ),
    Headline(
        "serve",
        "serve",
        "mixed FLUX / SDXL / SD3 stream, one GPU",
        "a diffusers worker holding one pipeline at a time, on a GPU that fits all three",
        "req/s",
        _serve,
        lower_is_better=False,
    ),
    Headline(
        "fp8",
        "fp8",
        "FLUX transformer forward at 1024², FP8, eager",
        "torchao per-row FP8",
        "s",
        _fp8,
    ),
    Headline(
        "remote",
        "remote",
        "FLUX transformer from S3 to the GPU, 50 MiB/s per connection",
        "boto3 `download_file` + `load_file`",
        "s",
        _remote,
    ),
)


def figures(headline: Headline, record: dict[str, Any]) -> dict[str, Any] | None:
    """The headline's entry for the index from one record, or ``None`` if it lacks either."""
    ours, peer = headline.figures(record)
    if not ours or not peer:
        return None
    ratio = peer / ours if headline.lower_is_better else ours / peer
    return {
        "what": headline.what,
        "nostall": ours,
        "peer": peer,
        "peer_name": headline.peer_name,
        "unit": headline.unit,
        "ratio": ratio,
    }


def _value(v: float, unit: str) -> str:
    if unit == "s" and v < 0.1:
        return f"{v * 1e3:.1f} ms"
    return f"{v:.2f} {unit}"


def _ratio(x: float) -> str:
    return f"{x:.1f}×" if x < 10 else f"{x:.0f}×"


def headlines_block(doc: Doc) -> str:
    """The README's headline table: a row per headline the index holds, with its run (a
    headline no run has measured yet has no row)."""
    measured = doc.index.get("headlines", {})
    rows = [
        [
            e["what"],
            f"**{_value(e['nostall'], e['unit'])}**",
            f"{_value(e['peer'], e['unit'])} ({e['peer_name']})",
            f"**{_ratio(e['ratio'])}**",
            run_cell(doc, e),
        ]
        for e in (measured[h.key] for h in HEADLINES if h.key in measured)
    ]
    return table(["what", "nostall", "peer", "ratio", "run"], rows)
