"""mmaccel.eval.ruler.merge_ruler: sweeps of other methods on the same samples merge with `full` counted once, a
running sweep's torn last line skipped, and the samples order index-major so that a sweep cut short covers every
task."""
import gzip
import json

import pytest

from mmaccel.eval.ruler import merge_ruler


def _rec(method, sample, mode, score, kv):
    task = sample.split("/")[0]
    return {"cell_id": f"{method}|{sample}|{mode}", "method": method, "method_name": method.split(":")[0],
            "status": "ok", "kv_cache_bytes_prefill": kv, "peak_memory_bytes": None, "ttft_s": 1.0, "decode_s": 1.0,
            "new_tokens": 3, "extra": {"task": task, "length": 4096, "mode": mode, "sample": sample, "score": score}}


def _sweep(folder, method, scores, config=None):
    folder.mkdir()
    samples = ["vt/L=4096/i=0", "cwe/L=4096/i=0"]
    recs = [_rec("full", s, "aware", 1.0, 100) for s in samples]
    recs += [_rec(method, s, "aware", sc, 25) for s, sc in zip(samples, scores)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"torn', encoding="utf-8")
    cfg = {"methods": ["full", method], "seed": 0, "chat_template": True, "haystack": "builtin", "qa_file": None,
           **(config or {})}
    (folder / "sweep.json").write_text(json.dumps({"config": cfg, "cells": [r["cell_id"] for r in recs]}))


def test_merge_counts_full_once_and_writes_the_plots(tmp_path):
    _sweep(tmp_path / "a", "snapkv:ratio=0.25", [0.0, 0.5])
    _sweep(tmp_path / "b", "kvzip:ratio=0.25", [1.0, 1.0])
    res = merge_ruler([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    methods = res.summary["methods"]
    assert methods["full"]["aware"]["accuracy"] == 1.0
    assert methods["snapkv:ratio=0.25"]["aware"] == {"accuracy": 0.25, "kv_bytes_ratio": 0.25, "tasks": 2}
    assert methods["kvzip:ratio=0.25"]["aware"]["accuracy"] == 1.0
    full_cells = [c for c in res.summary["cells"] if c["method"] == "full"]
    assert [c["n"] for c in full_cells] == [1, 1]  # not 2: the second folder's full is the same cell
    assert res.summary["sweep"] == {"expected": 6, "found": 6, "failed": 0, "complete": True}
    assert res.summary["config"]["methods"] == ["full", "snapkv:ratio=0.25", "kvzip:ratio=0.25"]
    lines = gzip.decompress((tmp_path / "m" / "results.jsonl.gz").read_bytes()).decode().splitlines()
    assert len(lines) == 6
    assert {p.name for p in (tmp_path / "m").glob("*.png")} == {"heatmap_aware_4096.png", "pareto.png"}


def test_merge_refuses_other_samples_and_its_own_folder(tmp_path):
    _sweep(tmp_path / "a", "snapkv:ratio=0.25", [0.0, 0.5])
    _sweep(tmp_path / "b", "kvzip:ratio=0.25", [1.0, 1.0], config={"seed": 5})
    with pytest.raises(ValueError, match="different samples"):
        merge_ruler([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    with pytest.raises(ValueError, match="one of the folders merged"):
        merge_ruler([tmp_path / "a"], tmp_path / "a")


def test_samples_are_index_major(monkeypatch):
    from mmaccel.eval import ruler

    monkeypatch.setattr(ruler, "make_ruler_sample", lambda tok, t, length, seed, **kw: (t, length, seed))
    keys = list(ruler.build_samples(None, ["vt", "cwe"], [4096], 2, seed=10))
    assert keys == ["vt/L=4096/i=0", "cwe/L=4096/i=0", "vt/L=4096/i=1", "cwe/L=4096/i=1"]
