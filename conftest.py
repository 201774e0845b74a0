"""Collection rules for the whole repository (``tests/conftest.py`` holds the fixtures).

``--doctest-modules`` imports every module under ``src/nostall``. The serving modules
import their optional dependencies (``nostall[serve]``) at the top; where those are not
installed, their docstring examples are not collected instead of failing to import.
"""

from __future__ import annotations

import importlib.util

_OPTIONAL = {
    "fastapi": [
        "src/nostall/serve/app.py",
        "src/nostall/serve/embed.py",
        "src/nostall/serve/fleet.py",
    ],
    "prometheus_client": ["src/nostall/serve/metrics.py"],
}

collect_ignore = [
    path
    for module, paths in _OPTIONAL.items()
    if importlib.util.find_spec(module) is None
    for path in paths
]
# The tests' conftest.py files are plugins, loaded as such; collected again as doctest
# modules, the ones outside a package collide on their shared name ``conftest``.
collect_ignore_glob = ["tests/conftest.py", "tests/*/conftest.py"]


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: half again as many workers as cores. A fifth of the suite's time is
    spent waiting (servers starting, subprocesses importing torch, sockets): on 2 cores,
    2 workers kept the cores 80% busy; 3 workers fill that wait. (tests/conftest.py gives
    each worker its share of the cores for torch's threads, at least one.)"""
    import os

    cores = len(os.sched_getaffinity(0))
    return max(2, cores + (cores + 1) // 2)


# The modules that take longest, longest first (seconds of a 2-core run with 3 workers).
# ``--dist loadscope`` hands out modules in order of their number of tests, the heaviest
# end-to-end modules (few tests each) among the last: the workers then finished minutes
# apart. Longest first, the others fill the workers' gaps (longest-processing-time
# first). A module missing here runs in xdist's order, after these; a renamed one is
# only late.
LONGEST_FIRST = (
    "torch.compile",  # ~40 s: SAME_WORKER's group
    "tests/bench/test_bench_serve_full.py",  # ~43 s
    "tests/cache/test_cache.py",  # ~32 s
    "tests/serve/test_embed.py",  # ~27 s
    "tests/bench/test_bench_switch.py",  # ~22 s
    "tests/synthetic/test_full.py",  # ~20 s
    "tests/synthetic/test_loras.py",  # ~18 s
    "tests/serve/test_video_jobs.py",  # ~17 s
    "tests/serve/test_adapters_http.py",  # ~16 s
    "tests/serve/test_app.py",  # ~16 s
    "tests/bench/test_bench_video.py",  # ~15 s
    "tests/serve/test_fleet.py",  # ~15 s
    "tests/serve/test_cli_serve.py",  # ~14 s
    "tests/serve/test_video_jobs_faults.py",  # ~14 s
    "tests/bench/test_bench_remote.py",  # ~14 s
    "tests/memory/test_shared_pool.py",  # ~13 s
)

# Handed out last: the Ray fleet (~55 s alone). Beside two busy workers its replicas took
# 3-4x as long to start, and Ray's processes twice the CPU (~120 s against ~60), and a
# request queued in Ray's handle when its replica was killed (the "mid-request" kill
# came too soon) went to the restarted replica instead of the other worker.
LAST = ("tests/serve/test_fleet_ray.py",)

# Modules handed to one worker together, as one module would be: the first torch.compile
# in a process spends ~5 s of CPU setting up Dynamo, every later one a fraction of that.
SAME_WORKER = {
    "tests/video/test_wan.py": "torch.compile",
    "tests/adapters/test_compile.py": "torch.compile",
    "tests/bench/test_bench_adapters.py": "torch.compile",
}


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the modules of :data:`SAME_WORKER` grouped, those of
    :data:`LONGEST_FIRST` handed out first and those of :data:`LAST` last."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

        def _assign_work_unit(self, node):
            if not getattr(self, "_ordered", False):  # the queue is whole: put them first
                self._ordered = True
                rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
                rank.update({m: len(rank) + 1 + i for i, m in enumerate(LAST)})
                queue = sorted(
                    self.workqueue.items(), key=lambda x: rank.get(x[0], len(LONGEST_FIRST))
                )
                self.workqueue.clear()
                self.workqueue.update(queue)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
