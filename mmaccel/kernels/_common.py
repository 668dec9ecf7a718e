"""Shared checks and the fp32 masked-softmax core used by every reference path."""
from __future__ import annotations

import math

import torch


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str) -> tuple[int, int, int, int, int, int]:
    """Validate [B, Hq, Lq, D] / [B, Hkv, Lk, D] inputs; return (B, Hq, Hkv, Lq, Lk, D).

    Raises
    ------
    ValueError
        On wrong ranks, mismatched batch / head_dim / key-value shapes, or Hq not a multiple of Hkv.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{op}: q must be [B, Hq, Lq, D] and k, v [B, Hkv, Lk, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    B, Hq, Lq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"{op}: batch and head_dim of q {tuple(q.shape)} and k {tuple(k.shape)} must match")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{op}: query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")
    return B, Hq, Hkv, Lq, k.shape[2], D


def require_contiguous(op: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor whose last dimension is not contiguous (stride != 1)."""
    for name, t in tensors.items():
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be contiguous in its last dimension (call .contiguous())")


def default_scale(scaling: float | None, head_dim: int) -> float:
    return float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax attention with GQA and a boolean mask; rows with no allowed key give zeros.

    Parameters
    ----------
    q : [B, Hq, M, D]; k, v : [B, Hkv, N, D]
    allowed : bool, broadcastable to [B, Hq, M, N], or None (all allowed).
    bias : float additive mask broadcastable to [B, Hq, M, N], or None.

    Returns
    -------
    (out, lse) : float32 [B, Hq, M, D], float32 [B, Hq, M] (``-inf`` for empty rows).
    """
    B, Hq, M, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    qf = q.float().reshape(B, Hkv, g * M, D)
    s = torch.matmul(qf, k.float().transpose(-1, -2)).reshape(B, Hq, M, -1) * scale
    if bias is not None:
        s = s + bias.float()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if s.shape[-1] == 0:  # nothing to attend
        return q.new_zeros(B, Hq, M, v.shape[-1], dtype=torch.float32), q.new_full((B, Hq, M), float("-inf"),
                                                                                dtype=torch.float32)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p.reshape(B, Hkv, g * M, -1), v.float()).reshape(B, Hq, M, -1)
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = torch.where(denom[..., 0] > 0, m[..., 0] + torch.log(denom[..., 0]), float("-inf"))
    return out, lse


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on ``device`` before a timestamp: ``torch.cuda.synchronize`` on a CUDA device, a no-op
    on the CPU (and for ``None``).

    Parameters
    ----------
    device : torch.device, str or None
        The device whose queue to drain (``"cuda:0"``, ``torch.device("cpu")``, ...).
    """
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
