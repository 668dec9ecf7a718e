"""ChunkKV: chunk ranking hand-computed, whole chunks kept on a real compression, shared vs per-head selection, the
wrapper's spec and errors. (Equivalence when unbounded, decode logits against the per-head masked reference, padding
and batches: tests/test_longctx_methods.py, whose method tables include chunkkv.)"""
import pytest
import torch
from tiny_models import random_prompt, tiny_llama

from mmaccel.longctx import METHODS, ChunkKV, SnapKV, build_method
from mmaccel.longctx.chunkkv import chunkkv_scores

INF = float("inf")


def test_chunk_means_rank_first_then_own_scores_and_inf_stays():
    # chunks of 4: means 1.25, 1.0, 2.25, inf -> order chunk 1, chunk 0, chunk 2, then the always-kept window
    scores = torch.tensor([[[0.0, 5, 0, 0, 1, 1, 1, 1, 0, 0, 9, 0, INF, INF]]])
    ranked = chunkkv_scores(scores, torch.arange(14)[None, None], 4)
    assert ranked[0, 0].tolist() == [4, 7, 5, 6, 0, 1, 2, 3, 8, 9, 11, 10, INF, INF]
    # a top-8 keeps the window, chunk 2 whole, and splits chunk 0 by its own scores: position 1 (5.0), then the last
    # of the tied zeros (a stable sort)
    kept = ranked.topk(2 + 6, dim=-1).indices.sort(dim=-1).values[0, 0].tolist()
    assert kept == [1, 3, 8, 9, 10, 11, 12, 13]


def test_token_level_top_k_splits_a_chunk_that_chunkkv_keeps_whole():
    # one isolated high-score token (position 2) against a chunk of steady middling ones (positions 4-7)
    scores = torch.tensor([[[0.0, 0, 9, 0, 3, 3, 3, 3]]])
    positions = torch.arange(8)[None, None]
    token_level = scores.topk(4, dim=-1).indices.sort().values[0, 0].tolist()
    chunked = chunkkv_scores(scores, positions, 4).topk(4, dim=-1).indices.sort().values[0, 0].tolist()
    assert token_level == [2, 4, 5, 6]
    assert chunked == [4, 5, 6, 7]


def test_shared_heads_rank_chunks_by_the_sum_over_heads_per_head_by_their_own():
    # head 0 prefers chunk 0 weakly, head 1 prefers chunk 1 strongly: shared -> both keep chunk 1
    scores = torch.tensor([[[2.0, 2, 1, 1], [0.0, 0, 5, 5]]])
    positions = torch.arange(4).expand(1, 2, 4)
    def top(ranked):
        return ranked.topk(2, dim=-1).indices.sort().values[0].tolist()

    assert top(chunkkv_scores(scores, positions, 2, shared=True)) == [[2, 3], [2, 3]]
    assert top(chunkkv_scores(scores, positions, 2, shared=False)) == [[0, 1], [2, 3]]


def test_chunks_follow_token_positions_not_slot_order():
    # slots that hold positions 0, 1, 8, 9 (what an earlier prefill chunk kept): chunk 4 -> chunks {0, 1} and {8, 9}
    scores = torch.tensor([[[1.0, 1, 0, 3]]])
    positions = torch.tensor([[[0, 1, 8, 9]]])
    ranked = chunkkv_scores(scores, positions, 4)
    assert ranked.topk(2, dim=-1).indices.sort().values[0, 0].tolist() == [2, 3]


def test_a_real_compression_keeps_whole_chunks_shared_by_the_heads():
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, attn="sdpa")
    method = build_method("chunkkv:chunk=4:method=snapkv,budget=16,window=4")
    with method.make_cache(model) as cache:
        model(random_prompt(40, seed=4), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            kept = layer.positions[0]  # [Hkv, 16]
            assert torch.equal(kept[0], kept[1])  # heads="shared"
            prefix = kept[0][kept[0] < 36]  # the window (36..39) is one whole chunk
            assert prefix.numel() == 12
            chunks = (prefix // 4).tolist()
            assert all(chunks.count(c) == 4 for c in set(chunks))  # 12 slots = 3 whole chunks, none split


def test_spec_round_trips_and_takes_the_wrapped_budget():
    method = build_method("chunkkv:method=snapkv,ratio=0.25,window=8:chunk=20:heads=per_head")
    assert isinstance(method, ChunkKV) and METHODS["chunkkv"] is ChunkKV
    assert method.ratio == 0.25 and method.budget is None and method.chunk == 20
    assert build_method(method.spec) == method
    assert ChunkKV(SnapKV(budget=64)).budget == 64
    assert build_method("chunkkv:method=h2o,budget=64").evicts_on_decode


@pytest.mark.parametrize("spec, message", [
    ("chunkkv:method=full", "wraps a scored method"),
    ("chunkkv:method=adakv", "wraps a scored method"),  # a wrapper over a wrapper
    ("adakv:method=chunkkv", "wraps a scored method"),
    ("chunkkv:method=snapkv:chunk=0", "chunk must be"),
    ("chunkkv:method=snapkv:heads=some", "heads must be one of"),
    ("chunkkv:method=snapkv,budget=64:budget=32", "differs from the wrapped method"),
])
def test_bad_arguments_raise_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        build_method(spec)
