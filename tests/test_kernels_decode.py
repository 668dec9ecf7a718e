"""Decode attention over all / selected tokens / selected pages: Triton split-K vs the reference (CPU)."""
import math

import pytest
import torch

from mmaccel.kernels import decode_attention
from mmaccel.kernels.decode import pages_to_indices
from mmaccel.kernels.triton_kernels import DEFAULT_DECODE_CONFIG, DecodeKernelConfig

TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}


def cache(B, Hq, Hkv, S, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, 1, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype),
            torch.randn(B, Hkv, S, D, generator=g).to(dtype))


def naive(q, k, v, keep):
    """keep: bool [B, Hq, S] keys each query head reads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ k.transpose(-1, -2))[:, :, 0] / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    return (p[:, :, None] @ v)


def keep_from(idx, B, Hq, S, lens):
    keep = torch.zeros(B, idx.shape[1], S + 1, dtype=torch.bool)
    keep.scatter_(2, torch.where(idx < 0, S, idx).clamp(max=S), True)
    keep = keep[..., :S] & (torch.arange(S) < lens[:, None, None])
    return keep.repeat_interleave(Hq // idx.shape[1], 1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("index_heads", ["kv", "q"])
def test_selected_tokens(backend, dtype, index_heads):
    B, Hq, Hkv, S = 2, 4, 2, 150
    q, k, v = cache(B, Hq, Hkv, S, 32, dtype)
    lens = torch.tensor([150, 77])
    g, Hi = torch.Generator().manual_seed(3), Hkv if index_heads == "kv" else Hq
    idx = torch.stack([torch.randperm(S, generator=g)[:45] for _ in range(B * Hi)]).reshape(B, Hi, 45)
    idx[:, :, ::7] = -1  # unused slots
    out = decode_attention(q, k, v, indices=idx, cache_seqlens=lens, num_splits=3, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), naive(q, k, v, keep_from(idx, B, Hq, S, lens)), **TOL[dtype])


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("splits", [1, 4])
def test_full_cache_and_split_k(backend, splits):
    q, k, v = cache(2, 6, 3, 97, 16)
    lens = torch.tensor([97, 1])
    out = decode_attention(q[:, :, 0], k, v, cache_seqlens=lens, num_splits=splits, backend=backend)  # [B, Hq, D] too
    keep = (torch.arange(97) < lens[:, None])[:, None].expand(2, 6, 97)
    torch.testing.assert_close(out, naive(q, k, v, keep)[:, :, 0], **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pages(backend):
    B, Hq, Hkv, S, ps = 2, 4, 2, 100, 16
    q, k, v = cache(B, Hq, Hkv, S, 16)
    pages = torch.tensor([[[0, 6, -1], [2, 1, 3]], [[1, -1, -1], [0, 5, 4]]])  # page 6 is the partial last page
    lens = torch.tensor([100, 90])
    out = decode_attention(q, k, v, pages=pages, page_size=ps, cache_seqlens=lens, backend=backend)
    keep = keep_from(pages_to_indices(pages, ps).clamp(max=S), B, Hq, S, lens)
    torch.testing.assert_close(out, naive(q, k, v, keep), **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_selection_gives_zero(backend):
    q, k, v = cache(1, 2, 1, 20, 16)
    for idx in (torch.full((1, 1, 4), -1), torch.zeros(1, 1, 0, dtype=torch.long)):
        assert torch.count_nonzero(decode_attention(q, k, v, indices=idx, backend=backend)) == 0


def test_errors():
    q, k, v = cache(1, 4, 2, 20, 16)
    with pytest.raises(ValueError, match=r"must lie in \[-1, 20\)"):
        decode_attention(q, k, v, indices=torch.tensor([[[3, 20]] * 2]))
    with pytest.raises(ValueError, match=r"must lie in \[-1, 2\)"):
        decode_attention(q, k, v, pages=torch.tensor([[[0, 2]] * 2]), page_size=16)
    with pytest.raises(ValueError, match="Hkv or Hq"):
        decode_attention(q, k, v, indices=torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="not both"):
        decode_attention(q, k, v, indices=torch.zeros(1, 2, 1, dtype=torch.long), pages=torch.zeros(1, 2, 1))
    with pytest.raises(ValueError, match="one query token"):
        decode_attention(torch.randn(1, 4, 2, 16), k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        decode_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, backend="triton")
    with pytest.raises(ValueError, match="cache_seqlens"):
        decode_attention(q, k, v, cache_seqlens=torch.tensor([21]))


DOT = DecodeKernelConfig(use_dot=True, block_n=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("config", [DOT, DecodeKernelConfig(block_n=64, splits_scale=3)], ids=["dot", "wide"])
@pytest.mark.parametrize("index_heads", ["none", "kv", "q"])
def test_kernel_configs_agree_with_the_naive_attention(config, index_heads):
    """Every launch setting the sweep may pick (``tl.dot`` with the GQA group padded to 16 rows, wider key blocks,
    more splits than keys per split) computes the same attention, incl. per-query-head selections and a short
    sequence in the batch."""
    B, Hq, Hkv, S = 2, 8, 2, 130
    q, k, v = cache(B, Hq, Hkv, S, 16, seed=5)
    lens = torch.tensor([130, 40])
    if index_heads == "none":
        idx, keep = None, (torch.arange(S) < lens[:, None])[:, None].expand(B, Hq, S)
    else:
        Hi = Hkv if index_heads == "kv" else Hq
        g = torch.Generator().manual_seed(1)
        idx = torch.stack([torch.randperm(S, generator=g)[:50] for _ in range(B * Hi)]).reshape(B, Hi, 50)
        idx[:, :, ::5] = -1
        keep = keep_from(idx, B, Hq, S, lens)
    out = decode_attention(q, k, v, indices=idx, cache_seqlens=lens, num_splits=2, backend="triton",
                           kernel_config=config)
    torch.testing.assert_close(out, naive(q, k, v, keep), **TOL[torch.float32])


def test_bf16_under_the_interpreter_matches_the_reference():
    """The interpreter's bf16 ``tl.dot`` is wrong, so on the CPU a bf16 cache falls back to broadcast products: the
    default setting still computes the attention."""
    q, k, v = cache(1, 8, 2, 100, 32, torch.bfloat16, seed=2)
    ref = decode_attention(q, k, v, backend="reference").float()
    for config in (None, DOT):
        out = decode_attention(q, k, v, backend="triton", kernel_config=config).float()
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [DOT, DecodeKernelConfig(), DEFAULT_DECODE_CONFIG], ids=["dot", "sum", "default"])
def test_gpu_bf16_long_cache_every_config(config):
    q, k, v = (t.cuda() for t in cache(2, 32, 8, 32768, 128, torch.bfloat16))
    idx = torch.randint(0, 32768, (2, 8, 2048), device="cuda")
    ref = decode_attention(q, k, v, indices=idx, backend="reference")
    out = decode_attention(q, k, v, indices=idx, backend="triton", kernel_config=config)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    whole = decode_attention(q, k, v, backend="triton", kernel_config=config)
    torch.testing.assert_close(whole.float(), decode_attention(q, k, v, backend="reference").float(), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.gpu
def test_gpu_bf16_long_cache():
    q, k, v = (t.cuda() for t in cache(2, 32, 8, 32768, 128, torch.bfloat16))
    idx = torch.randint(0, 32768, (2, 8, 2048), device="cuda")
    out = decode_attention(q, k, v, indices=idx, backend="triton")
    ref = decode_attention(q, k, v, indices=idx, backend="reference")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unchecked_out_of_range_selections_are_skipped_like_unused_slots(backend):
    """``check_indices=False`` (no GPU sync) never reads outside the cache: an out-of-range token or page is skipped
    like ``-1``; with the check (default) it raises."""
    q, k, v = cache(1, 4, 2, 64, 16)
    idx = torch.tensor([[[3, 70, 9, -1], [200, 5, 6, 7]]])
    clean = torch.where(idx >= 64, -1, idx)
    out = decode_attention(q, k, v, indices=idx, backend=backend, check_indices=False)
    torch.testing.assert_close(out, decode_attention(q, k, v, indices=clean, backend=backend), **TOL[torch.float32])
    pages = torch.tensor([[[0, 9], [3, 1]]])  # 64 tokens = 4 pages of 16: page 9 does not exist
    out = decode_attention(q, k, v, pages=pages, backend=backend, check_indices=False)
    expected = decode_attention(q, k, v, pages=torch.where(pages >= 4, -1, pages), backend=backend)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    with pytest.raises(ValueError, match="must lie in"):
        decode_attention(q, k, v, indices=idx, backend=backend)
