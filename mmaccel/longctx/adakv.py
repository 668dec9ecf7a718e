"""AdaKV: a head-wise budget wrapper over any scorer; a layer's slots go to the KV heads whose scores need them.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024,
arXiv 2407.11550.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import attention
from ..kernels.dense import causal_mask
from .base import EvictingLayer, LayerStep, held_tokens
from .owned import AttentionOwningLayer, OwnedAttentionCache
from .wrapper import ScorerWrapper


def adakv_keep_indices(scores: torch.Tensor, keep: int, alpha: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaKV's head-wise allocation: the layer's ``keep * Hkv`` slots go to the best scores over all its KV heads.

    Each head first gets its ``floor(alpha * keep)`` best slots (AdaKV's safeguard), then the rest of the layer's
    budget goes to the best remaining scores of any head.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hkv, S] float, higher = keep (``inf`` = always, ``-inf`` = never); comparable across heads (e.g.
        attention probabilities, as SnapKV's).
    keep : int
        Mean slots per KV head, ``1 <= keep <= S``.
    alpha : float
        Safeguard fraction in [0, 1].

    Returns
    -------
    (torch.LongTensor, torch.BoolTensor)
        ``indices`` [B, Hkv, K] and ``valid`` [B, Hkv, K], ``K`` = the most slots any head of any row got. Per head,
        the valid indices come first, ascending; padding repeats the head's last valid index (or 0) and is invalid.
        ``valid.sum(-1).sum(-1) == keep * Hkv`` for every row.

    Raises
    ------
    ValueError
        If ``keep`` is outside ``[1, S]`` or ``alpha`` outside [0, 1].
    """
    B, H, S = scores.shape
    if not 1 <= keep <= S or not 0 <= alpha <= 1:
        raise ValueError(f"adakv: cannot keep {keep} of {S} slots per head with alpha={alpha}")
    total = keep * H
    floor = math.floor(alpha * keep)
    chosen = torch.zeros(B, H, S, dtype=torch.bool, device=scores.device)
    if floor:
        chosen.scatter_(2, scores.topk(floor, dim=-1).indices, True)
    rest = total - floor * H
    if rest:
        flat = scores.masked_fill(chosen, float("-inf")).reshape(B, H * S)
        top = flat.topk(rest, dim=-1).indices
        chosen.view(B, H * S).scatter_(1, top, True)
    counts = chosen.sum(-1)  # [B, H]
    width = int(counts.max())
    order = torch.arange(S, device=scores.device).expand(B, H, S)
    # chosen slots first (ascending), then the rest: sort by (not chosen, index)
    ranked = torch.argsort((~chosen).long() * S + order, dim=-1)[..., :width]
    valid = torch.arange(width, device=scores.device) < counts[..., None]
    last = ranked.gather(2, (counts - 1).clamp(min=0)[..., None])
    return torch.where(valid, ranked, last), valid


