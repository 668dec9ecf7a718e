"""SnapKV: keep the prompt tokens the observation window attends to, per KV head, at the end of prefill.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024, arXiv 2404.14469.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import attention_column_scores
from .base import KVScorer, LayerStep, _check_int, check_group, query_group_scores, topk_keep_indices

_POOLINGS = ("avg", "max")


def snapkv_scores(
    column: torch.Tensor, *, window: int, num_kv_heads: int, kernel_size: int = 7, pooling: str = "avg",
    group: str = "mean",
) -> torch.Tensor:
    """SnapKV's slot scores from the window's column scores: pool the prefix, combine per GQA group, window = inf.

    Parameters
    ----------
    column : torch.Tensor
        [B, Hq, L] attention each of the ``L`` held keys gets from the last ``window`` queries, per query head.
    window : int
        Observation window: the last ``window`` slots score ``inf`` (always kept).
    num_kv_heads : int
        ``Hkv``; query head ``h`` maps to KV head ``h // (Hq // Hkv)``.
    kernel_size : int
        Odd 1-D pooling kernel over the prefix (stride 1, "same" padding, zeros outside); 1 = no pooling.
    pooling : {"avg", "max"}
        Pooling type.
    group : {"mean", "max"}
        How a GQA group's query heads combine (:func:`~mmaccel.longctx.base.query_group_scores`); SnapKV averages.

    Returns
    -------
    torch.Tensor
        [B, Hkv, L] float32, higher = keep.
    """
    B, Hq, L = column.shape
    prefix = column[..., : L - window].float()
    if kernel_size > 1 and prefix.shape[-1] > 0:
        pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
        prefix = pool(prefix.reshape(B * Hq, 1, -1), kernel_size, stride=1, padding=kernel_size // 2).reshape(B, Hq, -1)
    per_kv_head = query_group_scores(prefix, num_kv_heads, group)
    tail = per_kv_head.new_full((B, num_kv_heads, L - prefix.shape[-1]), float("inf"))
    return torch.cat([per_kv_head, tail], dim=-1)


def snapkv_keep_indices(
    scores: torch.Tensor, *, budget: int, window: int, num_kv_heads: int, kernel_size: int = 7, pooling: str = "avg",
    group: str = "mean",
) -> torch.Tensor:
    """SnapKV's selection (:func:`snapkv_scores`, then the base's top-k): top ``budget - window`` prefix + window.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hq, L] window column scores per query head.
    budget : int
        Slots kept per row and KV head, ``window <= budget <= L``.
    window, num_kv_heads, kernel_size, pooling, group
        See :func:`snapkv_scores`.

    Returns
    -------
    torch.LongTensor
        [B, Hkv, budget] kept slot indices, ascending.
    """
    slot = snapkv_scores(scores, window=window, num_kv_heads=num_kv_heads, kernel_size=kernel_size, pooling=pooling,
                         group=group)
    return topk_keep_indices(slot, budget)


@dataclass
class SnapKV(KVScorer):
    """SnapKV (Li et al., 2024, arXiv 2404.14469): per-KV-head prompt compression scored by an observation window.

    At the end of prefill, each layer's prompt keys are scored by the attention they get from the last ``window``
    prompt queries (:func:`mmaccel.kernels.attention_column_scores`, summed over the window), pooled along the
    sequence, averaged over the query heads of each GQA group (so memory is really per KV head, as in kvpress); the
    window scores ``inf``, and the base keeps the ``budget`` best slots in original order. Decode tokens are appended
    without further eviction. Each layer then holds [B, Hkv, budget + new tokens, D] K/V.

    Parameters
    ----------
    budget : int or None
        Prompt slots kept per layer and KV head, >= ``window`` (default 256). A prompt of at most ``budget`` tokens is
        not compressed (bit-exact with full attention; the telemetry warns).
    ratio : float or None
        Kept fraction of the prompt instead of ``budget`` (``snapkv:ratio=0.25``).
    window : int
        Observation window, >= 1 (default 32).
    kernel_size : int
        Odd pooling kernel, >= 1 (default 7).
    pooling : {"avg", "max"}
        Pooling type (default "avg", as in the reference implementation).
    group : {"mean", "max"}
        How the query heads of a GQA group combine their scores (default "mean", as in SnapKV and kvpress; "max"
        keeps what any one of them needs). Unlike Quest's page bounds, SnapKV does not gain from "max" on
        smollm2-135m at 4k: 5/10 NIAH documents at 25% against 7/10 for "mean", 4/10 both at 10%.

    Notes
    -----
    Under chunked prefill (``generate(prefill_chunk_size=C)`` or :class:`~mmaccel.longctx.chunked.Chunked`) every
    chunk compresses the held slots plus itself back to the budget, and "the window" is the last
    ``min(window, chunk)`` queries *of that chunk*: the final chunk uses the prompt's last tokens, as without chunking,
    but chooses only among what earlier chunks kept. Queries are recomputed from the attention module's input
    (``q_proj``, ``q_norm`` if any, RoPE), so any attention implementation works. Padded batches raise.

    Raises
    ------
    ValueError
        From ``__post_init__`` on a bad hyper-parameter; during prefill, if a padded batch must be compressed or a
        ratio keeps fewer slots than the window.
    """

    window: int = 32
    kernel_size: int = 7
    pooling: str = "avg"
    group: str = "mean"

    method_name = "snapkv"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    supports_speculative = True  # prefill-only: the speculative engine can crop its decode slots

    def __post_init__(self):
        super().__post_init__()
        _check_int(self.method_name, "window", self.window, 1, "pass the observation window length, e.g. window=32")
        _check_int(self.method_name, "kernel_size", self.kernel_size, 1, "e.g. kernel_size=7 (1 disables pooling)")
        if self.budget is not None and self.window > self.budget:
            raise ValueError(
                f"{self.method_name}: window ({self.window}) must be <= budget ({self.budget}); raise budget or lower "
                f"window, e.g. {self.method_name}:budget={self.budget}:window={min(32, self.budget)}"
            )
        if self.kernel_size % 2 == 0:
            raise ValueError(f"{self.method_name}: kernel_size must be odd, got {self.kernel_size}; e.g. kernel_size=7")
        check_group(self.method_name, self.group)
        if self.pooling not in _POOLINGS:
            raise ValueError(f"{self.method_name}: pooling must be one of {_POOLINGS}, got {self.pooling!r}")

    def min_budget(self, step: LayerStep) -> int:
        return min(self.window, step.query_length)

    def window_scores(self, step: LayerStep) -> torch.Tensor:
        """[B, Hq, S] attention each held slot gets from this forward's last ``window`` queries, summed."""
        queries = step.queries(self.window)
        return attention_column_scores(queries, step.keys, causal=True, reduce="sum", scaling=step.scaling)

    def score(self, step: LayerStep) -> torch.Tensor:
        return snapkv_scores(
            self.window_scores(step),
            window=min(self.window, step.query_length),
            num_kv_heads=step.num_kv_heads,
            kernel_size=self.kernel_size,
            pooling=self.pooling,
            group=self.group,
        )
