"""A model store in object storage: ModelCache("s3://…") serves the local store's images."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import nostall

from cache_support import reference, run


@pytest.mark.slow
def test_a_store_in_a_bucket_serves_the_images_of_the_local_store(store, s3_env, tmp_path):
    shutil.copytree(store / "flux", f"{s3_env.root}/stores/tiny/flux")
    shutil.copytree(store / "sdxl", f"{s3_env.root}/stores/tiny/sdxl")
    cache_dir = tmp_path / "cache"
    with nostall.ModelCache("s3://stores/tiny", device="cpu", cache_dir=cache_dir) as cache:
        assert cache.store.names() == ["flux", "sdxl"]
        for name in ("flux", "sdxl", "flux"):
            with cache.use(name) as pipe:
                assert np.array_equal(run(pipe, name), reference(store, name)), name
    # The disk tier now holds every weight file, byte for byte, for the next process.
    for src in store.glob("flux/*/*.safetensors"):
        kept = next(cache_dir.rglob(f"tiny/flux/{src.parent.name}/{src.name}"))
        assert kept.read_bytes() == src.read_bytes()
    # ... which reads them from disk: no stub is opened, the images are the same.
    with nostall.ModelCache("s3://stores/tiny", device="cpu", cache_dir=cache_dir) as cache:
        ckpt = cache.store.entry("flux").components["transformer"].checkpoint
        assert all(f.path.endswith(".safetensors") for f in ckpt.files)
        with cache.use("flux") as pipe:
            assert np.array_equal(run(pipe, "flux"), reference(store, "flux"))


@pytest.mark.slow
def test_a_store_in_a_bucket_is_indexed_ahead_as_a_local_one(store, s3_env, tmp_path):
    from nostall.store.catalog import Store

    shutil.copytree(store / "flux", f"{s3_env.root}/indexed/s/flux")
    remote = Store("s3://indexed/s", cache_dir=tmp_path / "r")
    local = Store(str(store), cache_dir=tmp_path / "l")
    for s in (remote, local):  # reads every weight file (from the bucket: ranged GETs)
        assert s.index_files("flux") > 0
    contents = [{c.role: c.content for c in s.entry("flux").weights} for s in (remote, local)]
    assert contents[0] == contents[1] and all(contents[0].values())
    # The files the hashing kept on disk (cache_dir) are known too: read from disk now.
    assert all(f.path.endswith(".safetensors") for c in remote.entry("flux").weights
               for f in c.checkpoint.files)  # fmt: skip
