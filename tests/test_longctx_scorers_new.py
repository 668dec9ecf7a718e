"""KeyDiff, ExpectedAttention and KVzip (kvpress's strongest scorers) on mmaccel's scorer base: selections against
hand-computed and independently computed cases, token equality at an unbounded budget, decode logits after a real
compression against tests/test_longctx_methods.py's per-head masked reference, bytes held, compositions and errors."""
import math

import pytest
import test_longctx_methods as methods_tests
import torch
from test_longctx_methods import (
    test_decode_logits_after_real_compression_match_a_per_head_masked_reference as _decode_matches_reference,
)
from test_longctx_methods import test_every_evicting_method_refuses_a_left_padded_batch as _refuses_padding
from test_longctx_methods import test_every_method_runs_an_unpadded_batch_row_by_row as _row_by_row
from test_longctx_methods import test_unbounded_budget_is_token_identical_to_full_and_warns as _unbounded_is_full
from tiny_models import random_prompt, tiny_llama
from transformers import DynamicCache

from mmaccel.longctx import METHODS, ExpectedAttention, KeyDiff, KVzip, build_method, kv_cache_bytes
from mmaccel.longctx.expected_attention import expected_attention_scores, future_rotation
from mmaccel.longctx.keydiff import keydiff_scores
from mmaccel.longctx.kvzip import _encode_prompts

LAYERS, HQ, HKV, HEAD_DIM = 2, 4, 2, 16
COMPRESSING = {
    "keydiff": "keydiff:budget=12",
    "expected_attention": "expected_attention:budget=12",
    "kvzip": "kvzip:budget=12:chunk=16",  # global budgets over layers and KV heads, heads stored apart
    "kvzip-uniform": "kvzip:budget=12:chunk=16:budgets=uniform",
}
UNBOUNDED = {"keydiff": "keydiff:budget=1000", "expected_attention": "expected_attention:budget=1000",
             "kvzip": "kvzip:budget=1000"}


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, attn="sdpa")


@pytest.fixture(scope="module")
def eager():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, attn="eager")


def _full_keys(model, ids):
    cache = DynamicCache(config=model.config)
    model(ids, past_key_values=cache, use_cache=True)
    return cache


def _top(scores, keep):
    return scores.topk(keep, dim=-1).indices.sort(dim=-1).values


def test_registered_with_round_tripping_specs():
    assert {"keydiff", "expected_attention", "kvzip"} <= set(METHODS)
    extra = ["kvzip:ratio=0.25", "expected_attention:window=8:vnorm=False"]
    for spec in [*COMPRESSING.values(), *UNBOUNDED.values(), *extra]:
        method = build_method(spec)
        assert build_method(method.spec) == method


# ------------------------- equivalence when unbounded, decode logits after a real compression, padding, batches
# (tests/test_longctx_methods.py's checks, run on these methods' specs)
@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_unbounded_budget_is_token_identical_to_full_and_warns(name, sdpa, monkeypatch):
    monkeypatch.setitem(methods_tests.UNBOUNDED, name, UNBOUNDED[name])
    _unbounded_is_full(name, sdpa)


@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_decode_logits_after_real_compression_match_a_per_head_masked_reference(name, sdpa, monkeypatch):
    monkeypatch.setitem(methods_tests.COMPRESSING, name, COMPRESSING[name])
    _decode_matches_reference(name, sdpa)


@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_refuses_a_left_padded_batch(name, sdpa, monkeypatch):
    monkeypatch.setitem(methods_tests.COMPRESSING, name, COMPRESSING[name])
    _refuses_padding(name, sdpa)


@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_an_unpadded_batch_is_compressed_row_by_row(name, sdpa, monkeypatch):
    monkeypatch.setitem(methods_tests.COMPRESSING, name, COMPRESSING[name])
    _row_by_row(name, sdpa)


