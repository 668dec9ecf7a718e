"""mmaccel.eval: measured generation, the NIAH harness and compare, on a tiny random Llama with a tiny BPE.

A random model does not answer NIAH; these tests check the harness (records, files, determinism, errors). One slow
test checks that the committed micro-lm answers at 512 tokens.
"""
import json
import statistics
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache

from mmaccel.data.haystack import score_answer, stdlib_paragraphs
from mmaccel.eval import Comparison, NIAHSample, RunRecord, compare, generate_measured, make_niah_sample, run_niah
from mmaccel.eval.memory import PeakMemory
from mmaccel.eval.niah import build_samples, summarize
from mmaccel.longctx import FullAttention
from mmaccel.models.tokenizer import train_bpe_tokenizer

LAYERS, HQ, HKV, HEAD_DIM = 2, 4, 2, 16
RECORD_FIELDS = set(RunRecord.__dataclass_fields__)


def tiny_model_and_tokenizer():
    """A 2-layer random Llama (GQA 4/2, head dim 16, fp32) and a 300-token BPE trained on stdlib prose."""
    tokenizer = train_bpe_tokenizer(stdlib_paragraphs("train")[:200], vocab_size=300)
    model = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, max_positions=2048, tokenizer=tokenizer)
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_and_tokenizer()


def _kv_bytes(tokens: int) -> int:
    """K and V bytes of all layers for `tokens` held slots (batch 1, float32)."""
    return LAYERS * 2 * HKV * tokens * HEAD_DIM * 4


class Exploding(FullAttention):
    """A method whose cache creation runs out of memory, to test failure recording."""

    method_name = "exploding"

    def make_cache(self, model):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


# --------------------------------------------------------------------------------------------- generate_measured
def test_generate_measured_matches_plain_greedy_and_accounts_kv_bytes(tiny):
    model, tok = tiny
    sample = make_niah_sample(tok, 160, 0.5, seed=3)
    ids = torch.tensor([sample.input_ids])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=DynamicCache(config=model.config),
                             do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[0, 160:].tolist()
    rec = generate_measured(model, tok, sample, method="full", max_new_tokens=6, warmup=0)
    assert rec.status == "ok" and rec.error is None
    assert rec.method == "full" and rec.method_name == "full"
    assert rec.output_ids == ref
    assert rec.output_text == tok.decode(ref, skip_special_tokens=True)
    assert (rec.prompt_tokens, rec.new_tokens) == (160, len(ref))
    # after prefill the cache holds the prompt; at the end every token but the last generated one
    assert rec.kv_cache_bytes_prefill == _kv_bytes(160)
    assert rec.kv_cache_bytes_final == _kv_bytes(160 + len(ref) - 1)
    assert rec.ttft_s > 0 and rec.decode_s >= 0
    assert rec.tokens_per_s == pytest.approx((rec.new_tokens - 1) / rec.decode_s)
    assert rec.peak_memory_method == "rss_delta_sampled" and isinstance(rec.peak_memory_bytes, int)
    assert rec.telemetry["method"] == "full" and rec.device == "cpu"
    json.dumps(rec.to_dict())  # JSON-serialisable
    assert set(rec.to_dict()) == RECORD_FIELDS


def test_kv_methods_hold_fewer_bytes_after_prefill(tiny):
    model, tok = tiny
    ids = make_niah_sample(tok, 200, 0.25, seed=1).input_ids
    stream = generate_measured(model, tok, ids, method="streaming:window=32:sink=4", max_new_tokens=4, warmup=0)
    with warnings.catch_warnings(record=True) as caught:  # the cache goes in under generate's current name
        warnings.simplefilter("always")
        snap = generate_measured(model, tok, ids, method="snapkv:budget=64:window=16", max_new_tokens=4, warmup=0)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    assert stream.kv_cache_bytes_prefill == _kv_bytes(36)
    assert stream.kv_cache_bytes_final == _kv_bytes(36 + 1)  # + the slot evicted in place, until it is overwritten
    assert snap.kv_cache_bytes_prefill == _kv_bytes(64)
    assert snap.kv_cache_bytes_final == _kv_bytes(64 + snap.new_tokens - 1)
    assert stream.telemetry["window"] == 32 and snap.telemetry["budget"] == 64
    assert stream.method == "streaming:window=32:sink=4"


def test_repeats_report_the_median_of_the_measured_runs(tiny):
    model, tok = tiny
    rec = generate_measured(model, tok, list(range(3, 83)), max_new_tokens=3, repeats=3, warmup=1)
    assert (rec.repeats, rec.warmup, len(rec.samples)) == (3, 1, 3)
    assert rec.ttft_s == pytest.approx(statistics.median(s["ttft_s"] for s in rec.samples))
    assert rec.decode_s == pytest.approx(statistics.median(s["decode_s"] for s in rec.samples))


