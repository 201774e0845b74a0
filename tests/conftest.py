"""Fixtures shared by every test; the cuda marker skips tests on machines without a GPU."""

from __future__ import annotations

import pytest
import torch

from support import sample_tensors


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _digest_index(tmp_path_factory):
    """Every test's digest index lives in the session's temporary folder, never in the
    user's cache; tests of the index itself pass their own ``cache_dir``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("NOSTALL_CACHE_DIR", str(tmp_path_factory.mktemp("nostall-cache")))
    yield
    mp.undo()


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return sample_tensors()


@pytest.fixture
def ckpt_file(tmp_path, tensors):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "origin": "test"})
    return path
