"""GPU kernel utilisation and timeline pictures from ``torch.profiler`` traces.

Utilisation is the union of kernel intervals over a window of wall time, the way
the Synthesia/AWS post read it off the profiler: over two consecutive chunks in
steady state, and over the whole decode. Chunk boundaries come from the
``nostall.chunk.N`` ranges the frame pipelines record around each chunk, which
the profiler also projects onto the GPU timeline (``gpu_user_annotation``).

"Busy" additionally counts the device-to-device copies and memsets the decoder
itself issues (the Wan decoder's feature-cache clones are ``cudaMemcpyAsync``, not
kernels); device↔host copies never count, so the synchronous baseline's blocking
copies show up as idle in both measures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from nostall.errors import ArgumentError

__all__ = ["Trace", "load_trace", "union_busy"]

_CHUNK = re.compile(r"^nostall\.chunk\.(\d+)$")


@dataclass
class Trace:
    """Intervals (µs) pulled from a chrome trace."""

    kernels: list[tuple[float, float]]  # compute kernels
    copies: list[tuple[float, float]]  # device→host memcpy
    writes: list[tuple[float, float]]  # nostall.write ranges (CPU)
    chunks: dict[int, tuple[float, float]]  # chunk → GPU span
    device_ops: list[tuple[float, float]] = field(default_factory=list)  # DtoD memcpy, memset
    cpu_chunks: dict[int, tuple[float, float]] = field(default_factory=dict)  # chunk → CPU range
    # (start, end, name): the device events busy() counts (kernels, DtoD copies, memsets), and the host's
    # runtime calls and operators, to say what the host was doing while the device idled.
    device_named: list[tuple[float, float, str]] = field(default_factory=list)
    host_named: list[tuple[float, float, str]] = field(default_factory=list)

    def utilisation(self, start: float, end: float) -> float:
        """Fraction of ``[start, end)`` covered by kernels."""
        return union_busy(self.kernels, start, end) / (end - start) if end > start else 0.0

    def busy(self, start: float, end: float) -> float:
        """Fraction of ``[start, end)`` covered by kernels, device copies or memsets."""
        ivs = self.kernels + self.device_ops
        return union_busy(ivs, start, end) / (end - start) if end > start else 0.0

    def add_writes_from_log(self, chunk_log: list[tuple[int, float, float]]) -> None:
        """Place writes recorded by a :class:`~nostall.video.FrameStats` on this trace.

        The profiler does not see ranges opened on the writer thread, so the async
        pipeline's writes come from its own log (seconds from the start of ``run``),
        anchored at the CPU start of ``nostall.chunk.0``, which opens right after it.
        """
        if 0 not in self.cpu_chunks:
            raise ArgumentError("the trace has no nostall.chunk.0 range to anchor the log to")
        t0 = self.cpu_chunks[0][0]
        self.writes = sorted(self.writes + [(t0 + a * 1e6, t0 + b * 1e6) for _, a, b in chunk_log])

    def gaps(self, start: float, end: float, *, top: int = 8) -> list[dict]:
        """The ``top`` longest stretches of ``[start, end)`` with nothing on the device,
        longest first: when (ms from ``start``), how long (ms), the device events on
        either side, and the host's longest runtime calls and operators inside it."""
        events = sorted(e for e in self.device_named if e[1] > start and e[0] < end)
        found = []
        reach, before = start, None
        for a, b, name in events:
            if a > reach and before is not None:
                found.append((a - reach, reach, a, before, name))
            if b > reach:
                reach, before = b, name
        found.sort(reverse=True)
        out = []
        for length, a, b, prev, nxt in found[:top]:
            inside = sorted(
                (
                    (min(hb, b) - max(ha, a), n)
                    for ha, hb, n in self.host_named
                    if hb > a and ha < b
                ),
                reverse=True,
            )
            out.append(
                {
                    "at_ms": (a - start) / 1e3,
                    "ms": length / 1e3,
                    "after": prev,
                    "before": nxt,
                    "host": [f"{n} ({d / 1e3:.2f} ms)" for d, n in inside[:4]],
                }
            )
        return out

    def whole(self) -> tuple[float, float]:
        return min(a for a, _ in self.kernels), max(b for _, b in self.kernels)

    def steady_window(self) -> tuple[float, float] | None:
        """Two consecutive chunks in the middle: from chunk k's first kernel to chunk k+2's."""
        starts = sorted((k, a) for k, (a, _) in self.chunks.items())
        if len(starts) < 4:
            return None
        mid = len(starts) // 2
        return starts[mid - 1][1], starts[mid + 1][1]


