"""KeyDiff: keep the keys least similar to the layer's mean key direction (no attention, no queries needed).

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments", 2025, arXiv 2504.15364.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import KVScorer, LayerStep


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff's slot scores: minus the cosine similarity of each key to the anchor, per row and KV head.

    The anchor is the mean of the unit-normalised keys of the head (so a few long keys do not dominate it).

    Parameters
    ----------
    keys : torch.Tensor
        [B, Hkv, S, D] held keys (after RoPE, as cached).

    Returns
    -------
    torch.Tensor
        [B, Hkv, S] float32 in [-1, 1], higher = keep (the most distinctive keys).
    """
    unit = F.normalize(keys.float(), dim=-1)
    anchor = F.normalize(unit.mean(dim=2, keepdim=True), dim=-1)  # [B, Hkv, 1, D]
    return -(unit * anchor).sum(dim=-1)


@dataclass
class KeyDiff(KVScorer):
    """KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the keys least similar to the mean key, per KV head.

    Score: ``-cos(k_j, mean_i(k_i / ||k_i||))`` of each held key (:func:`keydiff_scores`), [B, Hkv, S]; the base keeps
    the ``budget`` best slots per row and KV head after each prefill step (query-free, so the same selection serves
    any later question). Decode tokens are appended. The paper evicts block by block while the prompt streams in;
    here that is ``chunked:method=keydiff,...`` or ``generate(prefill_chunk_size=C)`` (each chunk scores the held
    slots plus itself), and one prefill scores the whole prompt at once, as kvpress's ``KeyDiffPress`` does.

    Parameters
    ----------
    budget, ratio
        Slots kept per layer and KV head (default 256) or a kept fraction of the prompt (``keydiff:ratio=0.25``).

    Raises
    ------
    ValueError
        On a bad budget or ratio; during prefill, for a padded batch.
    """

    method_name = "keydiff"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    supports_speculative = True  # prefill-only: the speculative engine can crop its decode slots

    def score(self, step: LayerStep) -> torch.Tensor:
        return keydiff_scores(step.keys)
