"""resolve_model_class / read_config: the right class, or a CheckpointError naming the file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from nostall.assemble import build_empty, read_config, resolve_model_class
from nostall.errors import CheckpointError, ModelMismatchError

from assemble_support import Saved, diffusers


@pytest.mark.parametrize("name", ["flux", "unet", "vae", "wan_vae", "t5", "clip"])
def test_resolves_the_saved_class(saved_models: dict[str, Saved], name: str) -> None:
    saved = saved_models[name]
    assert resolve_model_class(saved.folder) is saved.cls
    assert resolve_model_class(saved.folder / "config.json") is saved.cls


def _write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(text)
    return path


BAD_CONFIGS = {
    "not json": ("{'_class_name': ", "not valid JSON"),
    # json.loads raises RecursionError and a bare ValueError for these two.
    "nested too deep": ("[" * 100_000 + "]" * 100_000, "nests JSON arrays or objects deeper"),
    "integer too long": ('{"in_channels": ' + "4" * 5000 + "}", "integer literal longer than"),
    "not an object": ("[1, 2]", "JSON object"),
    "no class": (json.dumps({"in_channels": 4}), "names no model class"),
    "unknown diffusers class": (json.dumps({"_class_name": "NoSuchModel"}), "NoSuchModel"),
    "unknown transformers class": (json.dumps({"architectures": ["NoSuchLM"]}), "NoSuchLM"),
    "class name not a string": (json.dumps({"_class_name": ["A"]}), "must be a string"),
    "architectures not names": (json.dumps({"architectures": [3]}), "list of class names"),
    "not a model class": (json.dumps({"_class_name": "DDIMScheduler"}), "DDIMScheduler"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_raises_checkpoint_error(tmp_path: Path, case: str) -> None:
    text, needle = BAD_CONFIGS[case]
    path = _write(tmp_path / "model", text)
    with pytest.raises(CheckpointError, match=re.escape(needle)) as info:
        resolve_model_class(tmp_path / "model")
    assert not isinstance(info.value, ModelMismatchError)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


def test_missing_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=re.escape("no config.json")) as info:
        resolve_model_class(tmp_path)
    assert info.value.path == str(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=re.escape("no config.json")):
        read_config(tmp_path / "absent")


def test_config_that_does_not_construct(tmp_path: Path) -> None:
    # GroupNorm(3 groups, 8 channels) raises inside AutoencoderKL.__init__.
    config = {
        "_class_name": "AutoencoderKL",
        "block_out_channels": [8],
        "down_block_types": ["DownEncoderBlock2D"],
        "up_block_types": ["UpDecoderBlock2D"],
        "norm_num_groups": 3,
    }
    path = _write(tmp_path / "vae", json.dumps(config))
    cls = resolve_model_class(tmp_path / "vae")
    assert cls is diffusers.AutoencoderKL
    with pytest.raises(CheckpointError, match="does not construct AutoencoderKL") as info:
        build_empty(cls, tmp_path / "vae")
    assert info.value.path == str(path)
    assert info.value.__cause__ is not None


@pytest.mark.timeout(10)
def test_fifo_config_is_refused_without_blocking(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    os.mkfifo(folder / "config.json")  # reading it would wait forever for a writer
    with pytest.raises(CheckpointError, match="FIFO") as info:
        read_config(folder)
    assert info.value.path == str(folder / "config.json")
    with pytest.raises(CheckpointError, match="FIFO"):
        resolve_model_class(folder / "config.json")


@pytest.mark.timeout(10)
@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_device_config_is_refused_without_reading(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").symlink_to("/dev/zero")  # would be read forever
    with pytest.raises(CheckpointError, match="character device") as info:
        read_config(folder)
    assert info.value.path == str(folder / "config.json")
