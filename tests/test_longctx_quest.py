"""Quest: page bounds and page scores hand-computed, exact at a budget covering the context, decode logits after a
real page selection against an independent per-KV-head masked reference, the read fraction reported."""
import math

import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.kernels import decode_attention, gather_pages
from mmaccel.longctx import METHODS, Quest, build_method, kv_cache_bytes
from mmaccel.longctx.quest import QuestLayer, page_bounds, quest_page_scores

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")




def test_page_bounds_scores_and_selection_hand_computed():
    keys = torch.tensor([[1.0, 0.0], [3.0, -1.0], [0.0, 2.0], [-2.0, 1.0], [5.0, 5.0]])[None, None]  # [1, 1, 5, 2]
    kmin, kmax = page_bounds(keys, 2)
    assert kmin[0, 0].tolist() == [[1, -1], [-2, 1], [5, 5]] and kmax[0, 0].tolist() == [[3, 0], [0, 2], [5, 5]]
    query = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])[None, :, None]  # two query heads on one KV head: [1, 2, 1, 2]
    # page 0: mean of (3 + 0) and (-1 + 0) = 1; page 1: mean of (0 + 2), (2 + 0) = 2; page 2: mean of 10, -5 = 2.5
    assert quest_page_scores(query, kmin, kmax)[0, 0].tolist() == [1.0, 2.0, 2.5]
    # group="max": head 0 scores [3, 2, 10], head 1 [-1, 2, -5]; their maximum ranks page 0 above page 1
    assert quest_page_scores(query, kmin, kmax, group="max")[0, 0].tolist() == [3.0, 2.0, 10.0]
    by_max = QuestLayer(budget=4, ratio=None, page_size=2, group="max")
    by_max.update(keys, keys.clone())
    assert by_max.select_pages(query)[0, 0].tolist() == [0, 2]
    layer = QuestLayer(budget=4, ratio=None, page_size=2)
    layer.update(keys, keys.clone())
    assert layer.select_pages(query)[0, 0].tolist() == [1, 2]  # the newest page, then the best other page
    query_low = torch.tensor([[1.0, -1.0], [1.0, -1.0]])[None, :, None]  # page 0: 3 + 1 = 4 beats page 1
    assert layer.select_pages(query_low)[0, 0].tolist() == [0, 2]
    layer.budget = 1
    assert layer.select_pages(query_low)[0, 0].tolist() == [2]


def test_page_bounds_stay_right_as_tokens_arrive_one_by_one():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 23, 4)
    layer = QuestLayer(budget=8, ratio=None, page_size=5)
    layer.update(keys[:, :, :11], keys[:, :, :11])
    for t in range(11, 23):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        lo, hi = page_bounds(keys[:, :, : t + 1], 5)
        assert torch.equal(layer.kmin, lo) and torch.equal(layer.kmax, hi)


