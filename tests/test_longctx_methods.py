"""mmaccel.longctx on one base: every method's selection, its equivalence at an unbounded budget, and decode logits
after a real compression against an independent per-head masked reference."""
import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.longctx import (
    H2O,
    METHODS,
    TOVA,
    Chunked,
    KNorm,
    PyramidKV,
    SnapKV,
    StreamingLLM,
    bookkeeping_bytes,
    build_method,
    kv_cache_bytes,
)
from mmaccel.longctx.base import KVMethodCache, has_padding, mean_over_query_groups
from mmaccel.longctx.owned import OwnedAttentionCache
from mmaccel.longctx.pyramidkv import pyramid_budgets

LAYERS, HQ, HKV, HEAD_DIM = 2, 4, 2, 16
# Every method at a budget that forces eviction of a 40-token prompt (and, for decode-time methods, during decode).
COMPRESSING = {
    "streaming": "streaming:window=6:sink=2",
    "snapkv": "snapkv:budget=12:window=4",
    "pyramidkv": "pyramidkv:budget=12:window=4",
    "h2o": "h2o:budget=12:recent=4",
    "tova": "tova:budget=12",
    "knorm": "knorm:budget=12",
    "chunkkv": "chunkkv:chunk=4:method=snapkv,budget=12,window=4",
}
UNBOUNDED = {
    "streaming": "streaming:window=1000",
    "snapkv": "snapkv:budget=1000",
    "pyramidkv": "pyramidkv:budget=1000:window=8",
    "h2o": "h2o:budget=1000",
    "tova": "tova:budget=1000",
    "knorm": "knorm:budget=1000",
    "chunked": "chunked:chunk=7:method=snapkv,budget=1000",
    "chunkkv": "chunkkv:method=snapkv,budget=1000",
}


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, attn="sdpa")


@pytest.fixture(scope="module")
def eager():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, attn="eager")




def test_every_method_is_registered_and_round_trips_its_spec():
    assert set(COMPRESSING) | {"full", "chunked"} <= set(METHODS)
    for spec in [*COMPRESSING.values(), *UNBOUNDED.values(), "snapkv:ratio=0.25", "streaming:ratio=0.5"]:
        method = build_method(spec)
        assert build_method(method.spec) == method


# ------------------------------------------------------------------------------------- equivalence when unbounded
@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_unbounded_budget_is_token_identical_to_full_and_warns(name, sdpa):
    ids = random_prompt(40, seed=2)
    plain = sdpa.generate(ids, max_new_tokens=8, do_sample=False)
    method = build_method(UNBOUNDED[name])
    with method.make_cache(sdpa) as cache:
        out = sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
        telemetry = method.telemetry(cache)
    assert torch.equal(out, plain)
    assert any("ran as full attention" in w for w in telemetry["warnings"])


@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_compressing_budget_evicts_and_does_not_warn(name, sdpa):
    method = build_method(COMPRESSING[name])
    with method.make_cache(sdpa) as cache:
        sdpa.generate(random_prompt(40, seed=2), past_key_values=cache, max_new_tokens=4, do_sample=False)
        telemetry = method.telemetry(cache)
    assert telemetry["evicted_tokens"] > 0 and telemetry["warnings"] == []
    assert telemetry["kv_cache_bytes"] == kv_cache_bytes(cache) < LAYERS * 2 * HKV * 43 * HEAD_DIM * 4


