from __future__ import annotations

import subprocess
import sys

import pytest

import nostall
from nostall import errors


def test_all_is_exactly_the_public_surface():
    public = {n for n in dir(nostall) if not n.startswith("_")} - {
        "adapters",
        "api",
        "errors",
        "store",
        "verify",
        "logs",
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
        "stream",
        "synthetic",
    }
    assert set(nostall.__all__) - {"__version__"} == public
    for name in ("load_state_dict", "load_model", "PinnedPool", "NostallError", "CheckpointError"):
        assert name in nostall.__all__


def test_exception_tree():
    for name in errors.__all__:
        exc = getattr(errors, name)
        assert issubclass(exc, nostall.NostallError)
        if exc is not nostall.NostallError:  # the root, drawn without a branch
            assert f"── {name} " in errors.__doc__, f"{name} is not drawn in the tree"
    assert issubclass(nostall.ModelMismatchError, nostall.CheckpointError)
    # Callers written against the standard conventions keep catching them.
    assert issubclass(nostall.ArgumentError, ValueError)
    assert issubclass(nostall.InternalError, RuntimeError)
    for exc in (errors.UnsupportedBackend, nostall.DegradedError):
        assert issubclass(exc, nostall.UnsupportedError)
    for exc in (nostall.QueueFull, nostall.ShuttingDown, nostall.Cancelled):
        assert issubclass(exc, nostall.ServeError)
    assert issubclass(nostall.EmbeddingUnavailable, nostall.ServeError)


def test_errors_moved_into_the_tree_keep_their_old_import_paths():
    from nostall.serve.client import EmbeddingUnavailable
    from nostall.serve.worker import Cancelled, QueueFull, ShuttingDown
    from nostall.store.base import UnsupportedBackend

    assert UnsupportedBackend is errors.UnsupportedBackend
    assert EmbeddingUnavailable is nostall.EmbeddingUnavailable
    assert (QueueFull, ShuttingDown, Cancelled) == (
        nostall.QueueFull,
        nostall.ShuttingDown,
        nostall.Cancelled,
    )


# In ``python -O``, the libraries outside nostall load the bytecode they were installed
# with (``X.pyc``) instead of compiling their sources again for an ``X.opt-1.pyc`` that
# PYTHONDONTWRITEBYTECODE keeps from ever being cached (torch's: ~4 s of CPU each run);
# nostall's own modules (under PACKAGE) are compiled with their asserts stripped.
_THIRD_PARTY_BYTECODE = """
import importlib._bootstrap_external as external

_cache_from_source = external.cache_from_source


def cache_from_source(path, debug_override=None, *, optimization=None):
    if not path.startswith(PACKAGE):
        optimization = ""
    return _cache_from_source(path, debug_override, optimization=optimization)


external.cache_from_source = cache_from_source
"""


@pytest.mark.slow
def test_import_works_with_asserts_stripped():
    # python -O drops assert statements: no invariant may rest on one.
    import os

    package = os.path.dirname(nostall.__file__) + os.sep
    code = f"PACKAGE = {package!r}\n" + _THIRD_PARTY_BYTECODE
    code += "import nostall, nostall.video, nostall.store, nostall.transfer.loader\n"
    code += "assert False, 'asserts were not stripped'\n"  # (-O it is)
    subprocess.run([sys.executable, "-O", "-c", code], check=True)


@pytest.mark.slow
def test_import_does_not_touch_cuda():
    code = (
        "import torch, nostall, nostall.cli, nostall.bench.load\n"
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