def test_cpu_page_copy_path_equals_the_kernel_page_read_and_the_element_wise_bound():
    """The CPU path (whole pages copied by ``gather_pages``, the newest partial page appended, SDPA) equals
    ``decode_attention(pages=...)``; the two-matmul page bound equals the element-wise max of the paper."""
    torch.manual_seed(0)
    for T in (37, 40):  # a partial and a full newest page
        layer = QuestLayer(budget=16, ratio=None, page_size=4)
        layer.update(torch.randn(2, 2, T - 1, 8), torch.randn(2, 2, T - 1, 8))
        layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))  # a view into a grown store
        query = torch.randn(2, 6, 1, 8)
        pages = layer.select_pages(query)
        assert pages.shape[-1] == 4 and (pages[..., -1] == layer.kmin.shape[2] - 1).all()
        expected = decode_attention(query, layer.keys, layer.values, pages=pages, page_size=4, scaling=0.3)
        torch.testing.assert_close(layer.attend_pages(query, pages, 0.3), expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(gather_pages(layer.keys, pages[..., :1], 4)[1, 1], layer.keys[1, 1, 4 * pages[1, 1, 0]:][:4])
        q = query.reshape(2, 2, 3, 1, 8)
        elementwise = torch.maximum(q * layer.kmin[:, :, None], q * layer.kmax[:, :, None]).sum(-1).amax(2)
        torch.testing.assert_close(quest_page_scores(query, layer.kmin, layer.kmax, "max"), elementwise)


@pytest.mark.parametrize("spec", ["quest:budget=1000", "quest:ratio=1.0:page_size=4"])
def test_budget_covering_the_context_is_token_identical_to_full_and_warns(spec, sdpa):
    ids = random_prompt(40, seed=2)
    plain = sdpa.generate(ids, max_new_tokens=8, do_sample=False)
    method = build_method(spec)
    with method.make_cache(sdpa) as cache:
        out = sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
        telemetry = method.telemetry(cache)
    assert torch.equal(out, plain)
    assert telemetry["kv_read_fraction"] == 1.0 and any("read all K/V" in w for w in telemetry["warnings"])


def _perhead_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    group = query.shape[1] // key.shape[1]
    allowed = module._test_allowed.repeat_interleave(group, dim=1)
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    probs = ((query @ k.transpose(-1, -2)) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2).contiguous(), None


def test_decode_logits_after_real_page_selection_match_a_per_head_masked_reference(sdpa):
    """Prefill 40 tokens, then 6 decode steps reading 2 pages of 4 tokens per KV head; record the pages each layer
    and KV head read; one forward of the whole sequence through dense attention that lets decode row t see exactly
    those pages' tokens (causal) reproduces the logits; full attention does not."""
    prompt, steps, page = 40, 6, 4
    ids = random_prompt(prompt + steps, seed=3)
    method = Quest(budget=8, page_size=page, dense_layers=0)
    logits, read = [], []
    with method.make_cache(sdpa) as cache:
        logits.append(sdpa(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1])
        for t in range(prompt, prompt + steps):
            logits.append(sdpa(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
            read.append([layer.last_pages.clone() for layer in cache.layers])
        telemetry = method.telemetry(cache)
    total = prompt + steps
    reference = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")
    AttentionInterface.register("quest_perhead_test", _perhead_reference)
    AttentionMaskInterface.register("quest_perhead_test", sdpa_mask)
    reference.set_attn_implementation("quest_perhead_test")
    for layer_idx, layer in enumerate(reference.model.layers):
        allowed = torch.ones(1, HKV, total, total).tril().bool()
        for step, t in enumerate(range(prompt, total)):
            pages = read[step][layer_idx][0]  # [Hkv, 2]
            assert pages.shape == (HKV, 2) and bool((pages[:, -1] == t // page).all())  # the newest page is read
            tokens = (pages[..., None] * page + torch.arange(page)).flatten(1)  # [Hkv, 8]
            row = torch.zeros(HKV, total + page, dtype=torch.bool).scatter_(1, tokens, True)[:, :total]
            allowed[0, :, t] = row & (torch.arange(total) <= t)
        layer.self_attn._test_allowed = allowed
    ref = reference(ids).logits[0, prompt - 1 : total]
    torch.testing.assert_close(torch.cat(logits), ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ref, sdpa(ids).logits[0, prompt - 1 : total], atol=1e-3)
    # read fraction: 2 full pages of 4 = 8 rows, except when the newest page is partial
    expected = [(4 + (t % page) + 1) / (t + 1) for t in range(prompt, total)]
    assert telemetry["kv_read_fraction_per_step"] == pytest.approx(expected, abs=1e-6)
    # full storage (Quest bounds reads), in growable stores with at most 1/32 spare room (append_slots)
    full_bytes = LAYERS * 2 * HKV * total * D * 4
    assert full_bytes <= telemetry["kv_cache_bytes"] <= full_bytes * (1 + 1 / 32)
    bounds = LAYERS * 2 * HKV * math.ceil(total / page) * D * 4
    assert bounds <= telemetry["bookkeeping_bytes"] <= bounds * (1 + 1 / 32) + LAYERS * 2 * HKV * D * 4


def test_ratio_reads_that_fraction_of_the_context(sdpa):
    method = build_method("quest:ratio=0.25:page_size=4:dense_layers=0")
    with method.make_cache(sdpa) as cache:
        sdpa.generate(random_prompt(64, seed=4), past_key_values=cache, max_new_tokens=4, do_sample=False)
        telemetry = method.telemetry(cache)
        assert kv_cache_bytes(cache) == telemetry["kv_cache_bytes"]
    assert len(telemetry["kv_read_fraction_per_step"]) == 3  # 3 decode steps after the prefill's token
    assert all(0.2 <= f <= 0.3 for f in telemetry["kv_read_fraction_per_step"])
    assert telemetry["warnings"] == []


@pytest.mark.parametrize("spec, message", [
    ("quest:budget=0", "budget must be an integer >= 1"),
    ("quest:page_size=0", "page_size must be an integer >= 1"),
    ("quest:dense_layers=-1", "dense_layers must be an integer >= 0"),
    ("quest:group=sum", "group must be 'mean' or 'max'"),
    ("quest:budget=64:ratio=0.5", "not both"),
    ("quest:ratio=1.5", "ratio must be a kept fraction"),
])
def test_bad_arguments_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)


def test_registered_round_trips_and_refuses_padding(sdpa):
    assert METHODS["quest"] is Quest
    method = build_method("quest:budget=32:page_size=8")
    assert build_method(method.spec) == method
    assert build_method("chunked:chunk=8:method=quest,budget=32").method == Quest(budget=32)  # wrapped, see methods
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="left-padded batch"):
        sdpa.generate(torch.randint(0, 128, (2, 20)), attention_mask=mask, past_key_values=method.make_cache(sdpa),
                      max_new_tokens=2, do_sample=False)
    assert sdpa.model.layers[0].self_attn.config is sdpa.config


def test_dense_layers_read_everything_and_keep_no_page_bounds(sdpa):
    """Quest's first ``dense_layers`` layers stay dense at every step (as in Quest's evaluation); the rest select."""
    method = build_method("quest:budget=8:page_size=4:dense_layers=1")
    with method.make_cache(sdpa) as cache:
        sdpa.generate(random_prompt(40, seed=5), past_key_values=cache, max_new_tokens=4, do_sample=False)
        dense, sparse = cache.layers
        telemetry = method.telemetry(cache)
    assert dense.dense and not sparse.dense
    assert dense.last_pages is None and dense.kmin is None and dense.read_fractions == [1.0] * 3
    assert sparse.last_pages is not None and all(f < 0.5 for f in sparse.read_fractions)
    steps = telemetry["kv_read_fraction_per_step"]
    assert steps == pytest.approx([(1.0 + float(f)) / 2 for f in sparse.read_fractions])
    assert telemetry["dense_layers"] == 1
    assert telemetry["bookkeeping_bytes"] == 2 * HKV * math.ceil(43 / 4) * D * 4  # the sparse layer's bounds only
