"""LongHeads: chunk means and chunk selection hand-computed, pre-RoPE caching exact, token-identical to full attention
while the context fits the window, decode logits after a real selection against an independent per-head reference
with remapped positions, clear errors, and a run past the model's trained length with every RoPE position inside it."""
import math

import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from mmaccel.longctx import METHODS, build_method
from mmaccel.longctx.longheads import LongHeads, LongHeadsLayer, chunk_means, select_chunks

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")


# ------------------------------------------------------------------------------------------- independent RoPE
def _angles(positions: torch.Tensor, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    a = positions.float()[:, None] * inv
    return torch.cat([a, a], -1).cos(), torch.cat([a, a], -1).sin()


def _turn(x: torch.Tensor) -> torch.Tensor:  # 90 degrees in every (i, i + D/2) plane
    return torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)


def _rope(x, positions):
    cos, sin = _angles(positions)
    return x * cos + _turn(x) * sin


def _unrope(x, positions):
    cos, sin = _angles(positions)
    return x * cos - _turn(x) * sin


# ------------------------------------------------------------------------------------------------- selection
def test_chunk_means_and_selection_hand_computed():
    keys = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])[None, None]  # [1, 1, 3, 2]
    assert chunk_means(keys, 2)[0, 0].tolist() == [[2.0, 3.0]]  # the partial chunk has no representation yet
    reps = torch.tensor([[-9, -9], [2, -1], [0, 3], [-1, -1], [1, 1], [-9, -9]], dtype=torch.float)[None, None]
    both_up = torch.tensor([[1.0, 0.0], [0.0, 1.0]])[None]  # two query heads of one KV head: their sum is [1, 1]
    # scores of chunks 1..4 against [1, 1]: 1, 3, -2, 2; chunks 0 (sink) and 5 (before the own chunk 6) are forced
    assert select_chunks(both_up, reps, own=6, count=4)[0, 0].tolist() == [0, 2, 5]
    assert select_chunks(both_up, reps, own=6, count=5)[0, 0].tolist() == [0, 2, 4, 5]
    assert select_chunks(both_up, reps, own=6, count=3)[0, 0].tolist() == [0, 5]
    tilted = torch.tensor([[1.0, 0.0], [0.0, -1.0]])[None]  # sum [1, -1]: 3, -3, 0, 0
    assert select_chunks(tilted, reps, own=6, count=4)[0, 0].tolist() == [0, 1, 5]
    assert select_chunks(tilted, reps, own=3, count=4)[0, 0].tolist() == [0, 1, 2]  # all fit: every earlier chunk


