"""KV quantization (KIVI-style): codes and packing hand-computed, bits=16 passthrough exact, int8/int4 logits within a
stated tolerance, attention over a real quantized layer against a hand-written dequantized reference, real bytes, and
composition with prefill-time eviction."""
import pytest
import torch
from tiny_models import random_prompt, tiny_llama

from mmaccel.longctx import METHODS, KVQuant, build_method, kv_cache_bytes
from mmaccel.longctx.kvquant import QuantizedLayer, dequantize, pack, quantize, unpack

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture(scope="module")
def sdpa():
    return tiny_llama(layers=LAYERS, heads=HQ, kv_heads=HKV, head_dim=D, attn="sdpa")




def _run(model, spec, ids, new=8):
    method = build_method(spec)
    cache = method.make_cache(model)
    try:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits), method.telemetry(cache), cache
    finally:
        getattr(cache, "close", lambda: None)()


def test_codes_and_packing_hand_computed():
    codes, scale, zero = quantize(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 2, dim=-1)
    assert codes.tolist() == [[0 | 1 << 2 | 2 << 4 | 3 << 6]] and scale.item() == 1.0 and zero.item() == 0.0
    assert dequantize(codes, scale, zero, 2).tolist() == [[0.0, 1.0, 2.0, 3.0]]
    codes, scale, zero = quantize(torch.tensor([[2.0, 32.0]]), 4, dim=-1)  # scale (32 - 2) / 15 = 2
    assert codes.tolist() == [[0 | 15 << 4]] and scale.item() == 2.0 and zero.item() == 2.0
    raw = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack(pack(raw, 4), 4), raw)
    # the layout: the D codes are cut into 8 // bits slices; byte j holds code j of every slice, slice 0 lowest
    assert pack(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8), 4).tolist() == [[1 | 3 << 4, 2 | 4 << 4]]
    scale, zero = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[0.5, 0.0, 0.0, -1.0]])  # per channel
    assert dequantize(torch.tensor([[1 | 3 << 4, 2 | 4 << 4]], dtype=torch.uint8), scale, zero, 4).tolist() == \
        [[1.5, 4.0, 9.0, 15.0]]
    x = torch.randn(5, 64)
    codes, scale, zero = quantize(x, 8, dim=-1)
    assert codes.shape == (5, 64) and bool(((dequantize(codes, scale, zero, 8) - x).abs() <= scale / 2 + 1e-6).all())


def test_per_channel_keys_use_one_scale_per_channel_and_group():
    layer = QuantizedLayer(bits=8, key_axis="channel", value_axis="token", group=2, residual=0)
    keys = torch.tensor([[1.0, 10.0], [3.0, 20.0], [5.0, -4.0], [9.0, 4.0]])[None, None]  # [1, 1, 4, 2]
    layer.update(keys, keys.clone())
    layer.quantize_overflow()
    assert layer.quantized == 4 and layer.held == 0
    # groups of 2 tokens, per channel: min [1, 10], [5, -4]; range [2, 10], [4, 8] over 255 levels
    assert layer.key_zero[0, 0, :, 0].tolist() == [[1.0, 10.0], [5.0, -4.0]]
    torch.testing.assert_close(layer.key_scale[0, 0, :, 0], torch.tensor([[2.0, 10.0], [4.0, 8.0]]) / 255)
    assert layer.value_scale.shape == (1, 1, 4, 1)  # values: one scale per token
    k, _ = layer.full_kv()
    torch.testing.assert_close(k, keys)  # 2 values per group and channel: min and max are exact