# --------------------------------------------------------------- decode logits after a real compression vs reference
def _perhead_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Dense attention with the per-KV-head boolean mask the test put on the module: [B, Hkv, Lq, Lk]."""
    allowed = module._test_allowed.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # [B, Hq, Lq, Lk]
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (probs @ v).transpose(1, 2).contiguous(), None



def _live_positions(layer) -> torch.Tensor:
    """[B, Hkv, S'] positions a layer holds, less a slot marked dead by in-place decode eviction (``evict_one``); for
    a layer whose KV heads hold different counts (``head_positions``), each head padded by repeating its last."""
    if hasattr(layer, "head_positions"):
        heads = layer.head_positions()
        width = max(len(p) for row in heads for p in row)
        return torch.stack([torch.stack([p[torch.arange(width).clamp(max=len(p) - 1)] for p in row])
                            for row in heads])
    pos, free = layer.positions, getattr(layer, "free", None)
    if free is None:
        return pos.clone()
    alive = torch.ones_like(pos, dtype=torch.bool).scatter_(2, free[..., None], False)
    return pos[alive].view(*pos.shape[:2], -1)


@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_decode_logits_after_real_compression_match_a_per_head_masked_reference(name, sdpa):
    """Run prefill + 6 decode steps through the method's cache, recording which positions each layer and KV head held
    before each step; then one forward of the whole sequence through an independent attention function that lets
    decode row t see exactly those positions (+ itself) per KV head, and prompt rows everything causal."""
    prompt, steps = 40, 6
    ids = random_prompt(prompt + steps, seed=3)
    method = build_method(COMPRESSING[name])
    held = []  # per decode step: per layer [B, Hkv, S] positions
    logits = []
    with method.make_cache(sdpa) as cache:
        logits.append(sdpa(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1])
        kept = [[len(head.unique()) for head in _live_positions(layer)[0]] for layer in cache.layers]
        assert all(sum(heads) < prompt * len(heads) for heads in kept)  # a real compression
        for t in range(prompt, prompt + steps):
            held.append([_live_positions(layer) for layer in cache.layers])
            logits.append(sdpa(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    total = prompt + steps
    reference = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, attn="sdpa")
    AttentionInterface.register("perhead_test", _perhead_reference)
    AttentionMaskInterface.register("perhead_test", sdpa_mask)
    reference.set_attn_implementation("perhead_test")
    for layer_idx, layer in enumerate(reference.model.layers):
        allowed = torch.ones(1, HKV, total, total).tril().bool()
        for step, t in enumerate(range(prompt, total)):
            allowed[:, :, t] = False
            allowed[:, :, t].scatter_(-1, held[step][layer_idx], True)
            allowed[:, :, t, t] = True
        layer.self_attn._test_allowed = allowed
    ref = reference(ids).logits[0, prompt - 1 : total - 1]
    torch.testing.assert_close(torch.cat(logits[:-1]), ref, rtol=1e-4, atol=1e-5)
    full = sdpa(ids).logits[0, prompt - 1 : total - 1]
    assert not torch.allclose(ref, full, atol=1e-3)  # the compression changed the result


# ---------------------------------------------------------------------------------- selections, hand-computed
def test_knorm_keeps_the_smallest_key_norms(sdpa):
    ids = random_prompt(20, seed=4)
    full = DynamicCache(config=sdpa.config)
    sdpa(ids, past_key_values=full, use_cache=True)
    with KNorm(budget=5).make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
    for layer, ref in zip(cache.layers, full.layers):
        norms = ref.keys.norm(dim=-1)  # [1, Hkv, 20]
        expected = norms.topk(5, dim=-1, largest=False).indices.sort(dim=-1).values
        assert torch.equal(layer.positions, expected)


def test_tova_keeps_what_the_last_query_attends_to_head_averaged(eager):
    ids = random_prompt(24, seed=5)
    attentions = eager(ids, output_attentions=True).attentions
    with TOVA(budget=7).make_cache(eager) as cache:
        eager(ids, past_key_values=cache, use_cache=True)
    for layer_idx, layer in enumerate(cache.layers):
        last = attentions[layer_idx][0, :, -1, :].mean(0)  # [L] averaged over all query heads
        expected = last.topk(7).indices.sort().values
        assert layer.positions[0].tolist() == [expected.tolist()] * HKV


def test_h2o_accumulates_attention_and_evicts_at_every_decode_step(eager):
    """Prefill: accumulated = column sums of the model's own eager attention (GQA-mean); kept = the last `recent`
    slots + the heaviest others. Decode: each step adds the new token's attention and drops the lightest one."""
    budget, recent, length = 9, 3, 24
    ids = random_prompt(length + 1, seed=6)
    attentions = eager(ids[:, :length], output_attentions=True).attentions
    cache = H2O(budget=budget, recent=recent).make_cache(eager)
    eager(ids[:, :length], past_key_values=cache, use_cache=True)
    for layer_idx, layer in enumerate(cache.layers):
        acc = mean_over_query_groups(attentions[layer_idx].float().sum(dim=2), HKV)  # [1, Hkv, L]
        scores = acc.clone()
        scores[..., -recent:] = float("inf")
        expected = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.positions, expected)
        torch.testing.assert_close(layer.slot_state["attention"], acc.gather(2, expected), rtol=1e-4, atol=1e-6)
    # one decode step: budget + 1 held during attention, then the lightest non-recent slot is evicted (in place: it
    # is marked dead, for the next token to overwrite)
    before = [(layer.positions.clone(), layer.slot_state["attention"].clone()) for layer in cache.layers]
    eager(ids[:, length:], past_key_values=cache, use_cache=True)
    for layer, (pos, acc) in zip(cache.layers, before):
        live = _live_positions(layer)
        assert live.shape[-1] == budget and layer.free is not None
        alive = torch.ones_like(layer.positions, dtype=torch.bool).scatter_(2, layer.free[..., None], False)
        live_acc = layer.slot_state["attention"][alive].view(*live.shape)
        for h in range(HKV):
            assert {22, 23, 24} <= set(live[0, h].tolist())
            survivors = [p for p in live[0, h].tolist() if p != 24]
            old = dict(zip(pos[0, h].tolist(), acc[0, h].tolist()))
            assert set(survivors) < set(old) and len(set(old) - set(survivors)) == 1
            evicted = (set(old) - set(survivors)).pop()
            assert evicted not in (22, 23)  # never one of the recent slots
            new = dict(zip(live[0, h].tolist(), live_acc[0, h].tolist()))
            assert all(new[p] >= old[p] for p in survivors)  # attention only accumulates
    cache.close()


