"""SnapKV: keep the prompt tokens the observation window attends to, per KV head, at the end of prefill.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024, arXiv 2404.14469.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import attention_column_scores
from .base import (
    EvictingLayer,
    KVMethod,
    KVMethodCache,
    _check_int,
    has_padding,
    mean_over_query_groups,
    topk_keep_indices,
    window_queries,
)

_POOLINGS = ("avg", "max")


def snapkv_keep_indices(
    scores: torch.Tensor, *, budget: int, window: int, num_kv_heads: int, kernel_size: int = 7, pooling: str = "avg"
) -> torch.Tensor:
    """SnapKV's selection: pool the window's column scores, average per GQA group, keep top-k + the window.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hq, L] attention each of the ``L`` keys gets from the last ``window`` queries, per query head.
    budget : int
        Slots kept per row and KV head, ``window <= budget <= L``.
    window : int
        Observation window: the last ``window`` slots are always kept.
    num_kv_heads : int
        ``Hkv``; query head ``h`` maps to KV head ``h // (Hq // Hkv)``.
    kernel_size : int
        Odd 1-D pooling kernel over the sequence (stride 1, "same" padding); 1 = no pooling.
    pooling : {"avg", "max"}
        Pooling type.

    Returns
    -------
    torch.LongTensor
        [B, Hkv, budget] kept slot indices, ascending: top ``budget - window`` prefix slots, then the window.
    """
    B, Hq, L = scores.shape
    prefix = scores[..., : L - window].float()
    if kernel_size > 1 and prefix.shape[-1] > 0:
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        flat = prefix.reshape(B * Hq, 1, -1)
        prefix = pool(flat, kernel_size, stride=1, padding=kernel_size // 2).reshape(B, Hq, -1)
    per_kv_head = mean_over_query_groups(prefix, num_kv_heads)
    return topk_keep_indices(per_kv_head, budget - window, tail=window)


@dataclass
class SnapKV(KVMethod):
    """SnapKV (Li et al., 2024, arXiv 2404.14469): per-KV-head prompt compression scored by an observation window.

    At the end of prefill, each layer's prompt keys are scored by the attention they get from the last ``window``
    prompt queries (:func:`mmaccel.kernels.attention_column_scores`, summed over the window), pooled along the
    sequence, averaged over the query heads of each GQA group (so memory is really per KV head, as in kvpress), and
    the top ``budget - window`` prompt slots plus the window are kept, in original order. Decode tokens are appended
    without further eviction. Each layer then holds [B, Hkv, budget + new tokens, D] K/V.

    Parameters
    ----------
    budget : int
        Prompt slots kept per layer and KV head, >= 1 (default 256). A prompt of at most ``budget`` tokens is not
        compressed (bit-exact with full attention).
    window : int
        Observation window, ``1 <= window <= budget`` (default 32).
    kernel_size : int
        Odd pooling kernel, >= 1 (default 7).
    pooling : {"avg", "max"}
        Pooling type (default "avg", as in the reference implementation).

    Notes
    -----
    ``Cache.update`` never sees the queries, so :meth:`make_cache` registers a forward hook on each decoder
    self-attention module of *this* model (:meth:`KVMethodCache.observe_prefill`). After a layer's first attention
    forward with this cache (the prefill, which attends fully), the hook recomputes the window queries from the
    module's ``hidden_states`` input (``q_proj``, ``q_norm`` if any, RoPE from ``position_embeddings``), scores and
    compresses that layer's K/V in place. The hooks remove themselves once every layer is compressed, or on
    ``cache.close()`` / leaving ``with cache:``. Chunked prefill (``prefill_chunk_size``) is not supported: only the
    first chunk would be compressed. Batch > 1 selects per row; padded batches raise (see below).

    Raises
    ------
    ValueError
        From ``__post_init__`` on a bad hyper-parameter; during prefill, if a padded batch must be compressed.
    """

    budget: int = 256
    window: int = 32
    kernel_size: int = 7
    pooling: str = "avg"

    method_name = "snapkv"

    def __post_init__(self):
        _check_int("snapkv", "budget", self.budget, 1, "pass the number of prompt tokens to keep, e.g. budget=256")
        _check_int("snapkv", "window", self.window, 1, "pass the observation window length, e.g. window=32")
        _check_int("snapkv", "kernel_size", self.kernel_size, 1, "e.g. kernel_size=7 (1 disables pooling)")
        if self.window > self.budget:
            raise ValueError(
                f"snapkv: window ({self.window}) must be <= budget ({self.budget}); "
                f"raise budget or lower window, e.g. snapkv:budget={self.budget}:window={min(32, self.budget)}"
            )
        if self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv: kernel_size must be odd, got {self.kernel_size}; e.g. kernel_size=7")
        if self.pooling not in _POOLINGS:
            raise ValueError(f"snapkv: pooling must be one of {_POOLINGS}, got {self.pooling!r}")

    def make_layer(self, layer_idx: int) -> EvictingLayer:
        return EvictingLayer()

    def make_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """A fresh cache with prefill hooks on ``model``'s attention modules (removed after prefill or on close)."""
        cache = KVMethodCache(model, self.make_layer, method=self)
        cache.observe_prefill(model, self._compress)
        return cache

    def _compress(self, module, layer: EvictingLayer, hidden_states, position_embeddings, attention_mask) -> None:
        length = layer.held
        if length <= self.budget:
            return
        if has_padding(attention_mask):
            raise ValueError(
                "snapkv cannot compress a padded batch (left padding would be scored and mis-masked); "
                "run prompts one at a time or with equal lengths"
            )
        window = min(self.window, hidden_states.shape[1])
        queries = window_queries(module, hidden_states, position_embeddings, window)
        scores = attention_column_scores(
            queries, layer.keys, causal=True, reduce="sum", scaling=getattr(module, "scaling", None)
        )
        keep = snapkv_keep_indices(
            scores,
            budget=self.budget,
            window=window,
            num_kv_heads=layer.keys.shape[1],
            kernel_size=self.kernel_size,
            pooling=self.pooling,
        )
        layer.keep(keep)
