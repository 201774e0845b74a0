from __future__ import annotations

import json
import shutil

import pytest

from nostall.cache import Store
from nostall.errors import CheckpointError, UnknownModel


def test_scans_pipelines_and_identifies_shared_components_by_content(store, tmp_path):
    s = Store(store, cache_dir=tmp_path)
    assert s.names() == ["flux", "flux-b", "sd3", "sdxl", "wan"]
    a, b = s.entry("flux"), s.entry("flux-b")
    assert a.class_name == "FluxPipeline"
    roles = {c.role: c for c in a.weights}
    assert set(roles) == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    # Never read: separate files share nothing, whatever their headers say.
    assert not any(c.exact for c in a.weights)
    for role in roles:
        assert a.components[role].digest != b.components[role].digest
    for name in ("flux", "flux-b"):
        s.index_files(name)
    a, b = s.entry("flux"), s.entry("flux-b")
    assert all(c.exact for c in a.weights + b.weights)
    for role in ("text_encoder", "text_encoder_2", "vae"):
        assert a.components[role].digest == b.components[role].digest  # one copy in every tier
    ta, tb = a.components["transformer"], b.components["transformer"]
    assert ta.digest != tb.digest  # headers equal, weights differ
    assert ta.arch == tb.arch  # same architecture: the module can be shared
    assert a.components["tokenizer"].weights is False
    assert a.components["tokenizer"].digest == b.components["tokenizer"].digest
    assert s.entry("sdxl").components["unet"].arch != ta.arch
    # A new process (a new Store on the same index) knows them without reading.
    again = Store(store, cache_dir=tmp_path).entry("flux-b")
    assert [c.digest for c in again.weights] == [c.digest for c in b.weights]


