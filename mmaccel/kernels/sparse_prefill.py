"""Sparse prefill attention with per-head patterns (dense / streaming / chunked / block-sparse) in one call.

Every backend reads the same :func:`~mmaccel.kernels.patterns.block_plan`, so a tile that no head pair needs is never
computed: the reference loops over query tiles and gathers only the union of their key tiles, FlexAttention gets
the tiles as a ``BlockMask``, and the Triton kernel walks a per-(head, query tile) list of key tiles.
"""
from __future__ import annotations

import torch

from ._common import attend, check_qkv, default_scale, require_contiguous
from .backends import resolve_backend
from .dense import _sdpa
from .patterns import BlockPlan, Dense, as_head_patterns, block_plan, token_mask

SPARSE_BACKENDS = ("flex", "triton", "reference")
_DEFAULT_BLOCK = {"reference": 64, "flex": 128, "triton": 64}


def _check_lens(seq_lens: torch.Tensor | None, B: int, Lk: int, device) -> torch.Tensor | None:
    if seq_lens is None:
        return None
    seq_lens = torch.as_tensor(seq_lens, device=device)
    if seq_lens.shape != (B,) or seq_lens.dtype.is_floating_point:
        raise ValueError(f"seq_lens must be an integer tensor [B] = [{B}], got {tuple(seq_lens.shape)}")
    if seq_lens.numel() and (seq_lens.min() < 0 or seq_lens.max() > Lk):
        raise ValueError(f"seq_lens must lie in [0, {Lk}], got {seq_lens.tolist()}")
    return seq_lens


def _head_groups(plan: BlockPlan) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for h, g in enumerate(plan.head_group.tolist()):
        groups.setdefault(g, []).append(h)
    return groups