def test_keys_are_cached_before_rope_and_chunk_means_kept_as_they_complete():
    torch.manual_seed(0)
    plain = torch.randn(1, HKV, 21, D)
    cos, sin = _angles(torch.arange(21))
    rotated = apply_rotary_pos_emb(plain, plain, cos[None], sin[None])[1]  # transformers' own rotation
    cos12, sin12 = _angles(torch.arange(12))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    layer = LongHeadsLayer(chunk=4, window=12, inv_freq=inv_freq, scaling=1.0, cos=cos12, sin=sin12)
    layer.update(rotated[:, :, :10], rotated[:, :, :10])
    for t in range(10, 21):
        layer.update(rotated[:, :, t : t + 1], rotated[:, :, t : t + 1])
    torch.testing.assert_close(layer.keys, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.reps, plain[:, :, :20].reshape(1, HKV, 5, 4, D).mean(3), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------- exact when it fits
@pytest.mark.parametrize("spec", ["longheads:chunk=16", "longheads:chunk=8:window=128"])
def test_context_within_the_window_is_token_identical_to_full_and_warns(spec, sdpa):
    """100 prompt tokens + 8 new ones fit both windows (512 = the trained length, and 128): every chunk is read at
    its true position, so greedy decoding is full attention's, token for token."""
    ids = random_prompt(100, seed=2)
    greedy = {"max_new_tokens": 8, "do_sample": False}
    method = build_method(spec)
    cache = method.make_cache(sdpa)
    try:
        sparse = sdpa.generate(ids, past_key_values=cache, **greedy)
        telemetry = method.telemetry(cache)
    finally:
        cache.close()
    assert torch.equal(sparse, sdpa.generate(ids, **greedy))
    assert telemetry["kv_read_fraction"] == 1.0 and any("every chunk was read" in w for w in telemetry["warnings"])
    assert telemetry["max_rope_position"] == 106  # the true positions: 100 prompt + 7 decoded tokens before the last


# --------------------------------------------------------------------------------------- real selection vs reference
def _remapped_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention for prompt rows; for decode row t, per query head: the recorded chunks of its KV head plus
    its own chunk up to t, laid at positions 0..n-1 (query at n-1), RoPE re-applied there."""
    chosen, prompt, chunk = module._test_chosen, module._test_prompt, module._test_chunk
    group = query.shape[1] // key.shape[1]
    total = query.shape[2]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    causal = torch.ones(total, total).tril().bool()
    out = ((query @ k.transpose(-1, -2)) * scaling).masked_fill(~causal, float("-inf")).softmax(-1) @ v
    top = []
    plain_k = _unrope(key[0], torch.arange(total))  # [Hkv, total, D]
    for step, t in enumerate(range(prompt, total)):
        own = t // chunk
        means = plain_k[:, : own * chunk].reshape(key.shape[1], own, chunk, -1).mean(2)
        plain_q = _unrope(query[0, :, t : t + 1], torch.tensor([t]))[:, 0]  # [Hq, D]
        scores = (plain_q.reshape(key.shape[1], group, -1).sum(1)[:, None] * means).sum(-1)  # [Hkv, own]
        top.append(scores[:, 1 : own - 1].argmax(-1) + 1)  # the one chunk picked besides sink and previous
        for h in range(query.shape[1]):
            rows = torch.cat([(chosen[step][0, h // group, :, None] * chunk + torch.arange(chunk)).flatten(),
                              torch.arange(own * chunk, t + 1)])
            n = len(rows)
            ks = _rope(_unrope(key[0, h // group, rows], rows), torch.arange(n))
            qs = _rope(_unrope(query[0, h, t : t + 1], torch.tensor([t])), torch.tensor([n - 1]))
            out[0, h, t] = ((qs @ ks.T) * scaling).softmax(-1) @ value[0, h // group, rows]
    module._test_top = torch.stack(top)
    return out.transpose(1, 2).contiguous(), None


def _stepwise(model, method, ids, prompt):
    """Prefill ``prompt`` tokens, then one forward per token: the last-position logits of every forward [n, V], the
    chunks every layer read at each decode step, and the telemetry."""
    ends = [prompt, *range(prompt + 1, ids.shape[1] + 1)]
    out, chosen = [], []
    with method.make_cache(model) as cache:
        for begin, end in zip([0, *ends], ends):
            out.append(model(ids[:, begin:end], past_key_values=cache, use_cache=True).logits[0, -1])
            if end > prompt:
                chosen.append([layer.last_chunks.clone() for layer in cache.layers])
        return torch.stack(out), chosen, method.telemetry(cache)


def _remapped_model(chosen, prompt, chunk):
    """The same tiny Llama (same seed) running :func:`_remapped_reference` with each layer's recorded chunks."""
    model = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")
    AttentionInterface.register("longheads_remapped_test", _remapped_reference)
    AttentionMaskInterface.register("longheads_remapped_test", sdpa_mask)
    model.set_attn_implementation("longheads_remapped_test")
    for i, block in enumerate(model.model.layers):
        block.self_attn._test_chosen = [per_layer[i] for per_layer in chosen]
        block.self_attn._test_prompt, block.self_attn._test_chunk = prompt, chunk
    return model


def test_decode_logits_after_real_selection_match_a_remapped_per_head_reference(sdpa):
    """Prefill 32 tokens (4 chunks of 8 = the window: exact), then 12 decode steps in chunks 4 and 5, where each KV
    head reads the sink, the previous chunk, its own chunk and the best 1 of the other earlier chunks."""
    prompt, steps, chunk = 32, 12, 8
    total = prompt + steps
    ids = random_prompt(total, seed=3)
    logits, chosen, telemetry = _stepwise(sdpa, LongHeads(chunk=chunk, window=32), ids, prompt)
    reference = _remapped_model(chosen, prompt, chunk)
    with torch.no_grad():
        expected_logits = reference(ids).logits[0, prompt - 1 : total]
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expected_logits, sdpa(ids).logits[0, prompt - 1 : total], atol=1e-3)
    for i, layer in enumerate(reference.model.layers):  # the selection itself, recomputed from the plain keys
        picked = torch.stack([c[i][0, :, 1] for c in chosen])  # [steps, Hkv]: the chunk between sink and previous
        assert torch.equal(picked, layer.self_attn._test_top)
        assert all(c[i][0, :, 0].eq(0).all() and c[i][0, :, 2].eq(t // chunk - 1).all()
                   for c, t in zip(chosen, range(prompt, total)))
    assert len({tuple(p.tolist()) for c in chosen for p in c[0][0]}) > 1  # the heads do not all read the same
    expected = [(3 * chunk + t % chunk + 1) / (t + 1) for t in range(prompt, total)]
    assert telemetry["kv_read_fraction_per_step"] == pytest.approx(expected, abs=1e-6)
    assert telemetry["chunks_per_step"] == [4.0] * steps and telemetry["max_rope_position"] == 31
    assert telemetry["kv_cache_bytes"] == LAYERS * 2 * HKV * total * D * 4  # full storage: LongHeads bounds reads
    table = 2 * 32 * D * 4  # the shared rotation table, counted once
    assert telemetry["bookkeeping_bytes"] == LAYERS * HKV * (total // chunk) * D * 4 + table


def test_prefill_split_on_chunk_boundaries_equals_one_prefill(sdpa):
    ids = random_prompt(96, seed=5)
    method = LongHeads(chunk=8, window=32)
    with method.make_cache(sdpa) as cache:
        whole = sdpa(ids, past_key_values=cache, use_cache=True).logits
    with method.make_cache(sdpa) as cache:
        parts = torch.cat([sdpa(ids[:, i : i + 16], past_key_values=cache, use_cache=True).logits
                           for i in range(0, 96, 16)], dim=1)
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(whole, sdpa(ids).logits, atol=1e-3)  # past the window the prefill is sparse


# ------------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("spec, message", [
    ("longheads:chunk=0", "chunk must be an integer >= 1"),
    ("longheads:window=0", "window must be an integer >= 1"),
    ("longheads:chunk=16:window=40", r"multiple of chunk .*longheads:chunk=16:window=48"),
    ("longheads:chunk=16:window=32", "at least 3"),
])
def test_bad_arguments_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)


