"""Sparse prefill: every backend against the dense masked oracle, tile skipping, and pattern errors (CPU)."""
import pytest
import torch

from mmaccel.kernels import BlockSparse, Chunked, Dense, HeadPatterns, Streaming, sparse_prefill_attention
from mmaccel.kernels.patterns import block_plan, token_mask
from mmaccel.kernels.sparse_prefill import _masked_reference

TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
BACKENDS = [("reference", None), ("reference", 16), ("flex", None), ("flex", 32), ("triton", 32), ("triton", 16)]


def qkv(B, Hq, Hkv, Lq, Lk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def mk(h, n):
        return torch.randn(B, h, n, D, generator=g).to(dtype)

    return mk(Hq, Lq), mk(Hkv, Lk), mk(Hkv, Lk)


def mixed_patterns(L, bs=32):
    n = -(-L // bs)
    block_index = torch.randint(-1, n, (n, 3), generator=torch.Generator().manual_seed(1))
    n_chunks = -(-L // 40)
    selected = torch.zeros(n_chunks, n_chunks, dtype=torch.bool)
    selected[2:, 0] = True  # later chunks also see chunk 0
    return HeadPatterns(
        (Dense(), Streaming(4, 20), Chunked(40, sink=3, selected=selected), BlockSparse(block_index, bs))
    )


@pytest.mark.parametrize("backend,block", BACKENDS)
def test_mixed_heads_match_oracle(backend, block):
    q, k, v = qkv(2, 4, 2, 150, 150, 16)  # GQA, length not a multiple of any tile
    pats = mixed_patterns(150)
    out = sparse_prefill_attention(q, k, v, pats, backend=backend, block_size=block)
    torch.testing.assert_close(out, _masked_reference(q, k, v, pats), **TOL[torch.float32])


@pytest.mark.parametrize("backend,block", [("reference", 32), ("flex", None), ("triton", 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_padding_prefix_and_dtypes(backend, block, dtype):
    # batch > 1 with right padding, queries the last 70 of 100 positions (prefill after a cached prefix)
    q, k, v = qkv(2, 4, 1, 70, 100, 32, dtype=dtype)
    pats = HeadPatterns((Streaming(2, 16), Chunked(24, sink=1), Dense(), Streaming(0, 1)))
    lens = torch.tensor([100, 63])
    out = sparse_prefill_attention(q, k, v, pats, seq_lens=lens, backend=backend, block_size=block)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), _masked_reference(q, k, v, pats, seq_lens=lens).float(), **TOL[dtype])


@pytest.mark.parametrize("backend,block", [("reference", 16), ("flex", None), ("triton", 16)])
def test_single_token_and_empty_selection(backend, block):
    q, k, v = qkv(1, 2, 2, 1, 1, 16)
    out = sparse_prefill_attention(q, k, v, Streaming(1, 1), backend=backend, block_size=block)
    torch.testing.assert_close(out, v, **TOL[torch.float32])  # L = 1 attends itself only
    q, k, v = qkv(1, 2, 2, 40, 40, 16)
    empty = BlockSparse(torch.full((3, 1), -1), block_size=16)  # selects no block at all
    pats = HeadPatterns((empty, Dense()))
    out = sparse_prefill_attention(q, k, v, pats, backend=backend, block_size=block)
    assert torch.count_nonzero(out[:, 0]) == 0
    torch.testing.assert_close(out, _masked_reference(q, k, v, pats), **TOL[torch.float32])


def test_per_kv_head_patterns_expand_to_groups():
    q, k, v = qkv(1, 4, 2, 64, 64, 16)
    per_kv = HeadPatterns((Streaming(2, 8), Dense()))
    per_q = HeadPatterns((per_kv.patterns[0],) * 2 + (per_kv.patterns[1],) * 2)
    torch.testing.assert_close(sparse_prefill_attention(q, k, v, per_kv), sparse_prefill_attention(q, k, v, per_q))


def test_dense_pattern_equals_causal_attention():
    q, k, v = qkv(2, 4, 2, 90, 90, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(sparse_prefill_attention(q, k, v, Dense()), ref, **TOL[torch.float32])


def test_vertical_slash_blocks_cover_the_lines():
    L, bs = 200, 32
    vertical, slash = torch.tensor([0, 77]), torch.tensor([0, 5, 130])
    pat = BlockSparse.from_vertical_slash(vertical, slash, L, bs)
    mask = token_mask((pat,), L, L)[0]
    qa, kk = torch.arange(L)[:, None], torch.arange(L)[None, :]
    lines = ((kk == 0) | (kk == 77) | ((qa - kk)[..., None] == slash).any(-1)) & (kk <= qa)
    assert bool(mask[lines].all())  # every vertical/slash pair is inside a selected block
    assert mask.float().mean() < 0.6


def test_skipped_tiles_are_never_computed():
    # streaming tiles grow linearly with L, dense quadratically; the Triton kernel visits exactly the plan's tiles
    L, bs = 4096, 64
    dense = block_plan((Dense(),), L, L, bs, bs).active.sum().item()
    stream = block_plan((Streaming(64, 256),), L, L, bs, bs).active.sum().item()
    n = L // bs
    assert dense == n * (n + 1) // 2
    assert stream <= n * (256 // bs + 2)
    plan = block_plan((Streaming(4, 20),), 150, 150, 32, 32)
    num, idx = plan.kv_lists()
    assert num.tolist() == [[1, 2, 3, 3, 3]]  # query tile i visits sink tile 0 plus the window tiles only
    assert idx[0, 4, :3].tolist() == [0, 3, 4]


def test_errors():
    q, k, v = qkv(1, 4, 2, 64, 64, 16)
    with pytest.raises(ValueError, match="does not fit 4 query heads"):
        sparse_prefill_attention(q, k, v, HeadPatterns((Dense(),) * 3))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sparse_prefill_attention(q[:, :3], k, v, Dense())
    with pytest.raises(ValueError, match=r"ids must be in \[-1, 4\)"):
        sparse_prefill_attention(q, k, v, BlockSparse(torch.tensor([[0], [1], [2], [9]]), 16))
    with pytest.raises(ValueError, match="must be \\[4, k\\]"):
        sparse_prefill_attention(q, k, v, BlockSparse(torch.zeros(2, 1, dtype=torch.long), 16))
    with pytest.raises(ValueError, match="window >= 1"):
        Streaming(4, 0)
    with pytest.raises(TypeError, match="pattern"):
        sparse_prefill_attention(q, k, v, "streaming")
    with pytest.raises(ValueError, match="contiguous"):
        sparse_prefill_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, Dense(), backend="triton")
    with pytest.raises(ValueError, match="seq_lens"):
        sparse_prefill_attention(q, k, v, Dense(), seq_lens=torch.tensor([65]))
    with pytest.raises(ValueError, match="no 'flash' backend"):
        sparse_prefill_attention(q, k, v, Dense(), backend="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_gpu_bf16_matches_oracle(backend):
    q, k, v = (t.cuda() for t in qkv(2, 8, 2, 1000, 1000, 64, dtype=torch.bfloat16))
    n = -(-1000 // 64)
    pats = HeadPatterns((Dense(), Streaming(64, 128), Chunked(256, 64),
                         BlockSparse(torch.randint(-1, n, (n, 4)), 64)) * 2)
    out = sparse_prefill_attention(q, k, v, pats, backend=backend)
    torch.testing.assert_close(out.float(), _masked_reference(q, k, v, pats).float(), atol=2e-2, rtol=2e-2)
