"""The HTML status pages (``GET /``) of a worker and of a fleet's router: what an operator
looks at, refreshed every five seconds."""

from __future__ import annotations

import html
import time
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


def worker_page(
    s: dict[str, Any], *, videos: list[dict[str, Any]] | None = None, videos_down: str | None = None
) -> str:
    """The worker's status page (``GET /``) from :meth:`Worker.status`; with video jobs
    (``s["videos"]``, their counts), ``videos`` are the newest of them as OpenAI video
    objects (:meth:`VideoJobs.recent <nostall.serve.video_jobs.VideoJobs.recent>`), and
    ``videos_down`` says why a worker whose pipelines make video serves no video jobs."""
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
{_video_section(s.get("videos"), videos or [], videos_down)}</body></html>"""
    )


def _video_section(
    counts: dict[str, int] | None, jobs: list[dict[str, Any]], down: str | None
) -> str:
    """Video jobs: how many per status, then the newest, each with its progress. Every
    string a client gave (prompt, model) or an error carries is escaped."""
    e = html.escape
    if counts is None:
        return "" if down is None else f"<h2>Video jobs</h2><p><b>not served</b>: {e(down)}</p>"
    statuses = [k for k in counts if k != "bytes"]
    head = "".join(f"<th>{e(k)}</th>" for k in statuses)
    cells = "".join(f"<td>{int(counts[k])}</td>" for k in statuses)
    rows = "".join(_video_row(j) for j in jobs)
    return f"""<h2>Video jobs</h2>
<table><tr>{head}<th>videos kept</th></tr>
<tr>{cells}<td>{counts["bytes"] / 1e9:.2f} GB</td></tr></table>
<h3>Newest</h3>
<table><tr><th>id</th><th>model</th><th>prompt</th><th>status</th><th>progress</th>
<th>size</th><th>seconds</th><th>created</th><th>ended</th><th>phases (s)</th><th></th></tr>
{rows}</table>
"""


def _video_row(j: dict[str, Any]) -> str:
    e = html.escape
    vid, status, progress = str(j["id"]), str(j["status"]), int(j["progress"])
    prompt = str(j["prompt"])
    short = prompt if len(prompt) <= 80 else prompt[:79] + "…"  # cut before escaping
    if status == "completed":
        last = f'<a href="/v1/videos/{e(vid)}/content">MP4</a>'
    elif status == "failed" and j.get("error"):
        err = j["error"]
        last = f"<b>{e(str(err.get('code')))}</b>: {e(str(err.get('message')))}"
    else:
        last = ""
    phases = (j.get("nostall") or {}).get("info", {}).get("phases", {})
    took = " · ".join(f"{k} {phases[k]:.1f}" for k in ("denoise", "decode_write") if k in phases)
    return (
        f"<tr><td>{e(vid)}</td><td>{e(str(j['model']))}</td>"
        f"<td>{e(short)}</td><td>{e(status)}</td>"
        f'<td><progress value="{progress}" max="100"></progress> {progress}%</td>'
        f"<td>{e(str(j['size']))}</td><td>{e(str(j['seconds']))}</td>"
        f"<td>{_when(j.get('created_at'))}</td><td>{_when(j.get('completed_at'))}</td>"
        f"<td>{took}</td><td>{last}</td></tr>"
    )


def _when(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


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
