"""What a switch to a pipeline costs now: the bytes it would move from each tier divided
by the rates this worker measured per tier, plus a fixed part.

A moving average of a pipeline's past switches cannot tell a pipeline waiting in the
pinned host tier (tens of GB/s) from one that must be read from disk: the same pipeline
costs either, depending on what ran before. :class:`SwitchPrices` learns the rates from
every switch report (each component's tier, bytes and read/copy seconds) and prices a
switch from where the pipeline's bytes are now (:func:`placement`, from the cache's
:meth:`~nostall.ModelCache.stats`): what the scheduler charges a batch that would switch.

Pure but for :func:`placement`, which asks the cache.

>>> p = SwitchPrices()
>>> p.observe({"total_s": 0.52, "components": [
...     {"tier": "host", "nbytes": 24_000_000_000, "copy_s": 0.48, "read_s": 0.0}]})
>>> round(p.seconds(host=12e9, disk=0), 3)  # 12 GB at the measured 50 GB/s + 0.04 s fixed
0.28
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SwitchPrices", "placement"]


class SwitchPrices:
    """Per-tier rates (bytes per second) and a fixed part per switch, moving averages of
    what switches measured; priors until the first. ``alpha``: weight of a new one."""

    def __init__(
        self,
        *,
        host_bps: float = 20e9,
        disk_bps: float = 2e9,
        fixed_s: float = 0.05,
        alpha: float = 0.3,
    ):
        self.rates = {"host": float(host_bps), "disk": float(disk_bps)}
        self.fixed_s = float(fixed_s)
        self.alpha = alpha
        self._seen = {"host": False, "disk": False, "fixed": False}

    def observe(self, report: Mapping[str, Any]) -> None:
        """Learn from one switch report (:meth:`~nostall.cache.SwitchReport.as_dict`):
        each moved component's rate from its tier, and the switch's fixed part (its time
        beyond the slowest tier's moving)."""
        comps = report.get("components") or ()
        moved: dict[str, tuple[int, float]] = {}
        for c in comps:
            tier = c.get("tier")
            if tier not in self.rates:
                continue
            seconds = max(float(c.get("copy_s") or 0.0), float(c.get("read_s") or 0.0))
            n, s = moved.get(tier, (0, 0.0))
            moved[tier] = (n + int(c.get("nbytes") or 0), s + seconds)
        for tier, (n, s) in moved.items():
            if n > 0 and s > 0:
                self.rates[tier] = self._average(tier, self.rates[tier], n / s)
        total = report.get("total_s")
        if isinstance(total, (int, float)) and math.isfinite(total) and moved:
            busy = sum(s for _, s in moved.values())
            self.fixed_s = self._average("fixed", self.fixed_s, max(0.0, total - busy))

    def seconds(self, *, host: float, disk: float) -> float:
        """Estimated seconds of a switch that moves ``host`` bytes from the pinned host
        tier and reads ``disk`` bytes (0 and 0: nothing to move, nothing to pay)."""
        if host <= 0 and disk <= 0:
            return 0.0
        return self.fixed_s + host / self.rates["host"] + disk / self.rates["disk"]

    def _average(self, key: str, old: float, new: float) -> float:
        if not self._seen[key]:
            self._seen[key] = True
            return new
        return self.alpha * new + (1.0 - self.alpha) * old


def placement(
    cache: Any, model: str, without: Iterable[str] = (), *, where: Mapping | None = None
) -> tuple[int, int]:
    """``(host bytes, disk bytes)`` a switch to ``model`` (less the roles in
    ``without``) would move now: its weights components not on the device, by the
    fastest tier holding each (one never switched to is on disk). ``where``: the
    cache's ``stats().components``, when the caller has them already."""
    if where is None:
        where = cache.stats().components
    host = disk = 0
    for c in cache.store.entry(model).distinct_weights(frozenset(without)):
        tier = where.get(c.digest, {}).get("tier", "disk")
        if tier == "host":
            host += c.nbytes
        elif tier == "disk":
            disk += c.nbytes
    return host, disk