def union_busy(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[start, end)``."""
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        a, b = max(a, start), min(b, end)
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    return busy


def load_trace(path: str) -> Trace:
    """Parse a ``prof.export_chrome_trace`` file."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    kernels, copies, writes, chunks, device_ops = [], [], [], {}, []
    device_named: list[tuple[float, float, str]] = []
    host_named: list[tuple[float, float, str]] = []
    cpu_chunks: dict[int, tuple[float, float]] = {}
    launches: dict[int, float] = {}  # correlation id -> CPU launch timestamp
    pending: list[tuple[int, float, float]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        a = float(e.get("ts", 0))
        b = a + float(e.get("dur", 0))
        if cat in ("kernel", "gpu_memset") or (cat == "gpu_memcpy" and "DtoD" in name):
            device_named.append((a, b, name))  # what busy() counts
        elif cat in ("cuda_runtime", "cpu_op", "user_annotation", "python_function"):
            host_named.append((a, b, name))
        if cat == "kernel":
            kernels.append((a, b))
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                pending.append((corr, a, b))
        elif cat == "gpu_memcpy" and "DtoH" in name:
            copies.append((a, b))
        elif (cat == "gpu_memcpy" and "DtoD" in name) or cat == "gpu_memset":
            device_ops.append((a, b))
        elif cat == "cuda_runtime" and "Launch" in name:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = a
        elif name == "nostall.write":
            writes.append((a, b))
        elif (m := _CHUNK.match(name)) is not None:
            k = int(m.group(1))
            if cat == "gpu_user_annotation":
                chunks[k] = (a, b)
            else:
                cpu_chunks[k] = (a, b)
    if not chunks and cpu_chunks:
        # No GPU projection of the ranges: attribute each kernel to the chunk whose CPU
        # range contains its launch.
        spans: dict[int, list[float]] = {}
        ordered = sorted(cpu_chunks.items(), key=lambda kv: kv[1][0])
        for corr, a, b in pending:
            t = launches.get(corr)
            if t is None:
                continue
            for k, (ca, cb) in ordered:
                if ca <= t <= cb:
                    s = spans.setdefault(k, [a, b])
                    s[0], s[1] = min(s[0], a), max(s[1], b)
                    break
        chunks = {k: (v[0], v[1]) for k, v in spans.items()}
    return Trace(kernels, copies, writes, chunks, device_ops, cpu_chunks, device_named, host_named)


def plot_timelines(traces: dict[str, Trace], path: str, *, title: str) -> None:
    """Draw two consecutive steady-state chunks per trace: kernels, D2H copies, writes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 1.9 * len(traces) + 0.6), squeeze=False)
    for ax, (label, tr) in zip(axes[:, 0], traces.items(), strict=True):
        window = tr.steady_window() or tr.whole()
        a0, b0 = window
        pad = 0.15 * (b0 - a0)
        lo, hi = a0 - pad, b0 + pad
        rows = [
            ("compute kernels", tr.kernels, "#2b6cb0"),
            ("D2H copies", tr.copies, "#dd6b20"),
            ("sink.write", tr.writes, "#38a169"),
        ]
        for y, (_, ivs, color) in enumerate(rows):
            bars = [
                ((max(a, lo) - lo) / 1e3, (min(b, hi) - max(a, lo)) / 1e3)
                for a, b in ivs
                if b > lo and a < hi
            ]
            ax.broken_barh(bars, (len(rows) - 1 - y + 0.1, 0.8), color=color)
        ax.set_yticks([len(rows) - 1 - y + 0.5 for y in range(len(rows))], [r[0] for r in rows])
        ax.axvspan((a0 - lo) / 1e3, (b0 - lo) / 1e3, color="#000", alpha=0.04)
        ax.set_title(
            f"{label}: kernel utilisation {tr.utilisation(a0, b0):.2%} over two consecutive "
            f"chunks (with device copies/memsets {tr.busy(a0, b0):.2%})",
            fontsize=10,
        )
        ax.set_xlim(0, (hi - lo) / 1e3)
        ax.set_xlabel("ms")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