def test_model_dependent_errors_and_padding(sdpa, monkeypatch):
    with pytest.raises(ValueError, match="exceeds the model's trained length .*window=512"):
        build_method("longheads:chunk=16:window=1024").make_cache(sdpa)
    with pytest.raises(ValueError, match="holds 2 chunks of 256.*at least 3"):
        build_method("longheads").make_cache(sdpa)  # default chunk 256 on a 512-position model
    with pytest.raises(ValueError, match="make_cache"):
        LongHeads(chunk=8).make_layer(0)
    with monkeypatch.context() as patch:
        patch.setattr(sdpa.model.rotary_emb, "rope_type", "dynamic")
        with pytest.raises(ValueError, match="plain RoPE"):
            build_method("longheads:chunk=8").make_cache(sdpa)
    ids = random_prompt(20, batch=2)
    left_padded = (torch.arange(20) >= torch.tensor([[2], [0]])).long()  # row 0 starts with 2 pads
    with pytest.raises(ValueError, match="left-padded batch"):
        sdpa.generate(ids, attention_mask=left_padded, past_key_values=LongHeads(chunk=8).make_cache(sdpa),
                      max_new_tokens=2, do_sample=False)
    assert sdpa.model.layers[0].self_attn.config is sdpa.config  # the failed run gave the model its attention back


def test_registered_and_round_trips_its_spec():
    assert METHODS["longheads"] is LongHeads
    method = build_method("longheads:chunk=64:window=512")
    assert build_method(method.spec) == method and method.spec == "longheads:chunk=64:window=512"


# ------------------------------------------------------------------------------------- past the trained length
def test_runs_past_the_trained_length_with_every_rope_position_inside_it(monkeypatch):
    model = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, max_positions=64)
    rotated_to = []
    original = LongHeadsLayer.rotate

    def spy(self, x, first):
        rotated_to.append(first + x.shape[2] - 1)
        return original(self, x, first)

    monkeypatch.setattr(LongHeadsLayer, "rotate", spy)
    ids = random_prompt(200, seed=6)
    method = build_method("longheads:chunk=8")  # window = the trained 64 positions = 8 chunks
    with method.make_cache(model) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, return_dict_in_generate=True, output_logits=True)
        telemetry = method.telemetry(cache)
    assert out.sequences.shape == (1, 206) and all(torch.isfinite(s).all() for s in out.logits)
    assert rotated_to and max(rotated_to) == 63 < model.config.max_position_embeddings
    assert telemetry["max_rope_position"] == 63 and telemetry["window"] == telemetry["trained_length"] == 64
    assert telemetry["seen_tokens"] == 205 > 3 * 64  # the last generated token never goes through the cache
    expected = [(7 * 8 + t % 8 + 1) / (t + 1) for t in range(200, 205)]
    assert telemetry["kv_read_fraction_per_step"] == pytest.approx(expected, abs=1e-6)
    assert all(0 < c < 1 for c in telemetry["chunk_coverage"]) and telemetry["warnings"] == []
    assert math.isclose(telemetry["kv_read_fraction"], sum(expected) / len(expected), abs_tol=1e-6)
