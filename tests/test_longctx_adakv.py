"""AdaKV: head-wise allocation hand-computed, exact when unbounded, ragged per-head storage holding only the kept
bytes, and decode logits after a real ragged compression against an independent per-KV-head masked reference."""
import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.longctx import METHODS, AdaKV, SnapKV, build_method, kv_cache_bytes
from mmaccel.longctx.adakv import RaggedLayer, adakv_keep_indices

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")




def test_allocation_hand_computed():
    scores = torch.tensor([[[10.0, 9.0, 8.0, 7.0], [1.0, 0.5, 0.2, 0.1]]])  # [1, 2, 4]
    idx, valid = adakv_keep_indices(scores, 2, alpha=0.0)  # 4 slots for the layer: all to head 0
    assert idx.tolist() == [[[0, 1, 2, 3], [0, 0, 0, 0]]] and valid.tolist() == [[[True] * 4, [False] * 4]]
    idx, valid = adakv_keep_indices(scores, 2, alpha=0.5)  # safeguard: 1 each, then the 2 best left (head 0)
    assert idx.tolist() == [[[0, 1, 2], [0, 0, 0]]] and valid.tolist() == [[[True] * 3, [True, False, False]]]
    scores = torch.tensor([[[0.1, 5.0, 0.2, 4.0], [3.0, 0.3, 6.0, 0.0]]])
    idx, valid = adakv_keep_indices(scores, 2, alpha=0.0)  # best 4 of the layer: 6 (h1), 5 (h0), 4 (h0), 3 (h1)
    assert idx.tolist() == [[[1, 3], [0, 2]]] and bool(valid.all())
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        adakv_keep_indices(scores, 5)


def test_unbounded_budget_is_token_identical_to_full_and_warns(sdpa):
    ids = random_prompt(40, seed=2)
    plain = sdpa.generate(ids, max_new_tokens=8, do_sample=False)
    method = build_method("adakv:method=snapkv,budget=1000")
    with method.make_cache(sdpa) as cache:
        out = sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
        telemetry = method.telemetry(cache)
    assert torch.equal(out, plain) and any("ran as full attention" in w for w in telemetry["warnings"])


def _perhead_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    group = query.shape[1] // key.shape[1]
    allowed = module._test_allowed.repeat_interleave(group, dim=1)
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    probs = ((query @ k.transpose(-1, -2)) * scaling).masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2).contiguous(), None