def test_failed_run_is_recorded_not_raised(tiny):
    model, tok = tiny
    rec = generate_measured(model, tok, [1, 5, 6, 7], method=Exploding(), max_new_tokens=2)
    assert rec.status == "failed" and not rec.ok
    assert rec.error.startswith("OutOfMemoryError") and "simulated" in rec.error
    assert rec.method == "exploding" and rec.output_text == "" and rec.ttft_s is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "nosuch"}, "unknown KV-cache method 'nosuch'"),
        ({"method": "snapkv:budget=0"}, "budget must be an integer >= 1"),
        ({"method": "streaming:window=-5"}, "window must be an integer >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens >= 1"),
    ],
)
def test_configuration_errors_raise_up_front(tiny, kwargs, match):
    model, tok = tiny
    with pytest.raises(ValueError, match=match):
        generate_measured(model, tok, [1, 5, 6], **kwargs)


def test_peak_memory_sees_a_64_mib_allocation_on_the_cpu():
    with PeakMemory(torch.device("cpu")) as mem:
        block = torch.ones(16 * 1024 * 1024)  # 64 MiB of float32, held until the end
    assert mem.method == "rss_delta_sampled"
    assert 60 * 2**20 <= mem.peak <= 256 * 2**20
    del block


def test_allocator_meter_is_exact_tensor_bytes():
    """Under ``cpu_meter="allocator"`` the peak is the block's most tensor bytes held at once: 64 + 32 MiB, not the
    later 32 + 16, and not the 4 MiB allocated before the block."""
    before = torch.ones(1 << 20)
    with PeakMemory(torch.device("cpu"), cpu_meter="allocator") as mem:
        a = torch.ones(16 << 20)
        b = torch.ones(8 << 20)
        del a
        c = torch.ones(4 << 20)
    assert mem.method == "cpu_allocator_profiled"
    assert mem.peak == 96 << 20
    del b, c, before
    with pytest.raises(ValueError, match="cpu_meter must be one of"):
        PeakMemory(torch.device("cpu"), cpu_meter="psutil")


def test_generate_measured_allocator_meter_counts_the_kv_it_builds(tiny):
    model, tok = tiny
    ids = tok("the cat sat on the mat " * 30)["input_ids"][:150]
    rec = generate_measured(model, tok, ids, max_new_tokens=4, warmup=0, memory_meter="allocator")
    assert rec.status == "ok" and rec.peak_memory_method == "cpu_allocator_profiled"
    # the cache is allocated inside the run, so the exact peak holds at least its final K/V bytes
    assert rec.peak_memory_bytes >= _kv_bytes(len(ids) + rec.new_tokens - 1) > 0
    with pytest.raises(ValueError, match="memory_meter must be one of"):
        generate_measured(model, tok, ids, memory_meter="rss_exact")


def test_bad_prompts_raise(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="empty"):
        generate_measured(model, tok, [])
    with pytest.raises(ValueError, match="one prompt"):
        generate_measured(model, tok, torch.ones(2, 5, dtype=torch.long))


# ------------------------------------------------------------------------------------------------------------ NIAH
def test_niah_sample_is_deterministic_under_a_seed(tiny):
    _, tok = tiny
    a = make_niah_sample(tok, 300, 0.4, seed=7)
    b = make_niah_sample(tok, 300, 0.4, seed=7)
    c = make_niah_sample(tok, 300, 0.4, seed=8)
    assert a == b
    assert a.input_ids != c.input_ids
    assert len(a.input_ids) == 300 and a.input_ids[0] == tok.bos_token_id
    assert a.answer in tok.decode(a.input_ids[a.needle_position:])


