"""What the tests of ``nostall bench serve`` share: the targets its report names."""

from __future__ import annotations

FULL_TARGETS = {
    "full_worker_lost_or_mixed_up",
    "full_worker_with_embed_lost_or_mixed_up",
    "full_throughput_vs_diffusers_worker",
    "full_gpu_busy_share",
    "full_p99_over_p50",
    "full_prefetch_inference_slowdown",
    "soak_good_requests_lost",
    "soak_memory_growth",
}
TINY_TARGETS = {
    "worker_lost_or_mixed_up",
    "worker_warm_switches_from_memory_share",
    "fleet_warm_on_holding_worker_share",
    "fleet_throughput_vs_one",
    "embed_batching_speedup",
    "embed_cache_hit_ms",
}
