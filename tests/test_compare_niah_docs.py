"""`mmaccel compare --task niah`'s pieces: the peak-memory column under the shared prefill (each member's own phase
measured, the group's prefill peak beside it), its table (ratios only between peaks measured the same way, refusals
named), and run_niah taking the prompts the caller already built."""
from pathlib import Path

import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AutoTokenizer, DynamicCache

from mmaccel.data.haystack import HaystackTokens
from mmaccel.eval import niah as niah_module
from mmaccel.eval.compare import niah_docs_markdown, niah_docs_rows
from mmaccel.eval.niah import build_samples, run_niah
from mmaccel.eval.shared import generate_shared
from mmaccel.longctx import FullAttention

MICRO_LM = Path(__file__).resolve().parents[1] / "assets" / "models" / "micro-lm"
HAYSTACK = ("The river bends twice before it reaches the old mill. Farmers bring their grain in autumn. The miller "
            "keeps a ledger of every sack. Children fish below the weir in summer. A stone bridge crosses the water "
            "near the church. The bell rings at noon and at six. ") * 4
BALLAST = 64 * 2**20  # bytes one member allocates, and holds, during its own decode


class _BallastCache(DynamicCache):
    """A full cache that allocates (and touches) BALLAST bytes at its first decode step and holds them."""

    def update(self, *args, **kwargs):
        if not hasattr(self, "ballast"):
            self.ballast = torch.ones(BALLAST // 4, dtype=torch.float32)
        return super().update(*args, **kwargs)


class Ballast(FullAttention):
    """Full attention whose decode holds BALLAST extra bytes: the memory its own phase must be charged with."""

    method_name = "ballast"

    def make_cache(self, model):
        return _BallastCache(config=model.config)


@pytest.fixture(scope="module")
def shared_records():
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16)
    model.generation_config.eos_token_id = None  # decode every step (a random model may pick EOS first)
    return generate_shared(model, None, random_prompt(120), methods=[("full", "full"), (Ballast(), "ballast"),
                                                                     ("snapkv:budget=32:window=8", "snapkv")],
                           max_new_tokens=4, warmup=0, repeats=2, raise_errors=True)  # the 2nd repeat meters


def test_one_repeat_is_timed_unmetered_and_claims_no_peak():
    """The memory meter slows a CPU decode, so a single timed run is not metered: no peak is claimed."""
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16)
    model.generation_config.eos_token_id = None
    records = generate_shared(model, None, random_prompt(40), methods=[("full", "full")], max_new_tokens=3, warmup=0,
                              raise_errors=True)
    assert records[0].peak_memory_bytes is None and records[0].peak_memory_method == "unavailable"
    assert records[0].decode_s is not None and records[0].samples[0]["metered"] is False


def test_each_member_s_own_phase_is_measured(shared_records):
    full, ballast, snap = shared_records
    for r in shared_records:
        assert r.ok and r.peak_memory_method in ("kv_kept+rss_delta_sampled", "kv_kept+cuda_max_memory_allocated")
        assert r.peak_memory_bytes == r.kv_cache_bytes_prefill + r.extra["decode_peak_bytes"]
        assert r.samples[-1]["metered"] and r.samples[-1]["peak_memory_bytes"] == r.peak_memory_bytes
        assert not r.samples[0]["metered"] and r.samples[0]["peak_memory_bytes"] is None
    # the member that allocates during its own decode is charged with it, the others are not
    assert ballast.extra["decode_peak_bytes"] >= 0.9 * BALLAST
    assert full.extra["decode_peak_bytes"] < BALLAST / 4 and snap.extra["decode_peak_bytes"] < BALLAST / 4
    # its kept K/V is full's; SnapKV's is smaller, and so is the K/V part of its own peak
    assert ballast.kv_cache_bytes_prefill == full.kv_cache_bytes_prefill > snap.kv_cache_bytes_prefill
    # the group's prefill peak: one measurement, the same in every record
    assert len({r.extra["shared_prefill_peak_bytes"] for r in shared_records}) == 1
    assert full.extra["shared_prefill_peak_method"] in ("rss_delta_sampled", "cuda_max_memory_allocated")


