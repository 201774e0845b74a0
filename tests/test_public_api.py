from __future__ import annotations

import subprocess
import sys

import nostall
from nostall import errors


def test_all_is_exactly_the_public_surface():
    public = {n for n in dir(nostall) if not n.startswith("_")} - {
        "api",
        "checkpoint",
        "errors",
        "io",
        "memory",
        "transfer",
        "assemble",
        "video",
        "bench",
        "cache",
        "cli",
        "demo",
        "quant",
        "serve",
    }
    assert set(nostall.__all__) - {"__version__"} == public
    for name in ("load_state_dict", "load_model", "PinnedPool", "NostallError", "CheckpointError"):
        assert name in nostall.__all__


def test_exception_tree():
    for name in errors.__all__:
        exc = getattr(errors, name)
        assert issubclass(exc, nostall.NostallError)
    assert issubclass(nostall.ModelMismatchError, nostall.CheckpointError)


def test_import_does_not_touch_cuda():
    code = (
        "import torch, nostall, nostall.cli.main, nostall.bench.load\n"
        "assert not torch.cuda.is_initialized()\n"
        "p = nostall.PinnedPool(4 << 20, pin=False); p.close()\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docstrings_on_every_public_callable():
    for name in nostall.__all__:
        obj = getattr(nostall, name)
        if callable(obj):
            assert obj.__doc__, name
