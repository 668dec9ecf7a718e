"""KNorm: keep the keys with the smallest L2 norm (no attention needed).

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", 2024, arXiv 2406.11430.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KVScorer, LayerStep


@dataclass
class KNorm(KVScorer):
    """KNorm (Devoto et al., 2024, arXiv 2406.11430): score = minus the key's L2 norm, per KV head, at prefill.

    Score: ``-||k||_2`` of each held key (after RoPE, which preserves the norm), [B, Hkv, S]; the base keeps the
    ``budget`` lowest-norm slots per row and KV head after each prefill step. Decode tokens are appended.

    Parameters
    ----------
    budget, ratio
        Slots kept per layer and KV head (default 256) or a kept fraction of the prompt.

    Raises
    ------
    ValueError
        On a bad budget or ratio; during prefill, for a padded batch.
    """

    method_name = "knorm"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    supports_speculative = True  # prefill-only: the speculative engine can crop its decode slots

    def score(self, step: LayerStep) -> torch.Tensor:
        return -step.keys.float().norm(dim=-1)
