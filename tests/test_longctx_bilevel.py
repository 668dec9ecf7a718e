"""Video-XL-2-style bi-level KV ("bilevel"): the decode-time chunk selection and the prefill pattern hand-computed,
token-identical to full attention when every chunk is dense, decode logits after a real sparse prefill and chunk
selection against an independent masked reference (offloaded or not), honest bytes, clear errors."""
import pytest
import torch
from tiny_models import random_prompt, tiny_llama
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmaccel.longctx import METHODS, build_method, kv_cache_bytes
from mmaccel.longctx.bilevel import BiLevel, BiLevelLayer, dense_chunk_table

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")


def masked_attention(query, keys, values, allowed, scaling):
    """[B, Hq, Lq, D] softmax attention under a bool [Lq, Lk] (or [B, Hkv, Lq, Lk]) mask, GQA by repetition."""
    group = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    if allowed.dim() == 4:
        allowed = allowed.repeat_interleave(group, dim=1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


# --------------------------------------------------------------------------------------- hand-computed selections
def test_dense_chunk_table_keeps_own_previous_and_best_candidates():
    scores = torch.tensor([5.0, 1.0, 3.0, 9.0, 9.0])[None, None, None].repeat(1, 1, 3, 1)  # rows 1, 2, 4
    table = dense_chunk_table(scores, torch.tensor([1, 2, 4]), dense_chunks=2)[0, 0]
    assert table.tolist() == [
        [True, True, False, False, False],  # row 1: itself and chunk 0, no candidate
        [True, True, True, False, False],  # row 2: its one candidate (chunk 0) is taken
        [True, False, True, True, True],  # row 4: candidates 0, 1, 2 -> the best two (5, 3), then 3 and 4
    ]
    assert dense_chunk_table(scores, torch.tensor([1, 2, 4]), dense_chunks=0)[0, 0, 2].tolist() == [
        False, False, False, True, True]


@pytest.mark.parametrize("offload", [False, True])
def test_decode_chunk_selection_and_sparse_tokens_hand_computed(offload):
    """chunk=2, sink=1, one dense candidate, one sparse token; two query heads on one KV head, scale 1."""
    keys = torch.tensor([[1.0, 0], [2, 0], [0, 1], [0, 3], [-1, 0], [-3, 0], [0, 0], [0, 1], [0.5, 0.5]])[None, None]
    values = torch.randn(1, 1, 9, 2, generator=torch.Generator().manual_seed(0))
    layer = BiLevelLayer(chunk=2, dense_chunks=1, sparse_tokens=1, sink=1, offload=offload)
    layer.update(keys[:, :, :8], values[:, :, :8])
    layer.attend(torch.ones(1, 2, 8, 2), None, 1.0)  # prefill: every query is [1, 1]
    # summaries: chunk means [1.5, 0], [0, 2], [-2, 0], [0, 0.5]
    assert layer.summaries[0, 0].tolist() == [[1.5, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, 0.5]]
    # sparse token = the key the chunk's last query [1, 1] attends most: logits (1, 2), (1, 3), (-1, -3), (0, 1)
    assert layer.sparse_index[0, 0].tolist() == [[1], [3], [4], [7]]
    # prefill rows: 0 -> {0}; 1 -> {0, 1}; 2 -> {0, 1, 2}; 3 -> {1, 2, 3} + best of {0 (3), 1 (4)} = 1
    assert layer.last_prefill_table[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]

    query = torch.tensor([[-1.0, 0.0], [0.0, 1.5]])[None, :, None]  # [1, 2, 1, 2]
    layer.update(keys[:, :, 8:], values[:, :, 8:])
    out = layer.attend(query, None, 1.0)
    # token 8 is in chunk 4; chunk 3 is local; candidates 0, 1, 2 score -1.5 + 0, 0 + 3, 2 + 0 (head 0 + head 1):
    # chunk 1 is read densely (head 0 alone would have picked chunk 2)
    assert layer.last_dense[0, 0].tolist() == [False, True, False, True, True]
    read = [0, 1, 2, 3, 4, 6, 7, 8]  # sink 0, sparse 1 (chunk 0) and 4 (chunk 2), dense chunks 1, 3, 4
    assert layer.read_mask(layer.last_dense)[0, 0].nonzero().flatten().tolist() == read
    allowed = torch.zeros(1, 9, dtype=torch.bool)
    allowed[0, read] = True
    torch.testing.assert_close(out, masked_attention(query, keys, values, allowed, 1.0))
    assert layer.read_fractions == [8 / 9]
    if offload:  # chunks 0-2 in the host store, the sink and 4 sparse tokens copied, chunks 3-4 on the device
        assert (layer.start, layer.store_keys.shape[2], layer.sink_keys.shape[2]) == (6, 6, 1)
        assert layer.keys.shape[2] == 3 and layer.sparse_keys.shape[2:4] == (4, 1)


def test_prefill_pattern_against_a_hand_computed_mask():
    """chunk=4, sink=1, one dense candidate: chunk c < 4 has mean key 3 * e_c; query chunk 3's mean query points at
    chunk 1, query chunk 4's at chunk 0 (head 0) and weakly at chunk 1 (head 1)."""
    g = torch.Generator().manual_seed(1)
    T, C = 20, 4

    def zero_chunk_mean(x):
        return x - x.reshape(*x.shape[:2], -1, C, x.shape[-1]).mean(3).repeat_interleave(C, dim=2)

    keys = zero_chunk_mean(0.3 * torch.randn(1, 1, T, 4, generator=g))
    keys[0, 0, :16] += 3 * torch.eye(4).repeat_interleave(C, dim=0)
    values = torch.randn(1, 1, T, 4, generator=g)
    query = zero_chunk_mean(0.3 * torch.randn(1, 2, T, 4, generator=g))
    query[0, 0, 12:16, 1] += 1.0
    query[0, 0, 16:20, 0] += 1.0
    query[0, 1, 16:20, 1] += 0.5
    layer = BiLevelLayer(chunk=C, dense_chunks=1, sparse_tokens=1, sink=1, offload=False)
    layer.update(keys, values)
    out = layer.attend(query, None, 0.5)
    table = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 1, 1]]).bool()
    assert torch.equal(layer.last_prefill_table[0, 0], table)
    i, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (k <= i) & ((k < 1) | table[i // C, k // C])
    assert int(allowed.sum()) == 166  # of 210 causal pairs: a sparse prefill
    torch.testing.assert_close(out, masked_attention(query, keys, values, allowed, 0.5), rtol=1e-5, atol=1e-6)
    assert layer.prefill_densities == [pytest.approx((1 + 1 + 1 + 3 / 4 + 3 / 5) / 5)]


# -------------------------------------------------------------------------------------- equivalence when unbounded
@pytest.mark.parametrize("spec, chunked", [
    ("bilevel:chunk=8:dense_chunks=100:sparse_tokens=2", None),
    ("bilevel:chunk=512:sparse_tokens=8", None),
    ("bilevel:chunk=8:dense_chunks=100:sparse_tokens=2:offload=true", 16),
])
def test_every_chunk_dense_is_token_identical_to_full_and_warns(spec, chunked, sdpa):
    ids = random_prompt(40, seed=2)
    plain = sdpa.generate(ids, max_new_tokens=8, do_sample=False)
    method = build_method(spec)
    extra = {"prefill_chunk_size": chunked} if chunked else {}
    with method.make_cache(sdpa) as cache:
        out = sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, **extra)
        telemetry = method.telemetry(cache)
    assert torch.equal(out, plain)
    assert telemetry["kv_read_fraction"] == 1.0 and telemetry["prefill_chunk_density"] == 1.0
    assert any("ran as full attention" in w for w in telemetry["warnings"])


# ------------------------------------------------------------------- decode logits after a real sparse prefill
def _masked_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return masked_attention(query, key, value, module._test_allowed, scaling).transpose(1, 2).contiguous(), None


def _run(model, ids, prompt, method):
    logits, dense, sparse = [], [], []
    with method.make_cache(model) as cache:
        logits.append(model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1])
        tables = [layer.last_prefill_table.clone() for layer in cache.layers]
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
            dense.append([layer.last_dense.clone() for layer in cache.layers])
            sparse.append([layer.sparse_index.clone() for layer in cache.layers])
        telemetry = method.telemetry(cache)
        assert telemetry["kv_cache_bytes"] == kv_cache_bytes(cache)
    return torch.cat(logits), tables, dense, sparse, telemetry


