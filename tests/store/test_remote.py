"""Checkpoints in object storage: rclone's S3 server on loopback, and a fake client for
the faults a real server will not produce on demand."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

import nostall
from nostall.errors import ArgumentError, CheckpointError, FileChanged, RemoteError
from nostall.store.mirror import mirror
from nostall.store.remote import S3, ObjectRef, split_url
from nostall.synthetic.s3server import S3Server

from support import assert_same, make_sharded, sample_tensors


def put(server, bucket: str, key: str, src) -> str:
    """Place ``src`` (a file or folder) at ``s3://bucket/key`` of the server."""
    dest = os.path.join(server.root, bucket, key)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if os.path.isdir(src):
        shutil.copytree(src, dest, dirs_exist_ok=True)
    else:
        shutil.copyfile(src, dest)
    return f"s3://{bucket}/{key}"


def big_tensors(mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(mb)
    n = (mb << 20) // 4 // 8
    return {f"w{i}": torch.randn(n, generator=g) for i in range(8)}


@pytest.mark.slow
def test_a_file_in_a_bucket_loads_as_the_local_file(s3_env, ckpt_file, tensors, tmp_path):
    url = put(s3_env, "one", "ckpt/model.safetensors", ckpt_file)
    got = nostall.load_state_dict(url)
    assert_same(got, tensors)
    # No cache_dir: the mirror holds the stub, no weights.
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".safetensors")]
    assert all(p == ckpt_file for p in leftovers)


@pytest.mark.slow
def test_a_sharded_folder_loads_from_a_prefix_and_is_kept_for_the_next_process(s3_env, tmp_path):
    tensors = sample_tensors(seed=3)
    local = tmp_path / "sharded"
    local.mkdir()
    make_sharded(local, tensors, shards=3)
    url = put(s3_env, "sharded", "m", local)
    cache = tmp_path / "cache"
    got = nostall.load_state_dict(url, cache_dir=cache)
    assert_same(got, tensors)
    kept = sorted(p.name for p in cache.rglob("*.safetensors"))
    assert kept == sorted(p.name for p in local.glob("*.safetensors"))
    for p in cache.rglob("*.safetensors"):
        assert p.read_bytes() == (local / p.name).read_bytes()
    assert not [p for p in cache.rglob("*") if ".part" in p.name]
    # The next load reads the disk tier, not the bucket.
    folder = mirror(url, cache / "remote", keep_weights=True)
    result = nostall.Loader().load(folder)
    assert result.stats.read_mode == "buffered"
    assert_same(result.tensors, tensors)


@pytest.mark.slow
def test_a_model_loads_from_a_bucket(s3_env, tmp_path):
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    vae.save_pretrained(tmp_path / "vae")
    url = put(s3_env, "models", "sdxl/vae", tmp_path / "vae")
    got = nostall.load_model(url)
    assert type(got) is AutoencoderKL
    for k, v in vae.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k


@pytest.mark.slow
def test_the_object_replaced_mid_download_is_an_error_and_nothing_is_kept(tmp_path, monkeypatch):
    import nostall.store.remote as remote

    root = tmp_path / "buckets"
    (root / "b").mkdir(parents=True)
    # 64 MB in 16 MiB ranges over 2 connections at 16 MiB/s each: a second wave of ranges
    # starts after the replacement, and finds another object.
    save_file(big_tensors(64), str(root / "b" / "model.safetensors"))
    with S3Server(root, bwlimit="16M", dir_cache="0s") as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(remote, "_DEFAULT", None)
        cache = tmp_path / "cache"
        local = mirror("s3://b/model.safetensors", cache, keep_weights=True)

        def replace():
            time.sleep(0.5)
            other = tmp_path / "other.safetensors"
            save_file(big_tensors(65), str(other))
            os.replace(other, root / "b" / "model.safetensors")

        t = threading.Thread(target=replace)
        t.start()
        with pytest.raises(FileChanged, match="changed while it was read"):
            nostall.Loader(connections=2).load(local)
        t.join()
        remote._DEFAULT.close()
    assert not [p for p in cache.rglob("*") if p.name.endswith(".safetensors") or ".part" in p.name]


@pytest.mark.slow
def test_the_server_gone_mid_download_is_a_remote_error_within_bounded_time(tmp_path, monkeypatch):
    import nostall.store.remote as remote

    root = tmp_path / "buckets"
    (root / "b").mkdir(parents=True)
    save_file(big_tensors(32), str(root / "b" / "model.safetensors"))
    server = S3Server(root, bwlimit="4M", dir_cache="0s")
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(remote, "_DEFAULT", S3(attempts=3, backoff_s=0.05, timeout_s=2.0))
    cache = tmp_path / "cache"
    local = mirror("s3://b/model.safetensors", cache, keep_weights=True)
    threading.Timer(0.5, server.proc.kill).start()  # gone: no graceful end of the GETs
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="failed 3 times") as e:
        nostall.Loader(connections=4).load(local)
    assert time.monotonic() - t0 < 20
    assert "AWS_ENDPOINT_URL" in str(e.value)
    remote._DEFAULT.close()
    server.stop()
    assert not [p for p in cache.rglob("*") if p.name.endswith(".safetensors") or ".part" in p.name]


