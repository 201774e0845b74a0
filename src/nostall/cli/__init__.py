"""The ``nostall`` command: a thin layer over the public API, one module per command group.

Importing this package registers every command on :data:`~nostall.cli.app.app`;
:func:`main` is the console script (``python -m nostall.cli`` runs it too).
"""

from nostall.cli import bench, demo, generate, load, quant, serve, shm, switch, synthetic, video
from nostall.cli.app import app, main

__all__ = [
    "app",
    "bench",
    "demo",
    "generate",
    "load",
    "main",
    "quant",
    "serve",
    "shm",
    "switch",
    "synthetic",
    "video",
]