# ------------------------------------------------------------------------------------------------------- KeyDiff
def test_keydiff_scores_hand_computed():
    # three keys along x (one long) and one along y: the mean direction is near x, so y is the most distinctive;
    # the long x key is exactly as similar as the short ones (cosine, not dot product)
    keys = torch.tensor([[[[1.0, 0.0], [5.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]])
    scores = keydiff_scores(keys)[0, 0]
    anchor = torch.tensor([3.0, 1.0]) / math.sqrt(10)  # mean of the unit keys (3/4, 1/4), normalised
    torch.testing.assert_close(scores, -torch.tensor([anchor[0], anchor[0], anchor[0], anchor[1]]))
    assert _top(scores[None, None], 1)[0, 0].tolist() == [3]


def test_keydiff_keeps_the_keys_least_similar_to_the_mean_key(sdpa):
    ids = random_prompt(24, seed=4)
    full = _full_keys(sdpa, ids)
    with KeyDiff(budget=6).make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
    for layer, ref in zip(cache.layers, full.layers):
        keys = ref.keys  # [1, Hkv, 24, D]
        anchor = (keys / keys.norm(dim=-1, keepdim=True)).mean(dim=2, keepdim=True)
        similarity = torch.nn.functional.cosine_similarity(keys, anchor.expand_as(keys), dim=-1)
        assert torch.equal(layer.positions, _top(-similarity, 6))


# -------------------------------------------------------------------------------------------- ExpectedAttention
def test_future_rotation_is_the_mean_of_the_models_own_rope_over_the_next_positions(sdpa):
    rope = sdpa.model.rotary_emb
    x = torch.zeros(1, 1, HEAD_DIM)
    now = rope(x, torch.arange(30)[None])  # a 30-token forward's (cos, sin)
    cos, sin = rope(x, torch.arange(30, 30 + 64)[None])  # the 64 positions after it
    c, s = future_rotation(now, 64)
    torch.testing.assert_close(c, cos[0].mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, sin[0].mean(0), rtol=1e-5, atol=1e-5)


def test_expected_attention_closed_form_matches_sampled_queries():
    torch.manual_seed(0)
    D, S = 4, 6
    keys = torch.randn(1, 1, S, D)
    mean = torch.randn(1, 1, D) * 0.5
    a = torch.randn(D, D) * 0.3
    cov = (a @ a.T)[None, None]
    scaling = 0.5
    q = torch.distributions.MultivariateNormal(mean[0, 0], cov[0, 0]).sample((200_000,))  # [N, D]
    sampled = torch.exp(scaling * q @ keys[0, 0].T).mean(0)  # E[exp(s q.k)] per key
    closed = expected_attention_scores(mean, cov, keys, scaling=scaling)[0, 0]
    torch.testing.assert_close(closed, sampled / sampled.sum(), rtol=2e-2, atol=2e-3)
    # mean only: a plain softmax of the mean query's logits
    torch.testing.assert_close(expected_attention_scores(mean, None, keys, scaling=scaling)[0, 0],
                               (scaling * keys[0, 0] @ mean[0, 0]).softmax(-1))


def test_expected_attention_selection_recomputed_from_the_model(sdpa):
    """Pre-RoPE queries of the 20 non-sink tokens -> mean/cov -> rotated by the model's own RoPE averaged over the 32
    next positions -> closed-form scores, GQA mean, times ||v||; sinks kept: the positions the method holds."""
    ids = random_prompt(24, seed=5)
    captured = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda m, a, kw, o: captured.__setitem__(m.layer_idx, kw["hidden_states"]), with_kwargs=True)
        for layer in sdpa.model.layers]
    full = _full_keys(sdpa, ids)
    for h in hooks:
        h.remove()
    cos, sin = sdpa.model.rotary_emb(torch.zeros(1, 1, HEAD_DIM), torch.arange(24, 24 + 32)[None])
    with ExpectedAttention(budget=8, future=32, sink=4).make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
    for i, (layer, ref) in enumerate(zip(cache.layers, full.layers)):
        attn = sdpa.model.layers[i].self_attn
        q = attn.q_proj(captured[i][0, 4:]).view(20, HQ, HEAD_DIM).transpose(0, 1)  # [Hq, 20, D] pre-RoPE
        mu, centred = q.mean(1), q - q.mean(1, keepdim=True)
        cov = centred.transpose(1, 2) @ centred / 20
        rotated = [(mu * c + methods_rotate(mu) * s) for c, s in zip(cos[0], sin[0])]
        mu_future = torch.stack(rotated).mean(0)  # E[R_p mu] = mean_p R_p mu
        r_bar = torch.stack([torch.diag(c) + torch.diag(s) @ rotate_matrix() for c, s in zip(cos[0], sin[0])]).mean(0)
        cov_future = r_bar @ cov @ r_bar.T
        k = ref.keys[0].repeat_interleave(HQ // HKV, dim=0)[:, 4:]  # [Hq, 20, D]
        logits = attn.scaling * torch.einsum("hsd,hd->hs", k, mu_future)
        logits = logits + 0.5 * attn.scaling**2 * torch.einsum("hsd,hde,hse->hs", k, cov_future, k)
        probs = logits.softmax(-1).view(HKV, HQ // HKV, 20).mean(1) * ref.values[0, :, 4:].norm(dim=-1)
        expected = torch.cat([torch.arange(4).expand(HKV, 4), 4 + _top(probs, 4)], dim=-1)
        assert layer.positions[0].tolist() == expected.tolist()


def methods_rotate(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_matrix():
    half = HEAD_DIM // 2
    p = torch.zeros(HEAD_DIM, HEAD_DIM)
    p[:half, half:], p[half:, :half] = -torch.eye(half), torch.eye(half)
    return p


# ------------------------------------------------------------------------------------------------------ KVzip
@pytest.mark.parametrize("budgets", ["global", "uniform"])
@pytest.mark.parametrize("chunk", [40, 16])
def test_kvzip_scores_are_the_max_attention_of_the_reconstruction(eager, chunk, budgets):
    """Reference: one eager forward of [context, repeat of chunk c (after the previous chunk's last 8 tokens)]; each
    context slot of chunk c scores the max attention any repeat query of its GQA group pays it, normalised over the
    sinks, chunk c and the repeat; sinks kept. ``uniform``: each layer and KV head keeps its ``budget`` best;
    ``global``: the ``budget x Hkv x layers`` best over every layer and KV head, each head holding its own."""
    ids = random_prompt(40, seed=6)
    budget = 10
    method = KVzip(budget=budget, chunk=chunk, sink=4, budgets=budgets)
    with method.make_cache(eager) as cache:
        eager(ids, past_key_values=cache, use_cache=True)
    reference = torch.zeros(LAYERS, HKV, 40)
    for start in range(0, 40, chunk):
        end = min(start + chunk, 40)
        repeat = torch.cat([ids[:, max(0, start - 8): start], ids[:, start:end]], dim=-1) if start else ids[:, :end]
        attentions = eager(torch.cat([ids, repeat], dim=-1), output_attentions=True).attentions
        for i, att in enumerate(attentions):  # [1, Hq, 40 + r, 40 + r]
            rows = att[0, :, 40:]  # the repeat's queries; renormalised over sinks + chunk + repeat (kvpress's softmax)
            sinks = min(4, start)
            rows = rows / (rows[..., :sinks].sum(-1) + rows[..., start:end].sum(-1) + rows[..., 40:].sum(-1))[..., None]
            column = rows[..., start:end].amax(dim=1)  # [Hq, end - start]
            reference[i, :, start:end] = column.view(HKV, HQ // HKV, -1).amax(dim=1)
    reference[..., :4] = float("inf")
    if budgets == "uniform":
        for i, layer in enumerate(cache.layers):
            assert layer.positions[0].tolist() == _top(reference[i], budget).tolist()
            assert layer.held == budget
        return
    chosen = torch.zeros(LAYERS * HKV * 40, dtype=torch.bool)
    chosen[reference.flatten().topk(budget * HKV * LAYERS).indices] = True
    chosen = chosen.view(LAYERS, HKV, 40)
    counts = []
    for i, layer in enumerate(cache.layers):
        assert layer.ragged or bool(layer.slot_state["valid"].all())
        for head, positions in enumerate(layer.head_positions()[0]):
            assert positions.tolist() == chosen[i, head].nonzero().flatten().tolist()
            counts.append(len(positions))
    assert sum(counts) == budget * HKV * LAYERS and len(set(counts)) > 1  # the budget, unevenly spread


@pytest.mark.parametrize("budgets", ["global", "uniform"])
def test_kvzip_holds_only_the_kept_bytes(sdpa, budgets):
    ids = random_prompt(40, seed=7)
    full = _full_keys(sdpa, ids)
    method = build_method(f"kvzip:ratio=0.25:budgets={budgets}")
    with method.make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
        telemetry = method.telemetry(cache)
    assert sum(telemetry["kept_tokens_per_layer"]) == 10 * LAYERS  # ceil(0.25 * 40) per KV head on average
    assert kv_cache_bytes(cache) == LAYERS * 2 * HKV * 10 * HEAD_DIM * 4 == kv_cache_bytes(full) // 4
    assert telemetry["kv_cache_bytes"] == kv_cache_bytes(cache) and telemetry["evicted_tokens"] == LAYERS * 30
    if budgets == "global":
        assert telemetry["padding_fraction"] == 0
        assert sum(map(sum, telemetry["valid_tokens_per_head"])) == 10 * HKV * LAYERS


def test_kvzip_global_refuses_a_second_prefill_forward_and_uniform_serves_it(sdpa):
    """Global budgets leave layers of different lengths, which a later multi-token forward's one mask cannot cover:
    the second chunk of a chunked prefill is refused with the fix named; uniform budgets compress each chunk."""
    ids = random_prompt(96, seed=11)
    cache = build_method("chunked:chunk=32:method=kvzip,budget=24").make_cache(sdpa)
    with pytest.raises(ValueError, match="budgets=uniform"):
        sdpa.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.hooks_attached == 0  # the refusal closed the cache
    with build_method("chunked:chunk=32:method=kvzip,budget=24,budgets=uniform").make_cache(sdpa) as cache:
        sdpa.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
        assert [layer.held for layer in cache.layers] == [25, 25]  # 24 kept, then one decode token


class _ChatTokenizer:
    """Two words, one id per character; a chat template that wraps the user's message."""
    chat_template = "chat"

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<u>{messages[0]['content']}</u><a>"


def test_kvzip_instruction_and_chat_suffix_come_from_the_tokenizer(sdpa):
    first, following, suffix = _encode_prompts(_ChatTokenizer())
    assert "".join(map(chr, first)) == "\n\nRepeat the previous context:" and "".join(map(chr, suffix)) == "</u><a>"
    assert "".join(map(chr, following)).startswith("\n\nRepeat the previous context")
    ids = random_prompt(20, seed=8)
    cache = KVzip(budget=8, chunk=12, overlap=3).make_cache(sdpa, tokenizer=_ChatTokenizer())
    assert cache.warnings == []
    repeat = cache._repeat_ids(ids, 12, 20)[0].tolist()
    assert repeat == [*following, *ids[0, 9:12].tolist(), *suffix, *ids[0, 12:20].tolist()]
    assert cache._repeat_ids(ids, 0, 12)[0].tolist() == [*first, *suffix, *ids[0, :12].tolist()]
    cache.close()
    with KVzip(budget=8).make_cache(sdpa) as bare:  # a model with no tokenizer beside it: warned, no instruction
        assert bare._repeat_ids(ids, 0, 20).shape[-1] == 20 and "no tokenizer" in bare.warnings[0]


# ----------------------------------------------------------------------------------------- compositions, errors
@pytest.mark.parametrize("spec, kept", [("chunkkv:chunk=4:method=keydiff,ratio=0.25", 10),
                                        ("chunkkv:method=expected_attention,ratio=0.25", 10),
                                        ("kvquant:bits=4:residual=4:group=2:method=keydiff,ratio=0.25", 10),
                                        ("kvquant:bits=4:residual=4:group=2:method=expected_attention,budget=12", 12)])
def test_composes_with_chunkkv_and_kvquant(spec, kept, sdpa):
    method = build_method(spec)
    with method.make_cache(sdpa) as cache:
        sdpa(random_prompt(40, seed=9), past_key_values=cache, use_cache=True)
        assert method.telemetry(cache)["kept_tokens_per_layer"] == [kept] * LAYERS


def test_chunkkv_keeps_whole_chunks_of_keydiff(sdpa):
    with build_method("chunkkv:chunk=4:method=keydiff,budget=16").make_cache(sdpa) as cache:
        sdpa(random_prompt(40, seed=9), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            chunks = (layer.positions[0] // 4).tolist()
            assert all(row.count(c) == 4 for row in chunks for c in set(row))


@pytest.mark.parametrize("spec, message", [
    ("kvquant:bits=4:method=kvzip,ratio=0.25", "not kvzip"),
    ("kvzip:chunk=0", "chunk"),
    ("kvzip:budgets=layer", "'global' or 'uniform'"),
    ("kvquant:bits=4:method=kvzip,ratio=0.25,budgets=uniform", "not kvzip"),
    ("kvzip:ratio=0.25:budget=8", "not both"),
    ("expected_attention:future=0", "future"),
    ("expected_attention:vnorm=1", "vnorm"),
    ("expected_attention:window=0", "window"),
    ("keydiff:ratio=2", "ratio"),
])
def test_bad_arguments_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)


def test_kvzip_wrapped_by_chunkkv_raises_on_the_first_prefill(sdpa):
    cache = build_method("chunkkv:method=kvzip,ratio=0.25").make_cache(sdpa)
    with pytest.raises(ValueError, match="cannot be wrapped"):
        sdpa(random_prompt(20), past_key_values=cache, use_cache=True)
    assert cache.hooks_attached == 0
    with pytest.raises(ValueError, match="speculative"):
        KVzip(budget=8).make_cache(sdpa, speculative=True)