def _flip_one_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("change", ["one byte", "one tensor"])
def test_two_pipelines_that_differ_anywhere_are_two_components(store, tmp_path, change):
    from safetensors.torch import load_file, save_file

    from nostall.store import resolve

    root = tmp_path / "s"
    a, b = _copy(store, tmp_path, "flux"), root / "flux-x"
    shutil.copytree(a, b)
    (f,) = resolve(b / "transformer").files
    if change == "one byte":
        # Between two of the 16 blocks the old sampled digest read: an edit it missed.
        _flip_one_byte(f.path, f.data_start + (f.data_end - f.data_start) * 3 // 31 + 7)
    else:
        t = load_file(f.path)
        name = sorted(t)[len(t) // 2]
        t[name] = t[name].clone()
        t[name].view(-1)[0] += 1
        save_file(t, f.path, metadata=f.metadata)
    s = Store(root, cache_dir=tmp_path / "idx")
    for name in ("flux", "flux-x"):
        s.index_files(name)
    ea, eb = s.entry("flux"), s.entry("flux-x")
    assert ea.components["transformer"].digest != eb.components["transformer"].digest
    assert ea.components["transformer"].arch == eb.components["transformer"].arch
    assert ea.components["vae"].digest == eb.components["vae"].digest


def test_a_file_rewritten_in_place_is_a_new_component(store, tmp_path):
    _copy(store, tmp_path)
    s = Store(tmp_path / "s", cache_dir=tmp_path / "idx")
    s.index_files("flux")
    before = s.entry("flux").components["vae"]
    assert s.entry("flux") is s.entry("flux")  # unchanged: no scan
    (f,) = before.checkpoint.files
    _flip_one_byte(f.path, f.data_end - 1)  # same inode, same size
    after = s.entry("flux").components["vae"]
    assert after.digest != before.digest and not after.exact
    assert after.checkpoint.files[0].identity != f.identity


def test_index_entries_outside_the_pipeline_folder_are_refused(store, tmp_path):
    p = _copy(store, tmp_path)
    secret = tmp_path / "s" / "keys"
    secret.mkdir()
    (secret / "id_rsa").write_text("PRIVATE")
    index = json.loads((p / "model_index.json").read_text())
    for bad in ("../keys", str(secret), "a/../../keys"):
        doc = dict(index, **{bad: ["transformers", "CLIPTokenizer"]})
        (p / "model_index.json").write_text(json.dumps(doc))
        with pytest.raises(CheckpointError, match="not a folder name") as info:
            Store(tmp_path / "s", cache_dir=False).entry("flux")
        assert bad in str(info.value)


def test_dangling_symlinks_are_named(store, tmp_path):
    p = _copy(store, tmp_path)
    (p / "tokenizer" / "extra.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(CheckpointError, match="does not exist") as info:
        Store(tmp_path / "s", cache_dir=False).entry("flux")
    assert "extra.json" in str(info.value)
    (p / "tokenizer" / "extra.json").unlink()
    (p / "vae" / "weights.safetensors").symlink_to(tmp_path / "blob")
    with pytest.raises(CheckpointError, match="does not exist"):
        Store(tmp_path / "s", cache_dir=False).entry("flux")


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


def test_one_store_per_folder_is_shared_while_something_uses_it(store, tmp_path):
    import gc
    import weakref

    from nostall.errors import ArgumentError

    (tmp_path / "link").symlink_to(store, target_is_directory=True)
    a = Store.shared(store, cache_dir=tmp_path)
    a.entry("sdxl")
    assert Store.shared(tmp_path / "link", cache_dir=tmp_path) is a  # the same real folder
    assert Store.shared(store, cache_dir=tmp_path / "other") is not a  # another index
    assert Store.shared(store, variant="fp16", cache_dir=tmp_path) is not a
    assert Store.shared(a) is a
    with pytest.raises(ArgumentError, match="variant"):
        Store.shared(a, variant="fp16")
    with pytest.raises(ArgumentError, match="cache_dir"):
        Store.shared(a, cache_dir=tmp_path / "other")
    # Held weakly: once its last user lets go, the next call scans afresh.
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None
    fresh = Store.shared(store, cache_dir=tmp_path)
    assert fresh._entries == {}


def _wide_tree(root, *, folders=4, files=400):
    """A folder like /usr/lib: a few subfolders of many files, and more below them."""
    for i in range(folders):
        sub = root / f"lib{i}" / "deeper"
        sub.mkdir(parents=True)
        for j in range(files):
            (root / f"lib{i}" / f"f{j}.so").write_bytes(b"x")
        (sub / "never-read").write_bytes(b"y" * 1000)
    return root


def test_a_component_linked_to_a_large_folder_is_refused_at_once_naming_it(store, tmp_path):
    import time

    import nostall

    big = _wide_tree(tmp_path / "big")
    root = tmp_path / "s"
    p = _copy(store, tmp_path)
    shutil.rmtree(p / "tokenizer")
    (p / "tokenizer").symlink_to(big, target_is_directory=True)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="entries or more") as info:
        Store(root, cache_dir=False).entry("flux")
    assert time.perf_counter() - t0 < 1.0
    said = str(info.value)
    assert "'tokenizer'" in said and f"link to {big}" in said and str(p / "tokenizer") in said
    # A weights component linked there: no config.json, said so (not "vanished").
    (p / "tokenizer").unlink()
    shutil.copytree(store / "flux" / "tokenizer", p / "tokenizer")
    shutil.rmtree(p / "vae")
    (p / "vae").symlink_to(big, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"has no config\.json") as info:
        Store(root, cache_dir=False).entry("flux")
    assert "'vae'" in str(info.value) and f"link to {big}" in str(info.value)
    # A component linked to another pipeline's (a shared VAE) is served, as one copy;
    # a tokenizer one folder down is read, two folders down is not looked at.
    b = _copy(store, tmp_path, "flux-b")
    shutil.rmtree(b / "vae")
    (b / "vae").symlink_to(store / "flux" / "vae", target_is_directory=True)
    (b / "tokenizer" / "extra" / "deeper").mkdir(parents=True)
    (b / "tokenizer" / "extra" / "template.jinja").write_text("{{ x }}")
    (b / "tokenizer" / "extra" / "deeper" / "big.bin").write_bytes(b"z" * 1000)
    with nostall.ModelCache(root, device="cpu", cache_dir=False) as cache:
        with cache.use("flux-b") as pipe:
            assert pipe.vae is not None
        assert cache.store.entry("flux-b").components["vae"].folder == str(b / "vae")
        with pytest.raises(CheckpointError, match=r"has no config\.json"), cache.use("flux"):
            pass
    s = Store(root, cache_dir=False)
    key = s.entry("flux-b").components["tokenizer"].digest
    (b / "tokenizer" / "extra" / "deeper" / "big.bin").write_bytes(b"w" * 1000)
    assert Store(root, cache_dir=False).entry("flux-b").components["tokenizer"].digest == key
    (b / "tokenizer" / "extra" / "template.jinja").write_text("{{ y }}")
    assert s.entry("flux-b").components["tokenizer"].digest != key  # re-scanned: changed


@pytest.mark.parametrize("broken", ["no index", "dangling link"])
def test_a_folder_left_out_of_the_store_is_named_with_why(store, tmp_path, broken):
    root = tmp_path / "s"
    root.mkdir()
    shutil.copytree(store / "sdxl", root / "sdxl")
    if broken == "no index":
        shutil.copytree(store / "sdxl", root / "e")
        (root / "e" / "model_index.json").unlink()
        why = "has no model_index.json"
    else:
        (root / "e").symlink_to(tmp_path / "gone")
        why = "which does not exist"
    s = Store(root, cache_dir=False)
    assert s.names() == ["sdxl"]
    with pytest.raises(UnknownModel, match=why) as info:
        s.entry("e")
    assert info.value.left_out is not None and why in info.value.left_out
    with pytest.raises(UnknownModel) as other:
        s.entry("nothing-here")
    assert other.value.left_out is None