def test_pyramid_budgets_hand_computed_and_applied_per_layer(sdpa):
    # average 100, window 4, beta 20: low = 96 // 20 = 4, high = 2 * 96 - 4 = 188, step = 184 // 3 = 61
    assert pyramid_budgets(100, 4, 4, 20) == [192, 131, 70, 9]
    assert pyramid_budgets(12, 2, 4, 20) == [20, 4]
    with PyramidKV(budget=12, window=4).make_cache(sdpa) as cache:
        sdpa(random_prompt(40, seed=7), past_key_values=cache, use_cache=True)
    assert [layer.held for layer in cache.layers] == [20, 4]
    # each layer's kept slots are SnapKV's top-k at that layer's budget
    for layer_idx, budget in enumerate([20, 4]):
        with SnapKV(budget=budget, window=4).make_cache(sdpa) as ref:
            sdpa(random_prompt(40, seed=7), past_key_values=ref, use_cache=True)
        assert torch.equal(cache.layers[layer_idx].positions, ref.layers[layer_idx].positions)


# --------------------------------------------------------------------------------------------------- ratio budgets
@pytest.mark.parametrize("spec, kept", [("snapkv:ratio=0.25:window=4", 10), ("knorm:ratio=0.1", 4),
                                        ("streaming:ratio=0.25:sink=2", 10), ("h2o:ratio=0.5:recent=4", 20)])
def test_ratio_budget_keeps_that_fraction_of_the_prompt(spec, kept, sdpa):
    with build_method(spec).make_cache(sdpa) as cache:
        sdpa(random_prompt(40, seed=8), past_key_values=cache, use_cache=True)
    assert [layer.held for layer in cache.layers] == [kept] * LAYERS


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv:budget=64:ratio=0.5", "not both"),
        ("snapkv:ratio=0", "ratio"),
        ("snapkv:ratio=1.5", "ratio"),
        ("h2o:budget=8:recent=8", "recent"),
        ("knorm:budget=0", "budget"),
        ("tova:ratio=-1", "ratio"),
        ("pyramidkv:beta=0", "beta"),
        ("streaming:window=8:budget=20", "window . sink"),
        ("chunked:chunk=0", "chunk"),
        ("chunked:method=nosuch", "unknown KV-cache method 'nosuch'"),
    ],
)
def test_bad_arguments_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)


