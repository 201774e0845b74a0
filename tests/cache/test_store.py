from __future__ import annotations

import json
import shutil

import pytest

from nostall.cache import Store
from nostall.errors import CheckpointError, UnknownModel


def test_scans_pipelines_and_identifies_shared_components_by_content(store):
    s = Store(store)
    assert s.names() == ["flux", "flux-b", "sd3", "sdxl", "wan"]
    a, b = s.entry("flux"), s.entry("flux-b")
    assert a.class_name == "FluxPipeline"
    roles = {c.role: c for c in a.weights}
    assert set(roles) == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    for role in ("text_encoder", "text_encoder_2", "vae"):
        assert a.components[role].digest == b.components[role].digest  # one copy in every tier
    ta, tb = a.components["transformer"], b.components["transformer"]
    assert ta.digest != tb.digest  # headers equal, weights differ: the samples tell
    assert ta.arch == tb.arch  # same architecture: the module can be shared
    assert a.components["tokenizer"].weights is False
    assert a.components["tokenizer"].digest == b.components["tokenizer"].digest
    assert s.entry("sdxl").components["unet"].arch != ta.arch


def test_a_mapping_of_names_works_too(store):
    s = Store({"my-flux": store / "flux"})
    assert s.names() == ["my-flux"]
    assert s.entry("my-flux").class_name == "FluxPipeline"
    with pytest.raises(CheckpointError, match=r"model_index\.json"):
        Store({"x": store / "flux" / "vae"})


def test_unknown_model_lists_what_exists_and_close_matches(store):
    with pytest.raises(UnknownModel, match="did you mean 'flux'") as info:
        Store(store).entry("flx")
    assert info.value.available == ["flux", "flux-b", "sd3", "sdxl", "wan"]
    assert "flux" in info.value.close


def _copy(store, tmp_path, name="flux"):
    dst = tmp_path / "s" / name
    shutil.copytree(store / name, dst)
    return dst


def test_broken_pipeline_folders_are_checkpoint_errors(store, tmp_path):
    p = _copy(store, tmp_path)
    shutil.rmtree(p / "vae")
    with pytest.raises(CheckpointError, match="vae") as info:
        Store(tmp_path / "s").entry("flux")
    assert str(p / "vae") in str(info.value)

    (p / "model_index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Store(tmp_path / "s").entry("flux")
    (p / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "X"]}))
    with pytest.raises(CheckpointError, match="_class_name"):
        Store(tmp_path / "s").entry("flux")


def test_pickled_weights_only_are_refused_with_the_fix(store, tmp_path):
    p = _copy(store, tmp_path)
    for f in (p / "vae").glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(CheckpointError, match="safetensors only"):
        Store(tmp_path / "s").entry("flux")
