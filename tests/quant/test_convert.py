"""``nostall.quantize``: FP8 conversion of files, shards, components and pipelines (CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nostall
from nostall.errors import ArgumentError, CheckpointError
from nostall.quant import convert as convert_mod
from nostall.quant.fp8 import METADATA_KEY, dequantize
from nostall.store import resolve


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    return {
        "blocks.0.attn.to_q.weight": rnd(64, 32),
        "blocks.0.attn.to_q.bias": rnd(64),
        "blocks.0.norm.weight": rnd(32),
        "blocks.0.ff.weight": rnd(48, 20),  # 20 is not a multiple of 16
        "blocks.0.ff2.weight": rnd(32, 48, dtype=torch.float32),
        "x_embedder.weight": rnd(32, 16),  # first projection: skip list
        "embed_tokens.weight": rnd(128, 32),  # embedding: skip list
        "conv.weight": rnd(8, 4, 3, 3),  # not 2-D
        "steps": torch.arange(4),  # integer
    }


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


@pytest.fixture
def src_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt", "origin": "test"})
    return path


def test_a_file_converts_linear_weights_and_keeps_the_rest(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    seen = []
    report = nostall.quantize(src_file, out, progress=lambda d, t: seen.append((d, t)))
    src, got = load_file(str(src_file)), load_file(str(out))
    q = {"blocks.0.attn.to_q.weight", "blocks.0.ff2.weight"}
    assert report.quantized == 2 and report.kept == len(src) - 2
    for name, t in src.items():
        if name in q:
            assert got[name].dtype == torch.float8_e4m3fn
            scale = got[name + "_scale"]
            assert scale.dtype == torch.float32 and scale.shape == (t.shape[0],)
            assert _sqnr(t, dequantize(got[name], scale, t.dtype)) > 25
        else:
            assert torch.equal(got[name], t), name
            assert name + "_scale" not in got
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["origin"] == "test"
    scheme = json.loads(meta[METADATA_KEY])
    assert scheme["weight_dtype"] == "float8_e4m3fn" and scheme["quantized"] == 2
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] == report.bytes_in
    assert report.kept_reasons["skip list"] == 2
    assert not os.path.exists(str(out) + ".partial")


def test_row_scales_map_each_rows_max_to_448(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    nostall.quantize(src_file, out)
    got = load_file(str(out))
    w = load_file(str(src_file))["blocks.0.attn.to_q.weight"].float()
    scale = got["blocks.0.attn.to_q.weight_scale"]
    assert torch.allclose(scale * 448, w.abs().amax(dim=1))
    assert got["blocks.0.attn.to_q.weight"].float().abs().amax(dim=1).eq(448).all()


def test_the_skip_list_can_grow_and_be_dropped(src_file, tmp_path):
    more = nostall.quantize(src_file, tmp_path / "a.safetensors", skip=[r"attn\."])
    assert more.quantized == 1
    none = nostall.quantize(src_file, tmp_path / "b.safetensors", default_skip=False)
    assert none.quantized == 4  # + x_embedder and embed_tokens


def test_tensors_are_read_and_written_one_at_a_time(src_file, tmp_path, monkeypatch):
    events = []
    real_write = convert_mod.StreamWriter.write

    def write(self, name, tensor):
        events.append(("write", name))
        return real_write(self, name, tensor)

    monkeypatch.setattr(convert_mod.StreamWriter, "write", write)
    real_quant = convert_mod.quantize_weight
    monkeypatch.setattr(
        convert_mod, "quantize_weight", lambda w: events.append(("quant", None)) or real_quant(w)
    )
    nostall.quantize(src_file, tmp_path / "fp8.safetensors")
    # never two tensors read ahead of the writer: a conversion is followed by its writes
    for i, (kind, _) in enumerate(events):
        if kind == "quant":
            assert events[i + 1][0] == "write" and events[i + 2][0] == "write"


def test_a_failure_leaves_nothing_behind(src_file, tmp_path, monkeypatch):
    calls = []

    def boom(w):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return convert_mod.fp8_quantize(w)

    monkeypatch.setattr(convert_mod, "fp8_quantize", convert_mod.quantize_weight, raising=False)
    monkeypatch.setattr(convert_mod, "quantize_weight", boom)
    out = tmp_path / "fp8.safetensors"
    with pytest.raises(RuntimeError, match="disk on fire"):
        nostall.quantize(src_file, out)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_sharded_checkpoints_keep_their_shards_and_index(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    t = _tensors()
    names = sorted(t)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(src / shard))
        weight_map.update({k: shard for k in keys})
    with open(src / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": weight_map}, f)
    (src / "config.json").write_text("{}")
    dst = tmp_path / "dst"
    nostall.quantize(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    q = "blocks.0.attn.to_q.weight"
    assert index["weight_map"][q + "_scale"] == index["weight_map"][q]
    assert index["metadata"]["total_size"] == sum(os.path.getsize(dst / s) for s in shards)
    assert (dst / "config.json").read_text() == "{}"
    ckpt = resolve(dst)  # loads where the input loaded
    assert len(ckpt.files) == 2
    assert load_file(str(dst / index["weight_map"][q]))[q].dtype == torch.float8_e4m3fn


def test_a_pipeline_folder_converts_every_component(tmp_path):
    from nostall.synthetic import write_store

    store = write_store(tmp_path / "store", ("flux",))
    dst = tmp_path / "flux-fp8"
    report = nostall.quantize(store["flux"], dst)
    assert report.quantized > 0
    src_files = sorted(
        os.path.relpath(os.path.join(d, f), store["flux"])
        for d, _, fs in os.walk(store["flux"])
        for f in fs
    )
    dst_files = sorted(
        os.path.relpath(os.path.join(d, f), dst) for d, _, fs in os.walk(dst) for f in fs
    )
    assert dst_files == src_files  # same layout, same names
    tr = resolve(dst / "transformer").files[0].path
    with safe_open(tr, framework="pt") as f:
        assert METADATA_KEY in f.metadata()
    tok = "tokenizer/tokenizer_config.json"
    if os.path.exists(os.path.join(store["flux"], tok)):
        with open(os.path.join(store["flux"], tok), "rb") as f:
            assert (dst / tok).read_bytes() == f.read()
    assert not os.path.exists(str(dst) + ".partial")


# fmt: off
@pytest.mark.parametrize(
    "make, error, says",
    [
        (
            lambda p: save_file({"w": torch.zeros(16, 16, dtype=torch.float8_e4m3fn)}, p),
            CheckpointError,
            "already holds FP8",
        ),
        (lambda p: save_file({"ids": torch.arange(16)}, p), CheckpointError, "integer"),
        (
            lambda p: save_file({"norm.weight": torch.ones(16)}, p),
            CheckpointError,
            "no linear weight",
        ),
        (
            lambda p: save_file(
                {"a.weight": torch.ones(16, 16), "a.weight_scale": torch.ones(16)}, p
            ),
            CheckpointError,
            "does not know",
        ),
    ],
)
def test_inputs_it_cannot_convert_are_typed_errors(tmp_path, make, error, says):
    src = str(tmp_path / "in.safetensors")
    make(src)
    with pytest.raises(error, match=says) as e:
        nostall.quantize(src, tmp_path / "out.safetensors")
    assert isinstance(e.value, nostall.NostallError)
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_a_converted_checkpoint_is_refused(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    nostall.quantize(src_file, out)
    with pytest.raises(CheckpointError, match="already"):
        nostall.quantize(out, tmp_path / "again.safetensors")


def test_outputs_it_may_not_write_are_argument_errors(src_file, tmp_path):
    out = tmp_path / "fp8.safetensors"
    nostall.quantize(src_file, out)
    with pytest.raises(ArgumentError, match="exists"):
        nostall.quantize(src_file, out)
    nostall.quantize(src_file, out, overwrite=True)
    with pytest.raises(ArgumentError, match=r"\.safetensors"):
        nostall.quantize(src_file, tmp_path / "fp8.bin")
    with pytest.raises(ArgumentError, match="overlaps"):
        nostall.quantize(tmp_path, tmp_path / "inside")
    with pytest.raises(ArgumentError, match="does not exist"):
        nostall.quantize(src_file, tmp_path / "no" / "such.safetensors")


# ---- bad input and faults ----------------------------------------------------------------


def _component(folder):
    """A diffusers-style component folder: config.json and one weights file."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file(_tensors(), str(folder / "model.safetensors"))
    return folder


