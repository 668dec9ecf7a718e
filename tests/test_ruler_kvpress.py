"""benchmarks/vs_kvpress.py --task ruler, the parts that need no kvpress environment: the RULER cases are the ids
`mmaccel ruler` runs, the kept counts per query mode, RULER scoring of both sides, the equal-bytes verdict."""
import math
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from mmaccel.data.ruler import make_ruler_sample
from mmaccel.eval.ruler import build_samples
from mmaccel.longctx import kv_cache_bytes

ROOT = Path(__file__).resolve().parents[1]
HAYSTACK = ROOT / "README.md"


# the script is not a package module: its functions, run by path (no __main__)
vk = SimpleNamespace(**runpy.run_path(str(ROOT / "benchmarks" / "vs_kvpress.py")))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from mmaccel.models import zoo_path

    return AutoTokenizer.from_pretrained(zoo_path("micro-lm"))  # the tokenizer alone: no weights to load


@pytest.fixture(scope="module")
def job(tok):
    return vk.build_ruler_cases(tok, ["niah_single_1", "vt"], [512], 1, [0.25, 0.1], seed=3, chat_template="off",
                                haystack=HAYSTACK)


def test_cases_are_the_ids_mmaccel_ruler_runs(tok, job):
    samples = build_samples(tok, ["niah_single_1", "vt"], [512], 1, seed=3,
                            haystack=HAYSTACK.read_text(encoding="utf-8"), chat_template=False)
    assert [c["id"] for c in job["cases"]] == list(samples)
    for case in job["cases"]:
        s = samples[case["id"]]
        q = s.queries[0]
        assert case["input_ids"] == s.context_ids + q.question_ids
        assert case["n_question"] == len(q.question_ids) and case["references"] == q.references
        assert (case["task"], case["metric"], case["max_new_tokens"]) == (s.task, s.metric, s.max_new_tokens)
        n, n_ctx = len(case["input_ids"]), len(s.context_ids)
        assert case["keep"]["aware"] == {"0.25": math.ceil(0.25 * n), "0.1": math.ceil(0.1 * n)}
        assert case["keep"]["agnostic"] == {"0.25": math.ceil(0.25 * n_ctx), "0.1": math.ceil(0.1 * n_ctx)}
    warm = make_ruler_sample(tok, "niah_single_1", 512, seed=1003, haystack=HAYSTACK.read_text(encoding="utf-8"))
    assert job["warmup_case"]["input_ids"] == warm.input_ids()


def test_case_plan_per_mode():
    case = {"n_closing": 5, "n_question": 30, "keep": {"0.25": 100, "aware": {"0.25": 100}, "agnostic": {"0.25": 90}}}
    assert vk.case_plan(case, "whole", 0.25) == (0, 100)
    assert vk.case_plan(case, "context", 0.25) == (5, 95)
    assert vk.case_plan(case, "aware", 0.25) == (1, 99)  # the last token appended: the total held is mmaccel's
    assert vk.case_plan(case, "agnostic", 0.25) == (30, 90)  # the context keeps mmaccel's count, then the question
    assert vk.case_plan(case, "agnostic", None) == (30, None)
    with pytest.raises(ValueError, match="unknown mode"):
        vk.case_plan(case, "sideways", 0.25)
    # the compression ratio kvpress gets keeps exactly that many of the compressed tokens
    assert int(400 * (1 - vk.kvpress_compression_ratio(400, 99))) == 99


