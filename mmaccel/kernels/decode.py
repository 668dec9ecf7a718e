"""Single-token decode attention over all, selected tokens or selected pages of a KV cache (split-K on GPU)."""
from __future__ import annotations

import torch

from ._common import attend, default_scale, require_contiguous
from .backends import resolve_backend

DECODE_BACKENDS = ("triton", "reference")


def _check_index(t: torch.Tensor, name: str, B: int, Hq: int, Hkv: int, limit: int, bounds: bool) -> torch.Tensor:
    if t.dim() != 3 or t.shape[0] != B or t.shape[1] not in (Hq, Hkv) or t.dtype.is_floating_point:
        raise ValueError(
            f"{name} must be an integer tensor [B, Hkv or Hq, N] = [{B}, {Hkv} or {Hq}, N], got {tuple(t.shape)} "
            f"{t.dtype}"
        )
    if bounds and t.numel() and (int(t.min()) < -1 or int(t.max()) >= limit):
        raise ValueError(f"{name} must lie in [-1, {limit}) (-1 = unused slot); got [{int(t.min())}, {int(t.max())}]")
    return t


def pages_to_indices(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token positions [B, H, P * page_size] of page ids [B, H, P] (-1 stays -1). An index tensor, not a KV copy."""
    tok = pages.long()[..., None] * page_size + torch.arange(page_size, device=pages.device)
    return torch.where(pages[..., None] < 0, -1, tok).flatten(-2)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, page_size: int, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of whole pages of a cache, per head, in the order given: a copy of only the selected pages.

    The CPU's fast path for a page selection (Quest, Tang et al., 2024, arXiv 2406.10774): one ``index_select`` of
    whole pages (``page_size * D`` contiguous values each) per row and head, written straight into ``out``, then
    dense attention over the copy, instead of a per-token gather with a mask (:func:`decode_attention`'s reference
    path, 3-4x slower at 4k).

    Parameters
    ----------
    cache : torch.Tensor
        [B, H, S, D] keys or values (a view into a larger store is fine: its rows must be contiguous per head).
    pages : torch.Tensor
        int [B, H, k] page ids, each a *whole* page: ``0 <= page < S // page_size`` (not checked: callers select
        from their own full pages).
    page_size : int
        Tokens per page, >= 1.
    out : torch.Tensor, optional
        [B, H, >= k * page_size, D] contiguous, ``cache``'s dtype: the pages are written to its first
        ``k * page_size`` rows (the caller may fill the rest, e.g. with a partial newest page).

    Returns
    -------
    torch.Tensor
        [B, H, k * page_size, D] (a view of ``out`` when given, else a new contiguous tensor).
    """
    B, H, S, D = cache.shape
    full = S // page_size
    k = pages.shape[-1]
    n = k * page_size
    if out is None:
        out = cache.new_empty(B, H, n, D)
    if not (k and full):
        return out[:, :, :n]
    rows = cache[:, :, :full * page_size].reshape(B * H, full, page_size * D)
    ids = pages.reshape(B * H, k).long()
    if torch.is_grad_enabled() and cache.requires_grad:  # autograd cannot follow out=: index, then copy
        out[:, :, :n] = rows[torch.arange(B * H, device=cache.device)[:, None], ids].view(B, H, n, D)
        return out[:, :, :n]
    dest = out.view(B * H, out.shape[2] * D)
    for bh in range(B * H):  # index_select into the destination: no intermediate copy
        torch.index_select(rows[bh], 0, ids[bh], out=dest[bh, :n * D].view(k, page_size * D))
    return out[:, :, :n]


def _reference(q, k_cache, v_cache, idx, lens, scale) -> torch.Tensor:
    """Gather the selected keys (a copy: this is the oracle), then fp32 softmax attention."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    q4 = q[:, :, None]
    if idx is None:
        allowed = (torch.arange(S, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        return attend(q4, k_cache, v_cache, allowed, scale)[0][:, :, 0]
    Hi = idx.shape[1]
    if Hi == Hkv:  # per key/value head: keep the GQA group together
        valid = (idx >= 0) & (idx < lens[:, None, None])
        gi = idx.clamp(0, S - 1).long()[..., None].expand(-1, -1, -1, D)
        ks, vs = k_cache.gather(2, gi), v_cache.gather(2, gi)
        return attend(q4, ks, vs, valid[:, :, None, None, :].expand(-1, -1, Hq // Hkv, -1, -1).reshape(
            B, Hq, 1, -1), scale)[0][:, :, 0]
    # per query head: each head reads its own tokens of its key/value head
    kv_of = torch.arange(Hq, device=q.device) // (Hq // Hkv)
    valid = (idx >= 0) & (idx < lens[:, None, None])
    gi = idx.clamp(0, S - 1).long()[..., None].expand(-1, -1, -1, D)
    ks, vs = k_cache[:, kv_of].gather(2, gi), v_cache[:, kv_of].gather(2, gi)
    return attend(q4, ks, vs, valid[:, :, None, :], scale)[0][:, :, 0]


def _default_splits(n_tokens: int, batch_heads: int, device: torch.device) -> int:
    if device.type != "cuda":
        return max(1, min(4, n_tokens // 64))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return int(max(1, min(64, 2 * sms // max(batch_heads, 1), n_tokens // 256)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    indices: torch.Tensor | None = None,
    pages: torch.Tensor | None = None,
    page_size: int = 16,
    cache_seqlens: torch.Tensor | None = None,
    scaling: float | None = None,
    num_splits: int | None = None,
    backend: str = "auto",
    check_indices: bool = True,
    kernel_config=None,
) -> torch.Tensor:
    """Attention of one new token per sequence over a KV cache, reading only the selected tokens or pages.

    Token selection as in Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
    Inference", arXiv 2406.10774) and TokenSelect (Wu et al., 2024, arXiv 2411.02886); split-K as in flash-decoding
    (Dao et al., 2023) / FlashInfer (Ye et al., 2025, arXiv 2501.01005). The Triton kernel loads the selected
    rows straight from the cache; no gathered copy of K/V is made.

    Parameters
    ----------
    q : torch.Tensor
        [B, Hq, 1, D] (or [B, Hq, D]) fp32 / fp16 / bf16: the new token's queries.
    k_cache, v_cache : torch.Tensor
        [B, Hkv, S, D]; ``Hq`` a multiple of ``Hkv``.
    indices : torch.Tensor, optional
        int [B, Hkv, N] (shared by a GQA group) or [B, Hq, N] token positions to read; ``-1`` marks an unused slot.
        Positions at or beyond ``cache_seqlens`` are ignored; a position listed twice is counted twice (top-k
        selections are unique). An empty selection gives a zero output.
    pages : torch.Tensor, optional
        int [B, Hkv or Hq, P] page ids; page ``p`` covers positions ``[p * page_size, (p + 1) * page_size)``.
    page_size : int
        Tokens per page (with ``pages``).
    cache_seqlens : torch.Tensor, optional
        int [B] valid cache length per sequence (default ``S``).
    scaling : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    num_splits : int, optional
        Split-K partitions (Triton); default from the device's SM count and the number of selected tokens.
    backend : {"auto", "triton", "reference"}
        ``"auto"``: Triton on CUDA; on the CPU, SDPA for the whole cache and the reference (PyTorch gather +
        softmax over the selected rows only) for a selection.
    check_indices : bool
        Check that ``indices`` / ``pages`` lie in range (default). The check reads their min and max, which on a GPU
        waits for every queued kernel; callers whose selection is in range by construction (a top-k over the
        cache's own pages) pass ``False``. Either way no kernel reads outside the cache: an out-of-range entry is
        skipped like ``-1``.
    kernel_config : mmaccel.kernels.triton_kernels.DecodeKernelConfig, optional
        Launch settings of the Triton kernel (``tl.dot`` or broadcast products, keys per step, warps, stages,
        split scale); default ``DEFAULT_DECODE_CONFIG``, the swept setting with the least mean slowdown on an H200.
        Ignored by the other backends.

    Returns
    -------
    torch.Tensor
        Same shape as ``q``, in its dtype.

    Raises
    ------
    ValueError
        On mismatched shapes or head counts, both ``indices`` and ``pages``, indices / pages out of range,
        non-contiguous last dimensions (Triton), a bad ``cache_seqlens``, or an unknown backend.
    RuntimeError
        If an explicitly requested backend is unavailable on this device.
    """
    squeeze = q.dim() == 3
    q4 = q[:, :, None] if squeeze else q
    if q4.dim() != 4 or q4.shape[2] != 1:
        raise ValueError(f"decode_attention takes one query token: q [B, Hq, 1, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [B, Hkv, S, D], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    B, Hq, _, D = q4.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"batch and head_dim of q {tuple(q.shape)} and the cache {tuple(k_cache.shape)} must match")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")
    if indices is not None and pages is not None:
        raise ValueError("pass indices or pages, not both")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    name = resolve_backend(backend, q.device, DECODE_BACKENDS, "decode_attention")
    idx = None
    if indices is not None:
        idx = _check_index(indices, "indices", B, Hq, Hkv, S, check_indices)
    elif pages is not None:
        idx = pages_to_indices(_check_index(pages, "pages", B, Hq, Hkv, -(-S // page_size), check_indices), page_size)
    if cache_seqlens is None:
        lens = torch.full((B,), S, dtype=torch.int32, device=q.device)
    else:
        lens = torch.as_tensor(cache_seqlens, device=q.device)
        if lens.shape != (B,) or lens.dtype.is_floating_point or (lens.numel() and (lens.min() < 0 or lens.max() > S)):
            raise ValueError(f"cache_seqlens must be an integer tensor [B] = [{B}] with values in [0, {S}]")
        lens = lens.to(torch.int32)
    scale = default_scale(scaling, D)
    q3 = q4[:, :, 0]
    if name == "triton":
        from .triton_kernels import decode_triton

        require_contiguous("decode_attention(backend='triton')", q=q3, k_cache=k_cache, v_cache=v_cache)
        idx32 = idx.to(torch.int32).contiguous() if idx is not None else None
        n = idx32.shape[2] if idx32 is not None else S
        splits = num_splits or _default_splits(n, B * Hkv, q.device)
        out = decode_triton(q3, k_cache, v_cache, idx32, lens, scale, splits, kernel_config)
    elif idx is None and backend == "auto":  # whole cache: SDPA with a length mask is the fast CPU path
        from .dense import attention

        # every row reads the whole cache: no length mask (SDPA with a mask measured 2x slower at 4k on the CPU)
        keys = None if cache_seqlens is None else torch.arange(S, device=q.device)[None, :] < lens[:, None]
        out = attention(q4, k_cache, v_cache, causal=False, attention_mask=keys, scaling=scale, backend="sdpa")[:, :, 0]
    else:
        out = _reference(q3, k_cache, v_cache, idx, lens, scale)
    out = out.to(q.dtype)
    return out if squeeze else out[:, :, None]
