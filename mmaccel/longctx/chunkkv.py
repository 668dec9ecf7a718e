"""ChunkKV: keep whole chunks of consecutive tokens, ranked by the mean score of a wrapped scorer.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference", 2025,
arXiv 2502.00299.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictingLayer, LayerStep, _check_int
from .wrapper import ScorerWrapper

_HEADS = ("shared", "per_head")


def chunkkv_scores(scores: torch.Tensor, positions: torch.Tensor, chunk: int, *, shared: bool = True) -> torch.Tensor:
    """Slot scores that rank whole chunks first: by the chunk's mean score, then by the slot's own score.

    A chunk is ``chunk`` consecutive token positions (``position // chunk``), so under chunked prefill a chunk is what
    is left of those positions. Slots scoring ``inf`` (e.g. SnapKV's observation window) stay ``inf``.

    Parameters
    ----------
    scores : torch.Tensor
        [B, Hkv, S] the wrapped scorer's slot scores, higher = keep (finite or ``+inf``).
    positions : torch.Tensor
        [B, Hkv, S] integer token position of each slot.
    chunk : int
        Chunk length in tokens, >= 1 (1 = the wrapped scorer's own order).
    shared : bool
        Rank chunks by their scores summed over the KV heads, so every head of a layer keeps the same chunks (ChunkKV
        and kvpress's ``ChunkKVPress``); ``False`` ranks per KV head.

    Returns
    -------
    torch.Tensor
        [B, Hkv, S] float32: ``inf`` where ``scores`` is ``inf``, elsewhere the slot's rank ``0 .. S - 1`` in the order
        (chunk mean, own score), ascending, so that a top-k takes the best chunks whole and splits at most one.
    """
    B, H, S = scores.shape
    scores = scores.float()
    ids = positions.long() // chunk
    n = int(ids.max()) + 1 if S else 0
    sums = scores.new_zeros(B, H, n).scatter_add_(2, ids, scores)
    counts = scores.new_zeros(B, H, n).scatter_add_(2, ids, torch.ones_like(scores))
    means = sums / counts.clamp(min=1)
    if shared:
        means = means.sum(1, keepdim=True).expand(B, H, n)
    per_slot = means.gather(2, ids)
    order = scores.argsort(dim=-1, stable=True)  # own score, ascending
    order = order.gather(2, per_slot.gather(2, order).argsort(dim=-1, stable=True))  # then chunk mean, stably
    ranks = torch.arange(S, dtype=torch.float32, device=scores.device).expand(B, H, S)
    rank = torch.empty_like(scores).scatter_(2, order, ranks)
    return torch.where(torch.isposinf(scores), scores, rank)


@dataclass(init=False)
class ChunkKV(ScorerWrapper):
    """ChunkKV (Liu et al., 2025, arXiv 2502.00299): any scorer, ``ChunkKV(SnapKV(...), chunk=10)``, keeping whole chunks.

    The wrapped scorer scores the held slots ([B, Hkv, S]); the slots are grouped into chunks of ``chunk`` consecutive
    positions, chunks are ranked by their mean score (summed over the layer's KV heads with ``heads="shared"``, as in
    the paper), and the base keeps the ``budget`` best slots per KV head in that order (:func:`chunkkv_scores`):
    whole chunks, at most one split by the slots' own scores. A number, a name or a clause survives whole where a
    token-level top-k keeps its first digits and drops the rest (the failure of SnapKV on the NIAH needles of
    ``smollm2-135m``, ``studies/needle_digits/``). The storage, the budget and the decode behaviour are the
    wrapped method's. The paper's layer-wise index reuse (adjacent layers sharing one selection) is not built.

    Parameters
    ----------
    method : KVScorer or str
        The wrapped scorer or its spec with commas for colons (``chunkkv:method=snapkv,ratio=0.25``; the paper wraps
        SnapKV). Its budget, ratio, layer budgets (PyramidKV), decode-time eviction (H2O) and minimum budget are used.
    chunk : int
        Chunk length in tokens, >= 1 (default 10, the paper's; kvpress defaults to 20).
    heads : {"shared", "per_head"}
        One chunk selection per layer (default, the paper's and kvpress's) or one per KV head.
    budget, ratio
        Taken from the wrapped scorer; if given they must equal its own.

    Raises
    ------
    ValueError
        If ``method`` is not a scorer, ``chunk < 1``, ``heads`` is unknown, or budget/ratio disagree with the
        scorer's; during prefill, as the wrapped method raises (e.g. a padded batch).
    """

    chunk: int = 10
    heads: str = "shared"

    method_name = "chunkkv"

    def __init__(self, method: object = "snapkv", chunk: int = 10, heads: str = "shared", budget: int | None = None,
                 ratio: float | None = None):
        self.method, self.chunk, self.heads, self.budget, self.ratio = method, chunk, heads, budget, ratio
        self.__post_init__()

    def __post_init__(self):
        self.resolve()
        _check_int(self.method_name, "chunk", self.chunk, 1, "pass the chunk length in tokens, e.g. chunkkv:chunk=10")
        if self.heads not in _HEADS:
            raise ValueError(f"{self.method_name}: heads must be one of {_HEADS}, got {self.heads!r}")

    def own_spec(self) -> str:
        return f":chunk={self.chunk}:heads={self.heads}"

    @property
    def supports_speculative(self) -> bool:
        return self.method.supports_speculative

    def make_layer(self, layer_idx: int) -> EvictingLayer:
        return self.method.make_layer(layer_idx)

    def score(self, step: LayerStep) -> torch.Tensor:
        return chunkkv_scores(self.method.score(step), step.layer.positions, self.chunk, shared=self.heads == "shared")