# H2O on this random model accumulates near-identical attention in both heads, so it splits evenly; it still
# exercises AdaKV's re-allocation at every decode step.
@pytest.mark.parametrize("inner, ragged", [("snapkv,budget=12,window=4", True), ("h2o,budget=12,recent=4", False)])
def test_decode_logits_after_real_ragged_compression_match_a_per_head_masked_reference(inner, ragged, sdpa):
    """Prefill 40 tokens, compress to 12 slots per KV head on average, 6 decode steps; record the valid positions of
    every layer and KV head before each step; one dense forward with exactly those per-KV-head masks matches."""
    prompt, steps = 40, 6
    ids = random_prompt(prompt + steps, seed=3)
    method = build_method(f"adakv:method={inner}:alpha=0.2")
    held, logits = [], []
    with method.make_cache(sdpa) as cache:
        logits.append(sdpa(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1])
        counts = [layer.valid_counts()[0].tolist() for layer in cache.layers]
        assert any(c[0] != c[1] for c in counts) == ragged  # heads of one layer really hold different counts
        assert all(sum(c) == 12 * HKV for c in counts)  # the layer's total is the budget
        for t in range(prompt, prompt + steps):
            assert all(layer.ragged for layer in cache.layers) == ragged  # unequal heads are stored apart
            held.append([[p.clone() for p in layer.head_positions()[0]] for layer in cache.layers])
            logits.append(sdpa(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        telemetry = method.telemetry(cache)
    total = prompt + steps
    reference = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")
    AttentionInterface.register("adakv_perhead_test", _perhead_reference)
    AttentionMaskInterface.register("adakv_perhead_test", sdpa_mask)
    reference.set_attn_implementation("adakv_perhead_test")
    for layer_idx, layer in enumerate(reference.model.layers):
        allowed = torch.ones(1, HKV, total, total).tril().bool()
        for step, t in enumerate(range(prompt, total)):
            row = torch.zeros(1, HKV, total, dtype=torch.bool)
            for head, positions in enumerate(held[step][layer_idx]):
                row[0, head, positions] = True
            row[..., t] = True
            allowed[:, :, t] = row
        layer.self_attn._test_allowed = allowed
    ref = reference(ids).logits[0, prompt - 1 : total - 1]
    torch.testing.assert_close(torch.cat(logits[:-1]), ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ref, sdpa(ids).logits[0, prompt - 1 : total - 1], atol=1e-3)
    # SnapKV: 12 kept slots per KV head on average + one per decode step; H2O evicts back to 12 at every step;
    # the bytes are those slots', in buffers with at most 1/32 spare room each
    per_head = 12 if "h2o" in inner else 12 + steps
    assert [sum(row) for row in telemetry["valid_tokens_per_head"]] == [per_head * HKV] * LAYERS
    kept = LAYERS * HKV * per_head * 2 * D * 4
    assert kept <= telemetry["kv_cache_bytes"] <= kept * 33 / 32 + LAYERS * HKV * 2 * D * 4
    assert telemetry["padding_fraction"] == 0


def test_only_the_kept_bytes_are_held(sdpa):
    """After a head-wise compression the heads are stored apart: the K/V bytes are exactly the kept slots', the
    same as a uniform budget's, not every head padded to the widest (0.35 of the K/V at ratio 0.25 before)."""
    ids = random_prompt(40, seed=3)
    method = AdaKV(SnapKV(budget=12, window=4), alpha=0.0)
    with method.make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
        layer = cache.layers[0]
        assert isinstance(layer, RaggedLayer) and layer.ragged
        counts = layer.valid_counts()
        assert int(counts.max()) > 12 > int(counts.min())  # really ragged
        assert kv_cache_bytes(cache) == LAYERS * HKV * 12 * 2 * D * 4  # kept slots only
        telemetry = method.telemetry(cache)
    with SnapKV(budget=12, window=4).make_cache(sdpa) as uniform:
        sdpa(ids, past_key_values=uniform, use_cache=True)
        assert kv_cache_bytes(uniform) == kv_cache_bytes(cache)
    assert telemetry["padding_fraction"] == 0 and telemetry["kept_tokens_per_layer"] == [12.0] * LAYERS
    assert [sum(row) for row in telemetry["valid_tokens_per_head"]] == [12 * HKV] * LAYERS


def test_a_second_prefill_chunk_repacks_and_matches_the_masked_layout(sdpa):
    """A chunked prefill: the second chunk unpacks the ragged heads, attends with the per-head mask, compresses
    again and packs; the result is one held position set per head and the layer's total stays the budget."""
    ids = random_prompt(48, seed=5)
    method = AdaKV(SnapKV(budget=10, window=4), alpha=0.0)
    with method.make_cache(sdpa) as cache:
        sdpa(ids[:, :24], past_key_values=cache, use_cache=True)
        assert all(layer.ragged for layer in cache.layers)
        sdpa(ids[:, 24:], past_key_values=cache, use_cache=True)
        assert any(layer.ragged for layer in cache.layers)
        for layer in cache.layers:
            assert int(layer.valid_counts().sum()) == 10 * HKV  # an even split stays one rectangular tensor
            for positions in layer.head_positions()[0]:
                assert positions.tolist() == sorted(set(positions.tolist())) and int(positions.max()) < 48


@pytest.mark.parametrize("spec, message", [
    ("adakv:method=full", "wraps a scored method"),
    ("adakv:method=snapkv:alpha=1.5", "alpha must be in"),
    ("adakv:method=snapkv,budget=64:budget=32", "differs from the wrapped method"),
    ("adakv:method=chunked", "wraps a scored method"),
])
def test_bad_arguments_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)


def test_registered_round_trips_and_refuses_padding(sdpa):
    assert METHODS["adakv"] is AdaKV
    for spec in ["adakv:method=snapkv,budget=64,window=8", "adakv:method=pyramidkv,ratio=0.25:alpha=0.5"]:
        method = build_method(spec)
        assert build_method(method.spec) == method
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="padded batch"):
        sdpa.generate(random_prompt(20, batch=2), attention_mask=mask, max_new_tokens=2, do_sample=False,
                      past_key_values=build_method("adakv:method=snapkv,budget=8,window=4").make_cache(sdpa))
    assert sdpa.model.layers[0].self_attn.config is sdpa.config
