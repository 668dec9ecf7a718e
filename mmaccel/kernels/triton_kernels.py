"""Triton kernels: block-sparse flash attention forward and split-K decode over selected tokens.

Both load in their input dtype and compute in fp32 (bf16 arithmetic is wrong in the Triton CPU interpreter), then
cast on store; the decode kernel's ``tl.dot`` setting multiplies fp16/bf16 inputs on tensor cores with fp32
accumulation (on a GPU; under the interpreter bf16 falls back to fp32 broadcast products). On the CPU they only run
with ``TRITON_INTERPRET=1`` set before import (for tests).

The prefill kernel follows FlashAttention-2 (Dao, 2023, arXiv 2307.08691) with a per-(head, query tile) list of
key tiles, as in Block-Sparse-Attention / MInference: tiles not in the list are never loaded or computed. Inside a
visited tile the pattern's token rule (see :mod:`mmaccel.kernels.patterns`) masks individual pairs. The decode kernel
is flash-decoding (Dao et al., 2023, "Flash-Decoding for long-context inference"): the selected keys are split over
programs, each writes a partial output and log-sum-exp, and a second small kernel merges them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .patterns import BlockPlan


@triton.jit
def _sparse_prefill_fwd(
    Q, K, V, OUT, KV_NUM, KV_IDX, SINK, WIN, GRAN, HAS_T, TABLE, KV_LENS,
    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
    s_num_h, s_idx_h, s_idx_q, s_t_h, s_t_r,
    H, GROUP, Lq, Lk, scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    off = Lk - Lq
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    qa = offs_m + off
    k_len = tl.load(KV_LENS + b)
    sink = tl.load(SINK + h)
    win = tl.load(WIN + h)
    gran = tl.load(GRAN + h)
    has_t = tl.load(HAS_T + h)
    n_tiles = tl.load(KV_NUM + h * s_num_h + qb)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(n_tiles):
        kb = tl.load(KV_IDX + h * s_idx_h + qb * s_idx_q + j)
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Lk
        k = tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        ok = row_ok[:, None] & col_ok[None, :] & (offs_n[None, :] < k_len)
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= qa[:, None])
        rule = (offs_n[None, :] < sink) | ((qa[:, None] - offs_n[None, :]) < win)
        t_ok = ok & ((offs_n * 0 + has_t) != 0)[None, :]
        t = tl.load(TABLE + h * s_t_h + (qa // gran)[:, None] * s_t_r + (offs_n // gran)[None, :],
                    mask=t_ok, other=0)
        ok = ok & (rule | (t != 0))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def sparse_prefill_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float, kv_lens: torch.Tensor | None
) -> torch.Tensor:
    """Launch :func:`_sparse_prefill_fwd`; q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (last dim contiguous)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dev = q.device
    out = torch.empty_like(q)
    num, idx = plan.kv_lists()
    num, idx = num.to(dev), idx.to(dev)
    rules = plan.rules
    sink = torch.tensor([r.sink for r in rules], dtype=torch.int32, device=dev)
    win = torch.tensor([r.window for r in rules], dtype=torch.int32, device=dev)
    gran = torch.tensor([r.gran for r in rules], dtype=torch.int32, device=dev)
    has_t = torch.tensor([r.table is not None for r in rules], dtype=torch.int32, device=dev)
    rows = max([r.table.shape[0] for r in rules if r.table is not None], default=1)
    cols = max([r.table.shape[1] for r in rules if r.table is not None], default=1)
    table = torch.zeros(Hq, rows, cols, dtype=torch.int8, device=dev)
    for h, r in enumerate(rules):
        if r.table is not None:
            table[h, : r.table.shape[0], : r.table.shape[1]] = r.table.to(dev)
    if kv_lens is None:
        kv_lens = torch.full((B,), Lk, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(Lq, plan.block_q), B * Hq)
    _sparse_prefill_fwd[grid](
        q, k, v, out, num, idx, sink, win, gran, has_t, table, kv_lens.to(device=dev, dtype=torch.int32),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        num.stride(0), idx.stride(0), idx.stride(1), table.stride(0), table.stride(1),
        Hq, Hq // Hkv, Lq, Lk, scale,
        CAUSAL=plan.causal, HEAD_DIM=D, BLOCK_M=plan.block_q, BLOCK_N=plan.block_k,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
    )
    return out


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch settings of the split-K decode kernel.

    ``use_dot`` computes ``q @ k^T`` and ``p @ v`` with ``tl.dot`` (tensor cores for fp16/bf16 caches, IEEE fp32
    for fp32 ones; the GQA group is padded to 16 rows) instead of broadcast products on CUDA cores; ``block_n`` is
    the keys loaded per loop step; ``num_warps`` / ``num_stages`` are Triton's. ``splits_scale`` multiplies the
    default number of split-K partitions. :data:`DEFAULT_DECODE_CONFIG` is the setting with the least mean slowdown
    over six cases (whole cache, 2,048 tokens, 2,048 tokens in pages; 32k and 128k caches) among 72 swept on an H200
    in bf16 (``benchmarks/decode_kernel_sweep.py``; ``benchmarks/results/gpu_h200/run2_2026-11-27``): 2.4-4x faster
    than the broadcast-product setting over a whole cache. The CPU interpreter ignores warps and stages.
    """

    use_dot: bool = False
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    splits_scale: int = 1


DEFAULT_DECODE_CONFIG = DecodeKernelConfig(use_dot=True, block_n=32, num_warps=4, num_stages=3, splits_scale=4)


@triton.jit
def _decode_split_fwd(
    Q, K, V, IDX, LENS, O_PART, LSE_PART,
    s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ib, s_ih, s_ob, s_oh, s_os, s_lb, s_lh,
    HI, QG, GROUP, N_IDX, S, CHUNK, scale,
    HAS_IDX: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    bi = tl.program_id(0)
    split = tl.program_id(1)
    b = bi // HI
    ih = bi % HI
    hq0 = ih * QG
    hk = hq0 // GROUP
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < QG
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + b * s_qb + (hq0 + offs_g)[:, None] * s_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if USE_DOT:
        q = q.to(K.dtype.element_ty)
    else:
        q = q.to(tl.float32)
    n_valid = tl.load(LENS + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * CHUNK
    for n0 in range(start, start + CHUNK, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = (offs_n < N_IDX) & (offs_n < start + CHUNK)
        if HAS_IDX:
            pos = tl.load(IDX + b * s_ib + ih * s_ih + offs_n, mask=in_range, other=-1)
        else:
            pos = offs_n
        ok = in_range & (pos >= 0) & (pos < n_valid) & (pos < S)
        k = tl.load(K + b * s_kb + hk * s_kh + pos[:, None] * s_kn + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * s_vb + hk * s_vh + pos[:, None] * s_vn + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if USE_DOT:
            pv = tl.dot(p.to(V.dtype.element_ty), v, input_precision=PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(O_PART + b * s_ob + (hq0 + offs_g)[:, None] * s_oh + split * s_os + offs_d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LSE_PART + b * s_lb + (hq0 + offs_g) * s_lh + split, lse, mask=g_ok)


@triton.jit
def _combine_splits_fwd(O_PART, LSE_PART, OUT, SPLITS, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LSE_PART + row * SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(s_ok, tl.exp(lse - m), 0.0)
    denom = tl.sum(w, 0)
    o = tl.load(O_PART + row * SPLITS * HEAD_DIM + offs_s[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(OUT + row * HEAD_DIM + offs_d, out, mask=d_ok)


def decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor | None,
    lens: torch.Tensor, scale: float, num_splits: int, config: DecodeKernelConfig | None = None,
) -> torch.Tensor:
    """Split-K decode; q [B, Hq, D]; caches [B, Hkv, S, D]; idx int32 [B, Hi, N] (Hi = Hkv or Hq) or None.

    ``num_splits`` is scaled by ``config.splits_scale`` (default :data:`DEFAULT_DECODE_CONFIG`). Returns fp32
    [B, Hq, D] after the log-sum-exp combine of the splits (one Triton launch).
    """
    cfg = config or DEFAULT_DECODE_CONFIG
    if cfg.use_dot and k_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu":
        cfg = replace(cfg, use_dot=False)  # the CPU interpreter's bf16 tl.dot is wrong; broadcast products are not
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    Hi = idx.shape[1] if idx is not None else Hkv
    n_idx = idx.shape[2] if idx is not None else S
    block_n = cfg.block_n
    splits = max(1, min(num_splits * cfg.splits_scale, triton.cdiv(max(n_idx, 1), block_n)))
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(n_idx, 1), splits), block_n) * block_n)
    splits = max(1, triton.cdiv(n_idx, chunk))
    o_part = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    qg = Hq // Hi
    idx_arg = idx if idx is not None else lens  # unused pointer when HAS_IDX is False
    block_d = triton.next_power_of_2(D)
    _decode_split_fwd[(B * Hi, splits)](
        q, k_cache, v_cache, idx_arg, lens, o_part, lse_part,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        idx.stride(0) if idx is not None else 0, idx.stride(1) if idx is not None else 0,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        Hi, qg, Hq // Hkv, n_idx, S, chunk, scale,
        HAS_IDX=idx is not None, HEAD_DIM=D,
        BLOCK_G=max(16 if cfg.use_dot else 1, triton.next_power_of_2(qg)), BLOCK_N=block_n,
        BLOCK_D=max(16, block_d) if cfg.use_dot else block_d, USE_DOT=cfg.use_dot,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    _combine_splits_fwd[(B * Hq,)](o_part, lse_part, out, splits, HEAD_DIM=D,
                                   BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d)
    return out

