from __future__ import annotations

import logging

import pytest

pytest.importorskip("diffusers")


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """Tiny random FLUX, FLUX-b (same architecture, other transformer), SDXL, SD3, Wan."""
    from nostall.synthetic import write_store

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("store")
    write_store(folder, ("flux", "flux-b", "sdxl", "sd3", "wan"))
    return folder
