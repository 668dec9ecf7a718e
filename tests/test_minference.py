"""MInference-style dynamic sparse prefill (mmaccel.longctx.minference): selection, exactness, masked reference."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mmaccel.kernels import BlockSparse, HeadPatterns, sparse_prefill_attention
from mmaccel.kernels.hf import cache_kwarg
from mmaccel.kernels.sparse_prefill import _masked_reference, dense_plan_fraction
from mmaccel.longctx import METHODS, build_method
from mmaccel.longctx.minference import (
    HeadChoice,
    MInference,
    MInferencePattern,
    _PrefillState,
    block_sparse_table,
    estimate_patterns,
    pattern_recall,
    search_patterns,
    search_rows,
    vertical_slash_scores,
    vertical_slash_table,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------- selection
def test_vertical_and_slash_mass_by_hand():
    # two last queries (positions 2 and 3) over four keys
    probs = torch.tensor([[[0.5, 0.0, 0.5, 0.0], [0.25, 0.25, 0.0, 0.5]]])
    vertical, slash = vertical_slash_scores(probs)
    torch.testing.assert_close(vertical, torch.tensor([[0.75, 0.25, 0.5, 0.5]]))
    # offsets q - k: row 2 -> k0: 2, k2: 0; row 3 -> k0: 3, k1: 2, k3: 0
    torch.testing.assert_close(slash, torch.tensor([[1.0, 0.0, 0.75, 0.25]]))


def test_vertical_slash_blocks_by_hand():
    """32 tokens in blocks of 4; every query looks at key 17 only. The last query (31) finds vertical 17 and the
    slash at offset 14; with the forced sinks (0..3) and local offsets (0..3) the table is: block column 0, block
    column 4 (key 17), and the block diagonals 0, 1 (local) and 3, 4 (offset 14 crosses both)."""
    L, D, block = 32, 8, 4
    key = torch.zeros(1, L, D)
    key[0, 17, 0] = 1.0
    query = torch.zeros(1, L, D)
    query[0, :, 0] = 50.0
    choice = HeadChoice("vertical_slash", vertical=1 / L, slash=1 / L)
    (pattern,) = estimate_patterns(query, key, [choice], block=block, last_q=1, scaling=1.0)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    diag = i - j
    expected = (j == 0) | (j == 4) | ((i >= j) & ((diag == 0) | (diag == 1) | (diag == 3) | (diag == 4)))
    assert pattern.block_size == block
    assert torch.equal(pattern.block_index, expected)


def test_vectorized_table_is_the_kernel_helpers():
    gen = torch.Generator().manual_seed(0)
    for length, block in ((300, 16), (257, 8)):
        cols = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(0, length, (7,), generator=gen)])
        offs = torch.randint(0, length, (12,), generator=gen)
        helper = BlockSparse.from_vertical_slash(cols, offs, length, block).block_index
        assert torch.equal(vertical_slash_table(cols, offs, length, block), helper)


def test_block_sparse_table_by_hand():
    """Blocks of one token; key j scores j + 1 against every query. Keeping ceil(0.75 * (i + 1)) (>= 2) blocks per
    row, with block 0 and the diagonal forced: row 3 adds block 2 (score 3) over block 1 (score 2)."""
    key = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))[None]
    query = torch.ones(1, 4, 4)
    table = block_sparse_table(query, key, block=1, fraction=0.75, scaling=1.0)[0]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(table, expected)


# ------------------------------------------------------------------------------------------------ masked reference
def test_sparse_prefill_equals_dense_attention_under_the_selected_mask():
    """Mixed kinds on a GQA layer: the layer's output is dense attention with the estimated per-head mask, and
    that mask is really sparse (the output leaves dense attention)."""
    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 1, 4, 2, 256, 16
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    choices = [HeadChoice("a_shape", window=0.1), HeadChoice("vertical_slash", vertical=0.02, slash=0.05),
               HeadChoice("block_sparse", blocks=0.2), HeadChoice("vertical_slash", vertical=0.05, slash=0.02)]
    state = _PrefillState(lambda layer, h: choices, block=16, last_q=16, min_length=1)
    out = state.sparse(0, q, k, v, D ** -0.5)
    patterns = estimate_patterns(q[0], k[0], choices, block=16, last_q=16, scaling=D ** -0.5)
    reference = _masked_reference(q, k, v, HeadPatterns(patterns), scaling=D ** -0.5)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    dense = sparse_prefill_attention(q, k, v, HeadPatterns(estimate_patterns(
        q[0], k[0], [HeadChoice("vertical_slash", vertical=1.0)] * Hq, block=16, last_q=16, scaling=D ** -0.5)))
    assert float((out - dense).abs().max()) > 1e-2
    flops = state.flops[0][0]
    assert flops == pytest.approx(dense_plan_fraction(patterns, Hq, L, L, 16)) and 0.05 < flops < 0.8


# ------------------------------------------------------------------------------------------------------- exactness
def _greedy(model, cache=None, length=48):
    kwargs = cache_kwarg(model, cache, generate=True) if cache is not None else {}
    out = model.generate(ids(length), max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, **kwargs)
    return out.sequences, torch.stack(out.logits)


def test_every_block_kept_equals_plain_generate():
    model = tiny_llama()
    plain_seq, plain_logits = _greedy(model)
    method = build_method("minference:vertical=1:block=8:last_q=8:min_length=16")
    with method.make_cache(model) as cache:
        seq, logits = _greedy(model, cache)
        telemetry = method.telemetry(cache)
    assert torch.equal(seq, plain_seq)
    assert float((logits - plain_logits).abs().max()) <= 1e-4
    assert telemetry["sparse_layers"] == 2 and method.prefill_flops_fraction == 1.0
    assert all(m.config._attn_implementation == "sdpa" for m in (l.self_attn for l in model.model.layers))


def test_lossy_prefill_is_sparse_and_composes_with_snapkv():
    model = tiny_llama()
    plain_logits = _greedy(model, length=192)[1]
    method = build_method("minference:vertical=0.02:slash=0.05:block=8:last_q=8:min_length=16:"
                          "method=snapkv,budget=32,window=4")
    with method.make_cache(model) as cache:
        logits = _greedy(model, cache, length=192)[1]
        telemetry = method.telemetry(cache)
    assert 0 < telemetry["prefill_flops_fraction"] < 0.9
    assert telemetry["kept_tokens_per_layer"][0] <= 36  # SnapKV's budget held for decoding
    assert float((logits - plain_logits).abs().max()) > 1e-4  # the prefill really was sparse
    assert telemetry["inner_method"].startswith("snapkv")
    assert build_method(method.spec).spec == method.spec


def test_short_prompts_run_dense():
    model = tiny_llama()
    method = MInference(vertical=0.01, slash=0.01, min_length=1024)
    with method.make_cache(model) as cache:
        logits = _greedy(model, cache)[1]
        telemetry = method.telemetry(cache)
    assert float((logits - _greedy(model)[1]).abs().max()) <= 1e-4
    assert telemetry["sparse_layers"] == 0 and telemetry["dense_prefill_forwards"] == 2


@pytest.mark.parametrize("spec, match", [
    ("minference:vertical=2", "fraction"),
    ("minference:last_q=0", "last_q"),
    ("minference:method=quest", "computes its own attention"),
    ("minference:pattern=nope", "nope"),
    ("chunked:method=minference", "chunked prefill"),
])
def test_bad_specs_get_one_clear_error(spec, match):
    with pytest.raises(ValueError, match=match):
        build_method(spec)


# ---------------------------------------------------------------------------------------------------------- search
def test_search_picks_within_budget_saves_and_runs(tmp_path):
    model = tiny_llama()
    prompts = [ids(128, seed=s) for s in (1, 2)]
    candidates = (HeadChoice("a_shape", window=0.1), HeadChoice("vertical_slash", vertical=0.02, slash=0.05),
                  HeadChoice("block_sparse", blocks=0.2), HeadChoice("vertical_slash", vertical=1.0))
    pattern = search_patterns(model, prompts, density=0.6, candidates=candidates, block=16, last_q=16, rows=64,
                              label="tiny")
    assert [len(row) for row in pattern.heads] == [4, 4]
    assert all(c in candidates[:3] for row in pattern.heads for c in row)  # the dense one is over budget
    assert all(d <= 0.6 + 1e-6 for row in pattern.density for d in row)
    assert all(0 < r <= 1 + 1e-6 for row in pattern.recall for r in row)
    path = pattern.save(tmp_path / "p.json")
    loaded = MInferencePattern.load(str(path))
    assert loaded.heads == pattern.heads
    check = pattern_recall(model, loaded, [ids(128, seed=3)], block=16, last_q=16, rows=64)
    assert 0 < check["recall"] <= 1 and check["density"] <= 0.6 + 1e-6
    method = MInference(pattern=str(path), block=16, last_q=16, min_length=16)
    with method.make_cache(model) as cache:
        _greedy(model, cache, length=128)
    assert 0 < method.prefill_flops_fraction < 0.7
    other = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="another model"):
        method.make_cache(other)


def test_search_rows_spread_or_at_the_end_and_recall_measured_there():
    assert search_rows(10, 4).tolist() == [0, 3, 6, 9]
    assert search_rows(10, 4, "end").tolist() == [6, 7, 8, 9]
    assert search_rows(3, 8, "end").tolist() == [0, 1, 2]
    for bad in ({"rows_at": "last"}, {"rows": 0}):
        with pytest.raises(ValueError, match="rows"):
            search_rows(10, **{"rows": 4, **bad})
    model = tiny_llama()
    prompt = [ids(128, seed=3)]
    pattern = search_patterns(model, [ids(128, seed=1)], density=0.6, candidates=(HeadChoice("a_shape", window=0.1),),
                              block=16, last_q=16, rows=16, rows_at="end")
    assert pattern.found_by["rows_at"] == "end"
    every = [pattern_recall(model, pattern, prompt, block=16, last_q=16, rows=128, rows_at=at)["recall"]
             for at in ("spread", "end")]
    assert every[0] == pytest.approx(every[1], abs=1e-6)  # all 128 rows either way
    end, spread = (pattern_recall(model, pattern, prompt, block=16, last_q=16, rows=16, rows_at=at)["recall"]
                   for at in ("end", "spread"))
    assert end != pytest.approx(spread, abs=1e-4)  # a local window keeps less of a late row's attention
    with pytest.raises(ValueError, match="rows_at"):
        search_patterns(model, prompt, rows_at="question")


def test_a_wrapped_method_with_its_own_attention_is_refused_at_make_cache():
    model = tiny_llama()
    with pytest.raises(ValueError, match="computes its own attention"):
        build_method("minference:method=kvquant,bits=4").make_cache(model)
    assert all(m.config._attn_implementation == "sdpa" for m in (l.self_attn for l in model.model.layers))


def test_registered_and_shipped_pattern_fits_smollm2():
    assert METHODS["minference"] is MInference
    pattern = MInferencePattern.load("minference-smollm2-135m")
    assert pattern.fingerprint["num_hidden_layers"] == len(pattern.heads) == 30
    assert all(len(row) == 9 for row in pattern.heads)
    assert pattern.validation["recall"] > 0.5 and pattern.found_by["haystack"] != pattern.validation["haystack"]
