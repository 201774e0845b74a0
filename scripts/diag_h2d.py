"""Is H2D from registered anonymous memory as fast as from cudaHostAlloc, before and after
host memory has been churned? Prints GB/s and huge-page coverage. GPU machine only."""

import time

import torch

from nostall import PinnedPool
from nostall.bench.load import link_limit, pool_copy_rate

dev = torch.device("cuda")
print("link (cudaHostAlloc 4 GiB):", round(link_limit(dev), 1), flush=True)
for label in ("fresh", "after 24 GB churn"):
    if label != "fresh":
        junk = [torch.empty(256 << 20, dtype=torch.uint8).fill_(1) for _ in range(90)]
        del junk
    t = time.perf_counter()
    pool = PinnedPool(8 << 30)
    pool.wait_pinned()
    pin = time.perf_counter() - t
    s = pool.stats()
    print(
        label,
        "pool 8 GiB pinned in",
        round(pin, 2),
        "s; hugepages",
        s.hugepages,
        "; H2D",
        round(pool_copy_rate(pool, dev), 1),
        "GB/s",
        flush=True,
    )
    pool.close()
