"""``nostall synthetic``: a store of random-weight pipelines to try everything on."""

from __future__ import annotations

import json

import pytest
from cli_support import runner, usage_error

from nostall.cli import app


def test_synthetic_writes_a_store_the_other_commands_take(tmp_path):
    store = tmp_path / "store"
    result = runner.invoke(app, ["synthetic", str(store), "--pipeline", "sdxl"])
    assert result.exit_code == 0, result.output
    index = json.loads((store / "sdxl" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert "nostall switch --models" in result.output
    switched = runner.invoke(app, ["switch", "--models", str(store), "--device", "cpu", "sdxl"])
    assert switched.exit_code == 0, switched.output
    # A folder that holds files is written into only when asked; what is there is kept.
    again = runner.invoke(app, ["synthetic", str(store), "--pipeline", "sdxl"])
    usage_error(again, "already holds files; pass --overwrite")
    mtime = (store / "sdxl" / "model_index.json").stat().st_mtime_ns
    kept = runner.invoke(app, ["synthetic", str(store), "--pipeline", "sdxl", "--overwrite"])
    assert kept.exit_code == 0, kept.output
    assert (store / "sdxl" / "model_index.json").stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--size", "8k"], "Invalid value for --size: '8k' is not one of tiny, full"),
        (["--pipeline", "flux-dev"], "'flux-dev' is not one of flux, flux-b, sdxl, sd3, wan"),
        (["--device", "tpu"], "'tpu' is not a device"),
    ],
)
def test_bad_synthetic_options_are_usage_errors(tmp_path, args, says):
    result = runner.invoke(app, ["synthetic", str(tmp_path / "store"), *args])
    usage_error(result, says)
    assert not (tmp_path / "store").exists()


def test_a_file_is_not_a_store(tmp_path):
    (tmp_path / "f").write_text("")
    usage_error(runner.invoke(app, ["synthetic", str(tmp_path / "f")]), "is not a folder")