def _select_heads(q, k, v, heads: list[int], group: int):
    """q/k/v restricted to ``heads`` (query heads); keeps GQA sharing when whole groups are selected."""
    Hq = q.shape[1]
    if heads == list(range(Hq)):
        return q, k, v
    kv_heads = sorted({h // group for h in heads})
    if heads == [kh * group + i for kh in kv_heads for i in range(group)]:
        idx = torch.tensor(kv_heads, device=k.device)
    else:  # scattered heads: one key/value head per query head
        idx = torch.tensor([h // group for h in heads], device=k.device)
    hq = torch.tensor(heads, device=q.device)
    return q.index_select(1, hq), k.index_select(1, idx), v.index_select(1, idx)


def _reference(q, k, v, plan: BlockPlan, scale: float, seq_lens) -> torch.Tensor:
    """Block-skipping PyTorch: per distinct pattern, per query tile, attend only the tile's active key tiles."""
    _B, Hq, Lq, _D = q.shape
    Lk = k.shape[2]
    group = Hq // k.shape[1]
    off = Lk - Lq
    out = torch.empty_like(q)
    bq, bk = plan.block_q, plan.block_k
    tile = torch.arange(bk, device=q.device)
    for g, heads in _head_groups(plan).items():
        rule = plan.rules[heads[0]]
        qg, kg, vg = _select_heads(q, k, v, heads, group)
        if seq_lens is None and rule.table is None and rule.sink == 0 and rule.window >= Lk:  # dense head group
            res = _sdpa(qg, kg, vg, True, None, scale)
        else:
            res = torch.empty_like(qg)
            for i in range(plan.active.shape[1]):
                q0, q1 = i * bq, min((i + 1) * bq, Lq)
                kb = plan.active[g, i].nonzero().flatten()
                pos = (kb[:, None] * bk + tile[None, :]).flatten()
                pos = pos[pos < Lk]
                if pos.numel() == 0:
                    res[:, :, q0:q1] = 0
                    continue
                qa = torch.arange(q0, q1, device=q.device)[:, None] + off
                allowed = rule.allowed(qa, pos[None, :])
                if seq_lens is not None:
                    allowed = allowed & (pos[None, None, None, :] < seq_lens[:, None, None, None])
                o, _ = attend(qg[:, :, q0:q1], kg.index_select(2, pos), vg.index_select(2, pos), allowed, scale)
                res[:, :, q0:q1] = o.to(q.dtype)
        if len(heads) == Hq:
            return res
        out[:, heads] = res
    return out


def _flex(q, k, v, plan: BlockPlan, scale: float, seq_lens) -> torch.Tensor:
    from .flex import flex_attention_call, plan_block_mask

    bm = plan_block_mask(plan, q.shape[0], q.device, seq_lens)
    return flex_attention_call(q, k, v, bm, scale)


def _triton(q, k, v, plan: BlockPlan, scale: float, seq_lens) -> torch.Tensor:
    from .triton_kernels import sparse_prefill_triton

    require_contiguous("sparse_prefill_attention(backend='triton')", q=q, k=k, v=v)
    return sparse_prefill_triton(q, k, v, plan, scale, seq_lens)


_IMPLS = {"reference": _reference, "flex": _flex, "triton": _triton}


def sparse_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern,
    *,
    scaling: float | None = None,
    seq_lens: torch.Tensor | None = None,
    block_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal prefill attention where each head follows its own sparse pattern; skipped tiles are never computed.

    Patterns: :class:`~mmaccel.kernels.patterns.Dense`, ``Streaming(sink, window)`` (StreamingLLM, Xiao et al., 2023,
    arXiv 2309.17453; DuoAttention, arXiv 2410.10819), ``Chunked(chunk_size, sink, selected)`` (Video-XL-2,
    arXiv 2506.19225; LongHeads, arXiv 2402.10685), ``BlockSparse(block_index)`` (MInference, Jiang et al., 2024,
    arXiv 2407.02490). Kernel design after Block-Sparse-Attention (Guo et al., 2024) and FlashAttention-2.

    Parameters
    ----------
    q : torch.Tensor
        [B, Hq, Lq, D] fp32 / fp16 / bf16; queries are the last ``Lq`` of the ``Lk`` positions.
    k, v : torch.Tensor
        [B, Hkv, Lk, D]; ``Hq`` a multiple of ``Hkv`` (GQA).
    pattern : pattern or HeadPatterns or sequence of patterns
        One pattern for every head, or ``Hq`` patterns, or ``Hkv`` patterns (shared by each GQA group).
    scaling : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    seq_lens : torch.Tensor, optional
        int [B] valid keys per sequence (right padding); keys at or beyond it are masked.
    block_size : int, optional
        Kernel tile size (tokens, both axes); default 64 (reference, Triton) or 128 (flex). Triton needs >= 16.
    backend : {"auto", "flex", "triton", "reference"}
        ``"auto"``: FlexAttention (compiled) then Triton on CUDA; the block-skipping reference on the CPU.

    Returns
    -------
    torch.Tensor
        [B, Hq, Lq, D] in the dtype of ``q``; rows that attend no key (e.g. a block table that selects nothing) are
        zero.

    Raises
    ------
    ValueError
        On mismatched shapes or head counts, a pattern list of the wrong length, tables that do not fit ``Lk`` or
        hold out-of-range ids, bad ``seq_lens``, ``Lq > Lk``, inputs whose last dimension is not contiguous (Triton),
        or an unknown backend.
    TypeError
        If ``pattern`` is not a pattern.
    RuntimeError
        If an explicitly requested backend is unavailable on this device.
    """
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v, "sparse_prefill_attention")
    patterns = as_head_patterns(pattern, Hq, Hkv)
    name = resolve_backend(backend, q.device, SPARSE_BACKENDS, "sparse_prefill_attention")
    seq_lens = _check_lens(seq_lens, B, Lk, q.device)
    block = block_size or _DEFAULT_BLOCK[name]
    if block < 1 or (name == "triton" and block < 16):
        raise ValueError(f"block_size must be >= 1 (>= 16 for Triton), got {block}")
    plan = block_plan(patterns, Lq, Lk, block, block, q.device)
    if Lq == 0:
        return torch.zeros_like(q)
    return _IMPLS[name](q, k, v, plan, default_scale(scaling, D), seq_lens)


def _masked_reference(q, k, v, pattern, *, scaling=None, seq_lens=None) -> torch.Tensor:
    """Correctness oracle: dense fp32 attention under the full O(Lq * Lk) token mask of the patterns."""
    _B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v, "_masked_reference")
    allowed = token_mask(as_head_patterns(pattern, Hq, Hkv), Lq, Lk, q.device)[None]
    if seq_lens is not None:
        allowed = allowed & (torch.arange(Lk, device=q.device)[None, None, None, :] < seq_lens[:, None, None, None])
    return attend(q, k, v, allowed, default_scale(scaling, D))[0].to(q.dtype)


def dense_plan_fraction(pattern, num_heads: int, q_len: int, k_len: int, block: int = 128) -> float:
    """Fraction of the causal tiles the patterns compute (1.0 = dense), for reports."""
    patterns = as_head_patterns(pattern, num_heads, num_heads)
    plan = block_plan(patterns, q_len, k_len, block, block)
    dense = block_plan((Dense(),), q_len, k_len, block, block)
    per_head = plan.active[plan.head_group].sum()
    return float(per_head) / float(dense.active.sum() * num_heads)
