"""Attention column scores: how much attention each key receives from a window of queries.

This is what attention-scored methods (SnapKV, H2O, FastV, ...) need, computed here block by block so that they
run under SDPA/flash models, which return no attention weights.
"""
from __future__ import annotations

import math

import torch

_REDUCES = ("sum", "mean", "max")


def _check(q_window: torch.Tensor, k: torch.Tensor, reduce: str) -> None:
    if q_window.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q_window must be [B, Hq, W, D] and k [B, Hkv, L, D]; got {tuple(q_window.shape)} and {tuple(k.shape)}"
        )
    if q_window.shape[0] != k.shape[0] or q_window.shape[-1] != k.shape[-1]:
        raise ValueError(f"batch and head_dim must match: q_window {tuple(q_window.shape)}, k {tuple(k.shape)}")
    if q_window.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q_window.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}) for GQA"
        )
    if reduce not in _REDUCES:
        raise ValueError(f"reduce must be one of {_REDUCES}, got {reduce!r}")


def attention_column_scores_reference(
    q_window: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    reduce: str = "sum",
    scaling: float | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Reference column scores, computed over key blocks in O(W * block_size) extra memory.

    Parameters
    ----------
    q_window : torch.Tensor
        [B, Hq, W, D] queries of the observation window. With ``causal=True`` query ``i`` sits at absolute position
        ``L - W + i``, i.e. the window is the last ``W`` positions of the keys.
    k : torch.Tensor
        [B, Hkv, L, D] keys (RoPE already applied). ``Hq`` must be a multiple of ``Hkv`` (GQA).
    causal : bool
        Mask keys after each query's position.
    reduce : {"sum", "mean", "max"}
        How the W queries' probabilities are combined for each key.
    scaling : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    block_size : int, optional
        Keys per block, for the two-pass path over key blocks. Default (None): one pass over every key whenever
        the logits of at least 64 query rows fit in 64 MiB (fp32), in tiles of as many query rows as fit (one tile
        for a usual SnapKV window: a few large ops rather than many small ones, which on a GPU cost more in
        launches than in arithmetic); otherwise key blocks of as many keys as fit (at least 1,024).

    Returns
    -------
    torch.Tensor
        [B, Hq, L] float32: for each query head, the attention probability each key receives, reduced over the
        window queries.

    Raises
    ------
    ValueError
        On mismatched shapes, a head count that is not a GQA multiple, W > L with ``causal``, or an unknown reduce.

    Notes
    -----
    Query tiles: each tile's rows see every key, so one softmax per tile, reduced into the output (a long window,
    such as KVzip's reconstruction, costs one pass over the logits). Key blocks: two passes, the first finds each
    query row's log-sum-exp, the second turns logits into probabilities and reduces them. An L x L matrix is never
    formed.
    """
    _check(q_window, k, reduce)
    B, Hq, W, D = q_window.shape
    Hkv, L = k.shape[1], k.shape[2]
    if causal and W > L:
        raise ValueError(f"causal window of {W} queries is longer than the {L} keys")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    q = q_window.float().reshape(B, Hkv, group * W, D)
    if W == 1 and block_size is None:  # one query (a decode step): it sees every key, so no mask and no blocks
        probs = torch.softmax(torch.matmul(q, k.float().transpose(-1, -2)).mul_(scale), dim=-1)  # [B, Hkv, g, L]
        return probs.reshape(B, Hq, L)
    qpos = torch.arange(W, device=k.device) + (L - W)  # [W]
    qpos = qpos.repeat(group)  # [group * W], matching the reshape order (group-major)

    def logits(start: int, end: int) -> torch.Tensor:
        s = torch.matmul(q, k[:, :, start:end].float().transpose(-1, -2)) * scale  # [B, Hkv, gW, blk]
        if causal:
            kpos = torch.arange(start, end, device=k.device)
            s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        return s

    def reduced(p: torch.Tensor) -> torch.Tensor:  # [B, Hkv, group, W, n] probabilities -> [B, Hkv, group, n]
        return p.sum(dim=3) if reduce == "sum" else p.mean(dim=3) if reduce == "mean" else p.amax(dim=3)

    if block_size is None:
        rows = (64 << 20) // max(1, 4 * B * Hq * L)  # query rows whose logits over every key fit in 64 MiB
        if 64 <= rows < W:
            return _query_tiles(q.view(B, Hkv, group, W, D), k, rows, causal, reduce, scale).reshape(B, Hq, L)
        block_size = L if rows >= W else max(1024, (64 << 20) // max(1, 4 * B * Hq * W))
    if block_size >= L:  # one block: one pass
        return reduced(torch.softmax(logits(0, L), dim=-1).reshape(B, Hkv, group, W, L)).reshape(B, Hq, L)
    lse = torch.full((B, Hkv, group * W), float("-inf"), device=k.device)
    for start in range(0, L, block_size):
        lse = torch.logaddexp(lse, torch.logsumexp(logits(start, min(start + block_size, L)), dim=-1))
    out = torch.empty(B, Hkv, group, L, device=k.device, dtype=torch.float32)
    for start in range(0, L, block_size):
        end = min(start + block_size, L)
        out[..., start:end] = reduced(torch.exp(logits(start, end) - lse[..., None]).reshape(B, Hkv, group, W,
                                                                                                  end - start))
    return out.reshape(B, Hq, L)


def _query_tiles(q: torch.Tensor, k: torch.Tensor, rows: int, causal: bool, reduce: str,
                 scale: float) -> torch.Tensor:
    """Column scores over tiles of ``rows`` queries, one softmax over every key per tile: [B, Hkv, group, W, D]
    fp32 queries (the last W positions with ``causal``), [B, Hkv, L, D] keys -> [B, Hkv, group, L] float32."""
    B, Hkv, group, W, D = q.shape
    L = k.shape[2]
    keys = k.float().transpose(-1, -2)  # [B, Hkv, D, L]
    out = torch.zeros(B, Hkv, group, L, device=k.device, dtype=torch.float32)
    for start in range(0, W, rows):
        end = min(start + rows, W)
        tile = q[:, :, :, start:end].reshape(B, Hkv, group * (end - start), D)
        s = torch.matmul(tile, keys).mul_(scale).view(B, Hkv, group, end - start, L)
        if causal:  # query i of the window sits at L - W + i: only keys after L - W + start can be in its future
            first = L - W + start + 1
            future = torch.ones(end - start, L - first, dtype=torch.bool, device=k.device).triu_()
            s[..., first:].masked_fill_(future, float("-inf"))
        p = torch.softmax(s, dim=-1)
        if reduce == "max":
            torch.maximum(out, p.amax(dim=3), out=out)
        else:
            out += p.sum(dim=3)
    return out / W if reduce == "mean" else out


def attention_column_scores(
    q_window: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = True,
    reduce: str = "sum",
    scaling: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """For a window of queries, the attention probability each key receives, per query head.

    Used by SnapKV (Li et al., 2024, arXiv 2404.14469), H2O (Zhang et al., 2023, arXiv 2306.14048) and FastV
    (Chen et al., 2024, arXiv 2403.06764) so that they run under SDPA/flash models.

    Parameters
    ----------
    q_window : torch.Tensor
        [B, Hq, W, D]; with ``causal`` the queries are the last W positions of ``k``.
    k : torch.Tensor
        [B, Hkv, L, D].
    causal, reduce, scaling
        See :func:`attention_column_scores_reference`.
    backend : {"auto", "reference"}
        Which implementation to run; ``"auto"`` picks the fastest available.

    Returns
    -------
    torch.Tensor
        [B, Hq, L] float32.

    Raises
    ------
    ValueError
        On bad shapes, an unknown reduce or an unknown backend.
    """
    if backend not in ("auto", "reference"):
        raise ValueError(f"unknown backend {backend!r} for attention_column_scores; use 'auto' or 'reference'")
    return attention_column_scores_reference(q_window, k, causal=causal, reduce=reduce, scaling=scaling)
