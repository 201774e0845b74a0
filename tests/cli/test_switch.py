"""``nostall switch`` and ``nostall index`` on the shared tiny store."""

from __future__ import annotations

import pytest
from cli_support import runner, usage_error

from nostall.cli import app


def test_switch_prints_a_table_per_switch_and_the_tiers(tiny_store):
    result = runner.invoke(
        app, ["switch", "--models", str(tiny_store), "--device", "cpu", "flux", "sdxl", "flux"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("switch → flux on cpu") == 2
    assert "switch → sdxl on cpu" in result.output
    assert "tiers after the switches" in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--gpu-gb", "0"], "Invalid value for --gpu-gb: must be a positive number of GB, got 0"),
        (["--steps", "-1"], "'--steps': -1 is out of range; give at least 0"),
        (["--dtype", "int8"], "'int8' is not a cast target"),
        (["--device", "tpu"], "'tpu' is not a device"),
    ],
)
def test_bad_switch_options_are_usage_errors(tiny_store, args, says):
    result = runner.invoke(app, ["switch", "--models", str(tiny_store), "flux", *args])
    usage_error(result, says)


def test_index_hashes_a_store_once_and_says_what_is_shared(tiny_store, tmp_path):
    from nostall.cache import Store

    args = ["index", str(tiny_store), "--cache-dir", str(tmp_path / "idx")]
    args += ["--name", "flux", "--name", "flux-b"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hashed" in result.output and "one copy: flux/text_encoder, flux-b/text_encoder" in (
        result.output.replace("\n", " ")
    )
    s = Store(tiny_store, cache_dir=tmp_path / "idx")
    assert all(c.exact for n in ("flux", "flux-b") for c in s.entry(n).weights)
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "hashed 0.00 GB" in again.output  # nothing new
    bad = runner.invoke(app, [*args, "--name", "flx"])
    assert bad.exit_code != 0 and "did you mean 'flux'" in bad.output + str(bad.exception)


def test_switch_fuses_loras_and_says_so(tiny_store):
    pytest.importorskip("peft")
    from nostall.synthetic import write_lora

    (tiny_store / "loras").mkdir(exist_ok=True)
    write_lora(tiny_store / "flux", tiny_store / "loras" / "style.safetensors", rank=2)
    args = ["switch", "--models", str(tiny_store), "--device", "cpu", "flux"]
    result = runner.invoke(app, [*args, "--lora", "style:0.5", "--steps", "1", "--size", "32"])
    assert result.exit_code == 0, result.output
    assert "LoRAs fused: style 0.5" in result.output
    for bad, says in (("style:abc", "NAME:SCALE"), ("style:nan", "finite"),
                      ("style:1e9", "beyond")):  # fmt: skip
        out = runner.invoke(app, [*args, "--lora", bad])
        assert out.exit_code == 2 and says in out.output, out.output
    from nostall.errors import UnknownModel

    unknown = runner.invoke(app, [*args, "--lora", "stlye:1"])  # (main() prints it, one line)
    assert isinstance(unknown.exception, UnknownModel) and "did you mean style" in str(
        unknown.exception
    )


def test_switch_explain_prints_the_plan_of_a_pipeline_resident_in_part(tiny_store, tmp_path):
    from nostall.cache import ModelCache
    from nostall.cache.partial import least_pipeline_bytes

    with ModelCache(tiny_store, device="cpu", cache_dir=tmp_path) as c:
        with c.use("sdxl"):
            pass
        whole, least = c.stats().gpu_bytes, least_pipeline_bytes(c, "sdxl")
    gb = f"{(whole + least) / 2 / 1e9:.7f}"  # between the least it needs and all of it
    args = ["switch", "--models", str(tiny_store), "--device", "cpu", "--gpu-gb", gb]
    result = runner.invoke(app, [*args, "--explain", "sdxl"])
    assert result.exit_code == 0, result.output
    assert "sdxl/unet resident in part" in result.output
    assert "streamed per call" in result.output  # the switch table's note