def _snapshot(root):
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs
    )


def test_an_output_inside_the_input_through_a_symlink_is_refused(tmp_path):
    src = _component(tmp_path / "src")
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    before = _snapshot(tmp_path)
    with pytest.raises(ArgumentError, match="overlaps") as e:
        nostall.quantize(src, tmp_path / "link" / "out")
    assert str(tmp_path / "link" / "out") in str(e.value)
    assert _snapshot(tmp_path) == before  # nothing written into the input


def test_an_input_reached_through_a_symlink_into_the_output_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _component(out / "comp")
    (tmp_path / "in").symlink_to(out / "comp", target_is_directory=True)
    before = _snapshot(tmp_path)
    # with overwrite, the old code removed `out` (and so the input) after converting
    with pytest.raises(ArgumentError, match="overlaps"):
        nostall.quantize(tmp_path / "in", out, overwrite=True)
    assert _snapshot(tmp_path) == before


def test_an_output_that_is_a_symlink_to_the_input_file_is_refused(src_file, tmp_path):
    (tmp_path / "link.safetensors").symlink_to(src_file)
    with pytest.raises(ArgumentError, match="overlaps"):
        nostall.quantize(src_file, tmp_path / "link.safetensors", overwrite=True)
    assert load_file(str(src_file)).keys() == _tensors().keys()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_an_existing_partial_is_refused_and_left_alone(tmp_path, kind):
    if kind == "file":
        src = tmp_path / "model.safetensors"
        save_file(_tensors(), str(src))
        out = tmp_path / "fp8.safetensors"
        partial = tmp_path / "fp8.safetensors.partial"
        partial.write_text("mine")
        mine = partial
    else:
        src = _component(tmp_path / "src")
        out = tmp_path / "fp8"
        partial = tmp_path / "fp8.partial"
        partial.mkdir()
        mine = partial / "notes.txt"
        mine.write_text("mine")
    with pytest.raises(ArgumentError, match="move or delete it") as e:
        nostall.quantize(src, out)
    assert str(partial) in str(e.value)
    assert mine.read_text() == "mine" and not out.exists()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_partial_that_appears_after_the_checks_is_not_overwritten(tmp_path, kind, monkeypatch):
    # Another run creating <dst>.partial between the checks and the write: the exclusive
    # create (O_EXCL, os.mkdir) refuses it instead of truncating or deleting it.
    if kind == "file":
        src, out = tmp_path / "model.safetensors", tmp_path / "fp8.safetensors"
        save_file(_tensors(), str(src))
    else:
        src, out = _component(tmp_path / "src"), tmp_path / "fp8"
    partial = tmp_path / (out.name + ".partial")
    real_check = convert_mod._check_target

    def check_then_race(*args):
        real_check(*args)
        partial.write_text("theirs")

    monkeypatch.setattr(convert_mod, "_check_target", check_then_race)
    with pytest.raises(ArgumentError, match="move or delete it"):
        nostall.quantize(src, out)
    assert partial.read_text() == "theirs" and not out.exists()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_the_output_is_written_under_a_temporary_name_and_renamed(tmp_path, kind):
    if kind == "file":
        src, out = tmp_path / "model.safetensors", tmp_path / "fp8.safetensors"
        save_file(_tensors(), str(src))
    else:
        src, out = _component(tmp_path / "src"), tmp_path / "fp8"
    partial = tmp_path / (out.name + ".partial")
    seen = []
    nostall.quantize(
        src, out, progress=lambda d, t: seen.append((d, out.exists(), partial.exists()))
    )
    mid = [(o, p) for d, o, p in seen if d > 0]
    assert mid and all(p and not o for o, p in mid)  # mid-write: only the .partial exists
    assert out.exists() and not partial.exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "name, index",
    [
        ("blocks.0.attn.to_q.weight", (0, 0)),  # quantized: first element
        ("blocks.0.ff2.weight", (31, 47)),  # quantized, fp32: last element
        ("blocks.0.attn.to_q.bias", (37,)),  # kept
        ("embed_tokens.weight", (100, 5)),  # kept (skip list)
    ],
)
def test_non_finite_weights_are_refused_and_nothing_is_written(tmp_path, name, index, value):
    t = _tensors()
    t[name][index] = value
    t[name][1] = value  # more bad values (a whole row for 2-D tensors)
    bad = int((~torch.isfinite(t[name])).sum())
    assert bad > 1
    src = tmp_path / "model.safetensors"
    save_file(t, str(src))
    out = tmp_path / "fp8.safetensors"
    with pytest.raises(CheckpointError, match="not finite") as e:
        nostall.quantize(src, out)
    assert e.value.path == str(src) and e.value.tensor == name
    assert f"{bad} of {t[name].numel()} values" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_non_finite_weights_in_a_folder_leave_no_partial_folder(tmp_path):
    src = _component(tmp_path / "src")
    t = _tensors()
    t["blocks.0.ff2.weight"][3, 3] = float("nan")
    save_file(t, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 of 1536 values are not finite \(1 NaN"):
        nostall.quantize(src, tmp_path / "fp8")
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize(
    "skip, says",
    [
        (["("], r"skip pattern '\(' is not a valid regular expression \(missing \)"),
        ([r"attn\.", "[a-"], r"'\[a-' is not a valid regular expression"),
        ([1], "is a int, not a string"),
        ([b"attn"], "is a bytes, not a string"),
        ("attn", r"a list of regular expressions, not str 'attn'; write skip=\['attn'\]"),
        (None, "a list of regular expressions, not NoneType"),
    ],
)
def test_bad_skip_patterns_are_refused_before_anything_is_read(tmp_path, skip, says):
    # The input does not exist: reading anything would raise CheckpointError instead.
    with pytest.raises(ArgumentError, match=says):
        nostall.quantize(tmp_path / "missing.safetensors", tmp_path / "out.safetensors", skip=skip)
    assert os.listdir(tmp_path) == []


def test_a_failed_copy_is_a_typed_error_and_leaves_nothing(tmp_path, monkeypatch):
    import errno
    import shutil

    src = _component(tmp_path / "src")

    def full(a, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), a, None, b)

    monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(CheckpointError, match=r"No space left on device \(ENOSPC\)") as e:
        nostall.quantize(src, tmp_path / "fp8")
    assert e.value.path == str(tmp_path / "fp8.partial" / "config.json")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_sigterm_is_handled_only_during_the_write_and_restored(src_file, tmp_path):
    import signal
    import threading

    during = []
    nostall.quantize(
        src_file,
        tmp_path / "a.safetensors",
        progress=lambda d, t: during.append(signal.getsignal(signal.SIGTERM)),
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert during[-1] is not signal.SIG_DFL and callable(during[-1])

    def mine(signum, frame):  # an application's own handler is its choice: left alone
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        during.clear()
        nostall.quantize(
            src_file,
            tmp_path / "b.safetensors",
            progress=lambda d, t: during.append(signal.getsignal(signal.SIGTERM)),
        )
        assert set(during) == {mine} and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    # off the main thread, signal.signal would raise ValueError: no handler is installed
    errors = []
    worker = threading.Thread(
        target=lambda: errors.append(nostall.quantize(src_file, tmp_path / "c.safetensors"))
    )
    worker.start()
    worker.join()
    assert (tmp_path / "c.safetensors").exists()


def test_a_pipelines_vae_is_copied_as_it_is(tmp_path):
    import filecmp

    from nostall.synthetic import write_store

    flux = write_store(tmp_path / "s", ("flux",))["flux"]
    report = nostall.quantize(flux, tmp_path / "flux8")
    vae = [f for f in os.listdir(os.path.join(flux, "vae")) if f.endswith(".safetensors")]
    assert vae and all(
        filecmp.cmp(os.path.join(flux, "vae", f), tmp_path / "flux8" / "vae" / f, shallow=False)
        for f in vae
    )
    assert not any("/vae/" in f for f in report.files)


def test_a_pipeline_whose_components_are_linked_folders_is_copied_whole(tmp_path):
    # a component on another disk, linked into the pipeline folder (and a link back up
    # the tree, which must not be walked around forever)
    import shutil

    from nostall.synthetic import write_store

    flux = write_store(tmp_path / "s", ("flux",))["flux"]
    linked = tmp_path / "linked"
    linked.mkdir()
    for name in os.listdir(flux):
        os.symlink(os.path.join(flux, name), linked / name)
    shutil.move(os.path.join(flux, "scheduler"), tmp_path / "elsewhere-scheduler")
    os.unlink(linked / "scheduler")
    os.symlink(tmp_path / "elsewhere-scheduler", linked / "scheduler")
    os.symlink(tmp_path / "elsewhere-scheduler", tmp_path / "elsewhere-scheduler" / "loop")
    nostall.quantize(linked, tmp_path / "flux8")
    for role in ("vae", "scheduler", "tokenizer"):
        out = tmp_path / "flux8" / role
        assert out.is_dir() and not out.is_symlink() and os.listdir(out), role
    assert (tmp_path / "flux8" / "scheduler" / "scheduler_config.json").is_file()
    nostall.ModelCache(tmp_path, device="cpu").store.entry("flux8")  # a whole pipeline