def test_a_ratio_below_the_window_keeps_the_window_and_warns(sdpa):
    method = build_method("snapkv:ratio=0.05:window=8")
    with method.make_cache(sdpa) as cache:
        sdpa(random_prompt(40), past_key_values=cache, use_cache=True)
        assert all(layer.held == 8 for layer in cache.layers)
        assert any("ratio=0.05 of 40 tokens is 2 slots" in w for w in cache.warnings)


# ---------------------------------------------------------------------------------------------- padding and masks
@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_every_evicting_method_refuses_a_left_padded_batch(name, sdpa):
    ids = random_prompt(24, seed=9, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = build_method(COMPRESSING[name]).make_cache(sdpa)
    with pytest.raises(ValueError, match="padded batch"):
        sdpa.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.hooks_attached == 0


@pytest.mark.parametrize("name", sorted(COMPRESSING))
def test_every_method_runs_an_unpadded_batch_row_by_row(name, sdpa):
    ids = random_prompt(30, seed=10, batch=2)
    method = build_method(COMPRESSING[name])
    with method.make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
    for row in range(2):
        with method.make_cache(sdpa) as single:
            sdpa(ids[row : row + 1], past_key_values=single, use_cache=True)
        for layer, ref in zip(cache.layers, single.layers):
            mine, own = _live_positions(layer)[row], _live_positions(ref)[0]
            assert [h.unique().tolist() for h in mine] == [h.unique().tolist() for h in own]


def test_has_padding_reads_4d_2d_and_flex_block_masks():
    assert not has_padding(None)
    four = torch.ones(2, 1, 3, 5, dtype=torch.bool).tril(diagonal=2)
    assert not has_padding(four)
    four[1, :, :, 0] = False
    assert has_padding(four)
    additive = torch.zeros(2, 1, 3, 5)
    assert not has_padding(additive)
    additive[0, :, :, 1] = torch.finfo(torch.float32).min
    assert has_padding(additive)
    assert not has_padding(torch.ones(2, 7, dtype=torch.long))
    assert has_padding(torch.tensor([[1, 1, 1], [0, 1, 1]]))
    with pytest.raises(ValueError, match="cannot tell padding"):
        has_padding(torch.ones(3, 3, 3))
    with pytest.raises(ValueError, match="cannot tell padding"):
        has_padding("mask")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    pad = torch.tensor([0, 3])

    def padded(b, h, q, kv):
        return (kv >= pad[b]) & (kv <= q)

    def causal(b, h, q, kv):
        return kv <= q

    kw = {"B": 2, "H": None, "Q_LEN": 8, "KV_LEN": 8, "device": "cpu"}
    assert has_padding(flex.create_block_mask(padded, **kw))
    assert not has_padding(flex.create_block_mask(causal, **kw))


def test_a_model_error_after_the_first_layer_leaves_no_hooks(sdpa):
    cache = SnapKV(budget=8, window=2).make_cache(sdpa)

    def boom(module, args):
        raise RuntimeError("boom")

    handle = sdpa.model.layers[1].mlp.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            sdpa(random_prompt(20), past_key_values=cache, use_cache=True)
    finally:
        handle.remove()
    assert cache.hooks_attached == 0 and len(sdpa.model.layers[0].self_attn._forward_hooks) == 0


# -------------------------------------------------------------------------------------------------- byte accounting
def test_kv_bytes_and_bookkeeping_bytes_are_reported_apart(sdpa):
    method = SnapKV(budget=8, window=2)
    with method.make_cache(sdpa) as cache:
        sdpa(random_prompt(20), past_key_values=cache, use_cache=True)
    assert kv_cache_bytes(cache) == LAYERS * 2 * HKV * 8 * HEAD_DIM * 4
    assert bookkeeping_bytes(cache) == LAYERS * HKV * 8 * 8  # int64 positions
    tel = method.telemetry(cache)
    assert (tel["kv_cache_bytes"], tel["bookkeeping_bytes"]) == (kv_cache_bytes(cache), bookkeeping_bytes(cache))
    with H2O(budget=8, recent=2).make_cache(sdpa) as h2o:
        sdpa(random_prompt(20), past_key_values=h2o, use_cache=True)
    assert bookkeeping_bytes(h2o) == LAYERS * HKV * 8 * (8 + 4)  # positions + float32 accumulated attention
    assert bookkeeping_bytes(DynamicCache(config=sdpa.config)) == 0


def test_sliding_window_layer_counts_the_storage_it_keeps_alive():
    """DynamicSlidingWindowLayer keeps a view of the last window-1 tokens of the concatenated K/V: the whole
    concatenation stays alive until the next update, and that is what is counted."""
    layer = DynamicSlidingWindowLayer(sliding_window=4)
    k = torch.randn(1, 2, 10, 8)
    layer.update(k, k.clone())
    assert layer.keys.shape[-2] == 3 and layer.keys.nbytes == 3 * 2 * 8 * 4

    class Holder:
        layers = [layer]

    assert kv_cache_bytes(Holder()) == 2 * (10 * 2 * 8 * 4)
    layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    assert kv_cache_bytes(Holder()) == 2 * (4 * 2 * 8 * 4)


# ---------------------------------------------------------------------------------------------------- chunked prefill
def test_chunked_full_is_token_identical_and_splits_the_prompt(sdpa):
    ids = random_prompt(40, seed=11)
    plain = sdpa.generate(ids, max_new_tokens=8, do_sample=False)
    lengths = []
    handle = sdpa.model.register_forward_pre_hook(
        lambda mod, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        method = Chunked("full", chunk=16)
        with method.make_cache(sdpa) as cache:
            out = sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(out, plain)
    assert lengths == [16, 16, 8] + [1] * 7
    assert method.telemetry(cache)["chunk"] == 16


def test_chunked_snapkv_window_is_the_current_chunks_last_queries(sdpa):
    """Chunk 1 (tokens 0..19) is compressed exactly as SnapKV on those 20 tokens alone (its window = tokens 16..19);
    chunk 2 then chooses among chunk 1's survivors plus itself, with the prompt's last 4 tokens as the window. And
    generate(prefill_chunk_size=20) does the same as the wrapper."""
    ids = random_prompt(40, seed=12)
    inner = SnapKV(budget=8, window=4)
    with inner.make_cache(sdpa) as first:
        sdpa(ids[:, :20], past_key_values=first, use_cache=True)
    with Chunked(inner, chunk=20).make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for layer, one in zip(cache.layers, first.layers):
        allowed = set(one.positions[0, 0].tolist()) | set(range(20, 40))
        assert set(layer.positions[0, 0].tolist()) <= allowed
        assert layer.positions[0, :, -4:].tolist() == [[36, 37, 38, 39]] * HKV and layer.held == 8
    with inner.make_cache(sdpa) as native:
        sdpa.generate(ids, past_key_values=native, max_new_tokens=1, do_sample=False, prefill_chunk_size=20)
    for a, b in zip(cache.layers, native.layers):
        assert torch.equal(a.positions, b.positions)
    # a chunk as long as the prompt is plain SnapKV
    with Chunked(inner, chunk=40).make_cache(sdpa) as whole, inner.make_cache(sdpa) as plain:
        sdpa(ids, past_key_values=whole, use_cache=True)
        sdpa(ids, past_key_values=plain, use_cache=True)
        assert all(torch.equal(a.positions, b.positions) for a, b in zip(whole.layers, plain.layers))


@pytest.mark.parametrize("spec", ["quest:budget=16:page_size=4:dense_layers=0",
                                  "adakv:method=snapkv,budget=12,window=4", "kvquant:bits=4:residual=4:group=8",
                                  "longheads:chunk=8:window=24",
                                  "bilevel:chunk=8:dense_chunks=1:sparse_tokens=2:sink=2"])
def test_chunked_wraps_methods_with_their_own_caches_as_generate_chunking_does(sdpa, spec):
    """Quest, AdaKV, kvquant, LongHeads and BiLevel build their own cache types; the wrapper drives them exactly as
    ``generate(prefill_chunk_size=C)`` does."""
    ids = random_prompt(40, seed=13)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with build_method(spec).make_cache(sdpa) as cache:
        native = sdpa.generate(ids, past_key_values=cache, prefill_chunk_size=12, **kwargs)
    with Chunked(build_method(spec), chunk=12).make_cache(sdpa) as cache:
        wrapped = sdpa.generate(ids, past_key_values=cache, **kwargs)
    assert torch.equal(native.sequences, wrapped.sequences)
    torch.testing.assert_close(torch.stack(native.logits), torch.stack(wrapped.logits), rtol=1e-5, atol=1e-6)


def test_chunked_kvquant_with_eviction_is_refused_up_front():
    with pytest.raises(ValueError, match="cannot run with chunked prefill .with eviction"):
        Chunked(build_method("kvquant:bits=4:method=snapkv,budget=16,window=4"), chunk=8)


def test_chunked_refuses_a_method_that_cannot_run_chunked():
    class Unchunkable(KNorm):
        supports_chunking = False
        chunking_error = "it needs the whole prompt at once"

    with pytest.raises(ValueError, match="cannot run with chunked prefill .it needs the whole prompt"):
        Chunked(Unchunkable(budget=4), chunk=8)


def test_chunked_refuses_a_custom_4d_mask(sdpa):
    cache = Chunked("full", chunk=8).make_cache(sdpa)
    with pytest.raises(ValueError, match="2-D"):
        sdpa(random_prompt(20), attention_mask=torch.ones(1, 1, 20, 20, dtype=torch.bool), past_key_values=cache)


def test_streaming_ratio_and_window_are_exclusive():
    with pytest.raises(ValueError, match="not both"):
        StreamingLLM(window=8, ratio=0.5)


def test_one_query_column_scores_equal_the_blocked_masked_pass():
    """The one-query path of the column scores (a decode step: no mask, no blocks; H2O and TOVA use it every step)
    gives the same probabilities as the general two-pass blocked computation."""
    from mmaccel.kernels.column_scores import attention_column_scores_reference

    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 1, 8), torch.randn(2, 3, 11, 8)
    fast = attention_column_scores_reference(q, k, scaling=0.3)
    blocked = attention_column_scores_reference(q, k, scaling=0.3, block_size=4)  # 3 blocks, masked, two passes
    torch.testing.assert_close(fast, blocked, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fast.sum(-1), torch.ones(2, 6))


def test_h2o_decode_reads_its_scores_from_its_own_attention_with_the_same_result(sdpa):
    """H2O's layers compute a decode step's attention and keep its probabilities (one q_proj per layer and step, no
    recomputation); under a plain cache (the model's own attention, as for a softcapped model) it reuses the module's
    q_proj output (``captures_queries``) or, without it, projects again: the same logits and accumulated attention."""

    class Recomputing(H2O):
        captures_queries = False

    ids = random_prompt(30, seed=5)
    runs = {}
    for name, method, plain in (("owned", H2O(budget=12, recent=2), False), ("captured", H2O(budget=12, recent=2), True),
                                ("recomputing", Recomputing(budget=12, recent=2), True)):
        calls = []
        hooks = [layer.self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1)) for layer in sdpa.model.layers]
        try:
            with (KVMethodCache(sdpa, method) if plain else method.make_cache(sdpa)) as cache:
                assert isinstance(cache, OwnedAttentionCache) != plain
                sdpa(ids[:, :24], past_key_values=cache, use_cache=True)
                calls.clear()
                logits = [sdpa(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(24, 30)]
                runs[name] = (len(calls), torch.cat(logits), [layer.slot_state["attention"].clone() for layer in cache.layers])
        finally:
            for hook in hooks:
                hook.remove()
    steps = 6 * len(sdpa.model.layers)
    assert runs["owned"][0] == runs["captured"][0] == steps and runs["recomputing"][0] == 2 * steps
    torch.testing.assert_close(runs["captured"][1], runs["recomputing"][1], rtol=0, atol=0)
    torch.testing.assert_close(runs["owned"][1], runs["captured"][1], rtol=1e-5, atol=1e-5)
    for name in ("owned", "recomputing"):
        for a, b in zip(runs[name][2], runs["captured"][2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