@pytest.mark.slow
def test_missing_bucket_object_and_credentials_are_named(s3_env, monkeypatch, tmp_path):
    import nostall.store.remote as remote

    with pytest.raises(RemoteError, match="no bucket 'nobucket'"):
        nostall.load_state_dict("s3://nobucket/x.safetensors")
    os.makedirs(os.path.join(s3_env.root, "empty"), exist_ok=True)
    with pytest.raises(RemoteError, match="no objects under"):
        nostall.load_state_dict("s3://empty/nothing/here")
    with pytest.raises(ArgumentError, match="s3://<bucket>"):
        split_url("s3:///key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-key-000000000000000000000")
    monkeypatch.setattr(remote, "_DEFAULT", None)
    with pytest.raises(RemoteError, match="access denied"):
        nostall.load_state_dict("s3://empty/x.safetensors")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setattr(remote, "_DEFAULT", None)
    with pytest.raises(RemoteError, match="AWS_ACCESS_KEY_ID"):
        nostall.load_state_dict("s3://empty/x.safetensors")


@pytest.mark.slow
def test_a_changed_object_is_mirrored_again_and_its_stale_disk_copy_dropped(s3_env, tmp_path):
    a, b = sample_tensors(seed=1), sample_tensors(seed=2)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    url = put(s3_env, "changes", "m/model.safetensors", tmp_path / "a.safetensors")
    cache = tmp_path / "cache"
    assert_same(nostall.load_state_dict(url, cache_dir=cache), a)
    kept = next(cache.rglob("model.safetensors"))
    assert kept.read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    time.sleep(1.1)  # a new modification time for the server's ETag cache
    put(s3_env, "changes", "m/model.safetensors", tmp_path / "b.safetensors")
    assert_same(nostall.load_state_dict(url, cache_dir=cache), b)
    assert kept.read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.slow
def test_a_bad_header_in_the_bucket_is_refused_at_mirror_time(s3_env, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    url = put(s3_env, "bad", "bad.safetensors", bad)
    with pytest.raises(CheckpointError, match="header length"):
        nostall.load_state_dict(url)


# ---- faults a real server does not produce on demand: a fake client -----------------------


class _Body:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n):
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def close(self):
        pass


class _Client:
    """Answers get_object from ``data``; ``faults`` are consumed one per request."""

    def __init__(self, data: bytes, etag: str, faults: list[str]):
        self.data, self.etag, self.faults, self.calls = data, etag, list(faults), 0
        self.meta = type("M", (), {"endpoint_url": "http://fake"})()

    def get_object(self, Bucket, Key, Range, IfMatch=None):
        from botocore.exceptions import ClientError

        self.calls += 1
        a, b = (int(x) for x in Range.removeprefix("bytes=").split("-"))
        fault = self.faults.pop(0) if self.faults else None
        body, etag, length = self.data[a : b + 1], self.etag, b + 1 - a
        if fault == "503":
            raise ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
                "GetObject",
            )
        if fault == "short":
            body = body[: len(body) // 2]
        if fault == "length":
            length += 7
        if fault == "etag":
            etag = '"other"'
        return {
            "Body": _Body(body),
            "ETag": etag,
            "ContentLength": length,
            "ContentRange": f"bytes {a}-{b}/{len(self.data)}",
        }


def _fake(data: bytes, faults: list[str], attempts: int = 4) -> tuple[S3, ObjectRef]:
    s3 = S3(attempts=attempts, backoff_s=0.001)
    s3._client = _Client(data, '"e1"', faults)
    return s3, ObjectRef("s3://b/k", len(data), "e1")


@pytest.mark.parametrize("fault", ["503", "short", "length"])
def test_a_failed_range_is_retried_with_backoff(fault):
    data = os.urandom(1 << 16)
    s3, ref = _fake(data, [fault, fault])
    assert s3.read_bytes(ref, 100, 60000) == data[100:60000]
    assert s3.retries == 2 and s3._client.calls == 3


def test_a_range_that_keeps_failing_is_a_remote_error_naming_the_object():
    s3, ref = _fake(b"x" * 4096, ["503"] * 10, attempts=3)
    with pytest.raises(RemoteError, match=r"s3://b/k: object storage at http://fake failed 3"):
        s3.read_bytes(ref, 0, 4096)


def test_a_changed_etag_is_file_changed_not_retried():
    s3, ref = _fake(b"x" * 4096, ["etag"])
    with pytest.raises(FileChanged, match="ETag"):
        s3.read_bytes(ref, 0, 4096)
    assert s3._client.calls == 1
