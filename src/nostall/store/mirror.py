"""A local mirror of an ``s3://`` prefix: small files whole, weight files as stubs.

Everything in nostall reads local paths (a store's folders, ``config.json``, shard
indexes). :func:`mirror` makes an object-storage prefix one: under
``<root>/<endpoint>/<bucket>/<key>`` it writes

* every file that is not a ``.safetensors`` weight file (configs, indexes, tokenizers),
  downloaded whole, in parallel, each under a temporary name renamed into place;
* for every weight file, a *stub* ``<name>.safetensors.remote`` holding the object's URL,
  size, ETag and its safetensors header (two ranged GETs: the length, then the header).
  The loader reads the data through the stub (:class:`~nostall.store.remote.RemoteBackend`),
  straight into pinned memory; with ``keep_weights`` it also writes the disk tier's
  copy, renamed to ``<name>.safetensors`` only once complete.

Opening the mirror again compares every object's ETag with the one recorded: a file
whose object changed is downloaded again, and a weight file's stale disk copy is
deleted before its stub is rewritten. A weight file already on disk (and current) is
read from disk.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from nostall.errors import CheckpointError, RemoteError
from nostall.store.header import MAX_HEADER_BYTES, parse_header
from nostall.store.remote import (
    REMOTE_SUFFIX,
    S3,
    ObjectRef,
    default_s3,
    read_stub,
    split_url,
    unlink_missing,
    write_atomic,
    write_stub,
)

__all__ = ["mirror"]

log = logging.getLogger(__name__)

MANIFEST = ".nostall-mirror.json"
# The first GET of a weight file: its 8-byte length and, usually, the whole header.
_FIRST_BYTES = 1 << 20


def mirror(
    url: str,
    root: str | os.PathLike,
    *,
    keep_weights: bool = False,
    s3: S3 | None = None,
    threads: int = 16,
) -> str:
    """Mirror ``url`` (an object or a prefix) under ``root``; return the local path that
    stands for it (a folder for a prefix, the file's path for one object).

    >>> local = mirror("s3://models/flux", "/var/cache/nostall/remote")  # doctest: +SKIP
    >>> nostall.ModelCache(local)  # doctest: +SKIP
    """
    s3 = s3 or default_s3()
    bucket, key = split_url(url)
    base = os.path.join(os.fspath(root), _endpoint_dir(s3), bucket)
    # One listing: the object named by the key, or the objects under it as a folder.
    listed = s3.list(url)
    exact = [o for o in listed if o.key == key] if key and not key.endswith("/") else []
    if exact:
        objects, prefix = exact, key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    else:
        prefix = key if not key or key.endswith("/") else key + "/"
        objects = [o for o in listed if o.key.startswith(prefix)]
        if not objects:
            raise RemoteError(
                f"no objects under {prefix or '/'} in bucket {bucket!r}; check the URL",
                path=url,
            )
    folder = os.path.join(base, *prefix.rstrip("/").split("/")) if prefix else base
    os.makedirs(folder, exist_ok=True)
    manifest_path = os.path.join(folder, MANIFEST)
    manifest = _read_manifest(manifest_path)
    rels = []
    for o in objects:
        rel = o.key[len(prefix) :]
        if not rel or rel.endswith("/"):
            continue  # a "folder" marker object
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts) or parts[-1].endswith(REMOTE_SUFFIX):
            raise RemoteError(
                f"object key {o.key!r} cannot be mirrored as a file name; rename it", path=o.url
            )
        rels.append((rel, o))

    def one(item: tuple[str, ObjectRef]) -> tuple[str, str]:
        rel, o = item
        local = os.path.join(folder, *rel.split("/"))
        if rel.endswith(".safetensors"):
            _weight_stub(local, o, s3, keep_weights)
        elif manifest.get(rel) != o.etag or not os.path.isfile(local):
            s3.download(o, local)
        return rel, o.etag

    with ThreadPoolExecutor(max(1, min(threads, len(rels)))) as pool:
        done = dict(pool.map(one, rels))
    if done != manifest:
        write_atomic(manifest_path, json.dumps(done, sort_keys=True).encode())
    if exact:
        return os.path.join(folder, key.rsplit("/", 1)[-1])
    return folder


def _weight_stub(local: str, o: ObjectRef, s3: S3, keep: bool) -> None:
    stub = local + REMOTE_SUFFIX
    if os.path.exists(stub):
        try:
            ref, _, kept = read_stub(stub)
        except CheckpointError:
            ref, kept = None, False
        if ref == o and (kept or not keep):
            return
        if ref != o:
            unlink_missing(local)  # a disk copy of the old version
    elif os.path.exists(local) and os.path.getsize(local) != o.size:
        # A disk copy without its stub (a stub deleted by hand): trusted only by size.
        unlink_missing(local)
    head = s3.read_bytes(o, 0, min(o.size, _FIRST_BYTES))
    if len(head) < 8:
        raise CheckpointError(
            f"object is {o.size} bytes, too short to be a safetensors file", path=o.url
        )
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > o.size:
        raise CheckpointError(
            f"header length {n} goes beyond the object ({o.size} bytes); it is truncated or "
            "not a safetensors file",
            path=o.url,
        )
    if 8 + n > len(head):
        head += s3.read_bytes(o, len(head), 8 + n)
    head = head[: 8 + n]
    parse_header(head[8:], file_size=o.size, path=o.url)  # refuse a bad header now
    write_stub(stub, o, head, keep=keep)


def _read_manifest(path: str) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _endpoint_dir(s3: S3) -> str:
    """One folder per endpoint (``127.0.0.1_9000``, ``s3.amazonaws.com``)."""
    try:
        netloc = urlparse(s3.endpoint).netloc
    except RemoteError:
        raise
    except Exception:
        netloc = "default"
    return netloc.replace(":", "_") or "default"
