"""Dense attention with GQA, padding masks and variable-length (packed) batches, over several backends."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import attend, check_qkv, default_scale, require_contiguous
from .backends import resolve_backend

DENSE_BACKENDS = ("flash", "sdpa", "flex", "triton", "reference")


def causal_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """bool [Lq, Lk], queries at the last ``Lq`` key positions (bottom-right aligned, as flash-attn)."""
    qa = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return torch.arange(k_len, device=device)[None, :] <= qa


def _normalize_mask(mask: torch.Tensor | None, B: int, Hq: int, Lq: int, Lk: int) -> torch.Tensor | None:
    """A 2-D key mask [B, Lk] becomes [B, 1, 1, Lk]; 4-D masks are checked for broadcastability."""
    if mask is None:
        return None
    if mask.dim() == 2:
        if tuple(mask.shape) != (B, Lk):
            raise ValueError(f"a 2-D attention_mask must be [B, Lk] = [{B}, {Lk}], got {tuple(mask.shape)}")
        return mask.bool()[:, None, None, :]
    if mask.dim() != 4:
        raise ValueError(f"attention_mask must be [B, Lk] or [B, 1|Hq, Lq, Lk], got {tuple(mask.shape)}")
    for got, want, name in zip(mask.shape, (B, Hq, Lq, Lk), ["B", "Hq", "Lq", "Lk"]):
        if got not in (1, want):
            raise ValueError(f"attention_mask {tuple(mask.shape)} does not broadcast to {name}={want}")
    return mask


def _mask_parts(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Split a normalized mask into (bool allowed, float additive bias)."""
    if mask is None:
        return None, None
    return (mask, None) if mask.dtype == torch.bool else (None, mask)


def _prefix_lengths(mask4: torch.Tensor | None, B: int, Lk: int) -> torch.Tensor | None:
    """Key lengths [B] if the mask is a right-padding key mask; else ValueError (kernels taking lengths only)."""
    if mask4 is None:
        return None
    if mask4.dtype != torch.bool or mask4.shape[1] != 1 or mask4.shape[2] != 1:
        raise ValueError("this backend takes only a right-padding key mask [B, Lk]; use backend='sdpa' or 'reference'")
    keys = mask4[:, 0, 0].expand(B, Lk)
    lens = keys.sum(-1)
    if not torch.equal(keys, torch.arange(Lk, device=keys.device)[None, :] < lens[:, None]):
        raise ValueError("this backend needs right padding (valid keys first); use backend='sdpa' or 'reference'")
    return lens.to(torch.int32)


def _sdpa(q, k, v, causal, mask4, scale) -> torch.Tensor:
    Lq, Lk = q.shape[2], k.shape[2]
    is_causal = causal and mask4 is None and Lq == Lk
    if causal and not is_causal and Lq > 1:
        cm = causal_mask(Lq, Lk, q.device)
        if mask4 is None:
            mask4 = cm
        elif mask4.dtype == torch.bool:
            mask4 = mask4 & cm
        else:
            mask4 = mask4.masked_fill(~cm, float("-inf"))
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if mask4 is not None and mask4.dtype != torch.bool:
        mask4 = mask4.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask4, is_causal=is_causal, scale=scale, **gqa)


def _reference(q, k, v, causal, mask4, scale) -> torch.Tensor:
    allowed, bias = _mask_parts(mask4)
    if causal:
        cm = causal_mask(q.shape[2], k.shape[2], q.device)
        allowed = cm if allowed is None else allowed & cm
    return attend(q, k, v, allowed, scale, bias)[0].to(q.dtype)


def _flash(q, k, v, causal, mask4, scale) -> torch.Tensor:
    from flash_attn import flash_attn_func  # optional dependency

    if mask4 is not None:
        raise ValueError("backend 'flash' takes no attention_mask here; use cu_seqlens for packed batches")
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal)
    return out.transpose(1, 2)


def _flex(q, k, v, causal, mask4, scale) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    from .flex import flex_attention_call

    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    off = Lk - Lq
    if mask4 is not None and mask4.dtype != torch.bool:
        raise ValueError("backend 'flex' takes boolean masks only")

    def mask_mod(b, h, qi, ki):
        ok = (ki <= qi + off) if causal else (ki >= 0)
        if mask4 is not None:
            m = mask4
            ok = ok & m[b if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0,
                        qi if m.shape[2] > 1 else 0, ki if m.shape[3] > 1 else 0]
        return ok

    bm = create_block_mask(mask_mod, B, Hq, Lq, Lk, device=q.device)
    return flex_attention_call(q, k, v, bm, scale)


