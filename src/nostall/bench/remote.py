"""``nostall bench remote``: a FLUX transformer from object storage to the GPU, nostall
against the ways users download it today, and the shared host tier between processes.

A real S3 server runs on loopback (:class:`~nostall.synthetic.s3server.S3Server`, rclone's
``serve s3`` over a local folder) twice over the same bucket: as it is (``loopback``),
and with every connection limited to ``bwlimit`` (``throttled``: a stand-in for a remote
link, where one connection's speed is the limit, as from S3 to one host). The object is
a FLUX.1-dev transformer with random weights in the diffusers layout (``full``: 23.8 GB
in shards; ``small``: ~0.3 GB for CPU runs; ``tiny`` for tests). Parts (``parts``):

* ``remote``, per link:
  - **nostall**: ``mirror`` (list, the safetensors headers by ranged GETs) then one
    load through a pinned pool to the device, ``connections`` ranged GETs at once:
    the time to the transformer being resident, and the load's own
    ``total_s / read_s`` (how far the device copies trail the download: the overlap);
  - **one stream**: one ``GET`` of each file read through (as ``curl`` or
    ``requests`` do), stopped after ``single_cap_s`` (its rate is steady);
  - **boto3** ``download_file`` with its default ``TransferConfig`` (10 threads, 8 MB
    parts), file by file, then the files loaded to the device with safetensors'
    ``load_file``: the time to resident, and the download alone.
* ``shared``: one process reads the transformer into a shared host tier
  (:class:`~nostall.memory.SharedPool`); a second, new process maps the tier, and its
  load of the transformer is a memory hit: its switch's GB/s (on a CPU, memory-copy
  speed).

The report's ``targets`` are the storage-tiers issue's (#20); :func:`evaluate_targets`
recomputes them.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nostall.bench.record import check_run, header
from nostall.bench.targets import Targets
from nostall.bench.timing import sync

__all__ = ["PARTS", "SIZES", "evaluate_targets", "run_remote_bench", "tables"]

PARTS = ("remote", "shared")
SIZES = ("full", "small", "tiny")
KEY = "flux/transformer"
BUCKET = "models"


def _flux_config(size: str) -> dict[str, Any]:
    if size == "full":
        return {"guidance_embeds": True}  # FLUX.1-dev: 19 + 38 blocks, 3072 wide
    if size == "small":
        return {
            "guidance_embeds": True,
            "num_layers": 2,
            "num_single_layers": 4,
            "attention_head_dim": 64,
            "num_attention_heads": 12,
            "joint_attention_dim": 1024,
            "pooled_projection_dim": 256,
            "axes_dims_rope": (8, 28, 28),
        }
    return {
        "guidance_embeds": True,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "in_channels": 16,
        "axes_dims_rope": (4, 6, 6),
    }


def write_object(folder: str, size: str, device: str, log: Callable[[str], None]) -> int:
    """Write the random FLUX transformer (config + sharded weights) into ``folder``, unless
    a complete one is there (its marker file); return its weight bytes."""
    marker = os.path.join(folder, ".nostall-bench-complete")
    if os.path.exists(marker):
        with open(marker) as f:
            return int(f.read())
    import diffusers

    from nostall.synthetic.full import write_weights

    os.makedirs(folder, exist_ok=True)
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(**_flux_config(size))
    model.save_config(folder)
    gen = torch.device(device if torch.cuda.is_available() and device != "cpu" else "cpu")
    t = time.perf_counter()
    write_weights(
        model, folder, "diffusion_pytorch_model", torch.bfloat16, gen, 2026, log, "transformer"
    )
    nbytes = sum(
        os.path.getsize(os.path.join(folder, n))
        for n in os.listdir(folder)
        if n.endswith(".safetensors")
    )
    log(f"wrote the FLUX transformer: {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
    with open(marker, "w") as f:
        f.write(str(nbytes))
    return nbytes


@contextlib.contextmanager
def _pointed_at(server) -> Iterator[None]:
    """The AWS variables of ``server`` in this process, and a fresh default client."""
    import nostall.store.remote as remote

    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    old, remote._DEFAULT = remote._DEFAULT, None
    try:
        yield
    finally:
        if remote._DEFAULT is not None:
            remote._DEFAULT.close()
        remote._DEFAULT = old
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _nostall(url: str, dev: torch.device, connections: int, work: str) -> tuple[dict, dict]:
    """The figures, and the tensors loaded (on the device, to compare with the peer's)."""
    from nostall.memory.pool import PinnedPool, size_class
    from nostall.store.mirror import mirror
    from nostall.transfer.loader import Loader
    from nostall.transfer.plan import LoadPlan

    mirror_root = tempfile.mkdtemp(prefix="mirror-", dir=work)
    try:
        t0 = time.perf_counter()
        local = mirror(url, mirror_root)
        mirror_s = time.perf_counter() - t0
        from nostall.store import resolve

        need = size_class(LoadPlan(resolve(local)).host_bytes)
        with (
            Loader(connections=connections) as loader,
            PinnedPool(need, device=dev if dev.type == "cuda" else None) as pool,
        ):
            pool.wait_pinned()
            loader.prepare(dev)
            sync(dev)
            t1 = time.perf_counter()
            result = loader.load(local, device=dev, pool=pool)
            sync(dev)
            load_s = time.perf_counter() - t1
            st = result.stats
            tensors = result.tensors
            del result
        return tensors, {
            "mirror_s": mirror_s,
            "load_s": load_s,
            "to_resident_s": mirror_s + load_s,
            "download_s": st.read_s,
            "nbytes": st.nbytes,
            "read_mode": st.read_mode,
            "overlap": st.total_s / st.read_s if st.read_s else None,
            "gbps": st.nbytes / (mirror_s + load_s) / 1e9,
            "connections": connections,
        }
    finally:
        shutil.rmtree(mirror_root, ignore_errors=True)
        gc.collect()


def _objects(url: str) -> list:
    from nostall.store.remote import default_s3

    return [o for o in default_s3().list(url) if o.url.endswith(".safetensors")]


def _single_stream(url: str, cap_s: float) -> dict[str, Any]:
    """One GET per file read through in 8 MiB pieces (``requests``-style), at most
    ``cap_s`` seconds in all."""
    import boto3

    s3 = boto3.client("s3")
    buf = bytearray(8 << 20)
    got, t0 = 0, time.perf_counter()
    done = True
    for o in _objects(url):
        body = s3.get_object(Bucket=o.bucket, Key=o.key)["Body"]
        try:
            while True:
                chunk = body.read(len(buf))
                if not chunk:
                    break
                got += len(chunk)
                if time.perf_counter() - t0 > cap_s:
                    done = False
                    break
        finally:
            body.close()
        if not done:
            break
    s = time.perf_counter() - t0
    return {"bytes": got, "s": s, "gbps": got / s / 1e9, "complete": done}


def _boto3(url: str, dev: torch.device, work: str, ours: dict) -> dict[str, Any]:
    """boto3's ``download_file`` (default TransferConfig), file by file, then each file
    loaded onto the device with safetensors; whether every tensor equals ``ours``."""
    import boto3
    from safetensors.torch import load_file

    s3 = boto3.client("s3")
    folder = tempfile.mkdtemp(prefix="boto3-", dir=work)
    try:
        objects = _objects(url)
        sync(dev)
        t0 = time.perf_counter()
        for o in objects:
            s3.download_file(o.bucket, o.key, os.path.join(folder, os.path.basename(o.key)))
        download_s = time.perf_counter() - t0
        tensors = {}
        for o in objects:
            tensors.update(
                load_file(os.path.join(folder, os.path.basename(o.key)), device=str(dev))
            )
        sync(dev)
        total = time.perf_counter() - t0
        nbytes = sum(o.size for o in objects)
        equal = set(tensors) == set(ours) and all(
            torch.equal(v, ours[k]) for k, v in tensors.items()
        )
        del tensors
        return {
            "equal_to_nostall": equal,
            "download_s": download_s,
            "to_resident_s": total,
            "nbytes": nbytes,
            "download_gbps": nbytes / download_s / 1e9,
            "gbps": nbytes / total / 1e9,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()


def _shared_child(args: list[str]) -> None:
    """In a new process: map the shared tier ``name`` and load the transformer through it;
    print the load's figures as JSON."""
    from nostall.memory import SharedPool
    from nostall.transfer.loader import Loader

    folder, name, capacity, device, root = args
    dev = torch.device(device)
    t0 = time.perf_counter()
    # Kept: the second process must find what the first read (_shared destroys it).
    pool = SharedPool(
        name,
        int(capacity),
        device=dev if dev.type == "cuda" else None,
        root=root or None,
        keep=True,
    )
    pool.wait_pinned()
    attach_s = time.perf_counter() - t0
    with Loader() as loader:
        loader.prepare(dev)
        sync(dev)
        t = time.perf_counter()
        # As a model cache's switch does it for a host-tier hit: the tier's block, by key.
        result = loader.start(folder, device=dev, pool=pool, key=("bench-remote", KEY)).wait()
        sync(dev)
        s = time.perf_counter() - t
        st = result.stats
        del result
    pool.close()
    print(
        json.dumps(
            {
                "attach_s": attach_s,
                "scenario": st.scenario,
                "s": s,
                "nbytes": st.nbytes,
                "gbps": st.nbytes / s / 1e9,
            }
        )
    )


def _shared(folder: str, dev: torch.device, nbytes: int, log: Callable[[str], None]) -> dict:
    from nostall.memory.pool import size_class
    from nostall.memory.shared import default_root

    name = f"bench-{os.getpid()}"
    capacity = size_class(nbytes + (64 << 20))
    root = default_root()
    out: dict[str, Any] = {"name": name, "capacity": capacity}
    runs = []
    try:
        for i in (1, 2):
            cmd = [
                sys.executable,
                "-m",
                "nostall.bench.remote",
                "shared-child",
                folder,
                name,
                str(capacity),
                str(dev),
                root,
            ]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if p.returncode:
                raise RuntimeError(f"process {i} failed: {p.stderr.strip()[-800:]}")
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
            log(f"  shared tier, process {i}: {runs[-1]['scenario']} {runs[-1]['gbps']:.1f} GB/s")
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        out["error"] = str(e)
    finally:
        from nostall.memory import SharedPool

        with contextlib.suppress(Exception):
            SharedPool.destroy(name, root=root, force=True)
    out["first"], out["second"] = [*runs, None, None][:2]
    return out


def run_remote_bench(
    *,
    size: str = "full",
    device: str | None = None,
    parts: tuple[str, ...] = PARTS,
    connections: int = 64,
    bwlimit: str = "50M",
    single_cap_s: float = 10.0,
    work: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the parts; return the report (``targets`` included)."""
    from nostall.synthetic.s3server import S3Server
    from nostall.transfer.loader import resolve_device

    check_run(size, SIZES, 1, parts, PARTS)
    dev = resolve_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = header("remote", dev)
    report["config"] = {
        "size": size,
        "device": str(dev),
        "connections": connections,
        "bwlimit_per_connection": bwlimit,
        "single_cap_s": single_cap_s,
        "server": "rclone serve s3 on 127.0.0.1 (xxh3 ETags)",
        "peers": "one GET per file; boto3 download_file (default TransferConfig) + "
        "safetensors load_file",
    }
    base = work or tempfile.mkdtemp(prefix="nostall-remote-")
    buckets = os.path.join(base, "buckets")
    folder = os.path.join(buckets, BUCKET, *KEY.split("/"))
    nbytes = write_object(folder, size, str(dev), log)
    report["object"] = {"url": f"s3://{BUCKET}/{KEY}", "nbytes": nbytes}
    results: dict[str, Any] = {}
    if "remote" in parts:
        import boto3

        results["boto3_version"] = boto3.__version__
        links = {"loopback": None, "throttled": bwlimit}
        for link, limit in links.items():
            with S3Server(buckets, bwlimit=limit) as server, _pointed_at(server):
                url = f"s3://{BUCKET}/{KEY}"
                t = time.perf_counter()
                _objects(url)  # the server hashes each file once, for its ETags
                r: dict[str, Any] = {"server_first_list_s": time.perf_counter() - t}
                log(f"{link}: nostall, {connections} connections…")
                ours, r["nostall"] = _nostall(url, dev, connections, base)
                log(f"  {r['nostall']['to_resident_s']:.2f} s ({r['nostall']['gbps']:.2f} GB/s)")
                log(f"{link}: one stream…")
                r["single"] = _single_stream(url, single_cap_s)
                log(f"  {r['single']['gbps']:.3f} GB/s")
                log(f"{link}: boto3 download_file + load_file…")
                r["boto3"] = _boto3(url, dev, base, ours)
                del ours
                gc.collect()
                log(f"  {r['boto3']['to_resident_s']:.2f} s ({r['boto3']['gbps']:.2f} GB/s)")
                n = r["nostall"]
                r["vs_single_stream"] = n["gbps"] / r["single"]["gbps"]
                r["vs_boto3"] = r["boto3"]["to_resident_s"] / n["to_resident_s"]
                results[link] = r
    if "shared" in parts:
        log("shared host tier: two processes…")
        results["shared"] = _shared(folder, dev, nbytes, log)
    report["results"] = results
    report["targets"] = evaluate_targets(report)
    if work is None:
        shutil.rmtree(base, ignore_errors=True)
    return report


def evaluate_targets(report: dict) -> dict[str, dict]:
    """The storage-tiers issue's targets, each ``{"value", "threshold", "op", "met"}``
    (``met`` is ``None`` where the figure was not measured)."""
    res = report["results"]
    slow = res.get("throttled", {})
    t = Targets()

    t.add("remote_vs_single_stream", slow.get("vs_single_stream"), ">=", 8)
    t.add("remote_vs_boto3", slow.get("vs_boto3"), ">=", 1.5)
    overlaps = [
        res[link]["nostall"]["overlap"]
        for link in ("loopback", "throttled")
        if link in res and res[link]["nostall"].get("overlap")
    ]
    t.add("remote_first_bytes_overlap", max(overlaps) if overlaps else None, "<=", 1.1)
    second = (res.get("shared") or {}).get("second") or {}
    hit = second.get("scenario") == "memory-cache hit"
    t.add("shared_pool_second_process_gbps", second.get("gbps") if hit else None, ">=", 45)
    return t


def tables(report: dict) -> list:
    """What ``nostall bench remote`` prints: per link, nostall against the peers; the
    shared tier; the targets."""
    from rich.table import Table

    from nostall.bench import targets

    res = report["results"]
    gb = report["object"]["nbytes"] / 1e9
    out: list = []
    table = Table(title=f"FLUX transformer ({gb:.2f} GB) from S3 to {report['config']['device']}")
    for col in ("link", "method", "to resident (s)", "GB/s", "download (s)", "note"):
        table.add_column(col, justify="left" if col in ("link", "method", "note") else "right")
    for link in ("loopback", "throttled"):
        r = res.get(link)
        if not r:
            continue
        n, s, b = r["nostall"], r["single"], r["boto3"]
        label = (
            link
            if link == "loopback"
            else f"{link} ({report['config']['bwlimit_per_connection']}/conn)"
        )
        table.add_row(
            label,
            f"nostall ({n['connections']} conns)",
            f"{n['to_resident_s']:.2f}",
            f"{n['gbps']:.2f}",
            f"{n['download_s']:.2f}",
            f"mirror {n['mirror_s']:.2f} s, overlap {n['overlap']:.3f}",
        )
        table.add_row(
            "",
            "one stream (GET)",
            "",
            f"{s['gbps']:.3f}",
            "",
            "" if s["complete"] else f"rate over {s['s']:.1f} s",
        )
        table.add_row(
            "",
            "boto3 download_file + load_file",
            f"{b['to_resident_s']:.2f}",
            f"{b['gbps']:.2f}",
            f"{b['download_s']:.2f}",
            f"nostall {r['vs_boto3']:.2f}x, {r['vs_single_stream']:.1f}x one stream; "
            f"tensors {'equal' if b['equal_to_nostall'] else 'DIFFER'}",
        )
    if any(link in res for link in ("loopback", "throttled")):
        out.append(table)
    sh = res.get("shared")
    if sh:
        if sh.get("error"):
            out.append(f"shared tier: {sh['error']}")
        else:
            a, b = sh["first"], sh["second"]
            out.append(
                f"shared tier: process 1 {a['scenario']} {a['s']:.2f} s; process 2 (attach "
                f"{b['attach_s']:.2f} s) {b['scenario']} {b['s']:.3f} s = {b['gbps']:.1f} GB/s"
            )
    out.append(targets.table(report["targets"], title="targets (#20)"))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "shared-child":
        _shared_child(argv[1:])
        return 0
    print("usage: python -m nostall.bench.remote shared-child FOLDER NAME CAPACITY DEVICE ROOT")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
