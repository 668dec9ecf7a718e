"""Token-tree verification attention for speculative decoding."""
from __future__ import annotations

import torch

from ._common import check_qkv
from .dense import attention

TREE_BACKENDS = ("sdpa", "flex", "reference")


def tree_attention_mask(tree_mask: torch.Tensor, prefix_len: int, batch: int) -> torch.Tensor:
    """bool [B, 1, T, prefix_len + T]: every candidate sees the whole prefix, then its tree row.

    Raises
    ------
    ValueError
        If ``tree_mask`` is not bool [T, T] / [B, T, T] or a candidate does not attend itself.
    """
    if tree_mask.dtype != torch.bool or tree_mask.dim() not in (2, 3) or tree_mask.shape[-1] != tree_mask.shape[-2]:
        raise ValueError(f"tree_mask must be bool [T, T] or [B, T, T], got {tuple(tree_mask.shape)} {tree_mask.dtype}")
    tm = tree_mask if tree_mask.dim() == 3 else tree_mask[None]
    if tm.shape[0] not in (1, batch):
        raise ValueError(f"tree_mask batch {tm.shape[0]} does not match {batch}")
    if not bool(tm.diagonal(dim1=-2, dim2=-1).all()):
        raise ValueError("tree_mask must be True on its diagonal: every candidate attends itself")
    T = tm.shape[-1]
    prefix = torch.ones(tm.shape[0], T, prefix_len, dtype=torch.bool, device=tm.device)
    return torch.cat([prefix, tm], dim=-1).expand(batch, T, prefix_len + T)[:, None]


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    prefix_len: int,
    *,
    scaling: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Verify a token tree in one pass: causal over the prefix, the tree mask over the candidates.

    As in SpecInfer (Miao et al., 2023, arXiv 2305.09781) and Medusa (Cai et al., 2024, arXiv 2401.10774): candidate
    ``i`` attends the whole prefix and the candidates ``j`` with ``tree_mask[i, j]`` (its ancestors and itself).
    Position ids (prefix_len + depth) are the caller's business (RoPE is applied before this call).

    Parameters
    ----------
    q : torch.Tensor
        [B, Hq, T, D]: queries of the T candidate tokens.
    k, v : torch.Tensor
        [B, Hkv, prefix_len + T, D]: the prefix's keys followed by the candidates'.
    tree_mask : torch.Tensor
        bool [T, T] or [B, T, T]; True on the diagonal.
    prefix_len : int
        Cached tokens before the candidates.
    scaling : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    backend : {"auto", "sdpa", "flex", "reference"}
        ``"auto"`` is SDPA with a boolean mask.

    Returns
    -------
    torch.Tensor
        [B, Hq, T, D] in the dtype of ``q``.

    Raises
    ------
    ValueError
        If ``k`` does not hold ``prefix_len + T`` positions, on a malformed tree mask, mismatched heads, or an unknown
        backend.
    """
    B, _Hq, _Hkv, T, Lk, _D = check_qkv(q, k, v, "tree_attention")
    if prefix_len < 0 or Lk != prefix_len + T:
        raise ValueError(f"k must hold prefix_len + T = {prefix_len} + {T} positions, got {Lk}")
    if tuple(tree_mask.shape[-2:]) != (T, T):
        raise ValueError(f"tree_mask must be [T, T] with T = {T} candidates, got {tuple(tree_mask.shape)}")
    if backend not in ("auto",) + TREE_BACKENDS:
        raise ValueError(f"tree_attention has no {backend!r} backend; it supports {('auto',) + TREE_BACKENDS}")
    mask = tree_attention_mask(tree_mask.to(q.device), prefix_len, B)
    return attention(q, k, v, causal=False, scaling=scaling, attention_mask=mask,
                     backend="sdpa" if backend == "auto" else backend)