def _triton(q, k, v, causal, mask4, scale) -> torch.Tensor:
    from .patterns import Dense, block_plan
    from .triton_kernels import sparse_prefill_triton

    require_contiguous("attention(backend='triton')", q=q, k=k, v=v)
    B, Hq, Lq, _ = q.shape
    lens = _prefix_lengths(mask4, B, k.shape[2])
    block = 64 if q.is_cuda else 32
    plan = block_plan((Dense(),) * Hq, Lq, k.shape[2], block, block, q.device, causal=causal)
    return sparse_prefill_triton(q, k, v, plan, scale, lens)


_IMPLS = {"flash": _flash, "sdpa": _sdpa, "flex": _flex, "triton": _triton, "reference": _reference}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scaling: float | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Dense softmax attention with GQA, padding masks and packed variable-length batches.

    FlashAttention-2 (Dao, 2023, arXiv 2307.08691) semantics; packing as in "Prepacking" (Zhao et al., 2024,
    arXiv 2404.09529).

    Parameters
    ----------
    q : torch.Tensor
        [B, Hq, Lq, D], fp32 / fp16 / bf16.
    k, v : torch.Tensor
        [B, Hkv, Lk, D], same dtype; ``Hq`` a multiple of ``Hkv`` (GQA, never repeated in memory by this layer).
    causal : bool
        Causal mask, bottom-right aligned: query ``i`` sits at key position ``Lk - Lq + i``.
    scaling : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    attention_mask : torch.Tensor, optional
        bool [B, Lk] (True = real token) or bool / additive float [B|1, 1|Hq, Lq|1, Lk]; combined with ``causal``.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor, optional
        int [N + 1] cumulative lengths of ``N`` sequences packed along the length axis of a batch of 1; each
        sequence attends only itself (``cu_seqlens_k`` defaults to ``cu_seqlens_q``).
    backend : {"auto", "flash", "sdpa", "flex", "triton", "reference"}
        ``"auto"``: flash-attn on CUDA when installed and no mask is given, else SDPA (which dispatches to fused
        kernels itself). ``"triton"`` takes only right-padding key masks.

    Returns
    -------
    torch.Tensor
        [B, Hq, Lq, D] in the dtype of ``q``. Query rows with no allowed key are zero.

    Raises
    ------
    ValueError
        On mismatched shapes or head counts, a mask that does not broadcast, packed inputs with ``B != 1`` or
        with a mask, bad ``cu_seqlens``, a backend that does not take the given mask, or an unknown backend.
    RuntimeError
        If an explicitly requested backend is unavailable on this device.
    """
    B, Hq, _Hkv, Lq, Lk, D = check_qkv(q, k, v, "attention")
    scale = default_scale(scaling, D)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _varlen(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, attention_mask, backend)
    mask4 = _normalize_mask(attention_mask, B, Hq, Lq, Lk)
    supported = DENSE_BACKENDS if mask4 is None else DENSE_BACKENDS[1:]
    name = resolve_backend(backend, q.device, supported if backend == "auto" else DENSE_BACKENDS, "attention")
    if Lq == 0 or Lk == 0:
        return torch.zeros_like(q)
    return _IMPLS[name](q, k, v, causal, mask4, scale)


def _varlen(q, k, v, causal, scale, cu_q, cu_k, mask, backend) -> torch.Tensor:
    if q.shape[0] != 1:
        raise ValueError(f"packed (cu_seqlens) inputs must have batch 1, got {q.shape[0]}")
    if mask is not None:
        raise ValueError("cu_seqlens and attention_mask are exclusive: packing replaces padding")
    cu_q = cu_q if cu_q is not None else cu_k
    cu_k = cu_k if cu_k is not None else cu_q
    cq, ck = [int(x) for x in cu_q.tolist()], [int(x) for x in cu_k.tolist()]
    if len(cq) != len(ck) or cq[0] != 0 or ck[0] != 0 or cq[-1] != q.shape[2] or ck[-1] != k.shape[2] or any(
        b < a for a, b in zip(cq, cq[1:])
    ) or any(b < a for a, b in zip(ck, ck[1:])):
        raise ValueError(
            f"cu_seqlens must be non-decreasing, start at 0 and end at the packed lengths ({q.shape[2]}, "
            f"{k.shape[2]}); got {cq} and {ck}"
        )
    name = resolve_backend(backend, q.device, DENSE_BACKENDS, "attention")
    if name == "flash":
        from flash_attn import flash_attn_varlen_func  # optional dependency

        cq_t, ck_t = cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32)
        lq = max(b - a for a, b in zip(cq, cq[1:]))
        lk = max(b - a for a, b in zip(ck, ck[1:]))
        out = flash_attn_varlen_func(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cq_t, ck_t, lq, lk,
            softmax_scale=scale, causal=causal,
        )
        return out.transpose(0, 1)[None]
    out = torch.zeros_like(q)
    for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if q1 > q0 and k1 > k0:  # one call per sequence: no compute on cross-sequence pairs
            out[:, :, q0:q1] = _IMPLS[name](q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], causal, None, scale)
    return out