def test_decode_logits_after_real_sparse_prefill_and_selection_match_a_masked_reference(sdpa):
    """Prefill 44 tokens in chunks of 8 (sink 2, one dense candidate, 2 sparse tokens), then 6 decode steps that
    cross into a new chunk; record each layer's prefill chunk table and, per step, the dense chunks and sparse
    positions per KV head; one dense forward of the whole sequence whose mask lets each row see exactly those
    tokens reproduces every logit. The offloaded layout gives the same logits."""
    prompt, steps, C, sink, s = 44, 6, 8, 2, 2
    total = prompt + steps
    ids = random_prompt(total, seed=3)
    method = BiLevel(chunk=C, dense_chunks=1, sparse_tokens=s, sink=sink)
    logits, tables, dense, sparse, telemetry = _run(sdpa, ids, prompt, method)
    reference = tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")
    AttentionInterface.register("bilevel_test", _masked_reference)
    AttentionMaskInterface.register("bilevel_test", sdpa_mask)
    reference.set_attn_implementation("bilevel_test")
    k = torch.arange(total)
    for layer_idx, layer in enumerate(reference.model.layers):
        allowed = torch.zeros(1, HKV, total, total, dtype=torch.bool)
        table = tables[layer_idx][0]  # [Hkv, 6, 6]
        for i in range(prompt):
            allowed[0, :, i, : i + 1] = (k[: i + 1] < sink) | table[:, i // C, k[: i + 1] // C]
        for step, t in enumerate(range(prompt, total)):
            chunks = dense[step][layer_idx][0]  # [Hkv, cur + 1]
            cur = t // C
            assert chunks.shape == (HKV, cur + 1) and int(chunks[:, : cur - 1].sum(-1).max()) == 1
            row = (k[: t + 1] < sink) | chunks[:, k[: t + 1] // C]
            row.scatter_(1, sparse[step][layer_idx][0, :, : cur - 1].flatten(1), True)
            allowed[0, :, t, : t + 1] = row
        layer.self_attn._test_allowed = allowed
    ref = reference(ids).logits[0, prompt - 1 :]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(ref, sdpa(ids).logits[0, prompt - 1 :], atol=1e-3)
    assert telemetry["prefill_chunk_density"] < 1 and max(telemetry["kv_read_fraction_per_step"]) < 1
    # dense storage is kept (reads are bounded, not memory); bookkeeping: means, sparse positions, last tables
    assert telemetry["kv_cache_bytes"] == LAYERS * 2 * HKV * total * D * 4
    closed = total // C
    per_layer = HKV * (closed * D * 4 + closed * s * 8 + (total - 1) // C + 1 + 6 * 6)
    assert telemetry["bookkeeping_bytes"] == LAYERS * per_layer

    off_logits, off_tables, off_dense, _, off_tel = _run(sdpa, ids, prompt, BiLevel(C, 1, s, sink, offload=True))
    torch.testing.assert_close(off_logits, logits, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(off_tables, tables))
    assert all(torch.equal(a, b) for x, y in zip(off_dense, dense) for a, b in zip(x, y))
    assert off_tel["kv_read_fraction_per_step"] == telemetry["kv_read_fraction_per_step"]
    # the offloaded layout also keeps copies on the device: the sink and every closed chunk's sparse tokens
    assert off_tel["kv_cache_bytes"] == LAYERS * 2 * HKV * (total + sink + closed * s) * D * 4
    assert off_tel["kv_bytes_by_device"] == {"cpu": off_tel["kv_cache_bytes"]}


@pytest.mark.parametrize("offload", [False, True])
def test_chunked_wrapper_drives_it_as_generate_prefill_chunks_do(sdpa, offload):
    """Prefill pieces of 12 tokens (not aligned with the 8-token chunks), sparse at prefill and decode."""
    ids = random_prompt(40, seed=13)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    spec = f"bilevel:chunk=8:dense_chunks=1:sparse_tokens=2:sink=2:offload={offload}"
    with build_method(spec).make_cache(sdpa) as cache:
        native = sdpa.generate(ids, past_key_values=cache, prefill_chunk_size=12, **kwargs)
    method = build_method(f"chunked:chunk=12:method={spec.replace(':', ',')}")
    with method.make_cache(sdpa) as cache:
        wrapped = sdpa.generate(ids, past_key_values=cache, **kwargs)
        telemetry = method.telemetry(cache)
    assert torch.equal(native.sequences, wrapped.sequences)
    torch.testing.assert_close(torch.stack(native.logits), torch.stack(wrapped.logits), rtol=1e-5, atol=1e-6)
    assert telemetry["prefill_chunk_density"] < 1 and telemetry["kv_read_fraction"] < 1


# ----------------------------------------------------------------------------------------------------- errors
BAD_SPECS = {
    "bilevel:chunk=0": "chunk must be an integer >= 1",
    "bilevel:dense_chunks=-1": "dense_chunks must be an integer >= 0",
    "bilevel:chunk=8:sparse_tokens=9": "lower sparse_tokens or raise chunk",
    "bilevel:sink=-2": "sink must be an integer >= 0",
    "bilevel:offload=maybe": "offload must be true or false",
    "bilevel:chunk=2.5": "chunk must be an integer",
}


def test_each_bad_spec_raises_one_value_error_naming_the_fix():
    for spec, message in BAD_SPECS.items():
        with pytest.raises(ValueError, match=message):
            build_method(spec)


def test_spec_round_trip_and_a_padded_batch_is_refused_without_leaving_the_model_patched(sdpa):
    method = build_method("bilevel:chunk=16:dense_chunks=2:sparse_tokens=4:sink=2:offload=true")
    assert METHODS["bilevel"] is BiLevel and build_method(method.spec) == method
    ids = random_prompt(24, seed=5, batch=2)
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left padding on the second row
    cache = method.make_cache(sdpa)
    with pytest.raises(ValueError, match="bilevel cannot run a left-padded batch"):
        sdpa(ids, attention_mask=padding, past_key_values=cache, use_cache=True)
    assert cache.hooks_attached == 0 and sdpa.model.layers[1].self_attn.config is sdpa.config
