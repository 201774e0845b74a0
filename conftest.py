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
