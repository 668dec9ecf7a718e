"""mmaccel.longctx: StreamingLLM and SnapKV as transformers caches, on a tiny random Llama."""
import gc
import json

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache, LlamaForCausalLM

from mmaccel.longctx import (
    METHODS,
    FullAttention,
    KVMethodCache,
    SnapKV,
    StreamingLLM,
    build_method,
    kv_cache_bytes,
    snapkv_keep_indices,
)

LAYERS, HQ, HKV, HEAD_DIM = 2, 4, 2, 16


def _tiny_llama(attn: str) -> LlamaForCausalLM:
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, attn=attn)


@pytest.fixture(scope="module")
def eager():
    return _tiny_llama("eager")


@pytest.fixture(scope="module")
def sdpa():
    return _tiny_llama("sdpa")


def _prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _bytes(tokens: int, batch: int = 1) -> int:
    """Bytes of K and V of all layers for `tokens` held slots, float32."""
    return LAYERS * 2 * batch * HKV * tokens * HEAD_DIM * 4


# ------------------------------------------------------------------------------------------------ registry / errors
def test_registry_builds_each_method_from_its_spec():
    assert {"full", "streaming", "snapkv"} <= set(METHODS)
    snap = build_method("snapkv:budget=256:window=32")
    assert isinstance(snap, SnapKV) and (snap.budget, snap.window, snap.kernel_size) == (256, 32, 7)
    stream = build_method("streamingllm:window=64:sink=2")
    assert isinstance(stream, StreamingLLM) and (stream.window, stream.sink) == (64, 2)
    assert isinstance(build_method("full"), FullAttention)
    assert snap.name == "snapkv" and build_method(snap.spec) == snap
    assert build_method(stream.spec) == stream


def test_unknown_method_name_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown KV-cache method 'bogus'.*snapkv.*streaming"):
        build_method("bogus:budget=64")


@pytest.mark.parametrize(
    "spec, field",
    [
        ("snapkv:budget=0", "budget"),
        ("snapkv:budget=-8", "budget"),
        ("snapkv:budget=16:window=0", "window"),
        ("snapkv:budget=16:window=32", "window .32. must be <= budget .16."),
        ("snapkv:kernel_size=4", "kernel_size must be odd"),
        ("snapkv:pooling=median", "pooling"),
        ("streaming:window=0", "window"),
        ("streaming:sink=-1", "sink"),
        ("streaming:window=2.5", "window"),
        ("snapkv:budgt=64", "budgt"),
    ],
)
def test_bad_arguments_name_the_fix(spec, field):
    with pytest.raises(ValueError, match=field):
        build_method(spec)


# ---------------------------------------------------------------------------------------------------- byte account
def test_kv_cache_bytes_counts_held_tensors(eager):
    cache = DynamicCache(config=eager.config)
    assert kv_cache_bytes(cache) == 0
    eager(_prompt(10), past_key_values=cache, use_cache=True)
    assert kv_cache_bytes(cache) == _bytes(10)


