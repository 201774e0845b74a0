"""The HTML status pages (``GET /``) of a worker and of a fleet's router: what an operator
looks at, refreshed every five seconds."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["fleet_page", "worker_page"]

_HEAD = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<meta http-equiv="refresh" content="5">
<style>body{{font-family:system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left}}</style></head><body>
<h1>{title}</h1>"""


def _state(s: dict[str, Any]) -> str:
    if s.get("draining"):
        return "<b>shutting down</b>"
    return "ready" if s["ready"] else "not ready"


def worker_page(s: dict[str, Any]) -> str:
    """The worker's status page (``GET /``) from :meth:`Worker.status`."""
    e = html.escape

    def gb(n: int) -> str:
        return f"{n / 1e9:.2f} GB"

    left_out = s.get("unavailable", {})
    rows = "".join(
        f"<tr><td>{e(name)}</td><td>{e(', '.join(tiers))}</td></tr>"
        for name, tiers in s["models"].items()
        if name not in left_out
    )
    rows += "".join(
        f"<tr><td>{e(name)}</td><td><b>unavailable</b>: {e(why)}</td></tr>"
        for name, why in left_out.items()
    )
    phases = sorted({p for r in s["recent"] for p in r["phases"]})
    head = "".join(f"<th>{e(p)} (s)</th>" for p in phases)
    recent = "".join(
        "<tr>"
        + f"<td>{e(r['at'])}</td><td>{e(r['kind'])}</td><td>{e(r['model'])}</td>"
        + f"<td>{e(', '.join(r['tiers']))}</td>"
        + "".join(f"<td>{r['phases'].get(p, 0):.3f}</td>" for p in phases)
        + "</tr>"
        for r in s["recent"]
    )
    return (
        _HEAD.format(title="nostall worker")
        + f"""
<p>device <b>{e(s["device"])}</b> · {_state(s)} ·
up {s["uptime_s"]:.0f} s · running: {e(s["running"] or "nothing")} ·
queued: {len(s["queue"])}</p>
<h2>Tiers</h2>
<table><tr><th>tier</th><th>resident</th><th>budget</th></tr>
<tr><td>GPU</td><td>{gb(s["gpu"]["bytes"])}</td><td>{gb(s["gpu"]["budget"])}</td></tr>
<tr><td>pinned host</td><td>{gb(s["host"]["bytes"])}</td><td>{gb(s["host"]["budget"])}</td></tr>
</table>
<h2>Models</h2><table><tr><th>model</th><th>where its components are</th></tr>{rows}</table>
<h2>Recent requests</h2>
<table><tr><th>at</th><th>kind</th><th>model</th><th>switch from</th>{head}</tr>{recent}</table>
</body></html>"""
    )


def fleet_page(s: dict[str, Any]) -> str:
    """The fleet router's status page from its ``/fleet`` state: each worker, where its
    pipelines are, what it has in flight, whether it is marked down; the latest routes."""
    e = html.escape

    def where(models: dict[str, list[str]]) -> str:
        return "; ".join(f"{m}: {', '.join(tiers)}" for m, tiers in models.items())

    rows = "".join(
        f"<tr><td>{w['index']}</td><td>{e(str(w['actor'] or '-'))}</td>"
        f"<td>{'<b>down</b>' if w['down'] else 'up'}</td><td>{w['in_flight']}</td>"
        f"<td>{e(where(w['models']))}</td></tr>"
        for w in s["workers"]
    )
    routed = "".join(
        f"<tr><td>{e(r['model'])}</td><td>{r['worker']}</td><td>{e(r['tier_before'])}</td></tr>"
        for r in reversed(s["routed"][-20:])
    )
    return (
        _HEAD.format(title="nostall fleet")
        + f"""
<p>{len(s["workers"])} workers · request estimate {s["request_s"]:.2f} s</p>
<h2>Workers</h2>
<table><tr><th>worker</th><th>actor</th><th>state</th><th>in flight</th>
<th>pipelines (tiers)</th></tr>{rows}</table>
<h2>Latest routes</h2>
<table><tr><th>model</th><th>worker</th><th>tier before</th></tr>{routed}</table>
</body></html>"""
    )
