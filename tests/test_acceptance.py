"""The foundation's main job on the committed micro-lm: a 4k document, needle at depth 0.5, three methods."""
import pytest

from mmaccel.eval import compare, make_niah_sample
from mmaccel.models import list_models, load


@pytest.fixture(scope="module")
def micro_lm():
    entry = next(m for m in list_models() if m["name"] == "micro-lm")
    assert entry["trained"], "assets/models/micro-lm must be committed (mmaccel zoo train micro-lm)"
    return load("micro-lm", device="cpu")


def test_compare_4k_depth_half(micro_lm):
    model, tok = micro_lm
    sample = make_niah_sample(tok, 4096, 0.5, seed=0)
    cmp = compare(model, tok, sample, ["full", "snapkv:budget=256", "streaming:window=256"], max_new_tokens=8, warmup=0)
    full, snap, stream = cmp.records
    assert all(r.ok for r in cmp.records), [r.error for r in cmp.records]
    assert full.extra["correct"], full.output_text
    assert cmp.kv_ratio(snap) <= 1 / 8
    assert cmp.kv_ratio(stream) <= 1 / 8
    # the needle (token ~2,000) is far outside streaming's 4 sinks + 256 recent tokens: it cannot be answered
    assert sample.needle_position < 4096 - 256 - 32
    assert not stream.extra["correct"], stream.output_text
    # the K/V really shrank: full holds the whole prompt, the methods hold their budgets
    assert full.kv_cache_bytes_prefill > 8 * snap.kv_cache_bytes_prefill
    assert full.kv_cache_bytes_prefill > 8 * stream.kv_cache_bytes_prefill


def test_streaming_answers_when_the_needle_is_inside_its_window(micro_lm):
    model, tok = micro_lm
    sample = make_niah_sample(tok, 1024, 1.0, seed=3)
    cmp = compare(model, tok, sample, ["full", "streaming:window=256"], max_new_tokens=8, warmup=0)
    assert [r.extra["correct"] for r in cmp.records] == [True, True], [r.output_text for r in cmp.records]


@pytest.mark.xfail(
    strict=True,
    reason="known gap (issue 2, study in the micro-lm card): micro-lm has no attention sink and its layer-1 heads "
    "attend, while generating digits 2-3 of the answer, to haystack tokens that SnapKV's question window does not "
    "point at; SnapKV at budget 256 answers 3 of these 8 seeds at 4k (full: 8/8), its misses wrong in digits 2-3 "
    "(see studies/snapkv_diagnosis/). Real models with sinks are measured in assets/models/smollm2-135m.",
)
@pytest.mark.slow  # 30-60 s on 2 cores; covered in part by faster tests; CI stays inside 25 minutes
def test_snapkv_256_answers_the_4k_needle_over_8_seeds(micro_lm):
    model, tok = micro_lm
    hits = {"full": 0, "snapkv:budget=256": 0}
    for seed in range(8):
        sample = make_niah_sample(tok, 4096, 0.5, seed=seed)
        cmp = compare(model, tok, sample, list(hits), max_new_tokens=8, warmup=0)
        for r in cmp.records:
            hits[r.method] += r.extra["correct"]
    assert hits["full"] == 8
    assert hits["snapkv:budget=256"] >= 7, hits
