"""Session fixtures for the assemble tests."""

from __future__ import annotations

import pytest

from assemble_support import SPECS, Saved, save_model


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Saved]:
    """Every tiny model, saved once per session; 'flux_sharded' is FLUX in several files."""
    root = tmp_path_factory.mktemp("models")
    saved = {name: save_model(name, root / name) for name in SPECS}
    saved["flux_sharded"] = save_model("flux", root / "flux_sharded", max_shard_size="20KB")
    return saved
