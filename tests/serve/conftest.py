from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="package")
def store(tmp_path_factory):
    """Tiny random FLUX, SDXL, SD3 and Wan pipelines."""
    from nostall.synthetic import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("serve-store")
    write_store(folder, ("flux", "sdxl", "sd3", "wan"))
    return folder


from nostall.serve.local import BackgroundServer as Server  # noqa: E402


@pytest.fixture(scope="session")
def start_serve(fork_python):
    """:func:`nostall.serve.local.start_serve`, its ``nostall serve`` process forked by the
    conftest's ``fork_python``: a process of its own (pid, signals, exit status, its
    output on a pipe), without the ~10 s of CPU a new Python spends importing torch and
    diffusers (on 2 cores, while the other tests wait for the cores)."""
    import subprocess
    import sys
    import types

    from nostall.serve import local

    from support import CLI_MAIN

    def popen(args, *, stdout, stderr, text, env):
        assert args[:3] == [sys.executable, "-m", "nostall.cli"], args
        assert (stdout, stderr, text) == (subprocess.PIPE, subprocess.STDOUT, True)
        return fork_python(CLI_MAIN, *args[3:], stderr=subprocess.STDOUT, env=env)

    forked = types.SimpleNamespace(Popen=popen, PIPE=subprocess.PIPE, STDOUT=subprocess.STDOUT)

    def start(*args, **kw):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(local, "subprocess", forked)
            return local.start_serve(*args, **kw)

    return start


@pytest.fixture(scope="package")
def controlnets(store):
    """A tiny SDXL ControlNet under the store's controlnets/ folder."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    folder = store / "controlnets" / "edges"
    if not folder.exists():
        unet = UNet2DConditionModel.from_pretrained(str(store / "sdxl" / "unet"))
        torch.manual_seed(7)
        cn = ControlNetModel.from_unet(
            unet, conditioning_channels=3, conditioning_embedding_out_channels=(8, 16)
        )
        with torch.no_grad():
            for p in cn.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        cn.save_pretrained(str(folder))
    return folder


@pytest.fixture
def serve(store):
    """Start a worker over the tiny store on loopback: ``serve(**worker_kwargs)``."""
    from nostall.serve.app import create_app
    from nostall.serve.worker import Worker

    started = []

    def start(**kw):
        kw.setdefault("device", "cpu")
        kw.setdefault("gpu_budget", 64 << 20)
        kw.setdefault("host_budget", 64 << 20)
        worker = Worker(store, **kw)
        server = Server(create_app(worker)).__enter__()
        started.append(server)
        return server, worker

    yield start
    for s in started:
        s.__exit__(None, None, None)