class RaggedLayer(EvictingLayer, AttentionOwningLayer):
    """An :class:`~mmaccel.longctx.base.EvictingLayer` whose KV heads hold different numbers of tokens.

    K/V are stored padded to the widest head ([B, Hkv, K, D]); the per-slot state ``"valid"`` ([B, Hkv, K] bool)
    marks real slots, and :meth:`attend` masks the padding per head (``kernels.attention`` with a [B, Hq, q, K]
    mask). Padding is held memory and counts in ``kv_cache_bytes``.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.add_slot_state("valid", fill=True, dtype=torch.bool)

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        Hq, q = query.shape[1], query.shape[2]
        valid = self.slot_state["valid"]
        if bool(valid.all()):
            return attention(query, self.keys, self.values, causal=True, scaling=scaling)
        allowed = valid.repeat_interleave(Hq // valid.shape[1], dim=1)[:, :, None, :]  # [B, Hq, 1, K]
        if q > 1:
            allowed = allowed & causal_mask(q, valid.shape[-1], valid.device)
        return attention(query, self.keys, self.values, causal=False, attention_mask=allowed, scaling=scaling)

    def valid_counts(self) -> torch.Tensor:
        """int64 [B, Hkv] real slots per row and KV head."""
        return self.slot_state["valid"].sum(-1)


@dataclass(init=False)
class AdaKV(ScorerWrapper):
    """AdaKV (Feng et al., 2024, arXiv 2407.11550): head-wise budgets over any scorer, ``AdaKV(SnapKV(...))``.

    The wrapped scorer scores the held slots as usual ([B, Hkv, S]); instead of ``budget`` slots per KV head, each
    layer keeps its ``budget * Hkv`` best-scored slots over all its KV heads (each head first gets
    ``floor(alpha * budget)``, AdaKV's safeguard): :func:`adakv_keep_indices`. Heads whose attention is spread get
    more slots, peaked heads fewer. K/V are stored padded to the widest head with a per-head validity mask
    (:class:`RaggedLayer`); attention masks the padding per head, so the padding costs memory, which
    ``kv_cache_bytes`` reports (``padding_fraction`` in the telemetry says how much).

    Parameters
    ----------
    method : KVScorer or str
        The wrapped scorer or its spec with commas for colons (``adakv:method=snapkv,budget=256``). Its budget,
        ratio, layer budgets (PyramidKV), decode-time eviction (H2O) and minimum budget are used.
    alpha : float
        Safeguard fraction in [0, 1] (default 0.2, as in AdaKV).
    budget, ratio
        Taken from the wrapped scorer; if given they must equal its own.

    Notes
    -----
    Scores must be comparable across heads (attention probabilities are: SnapKV, PyramidKV, H2O, TOVA). A second
    compression (a later prefill chunk, or every decode step under H2O/StreamingLLM) scores the padded layout: padding
    slots score ``-inf``, but attention-based scorers normalise over them (they repeat a real slot), a small
    distortion. Padded batches raise, as for the wrapped methods. Works with ``generate(prefill_chunk_size=C)`` and under the ``Chunked`` wrapper.

    Raises
    ------
    ValueError
        If ``method`` is not a scorer, ``alpha`` is out of range, or budget/ratio disagree with the scorer's.
    """

    alpha: float = 0.2

    method_name = "adakv"

    def __init__(self, method: object = "snapkv", alpha: float = 0.2, budget: int | None = None,
                 ratio: float | None = None):
        self.method, self.alpha, self.budget, self.ratio = method, alpha, budget, ratio
        self.__post_init__()

    def __post_init__(self):
        self.resolve()
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"adakv: alpha must be in [0, 1], got {self.alpha!r}; e.g. adakv:alpha=0.2")

    def own_spec(self) -> str:
        return f":alpha={self.alpha}"

    def make_layer(self, layer_idx: int) -> RaggedLayer:
        return RaggedLayer()

    def make_cache(self, model: torch.nn.Module) -> OwnedAttentionCache:
        """A fresh cache for one ``generate`` run of ``model`` (close it, or use ``with``, when done)."""
        return OwnedAttentionCache(model, self)

    def score(self, step: LayerStep) -> torch.Tensor:
        scores = self.method.score(step).float()
        return scores.masked_fill(~step.layer.slot_state["valid"], float("-inf"))

    def compress(self, step: LayerStep, keep: int) -> None:
        """Keep the layer's ``keep * Hkv`` best slots over its KV heads, padded per head (see the class)."""
        layer = step.layer
        if int(layer.valid_counts().sum(-1).max()) <= keep * step.num_kv_heads:
            return  # wider than the budget only through padding: nothing to evict
        scores = self.score(step)
        indices, valid = adakv_keep_indices(scores, min(keep, scores.shape[-1]), self.alpha)
        layer.keep(indices)
        layer.slot_state["valid"] = valid

    def telemetry(self, cache) -> dict:
        """The base telemetry (``kept_tokens_per_layer`` = the padded width) plus ``valid_tokens_per_head``
        ([layer][KV head] real slots of row 0) and ``padding_fraction`` (padded slots / held slots)."""
        out = super().telemetry(cache)
        layers = [l for l in getattr(cache, "layers", []) if isinstance(l, RaggedLayer) and l.is_initialized]
        held = sum(held_tokens(l) * l.keys.shape[0] * l.keys.shape[1] for l in layers)
        real = sum(int(l.valid_counts().sum()) for l in layers)
        out.update(spec=self.spec, method=self.name, inner_method=self.method.spec,
                   valid_tokens_per_head=[l.valid_counts()[0].tolist() for l in layers],
                   padding_fraction=(held - real) / held if held else 0.0)
        return out
