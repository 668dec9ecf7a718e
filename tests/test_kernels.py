"""Dense attention, tree attention, column scores and backend choice vs fp32 references (CPU)."""
import math

import pytest
import torch

from mmaccel.kernels import attention, attention_column_scores, available_backends, tree_attention
from mmaccel.kernels.backends import resolve_backend
from mmaccel.kernels.column_scores import _query_tiles, attention_column_scores_reference
from mmaccel.kernels.dense import causal_mask

# Tolerances per input dtype, against an fp32 reference computed from the same (rounded) inputs.
TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def qkv(B, Hq, Hkv, Lq, Lk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def mk(h, n):
        return torch.randn(B, h, n, D, generator=g).to(dtype)

    return mk(Hq, Lq), mk(Hkv, Lk), mk(Hkv, Lk)


def naive(q, k, v, allowed, scale=None):
    """Textbook softmax(QK^T)V with repeated KV heads, fp32; empty rows -> 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 37, 16), (1, 6, 3, 1, 45, 32), (2, 2, 2, 20, 50, 16)])
def test_dense_matches_naive(backend, dtype, shape):
    _B, _Hq, _Hkv, Lq, Lk, _D = shape
    q, k, v = qkv(*shape, dtype=dtype)
    out = attention(q, k, v, causal=True, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    ref = naive(q, k, v, causal_mask(Lq, Lk, "cpu"))
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex", "triton"])
def test_dense_right_padding_batch(backend):
    q, k, v = qkv(3, 4, 2, 33, 33, 16)
    mask = torch.arange(33)[None, :] < torch.tensor([33, 20, 1])[:, None]
    out = attention(q, k, v, attention_mask=mask, backend=backend)
    ref = naive(q, k, v, causal_mask(33, 33, "cpu") & mask[:, None, None, :])
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_dense_4d_additive_mask_and_noncausal():
    q, k, v = qkv(2, 4, 2, 9, 14, 16)
    bias = torch.randn(2, 1, 9, 14)
    out = attention(q, k, v, causal=False, attention_mask=bias, backend="sdpa")
    ref = attention(q, k, v, causal=False, attention_mask=bias, backend="reference")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex", "triton"])
def test_dense_varlen_packed(backend):
    cu_q, cu_k = torch.tensor([0, 7, 7, 30, 31]), torch.tensor([0, 9, 12, 40, 41])
    q, k, v = qkv(1, 4, 2, 31, 41, 16)
    out = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend)
    for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        if q1 > q0:
            ref = naive(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], causal_mask(q1 - q0, k1 - k0, "cpu"))
            torch.testing.assert_close(out[:, :, q0:q1], ref, **TOL[torch.float32])


def test_dense_errors():
    q, k, v = qkv(1, 3, 2, 5, 5, 16)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k, v)
    q, k, v = qkv(1, 4, 2, 5, 5, 16)
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, k, v, attention_mask=torch.ones(1, 1, 4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="right padding"):
        attention(q, k, v, attention_mask=torch.tensor([[False, True, True, True, True]]), backend="triton")
    with pytest.raises(ValueError, match="cu_seqlens must"):
        attention(q, k, v, cu_seqlens_q=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="unknown backend"):
        attention(q, k, v, backend="cuda-magic")
    with pytest.raises(ValueError, match="contiguous"):
        attention(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, backend="triton")
    with pytest.raises(RuntimeError, match="flash"):
        attention(q, k, v, backend="flash")


def test_auto_never_picks_interpreter_on_cpu():
    assert resolve_backend("auto", torch.device("cpu"), ("flex", "triton", "reference"), "op") == "reference"
    dense_order = ("flash", "sdpa", "flex", "triton", "reference")
    assert resolve_backend("auto", torch.device("cpu"), dense_order, "op") == "sdpa"
    assert available_backends("cpu")[0] == "sdpa"


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
def test_tree_attention(backend):
    # tree: 0 -> (1, 2); 1 -> 3; 2 -> 4
    parent = [-1, 0, 0, 1, 2]
    T, P = len(parent), 11
    tm = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            tm[i, j] = True
            j = parent[j]
    q, k, v = qkv(2, 4, 2, T, P + T, 16)
    out = tree_attention(q, k, v, tm, P, backend=backend)
    allowed = torch.cat([torch.ones(T, P, dtype=torch.bool), tm], 1)
    torch.testing.assert_close(out, naive(q, k, v, allowed), **TOL[torch.float32])
    # a chain tree is plain causal attention
    chain = torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(tree_attention(q, k, v, chain, P, backend=backend),
                               attention(q, k, v, backend="reference"), **TOL[torch.float32])


def test_tree_attention_errors():
    q, k, v = qkv(1, 2, 2, 3, 7, 16)
    with pytest.raises(ValueError, match="prefix_len"):
        tree_attention(q, k, v, torch.eye(3, dtype=torch.bool), 5)
    with pytest.raises(ValueError, match="diagonal"):
        tree_attention(q, k, v, torch.zeros(3, 3, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=r"\[T, T\]"):
        tree_attention(q, k, v, torch.eye(2, dtype=torch.bool), 4)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("causal", [True, False])
# one block (one softmax), four key blocks (two passes), or query tiles of 3 rows (one softmax per tile)
@pytest.mark.parametrize("block_size", [None, 16, "tiles"])
def test_column_scores_match_dense_probabilities(reduce, causal, block_size):
    W, L = 7, 50
    q, k, _ = qkv(2, 4, 2, W, L, 16)
    if block_size is None:
        out = attention_column_scores(q, k, causal=causal, reduce=reduce)
    elif block_size == "tiles":
        out = _query_tiles(q.float().reshape(2, 2, 2, W, 16), k, 3, causal, reduce, 0.25).reshape(2, 4, L)
    else:
        out = attention_column_scores_reference(q, k, causal=causal, reduce=reduce, block_size=block_size)
    allowed = causal_mask(W, L, "cpu") if causal else torch.ones(W, L, dtype=torch.bool)
    g = 2
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / 4.0
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    ref = {"sum": p.sum(2), "mean": p.mean(2), "max": p.amax(2)}[reduce]
    assert out.shape == (2, 4, L) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    if reduce == "sum":  # every query row is a distribution
        torch.testing.assert_close(out.sum(-1), torch.full((2, 4), float(W)), atol=1e-4, rtol=0)


def test_a_long_window_takes_query_tiles_with_the_key_blocks_result(monkeypatch):
    """A window whose logits over every key pass 64 MiB (600 x 8,192 x 4 heads, fp32) is scored in query tiles, one
    softmax each (KVzip's reconstruction), and gives what the two-pass key blocks give."""
    import mmaccel.kernels.column_scores as cs

    tiles = []
    monkeypatch.setattr(cs, "_query_tiles", lambda *a: tiles.append(a[2]) or _query_tiles(*a))
    q, k, _ = qkv(1, 4, 2, 600, 8192, 16)
    out = attention_column_scores(q, k, causal=True, reduce="max")
    assert tiles == [512]
    torch.testing.assert_close(out, attention_column_scores_reference(q, k, causal=True, reduce="max",
                                                                      block_size=2048), atol=1e-6, rtol=1e-5)


def test_column_scores_errors():
    q, k, _ = qkv(1, 4, 2, 9, 5, 16)
    with pytest.raises(ValueError, match="longer than"):
        attention_column_scores(q, k)
    with pytest.raises(ValueError, match="reduce"):
        attention_column_scores(q[:, :, :2], k, reduce="median")
    with pytest.raises(ValueError, match="multiple"):
        attention_column_scores(q[:, :3, :2], k)
