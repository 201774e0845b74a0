"""Object storage → host memory: ranged GETs from S3, many connections at once.

A checkpoint in a bucket is read the way a local one is: the loader's reader threads
each fill a chunk of pinned memory, here with ranged ``GET`` requests of
``RANGE_BYTES`` each instead of ``preadv`` calls, so N threads are N connections and
the bytes go straight into the pool block (or staging slot) they are copied to the
GPU from, while later ranges are still downloading.

The client is ``boto3``'s (endpoint and credentials from the standard AWS environment
variables and config files: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, ``~/.aws/credentials``...). ``obstore`` was measured first and refused:
it insists on ``206 Partial Content`` for a ranged read, and rclone's S3 server (the one
our tests and benchmarks run) answers ranges with ``200`` and a ``Content-Range``.

Every range is checked against the object's ETag and size as the mirror saw them
(:mod:`nostall.store.mirror`): ``If-Match`` asks the server to refuse a replaced object,
and the response's ETag and ``Content-Range`` are compared too (servers that ignore
``If-Match`` exist), so an object replaced mid-download is a
:class:`~nostall.FileChanged`, never a mix of two versions. A range that fails
(connection reset, timeout, 5xx, 503 slow-down, a body shorter than announced) is
retried with exponential backoff; after ``attempts`` it is a
:class:`~nostall.RemoteError` naming the object and the endpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from nostall.errors import ArgumentError, CheckpointError, FileChanged, RemoteError
from nostall.store.base import REMOTE_RANGE_BYTES, REMOTE_SUFFIX, ReadBackend

__all__ = [
    "RANGE_BYTES",
    "REMOTE_SUFFIX",
    "S3",
    "ObjectRef",
    "RemoteBackend",
    "default_s3",
    "is_remote",
    "split_url",
    "unlink_missing",
    "write_atomic",
]

log = logging.getLogger(__name__)

RANGE_BYTES = REMOTE_RANGE_BYTES
# Retried: the server or the network, never the request itself.
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


def is_remote(source: object) -> bool:
    """Whether ``source`` is an object-storage URL (``s3://bucket/key``)."""
    return isinstance(source, str) and source.startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``; :class:`ArgumentError` if malformed.

    >>> split_url("s3://models/flux/transformer")
    ('models', 'flux/transformer')
    """
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ArgumentError(
            f"{url!r} is not an object-storage URL; write s3://<bucket>/<prefix>", field="url"
        )
    key = parsed.path.lstrip("/")
    if any(part in (".", "..") for part in key.split("/")):
        raise ArgumentError(f"{url!r}: '.' and '..' are not allowed in a key", field="url")
    return parsed.netloc, key


@dataclass(frozen=True)
class ObjectRef:
    """One object as listed: its URL, size and ETag (what every range is checked against)."""

    url: str
    size: int
    etag: str

    @property
    def bucket(self) -> str:
        return split_url(self.url)[0]

    @property
    def key(self) -> str:
        return split_url(self.url)[1]


class S3:
    """A thread-safe S3 client with ``connections`` pooled connections and per-range retries.

    Args:
        connections: the connection pool's size (the loader's remote reader threads
            share it; more threads than connections would wait for one).
        attempts: tries per request, the first included.
        backoff_s: the first retry's delay; each later one doubles it (with jitter),
            at most 5 s.
        timeout_s: connect and read timeout of one request.

    >>> s3 = S3(connections=8)  # doctest: +SKIP
    >>> s3.head("s3://models/flux/transformer/config.json").size  # doctest: +SKIP
    1031
    """

    def __init__(
        self,
        *,
        connections: int = 128,
        attempts: int = 6,
        backoff_s: float = 0.2,
        timeout_s: float = 30.0,
    ):
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
            raise ArgumentError(f"connections={connections!r} must be a positive integer")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ArgumentError(f"attempts={attempts!r} must be a positive integer")
        self.connections = connections
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()
        self.retries = 0  # ranges retried so far (read by benchmarks and tests)

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    import boto3
                    from botocore.config import Config
                except ImportError as e:
                    raise RemoteError(
                        "reading s3:// URLs needs boto3: pip install 'nostall[remote]'"
                    ) from e
                config = Config(
                    max_pool_connections=self.connections,
                    connect_timeout=self.timeout_s,
                    read_timeout=self.timeout_s,
                    # botocore retries what fails before the body (503 slow-down, resets
                    # on connect); _retrying() retries the rest, body included.
                    retries={"max_attempts": 1, "mode": "standard"},
                    s3={"addressing_style": "path"}
                    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
                    else {},
                )
                self._client = boto3.session.Session().client("s3", config=config)
            return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    # ---- requests --------------------------------------------------------------------

    def head(self, url: str) -> ObjectRef:
        """The object's size and ETag."""
        bucket, key = split_url(url)
        r = self._retrying(url, lambda: self.client.head_object(Bucket=bucket, Key=key))
        return ObjectRef(url, int(r["ContentLength"]), _etag(r.get("ETag")))

    def list(self, url: str) -> list[ObjectRef]:
        """Every object whose key starts with ``url``'s key, in key order."""
        bucket, prefix = split_url(url)
        out: list[ObjectRef] = []
        token = None
        while True:
            args = {"Bucket": bucket, "Prefix": prefix}
            if token:
                args["ContinuationToken"] = token
            page = self._retrying(url, lambda a=args: self.client.list_objects_v2(**a))
            for o in page.get("Contents", ()):
                out.append(
                    ObjectRef(f"s3://{bucket}/{o['Key']}", int(o["Size"]), _etag(o.get("ETag")))
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(out, key=lambda o: o.url)

    def read_range(self, ref: ObjectRef, offset: int, dest: memoryview) -> int:
        """Fill ``dest`` with the object's bytes from ``offset`` on (one ranged GET, retried
        as a whole); returns the bytes written (less than ``len(dest)`` only at the end)."""
        n = min(len(dest), ref.size - offset)
        if n <= 0:
            return 0
        return self._retrying(ref.url, lambda: self._get_into(ref, offset, dest[:n]))

    def read_bytes(self, ref: ObjectRef, start: int, end: int) -> bytes:
        buf = bytearray(max(0, min(end, ref.size) - start))
        got = self.read_range(ref, start, memoryview(buf))
        return bytes(buf[:got])

    def download(self, ref: ObjectRef, path: str) -> None:
        """The whole object into ``path``, written under a temporary name and renamed
        into place when complete (small files: configs, tokenizers, indexes)."""
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".nostall-", suffix=".part", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                buf = bytearray(min(max(ref.size, 1), RANGE_BYTES))
                offset = 0
                while offset < ref.size:
                    got = self.read_range(ref, offset, memoryview(buf))
                    f.write(memoryview(buf)[:got])
                    offset += got
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            unlink_missing(tmp)
            raise

    # ---- one GET, checked ---------------------------------------------------------------

    def _get_into(self, ref: ObjectRef, offset: int, dest: memoryview) -> int:
        n = len(dest)
        bucket, key = split_url(ref.url)
        args = {"Bucket": bucket, "Key": key, "Range": f"bytes={offset}-{offset + n - 1}"}
        if ref.etag:
            args["IfMatch"] = f'"{ref.etag}"'
        r = self.client.get_object(**args)
        body = r["Body"]
        try:
            etag = _etag(r.get("ETag"))
            total = _range_total(r.get("ContentRange"), offset, n, ref.url)
            if (ref.etag and etag and etag != ref.etag) or (
                total is not None and total != ref.size
            ):
                raise FileChanged(
                    f"the object changed while it was read (ETag {ref.etag} → {etag}, size "
                    f"{ref.size} → {total}); its bytes were not used. Load it again to read "
                    "the new version, and upload new versions under a new key",
                    path=ref.url,
                )
            length = int(r.get("ContentLength", -1))
            if length != n:
                raise _Retry(
                    f"the server answered {length} bytes for a range of {n} at offset {offset}"
                )
            got = _read_body(body, dest)
            if got != n:
                raise _Retry(f"the body ended after {got} of {n} bytes at offset {offset}")
            return n
        finally:
            body.close()

    def _retrying(self, url: str, call):
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        delay = self.backoff_s
        last: BaseException | None = None
        t0 = time.monotonic()
        for attempt in range(self.attempts):
            if attempt:
                with self._lock:
                    self.retries += 1
                time.sleep(min(5.0, delay) * (0.5 + random.random()))
                delay *= 2
            try:
                return call()
            except (NoCredentialsError, PartialCredentialsError) as e:
                raise RemoteError(
                    f"no usable credentials for object storage ({e}); set AWS_ACCESS_KEY_ID "
                    "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with a profile in "
                    "~/.aws/credentials",
                    path=url,
                ) from e
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                code = str(e.response.get("Error", {}).get("Code", status))
                if status in _RETRY_STATUS or code in ("SlowDown", "RequestTimeout"):
                    last = e
                    continue
                raise self._refused(url, code, status, e) from e
            except _Retry as e:
                last = e
            except (BotoCoreError, OSError) as e:
                # Connection refused or reset, timeouts, a body cut short (urllib3's
                # ProtocolError is an OSError subclass only in part: caught below).
                last = e
            except Exception as e:  # urllib3 errors from the body that are not OSErrors
                if type(e).__module__.startswith(("urllib3", "http.client")):
                    last = e
                    continue
                raise
        raise RemoteError(
            f"object storage at {self._endpoint_or_default()} failed {self.attempts} times "
            f"over {time.monotonic() - t0:.1f} s (last: {last}); check that the server is up "
            "and reachable (AWS_ENDPOINT_URL), then load again",
            path=url,
        ) from last

    def _refused(self, url: str, code: str, status: Any, e: BaseException) -> Exception:
        bucket, key = split_url(url)
        if code == "NoSuchBucket":
            return RemoteError(
                f"no bucket {bucket!r} at {self._endpoint_or_default()}; check the URL and "
                "AWS_ENDPOINT_URL",
                path=url,
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return RemoteError(
                f"no object {key!r} in bucket {bucket!r}; check the key (s3://bucket/key)",
                path=url,
            )
        if code in ("PreconditionFailed", "412"):
            return FileChanged(
                "the object was replaced while it was read (its ETag no longer matches); "
                "its bytes were not used. Load it again to read the new version",
                path=url,
            )
        if code in (
            "AccessDenied",
            "403",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "Forbidden",
        ):
            return RemoteError(
                f"access denied ({code}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE) and the bucket's policy",
                path=url,
            )
        return RemoteError(f"object storage refused the request: {code} ({e})", path=url)

    def _endpoint_or_default(self) -> str:
        try:
            return self.endpoint
        except Exception:
            return "the default AWS endpoint"

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _etag(value: object) -> str:
    """An ETag without its quotes (servers differ: rclone quotes it in GETs, not in lists)."""
    return str(value or "").strip().removeprefix("W/").strip('"')


class _Retry(Exception):
    """A response that may succeed when asked again (short body, wrong length)."""


def _range_total(content_range: str | None, offset: int, n: int, url: str) -> int | None:
    # "bytes 0-1023/268435456"
    if not content_range:
        return None
    try:
        unit, rest = content_range.split(" ", 1)
        span, total = rest.split("/", 1)
        first, last = (int(x) for x in span.split("-", 1))
    except ValueError:
        raise _Retry(f"unreadable Content-Range {content_range!r}") from None
    if unit != "bytes" or first != offset or last != offset + n - 1:
        raise _Retry(f"asked for bytes {offset}-{offset + n - 1}, got {content_range!r}")
    return None if total == "*" else int(total)


def _read_body(body: Any, dest: memoryview) -> int:
    """Read the response body straight into ``dest`` (no intermediate bytes object)."""
    raw = getattr(body, "_raw_stream", None)
    got = 0
    n = len(dest)
    if raw is not None and hasattr(raw, "readinto"):
        while got < n:
            k = raw.readinto(dest[got:])
            if not k:
                break
            got += k
        return got
    while got < n:  # another transport: read() then copy
        chunk = body.read(min(n - got, RANGE_BYTES))
        if not chunk:
            break
        dest[got : got + len(chunk)] = chunk
        got += len(chunk)
    return got


_DEFAULT: S3 | None = None
_DEFAULT_LOCK = threading.Lock()


def default_s3() -> S3:
    """The process's shared client (its connections are created on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = S3()
        return _DEFAULT


# ---- the stub a mirror leaves for a weight file, and the backend that reads it ------------


def write_stub(path: str, ref: ObjectRef, head: bytes, *, keep: bool) -> None:
    """Write the stub ``path`` (``<file>.safetensors.remote``) atomically: the object's
    URL, size, ETag, its first bytes (the safetensors header) and whether a load should
    keep a disk copy."""
    doc = {"url": ref.url, "size": ref.size, "etag": ref.etag, "head": head.hex(), "keep": keep}
    write_atomic(path, json.dumps(doc).encode())


def read_stub(path: str) -> tuple[ObjectRef, bytes, bool]:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        ref = ObjectRef(str(doc["url"]), int(doc["size"]), str(doc["etag"]))
        return ref, bytes.fromhex(doc["head"]), bool(doc.get("keep", False))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"unreadable remote stub ({e}); open the s3:// URL again to rebuild the mirror",
            path=path,
        ) from e


class RemoteBackend(ReadBackend):
    """Reads an object through its mirror stub: ranged GETs into the caller's memory.

    Its descriptor is the stub's (a local file), so a load's identity checks work as for
    a local file: the mirror rewrites the stub when the object changes. With ``keep`` in
    the stub, every range is also written to ``<file>.part-…`` beside it, and a load that
    covered the whole object renames that into ``<file>`` (the disk tier); otherwise the
    partial file is deleted.
    """

    name = "s3"

    def __init__(self, path: str, *, block_bytes: int = RANGE_BYTES, s3: S3 | None = None):
        super().__init__(path, block_bytes=max(block_bytes, RANGE_BYTES))
        self.ref, self.head, keep = read_stub(path)
        self.size = self.ref.size
        self.s3 = s3 or default_s3()
        self._copy = _DiskCopy(path[: -len(REMOTE_SUFFIX)], self.ref, self.head) if keep else None

    def _open(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def _pread(self, dest: memoryview, offset: int) -> int:
        got = self.s3.read_range(self.ref, offset, dest)
        if self._copy is not None and got:
            self._copy.write(offset, dest[:got])
        return got

    def close(self) -> None:
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.finish(self.path)
        super().close()


class _DiskCopy:
    """The disk tier's copy of one object, written by the reader threads as ranges land."""

    def __init__(self, final: str, ref: ObjectRef, head: bytes):
        self.final = final
        self.ref = ref
        self._lock = threading.Lock()
        self._covered: list[tuple[int, int]] = []
        self.tmp = f"{final}.part-{os.getpid()}-{random.getrandbits(32):08x}"
        self.fd = -1
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(self.fd, ref.size)
            self.write(0, memoryview(head))
        except OSError as e:
            log.warning("%s: no disk copy this time (%s)", final, e)
            self._drop()

    def write(self, offset: int, data: memoryview) -> None:
        if self.fd < 0:
            return
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], offset + done)
        except OSError as e:
            log.warning("%s: disk copy stopped (%s); the load goes on", self.final, e)
            with self._lock:
                self._drop()
            return
        with self._lock:
            self._covered.append((offset, offset + len(data)))

    def finish(self, stub: str) -> None:
        with self._lock:
            if self.fd < 0:
                return
            complete = _covers(self._covered, self.ref.size)
            try:
                current = read_stub(stub)[0] == self.ref
            except CheckpointError:
                current = False
            if not (complete and current):
                self._drop()
                return
            try:
                os.fsync(self.fd)
                os.close(self.fd)
                self.fd = -1
                os.replace(self.tmp, self.final)
                _fsync_dir(os.path.dirname(self.final))
                log.info("%s: kept on disk (%d bytes)", self.final, self.ref.size)
            except OSError as e:
                log.warning("%s: could not keep the disk copy (%s)", self.final, e)
                self._drop()

    def _drop(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        unlink_missing(self.tmp)


def _covers(spans: list[tuple[int, int]], size: int) -> bool:
    end = 0
    for a, b in sorted(spans):
        if a > end:
            return False
        end = max(end, b)
    return end >= size


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` under a temporary name, renamed into place when complete."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".nostall-", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_missing(tmp)
        raise


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def unlink_missing(path: str) -> None:
    """Remove ``path``; nothing to do if it is not there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