# ------------------------------------------------------------------------------------------------------- streaming
def _manual_run(model, cache, ids: torch.Tensor, prompt_len: int) -> list[torch.Tensor]:
    """Prefill ids[:, :prompt_len], then feed the rest one token at a time, *without* position_ids."""
    logits = [model(ids[:, :prompt_len], past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(prompt_len, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return logits


def test_streaming_keeps_sinks_and_recent_window_at_true_positions(eager):
    ids = _prompt(15)
    method = StreamingLLM(window=5, sink=2)
    cache = method.make_cache(eager)
    eager(ids[:, :12], past_key_values=cache, use_cache=True)
    for layer in cache.layers:  # hand-computed: sinks 0, 1 and the 5 most recent of 12
        assert layer.positions.tolist() == [[[0, 1, 7, 8, 9, 10, 11]] * HKV]
    full = DynamicCache(config=eager.config)
    _manual_run(eager, full, ids, 12)
    cache = method.make_cache(eager)
    _manual_run(eager, cache, ids, 12)
    kept = [0, 1, 10, 11, 12, 13, 14]
    assert cache.get_seq_length() == 15
    # decode evicts in place: the oldest window slot is marked dead and the next token overwrites it, so the live
    # slots are the kept positions in no particular order, plus one dead slot until the next step
    layer = cache.layers[0]
    dead = int(layer.free[0, 0])
    slots = sorted((i for i in range(layer.held) if i != dead), key=lambda i: int(layer.positions[0, 0, i]))
    assert [int(layer.positions[0, 0, i]) for i in slots] == kept
    # Layer-0 keys depend only on the token and its RoPE position: equal to the full cache's at the kept positions,
    # so the decode tokens (fed without position_ids) were rotated with their true positions.
    torch.testing.assert_close(layer.keys[:, :, slots], full.layers[0].keys[:, :, kept], rtol=0, atol=0)
    assert kv_cache_bytes(cache) == _bytes(7 + 1)  # the dead slot stays allocated until it is overwritten


def test_streaming_decode_equals_masked_full_attention(eager):
    """Each decode token attends to the sinks and the `window` previous tokens: same logits as a full forward with
    that attention pattern written as an explicit 4-D mask (prompt rows fully causal, as prefill attends fully)."""
    sink, window, prompt_len, total = 2, 5, 12, 16
    ids = _prompt(total, seed=3)
    logits = _manual_run(eager, StreamingLLM(window=window, sink=sink).make_cache(eager), ids, prompt_len)

    allowed = torch.ones(total, total).tril().bool()
    for p in range(prompt_len, total):
        allowed[p] = False
        allowed[p, :sink] = True
        allowed[p, p - window : p + 1] = True
    mask = torch.zeros(1, 1, total, total).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = eager(ids, attention_mask=mask).logits[0]
    got = torch.cat(logits)
    torch.testing.assert_close(got, ref[prompt_len - 1 :], rtol=1e-4, atol=1e-5)
    # ...and the eviction really changes the result compared with full attention.
    assert not torch.allclose(got[-1], eager(ids).logits[0, -1], atol=1e-3)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_streaming_chunk_after_eviction_is_causal_within_the_chunk(attn, eager, sdpa):
    """A multi-token forward after an eviction (a second turn): get_mask_sizes must offset the causal mask so the
    chunk sees every held slot and only the earlier tokens of its own chunk."""
    model = eager if attn == "eager" else sdpa
    ids = _prompt(15, seed=4)
    cache = StreamingLLM(window=5, sink=2).make_cache(model)
    model(ids[:, :12], past_key_values=cache, use_cache=True)
    got = model(ids[:, 12:], past_key_values=cache, use_cache=True).logits[0]
    allowed = torch.ones(15, 15).tril().bool()
    allowed[12:, 2:7] = False  # positions 2..6 were evicted after the prefill
    mask = torch.zeros(1, 1, 15, 15).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = eager(ids, attention_mask=mask).logits[0, 12:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert cache.layers[0].positions[0, 0].tolist() == [0, 1, 10, 11, 12, 13, 14]


def test_generate_passes_true_positions_after_eviction(sdpa):
    seen = []
    handle = sdpa.model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["position_ids"][0].tolist()), with_kwargs=True
    )
    try:
        method = build_method("streaming:window=4:sink=1")
        cache = method.make_cache(sdpa)
        sdpa.generate(_prompt(20), past_key_values=cache, max_new_tokens=6, do_sample=False)
    finally:
        handle.remove()
    assert seen == [list(range(20)), [20], [21], [22], [23], [24]]
    assert cache.get_seq_length() == 25
    layer = cache.layers[1]  # in-place decode eviction: the live slots in any order, one dead slot (20) to overwrite
    live = [p for i, p in enumerate(layer.positions[0, 1].tolist()) if i != int(layer.free[0, 1])]
    assert sorted(live) == [0, 21, 22, 23, 24] and int(layer.positions[0, 1, layer.free[0, 1]]) == 20
    tel = method.telemetry(cache)
    assert json.loads(json.dumps(tel)) == tel
    assert tel["kept_tokens_per_layer"] == [5, 5] and tel["evicted_tokens"] == 2 * 20
    assert tel["kv_cache_bytes"] == _bytes(5 + 1) == kv_cache_bytes(cache)


# ---------------------------------------------------------------------------------------------------------- snapkv
def test_snapkv_selection_hand_computed():
    scores = torch.tensor(
        [
            [
                [0, 5, 0, 1, 0, 0, 9, 9],  # query heads 0, 1 -> KV head 0
                [0, 3, 0, 1, 4, 0, 9, 9],
                [6, 0, 0, 0, 0, 2, 9, 9],  # query heads 2, 3 -> KV head 1
                [2, 0, 1, 0, 0, 0, 9, 9],
            ]
        ],
        dtype=torch.float32,
    )
    kw = {"budget": 5, "window": 2, "num_kv_heads": 2}
    # no pooling: KV head 0 means [0, 4, 0, 1, 2, 0] -> top 3 = {1, 4, 3}; KV head 1 [4, 0, .5, 0, 0, 1] -> {0, 5, 2}
    idx = snapkv_keep_indices(scores, kernel_size=1, **kw)
    assert idx.tolist() == [[[1, 3, 4, 6, 7], [0, 2, 5, 6, 7]]]
    # max-pool k=3 first: head 0 -> [5, 5, 5, 1, 1, 0], head 1 -> [3, 3, 3, 4, 4, 4]; mean [4, 4, 4, 2.5, 2.5, 2]
    idx = snapkv_keep_indices(scores, kernel_size=3, pooling="max", **kw)
    assert idx[0, 0].tolist() == [0, 1, 2, 6, 7]


def test_snapkv_group_max_keeps_what_one_query_head_needs():
    """Two query heads share a KV head: by their mean slot 0 wins (4 vs 3.5); by their maximum slot 1 (7 vs 4)."""
    scores = torch.tensor([[[4.0, 0.0, 9.0], [4.0, 7.0, 9.0]]])  # [B=1, Hq=2, L=3], the last slot is the window
    kw = {"budget": 2, "window": 1, "num_kv_heads": 1, "kernel_size": 1}
    assert snapkv_keep_indices(scores, **kw).tolist() == [[[0, 2]]]
    assert snapkv_keep_indices(scores, group="max", **kw).tolist() == [[[1, 2]]]
    assert build_method("snapkv:ratio=0.25:group=max").group == "max"
    with pytest.raises(ValueError, match="group must be 'mean' or 'max'"):
        build_method("snapkv:group=median")


def test_snapkv_prefill_keeps_what_eager_attention_says(eager):
    """Kept slots per layer and KV head equal a selection from the model's own eager attention probabilities
    (output_attentions), which checks the recomputed queries (q_proj, RoPE) and the column scores."""
    budget, window, length = 12, 4, 40
    ids = _prompt(length, seed=5)
    attentions = eager(ids, output_attentions=True).attentions
    cache = SnapKV(budget=budget, window=window).make_cache(eager)
    full = DynamicCache(config=eager.config)
    eager(ids, past_key_values=full, use_cache=True)
    eager(ids, past_key_values=cache, use_cache=True)
    for layer_idx, layer in enumerate(cache.layers):
        column = attentions[layer_idx][:, :, -window:, :].float().sum(dim=2)  # [B, Hq, L]
        ref = snapkv_keep_indices(column, budget=budget, window=window, num_kv_heads=HKV)
        assert torch.equal(layer.positions, ref)
        assert layer.positions[0, :, -window:].tolist() == [list(range(length - window, length))] * HKV
        assert not torch.equal(layer.positions[0, 0], layer.positions[0, 1])  # per KV head
        gather = ref.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM)
        torch.testing.assert_close(layer.keys, full.layers[layer_idx].keys.gather(2, gather), rtol=0, atol=0)
        torch.testing.assert_close(layer.values, full.layers[layer_idx].values.gather(2, gather), rtol=0, atol=0)
    assert kv_cache_bytes(cache) == _bytes(budget)
    assert cache.get_seq_length() == length


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_snapkv_budget_at_least_prompt_is_token_identical(attn, eager, sdpa):
    model = eager if attn == "eager" else sdpa
    ids = _prompt(30, seed=7)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    for budget in (30, 64):
        cache = build_method(f"snapkv:budget={budget}:window=8").make_cache(model)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
        assert torch.equal(out, plain)
        assert kv_cache_bytes(cache) == _bytes(30 + 11)


def test_snapkv_generate_compresses_once_then_appends_and_hooks_leave_on_close(sdpa):
    method = build_method("snapkv:budget=8:window=2:kernel_size=3")
    cache = method.make_cache(sdpa)
    attn = [layer.self_attn for layer in sdpa.model.layers]
    # one hook per attention module (prefill and every decode step) + one on the model (closes the cache on error)
    assert all(len(m._forward_hooks) == 1 for m in attn) and cache.hooks_attached == LAYERS + 1
    sdpa.generate(_prompt(24, seed=9), past_key_values=cache, max_new_tokens=5, do_sample=False)
    for layer in cache.layers:  # 8 prompt slots (last 2 = window), then the 4 decode tokens appended
        assert layer.positions.shape == (1, HKV, 12)
        assert layer.positions[0, :, -6:].tolist() == [[22, 23, 24, 25, 26, 27]] * HKV
    assert kv_cache_bytes(cache) == _bytes(12)
    assert method.telemetry(cache)["evicted_tokens"] == LAYERS * (28 - 12)
    cache.close()
    assert all(len(m._forward_hooks) == 0 for m in attn) and len(sdpa._forward_hooks) == 0
    assert cache.hooks_attached == 0


def test_speculative_cache_compresses_the_prefill_only_and_crops_what_came_after(sdpa):
    prompt = _prompt(24, seed=9)
    with build_method("snapkv:budget=8:window=2").make_cache(sdpa) as plain:
        sdpa(prompt, past_key_values=plain, use_cache=True)
        with pytest.raises(ValueError, match="cannot be cropped"):
            plain.crop(-1)
    with build_method("snapkv:budget=8:window=2").make_cache(sdpa, speculative=True) as cache:
        sdpa(prompt, past_key_values=cache, use_cache=True)
        assert cache.layers[0].held == 8 and cache.get_seq_length() == 24
        # a 5-token verification forward is appended, not compressed, and its last 3 slots crop exactly
        sdpa(_prompt(5, seed=3), position_ids=torch.arange(24, 29)[None], past_key_values=cache, use_cache=True)
        assert cache.layers[0].held == 13
        cache.crop(-3)
        for layer in cache.layers:
            assert layer.held == 10 and layer.cumulative_length == 26
            assert layer.positions[0, :, -3:].tolist() == [[23, 24, 25]] * HKV
        assert kv_cache_bytes(cache) == _bytes(13)  # a crop slices a view: the storage is freed at the next append
        with pytest.raises(ValueError, match="evicted slots among its first 24"):
            cache.crop(-3)  # would reach into the compressed prompt
        with pytest.raises(ValueError, match="negative count"):
            cache.crop(2)
    with pytest.raises(ValueError, match="h2o evicts during decoding"):
        build_method("h2o:budget=64").make_cache(sdpa, speculative=True)


def test_unused_snapkv_cache_detaches_on_close(sdpa):
    attn = sdpa.model.layers[0].self_attn
    with SnapKV(budget=8, window=2).make_cache(sdpa) as cache:
        assert isinstance(cache, KVMethodCache) and len(attn._forward_hooks) == 1
        # a run with another cache does not trigger this cache's hooks
        sdpa(_prompt(12), past_key_values=DynamicCache(config=sdpa.config), use_cache=True)
        assert cache.hooks_attached == LAYERS + 1 and cache.get_seq_length() == 0
    assert len(attn._forward_hooks) == 0


def test_a_forgotten_cache_leaves_no_hooks_when_collected(sdpa):
    cache = SnapKV(budget=8, window=2).make_cache(sdpa)
    sdpa.generate(_prompt(12), past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert len(sdpa.model.layers[0].self_attn._forward_hooks) == 1
    del cache
    gc.collect()
    assert len(sdpa.model.layers[0].self_attn._forward_hooks) == 0 and len(sdpa._forward_hooks) == 0


def test_snapkv_batch_rows_are_compressed_independently(sdpa):
    ids = _prompt(24, seed=11, batch=2)
    cache = SnapKV(budget=8, window=2).make_cache(sdpa)
    sdpa(ids, past_key_values=cache, use_cache=True)
    for row in range(2):
        single = SnapKV(budget=8, window=2).make_cache(sdpa)
        sdpa(ids[row : row + 1], past_key_values=single, use_cache=True)
        for layer, ref in zip(cache.layers, single.layers):
            assert torch.equal(layer.positions[row], ref.positions[0])
            torch.testing.assert_close(layer.keys[row], ref.keys[0])


@pytest.mark.parametrize("method", [SnapKV(budget=8, window=2), StreamingLLM(sink=2, window=8)], ids=["snapkv", "streaming"])
def test_refuses_padded_batch(sdpa, method):
    ids = _prompt(24, seed=13, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = method.make_cache(sdpa)
    with pytest.raises(ValueError, match="padded batch"):
        sdpa(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    # the failed prefill removed every hook by itself (no close() needed)
    assert cache.hooks_attached == 0
    assert len(sdpa.model.layers[0].self_attn._forward_hooks) == 0 and len(sdpa._forward_hooks) == 0


def test_streaming_without_sinks_is_exact_on_a_left_padded_batch(sdpa):
    """sink=0 (a sliding window) with left padding: each row generates what it generates alone, unpadded."""
    ids = _prompt(24, seed=17, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    method = StreamingLLM(sink=0, window=8)  # evicts at prefill and at every decode step
    out = sdpa.generate(ids, attention_mask=mask, past_key_values=method.make_cache(sdpa), max_new_tokens=6,
                        do_sample=False)
    for row, start in ((0, 0), (1, 3)):
        alone = ids[row : row + 1, start:]
        ref = sdpa.generate(alone, attention_mask=torch.ones_like(alone), past_key_values=method.make_cache(sdpa),
                            max_new_tokens=6, do_sample=False)
        assert torch.equal(out[row, 24:], ref[0, alone.shape[1]:])


def test_streaming_unpadded_batch_runs_and_hooks_leave_on_close(sdpa):
    ids = _prompt(24, seed=19, batch=2)
    with StreamingLLM(sink=2, window=8).make_cache(sdpa) as cache:
        sdpa(ids, past_key_values=cache, use_cache=True)
        assert [layer.held for layer in cache.layers] == [10] * LAYERS
    assert cache.hooks_attached == 0 and len(sdpa.model.layers[0].self_attn._forward_hooks) == 0