def test_run_niah_writes_records_summary_and_heatmaps(tiny, tmp_path):
    model, tok = tiny
    methods = ["full", "streaming:window=32"]
    lengths, depths, trials = [128, 192], [0.0, 1.0], 2
    res = run_niah(model, tok, methods, lengths, depths, trials, seed=5, max_new_tokens=4, out_dir=tmp_path,
                   progress=False)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == len(res.records) == 2 * 2 * 2 * 2
    assert all(set(r) == RECORD_FIELDS | {"cell_id"} for r in rows)  # the sweep names each cell
    assert {r["method"] for r in rows} == set(methods)
    # every method saw exactly the same prompts
    per_method = {m: [(r["extra"]["length"], r["extra"]["depth"], r["extra"]["trial"], r["extra"]["key"],
                       r["extra"]["answer"], r["prompt_tokens"]) for r in rows if r["method"] == m] for m in methods}
    assert per_method["full"] == per_method["streaming:window=32"]
    assert all(r["prompt_tokens"] == r["extra"]["length"] for r in rows)
    assert all(r["extra"]["correct"] == score_answer(r["output_text"], r["extra"]["answer"]) for r in rows)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(res.summary))
    for m in methods:
        cells = summary["methods"][m]["cells"]
        assert [(c["length"], c["depth"]) for c in cells] == [(n, d) for n in lengths for d in depths]
        assert all(c["n"] == trials and c["failed"] == 0 and c["median_ttft_s"] > 0 for c in cells)
        mine = [r for r in rows if r["method"] == m]
        assert summary["methods"][m]["accuracy"] == sum(r["extra"]["correct"] for r in mine) / len(mine)
    full_kv = summary["methods"]["full"]["cells"][-1]["median_kv_cache_bytes"]
    stream_kv = summary["methods"]["streaming:window=32"]["cells"][-1]["median_kv_cache_bytes"]
    assert stream_kv < full_kv
    assert summary["config"]["lengths"] == lengths and summary["config"]["trials"] == trials
    for name in ("heatmap_full.png", "heatmap_streaming_window-32.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert set(res.heatmaps) == set(methods)


def test_run_niah_is_deterministic_and_survives_a_failing_method(tiny, tmp_path):
    model, tok = tiny
    kw = {"seed": 1, "max_new_tokens": 3, "warmup": 0, "progress": False}
    a = run_niah(model, tok, ["full"], [128], [0.5], 2, **kw)
    b = run_niah(model, tok, [Exploding(), "full"], [128], [0.5], 2, out_dir=tmp_path, **kw)
    assert [r["output_ids"] for r in a.records] == [r["output_ids"] for r in b.records if r["method"] == "full"]
    failed = [r for r in b.records if r["method"] == "exploding"]
    assert len(failed) == 2 and all(r["status"] == "failed" and not r["extra"]["correct"] for r in failed)
    bad = b.summary["methods"]["exploding"]
    assert (bad["accuracy"], bad["n"], bad["failed"]) == (None, 0, 2)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4


def test_summarize_counts_accuracy_over_successful_runs():
    def row(correct, status="ok"):
        return {"method": "m", "status": status, "extra": {"length": 10, "depth": 0.5, "correct": correct},
                "ttft_s": 1.0, "tokens_per_s": 2.0, "peak_memory_bytes": 3, "kv_cache_bytes_final": 4}

    s = summarize([row(True), row(False), row(True), row(False, "failed")], [10], [0.5])
    cell = s["methods"]["m"]["cells"][0]
    assert (cell["accuracy"], cell["n"], cell["failed"]) == (pytest.approx(2 / 3), 3, 1)
    assert s["methods"]["m"]["accuracy"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"methods": ["full", "nosuch"]}, ValueError, "unknown KV-cache method"),
        ({"methods": ["snapkv:budget=0"]}, ValueError, "budget must be"),
        ({"lengths": [20]}, ValueError, "smaller than the needle"),
        ({"haystack": "/no/such/haystack.txt"}, FileNotFoundError, "does not exist"),
        ({"depths": [1.5]}, ValueError, "depths must be"),
        ({"needle_template": "no placeholders"}, ValueError, "must contain"),
    ],
)
def test_run_niah_configuration_errors_before_any_run(tiny, tmp_path, kwargs, exc, match):
    model, tok = tiny
    args = {"methods": ["full"], "lengths": [128], "depths": [0.5]}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        run_niah(model, tok, args.pop("methods"), args.pop("lengths"), args.pop("depths"), 1, out_dir=tmp_path,
                 progress=False, **args)
    assert not (tmp_path / "results.jsonl").exists()


def test_run_niah_with_haystack_file_and_templates(tiny, tmp_path):
    model, tok = tiny
    hay = tmp_path / "hay.txt"
    hay.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    templates = {"needle_template": "Remember: the code for {key} is {value}.",
                     "question_template": "What is the code for {key}? The code for {key} is"}
    ((_, sample),) = build_samples(tok, [128], [0.5], 1, haystack=str(hay), **templates)
    prompt = tok.decode(sample.input_ids)
    assert "quick brown fox" in prompt and f"Remember: the code for {sample.key} is {sample.answer}." in prompt
    assert "secret number" not in prompt
    res = run_niah(model, tok, ["full"], [128], [0.5], 1, haystack=str(hay), max_new_tokens=2, warmup=0,
                   progress=False, **templates)
    rec = res.records[0]
    assert rec["status"] == "ok" and rec["prompt_tokens"] == 128
    assert (rec["extra"]["key"], rec["extra"]["answer"]) == (sample.key, sample.answer)
    assert res.summary["config"]["haystack"] == str(hay)
    assert res.summary["config"]["needle_template"] == templates["needle_template"]


