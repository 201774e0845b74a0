"""#28 at real size on the GPU machine: `nostall serve` processes over real-size random
stores, on CUDA, as an operator runs them.

1. Drain: a worker serving FLUX.1-dev (34 GB) gets SIGTERM with one 1024x1024 job running
   past its grace period and one queued behind it, a short job finished first: the
   finished job's image arrives, the other two get 503, the process exits within
   --grace-s.
2. Shared tier: two workers share `--host-tier shared:check` over SDXL (6.9 GB); the index
   beside the segment is overwritten, a third worker asks for a smaller tier; the first
   worker's next image equals its first bit for bit (its held bytes never changed), and
   the segment is gone once the last worker stops.

    python3 scripts/serve_check.py --store /tmp/store --out $OUT/serve-check.json
    python3 scripts/serve_check.py --size tiny --device cpu --shm /tmp/shm ...  # a dry run

Writes JSON (date, commit, hardware, each check's figures and pass/fail) and prints a table.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from nostall.errors import ServeError
from nostall.serve.local import start_serve

# What the checks ask for at each size: (image side, grace s, GPU GB, host GB, smaller host GB)
SIZES = {"full": (1024, 20.0, "20", "16", "8"), "tiny": (256, 10.0, "0.2", "0.2", "0.1")}


def _start(store: str, device: str, *args: str, log: str) -> tuple[subprocess.Popen, str]:
    out = open(log, "w")  # noqa: SIM115 (the process writes it until it ends)
    try:
        return start_serve(store, *args, device=device, output=out, timeout=600)
    except ServeError as e:
        raise SystemExit(f"worker did not start; {e}") from None


def _image(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)


def drain(store: str, logs: str, size: str, device: str) -> dict:
    side, grace, gpu, host, _ = SIZES[size]
    options = ("--grace-s", str(grace), "--max-overtaken", "0", "--host-budget-gb", host)
    if size == "tiny":  # (at full size: the default, FLUX's 34 GB resident)
        options += ("--gpu-budget-gb", gpu)
    proc, url = _start(store, device, *options, log=f"{logs}/drain.log")
    base = {"model": "flux", "prompt": "a lighthouse", "size": f"{side}x{side}", "seed": 1}
    base["max_sequence_length"] = 64
    warm = _image(url, {**base, "steps": 1})  # the first switch out of the way
    answers: dict[str, httpx.Response] = {}
    took: dict[str, float] = {}

    def post(name: str, body: dict) -> None:
        t = time.monotonic()
        answers[name] = _image(url, body)
        took[name] = time.monotonic() - t

    jobs = {"a": {**base, "steps": 8}, "b": {**base, "steps": 150}, "c": {**base, "steps": 4}}
    threads = []
    for name, body in jobs.items():
        threads.append(threading.Thread(target=post, args=(name, body)))
        threads[-1].start()
        while True:
            s = httpx.get(f"{url}/status.json", timeout=10).json()
            if len(s["queue"]) + (s["running"] is not None) == len(threads):
                break
            time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    ready = httpx.get(f"{url}/readyz", timeout=10).status_code
    late = _image(url, {**base, "steps": 1}).status_code
    proc.wait(120)
    exit_s = time.monotonic() - sent
    for t in threads:
        t.join(60)
    ok = (
        warm.status_code == 200
        and answers["a"].status_code == 200
        and answers["b"].status_code == 503
        and answers["c"].status_code == 503
        and ready == 503
        and late == 503
        and exit_s < grace
        and proc.returncode == 128 + signal.SIGTERM
    )
    return {
        "grace_s": grace,
        "exit_after_sigterm_s": round(exit_s, 2),
        "readyz_after_sigterm": ready,
        "new_request_after_sigterm": late,
        "finished_job": answers["a"].status_code,
        "running_job": answers["b"].status_code,
        "running_job_says": answers["b"].json()["error"]["message"][:200],
        "queued_job": answers["c"].status_code,
        "returncode": proc.returncode,
        "ok": ok,
    }


def shared_tier(store: str, logs: str, root: str, size: str, device: str) -> dict:
    from nostall.memory.shared_segment import segment_path

    side, _, gpu, host, smaller = SIZES[size]
    os.environ["NOSTALL_SHM_DIR"] = root  # (the workers inherit it)
    # SDXL alone: three workers of one GPU, each with a device tier SDXL fits
    only = os.path.join(os.path.dirname(os.path.abspath(store)), "sdxl-only")
    os.makedirs(only, exist_ok=True)
    if not os.path.lexists(os.path.join(only, "sdxl")):
        os.symlink(os.path.join(os.path.abspath(store), "sdxl"), os.path.join(only, "sdxl"))
    store = only
    body = {"model": "sdxl", "prompt": "a lighthouse", "size": f"{side}x{side}", "steps": 4}
    body["seed"] = 3
    common = ("--host-tier", "shared:check", "--gpu-budget-gb", gpu)
    one, url1 = _start(store, device, *common, "--host-budget-gb", host, log=f"{logs}/shared-1.log")
    two, url2 = _start(store, device, *common, "--host-budget-gb", host, log=f"{logs}/shared-2.log")
    first = _image(url1, body)
    second_worker = _image(url2, body)
    index = segment_path("check", root) + ".index"
    with open(index, "wb") as f:
        f.write(b"\x00garbage, as a crash or a full disk can leave it")
    three, url3 = _start(
        store, device, *common, "--host-budget-gb", smaller, log=f"{logs}/shared-3.log"
    )
    third = _image(url3, {**body, "seed": 4})
    again = _image(url1, body)
    info = [(s.name, s.capacity, len(s.processes)) for s in _segments(root)]
    procs = (one, two, three)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(120)
    left = glob.glob(os.path.join(root, "nostall-*check*"))
    same = first.status_code == again.status_code == 200 and _png(first) == _png(again)
    with open(f"{logs}/shared-3.log") as f:
        warned = "using it as it is instead of" in f.read()
    ok = same and second_worker.status_code == 200 and third.status_code == 200 and not left
    return {
        "segment_after_damage": info,
        "first_worker_image_unchanged": same,
        "second_worker": second_worker.status_code,
        "third_worker_smaller_budget": third.status_code,
        "third_worker_warned": warned,
        "second_worker_switch_tiers": second_worker.headers.get("x-nostall-switch-tiers"),
        "files_left_after_last_worker": left,
        "ok": ok,
    }


def _segments(root: str):
    from nostall.memory import SharedPool

    return SharedPool.segments(root=root)


def _hardware() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return f"no GPU ({os.cpu_count()} CPUs)"


def _png(r: httpx.Response) -> bytes:
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=("drain", "shared", "all"), default="all")
    ap.add_argument("--size", choices=tuple(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shm", default="/dev/shm", help="the shared tier's folder")
    args = ap.parse_args()
    logs = os.path.dirname(os.path.abspath(args.out))
    record: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("NOSTALL_COMMIT", "unknown"),
        "hardware": _hardware(),
    }
    write = [sys.executable, "-m", "nostall.cli", "synthetic", args.store, "--size", args.size]
    write += ["--overwrite", "--pipeline", "flux", "--pipeline", "sdxl"]
    subprocess.run(write, check=True)
    record["size"], record["device"] = args.size, args.device
    if args.part in ("drain", "all"):
        record["drain"] = drain(args.store, logs, args.size, args.device)
    if args.part in ("shared", "all"):
        record["shared_tier"] = shared_tier(args.store, logs, args.shm, args.size, args.device)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    for part in ("drain", "shared_tier"):
        for k, v in record.get(part, {}).items():
            print(f"{part:12} {k:32} {v}")


if __name__ == "__main__":
    main()