def test_attention_over_a_quantized_layer_matches_a_hand_dequantized_reference():
    """Prefill 40 random tokens (group 8, residual 8: 32 quantized), then 3 decode steps; the output equals dense
    attention over keys quantized per channel in groups of 8 tokens and values per token, written out here."""
    torch.manual_seed(0)
    bits, group, residual, n = 4, 8, 8, 40
    layer = QuantizedLayer(bits=bits, key_axis="channel", value_axis="token", group=group, residual=residual)
    keys, values, queries = torch.randn(1, 2, n + 3, D), torch.randn(1, 2, n + 3, D), torch.randn(1, 4, n + 3, D)
    layer.update(keys[:, :, :n], values[:, :, :n])
    layer.quantize_overflow()

    def fake_quant(x, dim):
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        step = (hi - lo) / 15
        return ((x - lo) / step).round().clamp(0, 15) * step + lo

    for t in range(n, n + 3):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        out = layer.attend(queries[:, :, t : t + 1], None, D**-0.5)
        q_n = layer.quantized
        assert q_n == 32 and layer.held == t + 1 - 32  # decode tokens wait in the residual until a group fills
        k_ref, v_ref = keys[:, :, : t + 1].clone(), values[:, :, : t + 1].clone()
        k_ref[:, :, :q_n] = fake_quant(k_ref[:, :, :q_n].reshape(1, 2, q_n // group, group, D), 3).reshape(1, 2, q_n, D)
        v_ref[:, :, :q_n] = fake_quant(v_ref[:, :, :q_n], -1)
        k_ref, v_ref = k_ref.repeat_interleave(2, 1), v_ref.repeat_interleave(2, 1)
        probs = (queries[:, :, t : t + 1] @ k_ref.transpose(-1, -2) * D**-0.5).softmax(-1)
        torch.testing.assert_close(out, probs @ v_ref, rtol=1e-4, atol=1e-5)
        layer.quantize_overflow()
    assert not torch.allclose(layer.full_kv()[0], keys[:, :, : n + 3], atol=1e-3)  # really lossy


@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("value_axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_folded_decode_equals_attention_over_the_dequantized_layer(key_axis, value_axis, bits, monkeypatch):
    """One decode token over codes + residual (scales folded into the query and the probabilities) equals fp32
    softmax attention over :meth:`full_kv` (the dequantized slots plus the residual), written out here: B = 2, GQA
    with 1 and 3 query heads per KV head, a residual of 0 and of 11 slots (not a whole group: the quantized part is
    always whole groups), and the folded path never dequantizes."""
    torch.manual_seed(bits)
    B, H, group = 2, 2, 8
    for residual, tokens in [(0, 40), (5, 43)]:
        layer = QuantizedLayer(bits=bits, key_axis=key_axis, value_axis=value_axis, group=group, residual=residual)
        layer.update(torch.randn(B, H, tokens, D) * 3, torch.randn(B, H, tokens, D) + 1)
        layer.quantize_overflow()
        assert layer.quantized % group == 0 and layer.quantized + layer.held == tokens
        assert layer.held == (0 if residual == 0 else 11)
        k, v = (t.clone() for t in layer.full_kv())
        for nq in (1, 3):
            query = torch.randn(B, H * nq, 1, D)
            with monkeypatch.context() as m:  # the folded path must not write a dequantized copy
                m.setattr(layer, "_dequantize", lambda *a, **kw: pytest.fail("decode dequantized the layer"))
                out = layer.attend(query, None, 0.3)
            scores = query.reshape(B, H, nq, D) @ k.transpose(-1, -2) * 0.3
            want = (scores.softmax(-1) @ v).reshape(B, H * nq, 1, D)
            assert out.shape == query.shape and out.dtype == query.dtype
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_folded_decode_runs_in_fp32_for_a_bf16_cache_and_prefill_still_dequantizes():
    torch.manual_seed(1)
    layer = QuantizedLayer(bits=4, key_axis="channel", value_axis="token", group=8, residual=4)
    keys, values = torch.randn(1, 2, 36, D), torch.randn(1, 2, 36, D)
    layer.update(keys.bfloat16(), values.bfloat16())
    layer.quantize_overflow()
    query = torch.randn(1, 4, 1, D).bfloat16()
    k, v = (t.float().repeat_interleave(2, 1) for t in layer.full_kv())
    want = ((query.float() @ k.transpose(-1, -2) * 0.25).softmax(-1) @ v).bfloat16()
    out = layer.attend(query, None, 0.25)
    assert out.dtype == torch.bfloat16
    # the decode's working memory: one fp32 buffer for the codes (keys', then values'), no bf16 pair kept besides
    assert layer.scratch.v is None and layer.scratch.k.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)  # bf16 scales; the output rounded to bf16
    prefill = layer.attend(torch.randn(1, 4, 3, D).bfloat16(), None, 0.25)  # q > 1: over full_kv, causal
    assert prefill.shape == (1, 4, 3, D) and bool(prefill.isfinite().all())


def test_bits16_is_a_bit_exact_passthrough_alone_and_under_eviction(sdpa):
    ids = random_prompt(80)
    seq, logits, _, _ = _run(sdpa, "full", ids)
    got, got_logits, telemetry, _ = _run(sdpa, "kvquant:bits=16", ids)
    assert torch.equal(got, seq) and torch.equal(got_logits, logits) and telemetry["quantized_tokens_per_layer"] == [0, 0]
    snap, snap_logits, snap_tel, _ = _run(sdpa, "snapkv:budget=40:window=4", ids)
    got, got_logits, telemetry, _ = _run(sdpa, "kvquant:bits=16:method=snapkv,budget=40,window=4", ids)
    assert torch.equal(got, snap) and torch.equal(got_logits, snap_logits)
    assert telemetry["kv_cache_bytes"] == snap_tel["kv_cache_bytes"]


# Measured on this tiny random model (80-token prompt, 8 new tokens): int8 max |dlogit| ~2e-4, int4 ~5e-3.
@pytest.mark.parametrize("bits, tolerance", [(8, 1e-3), (4, 2e-2)])
def test_int8_and_int4_logits_stay_close_to_full_and_bytes_are_real(bits, tolerance, sdpa):
    ids = random_prompt(80)
    seq, logits, _, _ = _run(sdpa, "full", ids)
    got, got_logits, telemetry, cache = _run(sdpa, f"kvquant:bits={bits}:group=16:residual=8", ids)
    assert (got_logits - logits).abs().max() < tolerance and torch.equal(got, seq)
    assert telemetry["quantized_tokens_per_layer"] == [64, 64] and telemetry["seen_tokens"] == 87
    codes = LAYERS * 2 * HKV * 64 * D * bits // 8
    residual = LAYERS * 2 * HKV * (87 - 64) * D * 4
    assert telemetry["kv_cache_bytes"] == kv_cache_bytes(cache) == codes + residual
    scales = LAYERS * HKV * 4 * (2 * (64 // 16) * D + 2 * 64)  # keys per channel and group, values per token
    positions = LAYERS * HKV * 87 * 8
    assert telemetry["bookkeeping_bytes"] == scales + positions


def test_eviction_then_quantization_keeps_the_same_slots(sdpa):
    ids = random_prompt(80, seed=4)
    _, snap_logits, _, snap_cache = _run(sdpa, "snapkv:budget=40:window=4", ids)
    _, got_logits, telemetry, cache = _run(sdpa, "kvquant:bits=8:group=8:residual=8:method=snapkv,budget=40,window=4",
                                          ids)
    for mine, theirs in zip(cache.layers, snap_cache.layers):
        assert torch.equal(torch.cat([mine.quantized_positions, mine.positions], -1), theirs.positions)
    assert (got_logits - snap_logits).abs().max() < 1e-3
    assert telemetry["evicted_tokens"] > 0 and telemetry["kept_tokens_per_layer"] == [47, 47]


@pytest.mark.parametrize("spec, message", [
    ("kvquant:bits=3", "bits must be one of"),
    ("kvquant:key_axis=head", "key_axis must be one of"),
    ("kvquant:group=0", "group must be an integer >= 1"),
    ("kvquant:method=h2o,budget=64", "composes with prefill-time eviction"),
    ("kvquant:method=adakv", "composes with prefill-time eviction"),
])
def test_bad_arguments_are_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)


def test_registered_round_trips_and_chunked_prefill_rules(sdpa):
    assert METHODS["kvquant"] is KVQuant
    for spec in ["kvquant:bits=4", "kvquant:bits=8:key_axis=token:value_axis=channel:method=snapkv,budget=64"]:
        method = build_method(spec)
        assert build_method(method.spec) == method
    ids = random_prompt(80, seed=5)
    seq, _, _, _ = _run(sdpa, "kvquant:bits=8:group=8:residual=8", ids)
    method = build_method("kvquant:bits=8:group=8:residual=8")
    with method.make_cache(sdpa) as cache:  # without eviction, prefill chunks are fine
        out = sdpa.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, prefill_chunk_size=32)
    assert torch.equal(out, seq)
    method = build_method("kvquant:bits=8:group=8:residual=8:method=snapkv,budget=40,window=4")
    with pytest.raises(ValueError, match="cannot run a second prefill chunk"):
        sdpa.generate(ids, past_key_values=method.make_cache(sdpa), max_new_tokens=2, do_sample=False,
                      prefill_chunk_size=64)
    assert sdpa.model.layers[0].self_attn.config is sdpa.config