# --------------------------------------------------------------------------------------------------------- compare
def test_compare_table_and_json(tiny):
    model, tok = tiny
    sample = make_niah_sample(tok, 192, 0.5, seed=2)
    result = compare(model, tok, sample, ["full", "streaming:window=32", Exploding()], max_new_tokens=4, warmup=0)
    assert isinstance(result, Comparison) and [r.method for r in result.records] == [
        "full", "streaming:window=32", "exploding"]
    full, stream, bad = result.records
    assert result.answer == sample.answer
    assert full.extra["answer"] == sample.answer and isinstance(full.extra["correct"], bool)
    assert result.kv_ratio(full) == 1.0
    assert result.kv_ratio(stream) == pytest.approx(stream.kv_cache_bytes_final / full.kv_cache_bytes_final)
    assert result.kv_ratio(stream) < 0.5 and bad.status == "failed"

    md = result.to_markdown().splitlines()
    assert md[0] == "| method | answer | correct | TTFT (s) | tok/s | peak mem | KV bytes | KV ratio vs full |"
    assert len(md) == 2 + 3
    assert md[2].startswith("| full |") and md[2].endswith("| 1.000 |")
    assert "FAILED: OutOfMemoryError" in md[4]

    data = json.loads(result.to_json())
    assert data["answer"] == sample.answer and data["inputs"]["prompt_tokens"] == 192
    assert data["records"][0]["kv_ratio_vs_full"] == 1.0
    assert len({frozenset(r) for r in data["records"]}) == 1  # the same fields for every method


def test_compare_accepts_text_and_an_explicit_answer(tiny, tmp_path):
    model, tok = tiny
    result = compare(model, tok, "The secret number is", ["streaming:window=8"], max_new_tokens=2, warmup=0,
                     answer="12345")
    rec = result.records[0]
    assert rec.prompt_tokens == len(tok("The secret number is")["input_ids"])
    assert rec.extra == {"answer": "12345", "correct": False, "correct_contains": False}
    assert result.baseline is None and result.kv_ratio(rec) is None  # no "full" record
    assert "| - |" in result.to_markdown()
    path = tmp_path / "sub" / "c.json"
    result.to_json(path)
    assert json.loads(path.read_text())["records"][0]["method"] == "streaming:window=8"


def test_compare_rejects_unknown_methods_before_running(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="unknown KV-cache method 'bogus'"):
        compare(model, tok, [1, 2, 3], ["full", "bogus"])


def test_top_level_compare_forwards(tiny):
    import mmaccel

    model, tok = tiny
    result = mmaccel.compare(model, tok, NIAHSample([1, 5, 6, 7, 8], "1", "k", 5, 0.5, 1), ["full"],
                             max_new_tokens=1, warmup=0)
    assert result.records[0].new_tokens == 1 and result.records[0].tokens_per_s is None


# ------------------------------------------------------------------------------------------------------ micro-lm
def test_micro_lm_answers_at_512_tokens_with_full_attention():
    from mmaccel.models import list_models, load

    entry = next(m for m in list_models() if m["name"] == "micro-lm")
    # train_log.json is written when training finishes; before that only a partial (per-phase) checkpoint exists
    if not entry["trained"] or not (Path(entry["path"]) / "train_log.json").exists():
        pytest.skip("fully trained micro-lm weights are not there yet (run `mmaccel zoo train micro-lm`)")
    model, tok = load("micro-lm", device="cpu")
    res = run_niah(model, tok, ["full"], [512], [0.25, 0.75], 2, max_new_tokens=8, warmup=0, progress=False)
    assert res.accuracy("full") >= 0.75, [(r["output_text"], r["extra"]["answer"]) for r in res.records]


def test_run_niah_measures_exact_peaks_on_request(tiny):
    model, tok = tiny
    res = run_niah(model, tok, ["full"], [128], [0.5], 1, max_new_tokens=2, progress=False, memory_meter="allocator")
    assert [r["peak_memory_method"] for r in res.records] == ["cpu_allocator_profiled"]
    assert res.records[0]["peak_memory_bytes"] >= res.records[0]["kv_cache_bytes_prefill"] > 0
    assert res.summary["config"]["memory_meter"] == "allocator"
    with pytest.raises(ValueError, match="memory_meter must be one of"):
        run_niah(model, tok, ["full"], [128], [0.5], 1, progress=False, memory_meter="exact")