def _record(method, depth, *, peak, meter, kv=100, ok=True, error=None, prefill_peak=None, correct=True):
    extra = {"length": 64, "depth": depth, "trial": 0, "correct": correct, "correct_contains": correct}
    if prefill_peak is not None:
        extra.update(shared_prefill=True, shared_prefill_peak_bytes=prefill_peak)
    return {"method": method, "method_name": method.split(":")[0], "status": "ok" if ok else "failed",
            "error": error, "peak_memory_bytes": peak if ok else None, "peak_memory_method": meter,
            "kv_cache_bytes_prefill": kv if ok else None, "kv_cache_bytes_final": kv if ok else None,
            "ttft_s": 1.0, "tokens_per_s": 10.0, "extra": extra}


def test_table_peak_column_compares_like_with_like_and_names_refusals():
    shared = "kv_kept+rss_delta_sampled"
    records = []
    for d, (full_peak, snap_peak) in zip((0.25, 0.75), ((400, 100), (600, 300))):
        records += [_record("full", d, peak=full_peak, meter=shared, kv=200, prefill_peak=5000),
                    _record("snapkv:ratio=0.25", d, peak=snap_peak, meter=shared, kv=50, prefill_peak=5000,
                            correct=d < 0.5),
                    _record("chunked_ffn", d, peak=900, meter="rss_delta_sampled", kv=200),
                    _record("longheads", d, peak=None, meter="unavailable", ok=False,
                            error="ValueError: longheads needs RoPE")]
    rows = {r["method"]: r for r in niah_docs_rows(records)}
    assert rows["snapkv:ratio=0.25"]["peak_memory_ratio"] == pytest.approx((100 / 400 + 300 / 600) / 2)
    assert rows["snapkv:ratio=0.25"]["peak_bytes"] == 200 and rows["full"]["prefill_peak_bytes"] == 5000
    assert rows["snapkv:ratio=0.25"]["correct"] == 1
    # a whole run's peak (its own prefill) is not divided by full's own phase
    assert rows["chunked_ffn"]["peak_memory_ratio"] is None and rows["chunked_ffn"]["peak_bytes"] == 900
    assert rows["longheads"]["refused"] == "ValueError: longheads needs RoPE" and rows["full"]["refused"] is None
    table = niah_docs_markdown(list(rows.values()), speed=False).splitlines()
    assert table[0] == ("| method | correct | K/V bytes | K/V vs full | peak mem | peak mem vs full | "
                        "shared prefill peak |")
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[2:]}
    assert cells["snapkv:ratio=0.25"] == ["1/2", "50 B", "0.250", "200 B (own phase)", "0.38", "4.9 KiB"]
    assert cells["chunked_ffn"][3:] == ["900 B", "-", "-"]
    assert cells["longheads"][0] == "refused: ValueError: longheads needs RoPE"
    assert "prefill speed vs full" in niah_docs_markdown(list(rows.values()))


def test_run_niah_takes_prebuilt_samples(monkeypatch):
    tok = AutoTokenizer.from_pretrained(MICRO_LM)
    model = tiny_llama(layers=1, heads=2, kv_heads=1, head_dim=8, tokenizer=tok)
    hay = HaystackTokens(tok, HAYSTACK)  # a short haystack: fast to tokenize
    kw = {"seed": 3, "haystack": hay, "max_new_tokens": 2, "warmup": 0, "progress": False, "chat_template": False}
    samples = build_samples(tok, [96], [0.25, 0.75], 1, seed=3, haystack=hay)
    expected = run_niah(model, tok, ["full"], [96], [0.25, 0.75], 1, **kw)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("run_niah rebuilt the samples it was given")

    monkeypatch.setattr(niah_module, "build_samples", no_rebuild)
    given = run_niah(model, tok, ["full"], [96], [0.25, 0.75], 1, samples=samples, **kw)
    assert [r["output_ids"] for r in given.records] == [r["output_ids"] for r in expected.records]
    assert [r["extra"]["needle_position"] for r in given.records] == [s.needle_position for _, s in samples]
    with pytest.raises(ValueError, match="the sweep needs 3"):
        run_niah(model, tok, ["full"], [96], [0.25, 0.5, 0.75], 1, samples=samples, chat_template=False)
    with pytest.raises(ValueError, match=r"samples\[0\] is \(length 96, depth 0.25, trial 0\), the sweep expects "
                                         r"\(length 96, depth 0.75"):
        run_niah(model, tok, ["full"], [96], [0.75, 0.25], 1, samples=samples, chat_template=False)