def test_ruler_scoring_and_kept_fraction_per_mode(job):
    case = job["cases"][0]
    n, nq = len(case["input_ids"]), case["n_question"]
    refs = case["references"]
    recs = [
        {"side": "kvpress", "mode": "aware", "method": "snapkv", "ratio": 0.25, "case": case["id"], "status": "ok", "error": None,
         "output_text": f"The value is {refs[0]}.", "kv_cache_bytes": 10 * n},
        {"side": "mmaccel", "mode": "agnostic", "method": "snapkv", "ratio": 0.25, "case": case["id"],
         "status": "ok", "error": None, "output_text": "no idea", "kv_cache_bytes": 10 * (n - nq)},
        {"side": "mmaccel", "mode": "agnostic", "method": "snapkv", "ratio": 0.25, "case": case["id"],
         "status": "failed", "error": "boom", "output_text": refs[0], "kv_cache_bytes": None},
    ]
    out = vk.score_records(vk.dedupe(recs), job["cases"], bytes_per_token=40)
    assert len(out) == 2  # the failed retry replaced the earlier record of the same run
    assert out[0]["correct"] == 1.0 and out[0]["kept_fraction"] == pytest.approx(0.25)
    assert out[1]["correct"] == 0.0 and out[1]["kept_fraction"] is None and out[1]["task"] == case["task"]
    rows = vk.summarize(out)
    assert {(r["side"], r["accuracy"], r["failed"]) for r in rows} == {("kvpress", 1.0, 0), ("mmaccel", None, 1)}


def _row(side, method, acc, kept, mode="aware", n=11, ratio=0.25, failed=0):
    return {"side": side, "mode": mode, "method": method, "ratio": ratio, "accuracy": acc, "kept_fraction": kept,
            "n": n, "failed": failed}


def test_equal_bytes_picks_the_best_that_fits():
    rows = [
        _row("mmaccel", "chunkkv", 0.6, 0.2502), _row("mmaccel", "kvquant:bits=4", 0.7, 0.16, ratio=None),
        _row("mmaccel", "snapkv", 0.9, 0.30),  # over the budget
        _row("kvpress", "kvzip", 0.95, 1.0),  # masks: holds everything
        _row("kvpress", "snapkv", 0.3, 0.25), _row("kvpress", "keydiff", 0.5, 0.25, n=5),  # fewer cases: skipped
        _row("kvpress", "streaming", 0.2, 0.1, ratio=0.1), _row("mmaccel", "chunkkv", 0.4, 0.1, ratio=0.1),
    ]
    best = {(b["budget"], b["side"]): (b["method"], b["accuracy"]) for b in vk.equal_bytes(rows)}
    assert best == {(0.25, "mmaccel"): ("kvquant:bits=4", 0.7), (0.25, "kvpress"): ("snapkv", 0.3),
                    (0.1, "mmaccel"): ("chunkkv", 0.4), (0.1, "kvpress"): ("streaming", 0.2)}
    table = vk.equal_bytes_markdown(vk.equal_bytes(rows))
    assert "| aware | 25% | `kvquant:bits=4` (0.160) | 0.700 | `snapkv` @0.25 (0.250) | 0.300 |" in table


def test_sweep_records_become_side_records(job):
    case = job["cases"][1]
    specs = vk.mmaccel_specs(["full", "chunkkv:method=snapkv,ratio={r}"], [0.25])
    rec = {"method": "chunkkv:method=snapkv,ratio=0.25", "status": "ok", "prompt_tokens": len(case["input_ids"]),
           "ttft_s": 1.0, "kv_cache_bytes_prefill": 123, "peak_memory_bytes": None,
           "extra": {"sample": case["id"], "mode": "agnostic", "answers": [{"output_text": "x"}]}}
    other = dict(rec, method="snapkv:ratio=0.25")  # not a spec of this table
    side = vk.ruler_side_records([rec, other], specs, job["cases"])
    assert [(r["method"], r["ratio"], r["mode"], r["kv_cache_bytes"], r["output_text"]) for r in side] == [
        ("chunkkv:method=snapkv", 0.25, "agnostic", 123, "x")]
    with pytest.raises(ValueError, match="not the same samples"):
        vk.ruler_side_records([dict(rec, prompt_tokens=7)], specs, job["cases"])


def test_held_kv_counts_what_mmaccel_counts():
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), layer)
    total, tokens = vk._held_kv(cache)
    assert total == kv_cache_bytes(cache) and tokens == [9, 9]
