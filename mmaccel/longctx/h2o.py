"""H2O: keep the heavy hitters (largest accumulated attention) and the recent tokens, evicting at every step.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", 2023,
arXiv 2306.14048.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import attention_column_scores
from .base import KVScorer, LayerStep, _check_int, mean_over_query_groups
from .owned import DecodeProbsScorer

_QUERY_BLOCK = 256


def accumulated_attention(queries: torch.Tensor, keys: torch.Tensor, *, scaling=None, block: int = _QUERY_BLOCK):
    """Attention each key receives, summed over causal queries that are the last ``W`` positions of the keys.

    Parameters
    ----------
    queries : torch.Tensor
        [B, Hq, W, D] post-RoPE queries of positions ``S - W .. S - 1``.
    keys : torch.Tensor
        [B, Hkv, S, D] keys (RoPE applied).
    scaling : float, optional
        Softmax scale (default ``1 / sqrt(D)``).
    block : int
        Queries per block (bounds the temporary memory to [B, Hq, block, 1024] floats).

    Returns
    -------
    torch.Tensor
        [B, Hq, S] float32 column sums of the causal attention probabilities.
    """
    B, Hq, W, _ = queries.shape
    S = keys.shape[2]
    out = torch.zeros(B, Hq, S, dtype=torch.float32, device=keys.device)
    for start in range(0, W, block):
        end = min(start + block, W)
        visible = S - W + end  # keys seen by the last query of the block
        out[..., :visible] += attention_column_scores(
            queries[:, :, start:end], keys[:, :, :visible], causal=True, reduce="sum", scaling=scaling
        )
    return out


@dataclass
class H2O(DecodeProbsScorer, KVScorer):
    """H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention + a recent window.

    Every held slot carries its accumulated attention (per-slot state ``"attention"``, [B, Hkv, S] float32): the
    attention probability it received from every query so far, averaged over the query heads of its GQA group. The
    prefill adds the column sums of the prompt's causal attention; every decode step adds the new token's attention.
    After the prefill, and after every decode step (``evicts_on_decode``), the layer keeps ``budget`` slots: the
    ``recent`` most recent ones and the heaviest of the rest. A decode step's layer computes its own attention and
    keeps the probabilities (:class:`~mmaccel.longctx.owned.DecodeProbsLayer`); the prefill's column sums (and every
    step on a model with a softcap or sinks, whose own attention runs) are recomputed from the module's query
    projection and the held keys (:func:`mmaccel.kernels.attention_column_scores`): eager is never needed.

    Parameters
    ----------
    budget : int or None
        Slots kept per layer and KV head (default 256); ``ratio`` instead for a kept fraction of the prompt.
    recent : int
        Most recent slots always kept, >= 0 and < budget (default 32).

    Notes
    -----
    Each decode token attends to the ``budget`` held slots plus itself, then the lightest non-recent slot is dropped.
    Under chunked prefill, a slot's score only counts the queries of the chunks it was held for.

    Raises
    ------
    ValueError
        On a bad hyper-parameter; during prefill for a padded batch or a ratio keeping <= ``recent`` slots.
    """

    recent: int = 32

    method_name = "h2o"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    evicts_on_decode = True
    captures_queries = True  # its decode-step score reads the queries: reuse the module's own projection

    def __post_init__(self):
        super().__post_init__()
        _check_int("h2o", "recent", self.recent, 0, "pass the number of recent tokens always kept, e.g. recent=32")
        if self.budget is not None and self.recent >= self.budget:
            raise ValueError(f"h2o: recent ({self.recent}) must be < budget ({self.budget}), e.g. h2o:budget=256:recent=32")

    def min_budget(self, step: LayerStep) -> int:
        return self.recent + 1

    def observe(self, step: LayerStep) -> None:
        acc = step.layer.add_slot_state("attention")
        if step.query_length == 1:  # a decode step: one query's probabilities, added in place
            column = getattr(step.layer, "decode_probs", None)  # from the step's attention (None: recompute)
            if column is None:
                column = attention_column_scores(step.queries(), step.keys, causal=True, scaling=step.scaling)
            acc.add_(mean_over_query_groups(column, step.num_kv_heads))
            return
        column = accumulated_attention(step.queries(), step.keys, scaling=step.scaling)
        step.layer.slot_state["attention"] = acc + mean_over_query_groups(column, step.num_kv_heads)

    def score(self, step: LayerStep) -> torch.Tensor:
        scores = step.layer.slot_state["attention"]
        if self.recent:  # the most recent tokens by position (slots are not in order after in-place eviction)
            recent = step.layer.positions >= step.layer.cumulative_length - self.recent
            scores = scores.masked_fill(recent, float("inf"))
        return scores
