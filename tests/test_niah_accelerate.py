"""NIAH sweeps sharded over processes with accelerate, and ``load(..., device_map=...)``.

The acceptance test launches ``mmaccel niah`` on micro-lm in two CPU processes with ``accelerate launch`` and checks
that the merged files equal a one-process run's on every deterministic field (timings differ). On a machine without
CUDA, ``accelerate launch --num_processes 2`` (plain or ``--cpu``) starts one process; ``--multi_gpu`` starts two
through torchrun, which find each other over gloo (:func:`mmaccel.eval.niah.process_state`).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmaccel.cli import main
from mmaccel.eval.niah import run_niah, shard_cells, shard_dir
from mmaccel.models import load

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ["--model", "micro-lm", "--chat-template", "off", "--methods", "full", "snapkv:budget=256", "--lengths",
         "512", "1024", "--depths", "0", "0.5", "1", "--trials", "1", "--threads", "1", "--warmup", "0",
         "--no-progress"]
# What must not depend on how the cells were spread: everything but timings, memory peaks and the machine's load.
CELL_FIELDS = ("method", "status", "error", "output_text", "prompt_tokens", "new_tokens", "kv_cache_bytes_prefill",
               "kv_cache_bytes_final", "device", "dtype", "threads", "extra")
ACCURACY_FIELDS = ("accuracy", "accuracy_contains", "n", "failed")


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]


def _cells(records: list[dict]) -> list[tuple]:
    def stable(r, k):  # extra's timings of a shared prefill ("shared_prefill_s", ...) vary like every timing
        return {n: v for n, v in r[k].items() if not n.endswith("_s")} if k == "extra" else r[k]

    return [tuple(json.dumps(stable(r, k), sort_keys=True) for k in CELL_FIELDS) for r in records]


def _accuracy_table(summary: dict) -> dict:
    """Per method: overall, per length (with the K/V ratio) and per cell accuracy, counts and failures."""
    table = {}
    for label, m in summary["methods"].items():
        table[label] = {
            "all": [m[k] for k in ACCURACY_FIELDS],
            "by_length": [[row["length"], row["kv_ratio_prefill"], *(row[k] for k in ACCURACY_FIELDS)]
                          for row in m["by_length"]],
            "cells": [[c["length"], c["depth"], *(c[k] for k in ACCURACY_FIELDS)] for c in m["cells"]],
        }
    return table


# ---------------------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("n_proc", [1, 2, 3, 5])
def test_shard_cells_gives_cell_i_to_process_i_mod_n_and_every_cell_once(n_proc):
    cells = [(m, s) for m in range(2) for s in range(6)]  # 2 methods x 6 prompts, method-major
    shards = [shard_cells(cells, n_proc, k) for k in range(n_proc)]
    for k, shard in enumerate(shards):
        assert shard == [c for i, c in enumerate(cells) if i % n_proc == k]
    flat = [c for shard in shards for c in shard]
    assert sorted(flat) == sorted(cells) and len(flat) == len(cells)
    # balanced to within one cell
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shard_cells_two_processes_split_each_method_over_both():
    cells = [(m, s) for m in range(2) for s in range(6)]
    assert shard_cells(cells, 2, 0) == [(0, 0), (0, 2), (0, 4), (1, 0), (1, 2), (1, 4)]
    assert shard_cells(cells, 2, 1) == [(0, 1), (0, 3), (0, 5), (1, 1), (1, 3), (1, 5)]
    assert shard_cells(cells, 20, 15) == []  # more processes than cells: some run nothing


@pytest.mark.parametrize("n_proc, index", [(0, 0), (2, 2), (2, -1)])
def test_shard_cells_rejects_a_process_outside_the_launch(n_proc, index):
    with pytest.raises(ValueError, match="process_index must be in"):
        shard_cells([1, 2, 3], n_proc, index)


class FakeState(SimpleNamespace):
    """The part of ``accelerate.PartialState`` that run_niah uses, for one process of a launch run in turn."""

    def wait_for_everyone(self):
        self.waited = True


@pytest.fixture(scope="module")
def micro_lm():
    return load("micro-lm", device="cpu")


@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
def test_run_niah_shards_merge_in_the_single_process_order(micro_lm, tmp_path, monkeypatch):
    from mmaccel.eval import niah

    model, tok = micro_lm
    args = (model, tok, ["full", "streaming:window=128"], [256, 384], [0.0, 1.0])
    hay = tmp_path / "hay.txt"  # a small haystack: the built-in prose takes seconds to tokenize, three times here
    hay.write_text(" ".join(f"The {w} river runs past the {v} hill near the old mill." for w in
                            ("red", "green", "slow", "wide", "cold") for v in ("north", "south", "east", "west")) * 12)
    kw = {"trials": 1, "max_new_tokens": 8, "warmup": 1, "progress": False, "chat_template": "off",
          "shared_prefill": False, "haystack": hay}  # every method through generate_measured (the spy counts warm-ups)
    one = run_niah(*args, out_dir=tmp_path / "one", **kw)
    warmups = []
    measured = niah.generate_measured

    def spy(*a, **k):
        warmups.append((k["label"], k["warmup"]))
        return measured(*a, **k)

    monkeypatch.setattr(niah, "generate_measured", spy)
    # the non-main process finishes first; the main one then merges both shards. (Run one after the other here, the
    # main one sees the worker's shard: resume=True keeps it; in a launch both check the folder before a barrier.)
    worker = run_niah(*args, out_dir=tmp_path / "two", state=FakeState(num_processes=2, process_index=1,
                                                                        is_main_process=False), **kw)
    chief = run_niah(*args, out_dir=tmp_path / "two", state=FakeState(num_processes=2, process_index=0,
                                                                       is_main_process=True), resume=True, **kw)
    # the warm-up stays per method per process: each process warms up on its first cell of each method; methods are
    # interleaved per prompt, their order rotated per prompt, and the units dealt round-robin
    full, stream = "full", "streaming:window=128"
    assert warmups == [(stream, 1), (full, 1), (stream, 0), (full, 0), (full, 1), (stream, 1), (full, 0), (stream, 0)]
    assert (worker.process_index, worker.num_processes, len(worker.records)) == (1, 2, 4)
    assert worker.out_dir == shard_dir(tmp_path / "two", 1, 2) and not worker.heatmaps
    assert (chief.process_index, chief.num_processes, len(chief.records)) == (0, 2, 8)
    # the merged file is in cell order; a one-process file in the order the cells ran (interleaved)
    assert _cells(_records(tmp_path / "two")) == _cells(one.records)
    assert sorted(_cells(_records(tmp_path / "one"))) == sorted(_cells(one.records))
    merged = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert _accuracy_table(merged) == _accuracy_table(one.summary)
    assert {k: v for k, v in merged["config"].items() if k != "shards"} == one.summary["config"]
    assert sorted(p.name for p in (tmp_path / "two").glob("heatmap_*.png")) == sorted(one.heatmaps[label].name
                                                                                        for label in one.heatmaps)
    # round-robin over the interleaved units: process 1 got the odd ones, one method per prompt
    assert [(r["method"], r["extra"]["length"], r["extra"]["depth"]) for r in worker.records] == [
        (stream, 256, 0.0), (full, 256, 1.0), (stream, 384, 0.0), (full, 384, 1.0)]


def test_run_niah_sharded_errors(micro_lm, tmp_path):
    model, tok = micro_lm
    state = FakeState(num_processes=2, process_index=0, is_main_process=True)
    with pytest.raises(ValueError, match="needs out_dir"):
        run_niah(model, tok, ["full"], [256], [0.5], max_new_tokens=2, warmup=0, progress=False, state=state)
    # the main process finds a shard that does not hold the other cells (here: the other process never ran)
    (shard_dir(tmp_path, 1, 2)).mkdir(parents=True)
    (shard_dir(tmp_path, 1, 2) / "results.jsonl").write_text("")
    with pytest.raises(RuntimeError, match="hold no record of 1 of 2 cells"):
        run_niah(model, tok, ["full"], [256], [0.0, 1.0], max_new_tokens=2, warmup=0, progress=False, state=state,
                 out_dir=tmp_path, chat_template="off", resume=True)


# ------------------------------------------------------------------------------------------------- acceptance
@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
@pytest.mark.timeout(600)
def test_accelerate_launch_two_cpu_processes_give_the_one_process_summary(capsys, tmp_path):
    """Budget: about 60 s on an idle 2-core machine (process start-up dominates), several times that under load."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "0", "-m", "mmaccel", "niah", *SWEEP, "--out", str(tmp_path / "two")]
    start = time.perf_counter()
    proc = subprocess.Popen(launch, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the one-process sweep runs here meanwhile (the same CLI, in this process)
    assert main(["niah", *SWEEP, "--out", str(tmp_path / "one")]) == 0
    one_out = capsys.readouterr().out
    out, err = proc.communicate(timeout=540)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, err[-4000:]

    two = tmp_path / "two"
    for k in range(2):
        assert len(_records(shard_dir(two, k, 2))) == 6
    assert {p.name for p in two.iterdir()} == {p.name for p in (tmp_path / "one").iterdir()} | {"shard-0-of-2",
                                                                                               "shard-1-of-2"}
    a, b = _records(tmp_path / "one"), _records(two)
    assert len(a) == 12 and sorted(_cells(a)) == sorted(_cells(b))
    assert all(r["threads"] == 1 and r["device"] == "cpu" for r in b)
    sa = json.loads((tmp_path / "one" / "summary.json").read_text())
    sb = json.loads((two / "summary.json").read_text())
    assert _accuracy_table(sa) == _accuracy_table(sb)
    assert sb["config"]["shards"] == [str(shard_dir(two, k, 2)) for k in range(2)]
    # the main process alone prints the table, the same as one process's (timing columns aside)
    assert out.count("| full | all |") == 1 and "split over 2 processes" in out
    rows = [line.split("|")[1:7] for line in one_out.splitlines() if line.startswith("| ")]
    assert rows == [line.split("|")[1:7] for line in out.splitlines() if line.startswith("| ")]
    print(f"two-process launch and one-process sweep: {elapsed:.0f} s")


# -------------------------------------------------------------------------------------------------- device_map
def test_load_passes_device_map_to_from_pretrained_and_keeps_the_placement(monkeypatch, micro_lm):
    import transformers

    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    mapped, _ = load("micro-lm", device_map={"": "cpu"})
    plain, _ = micro_lm
    assert seen == [{"": "cpu"}] and not mapped.training and mapped.device.type == "cpu"
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.equal(mapped(ids).logits, plain(ids).logits)
