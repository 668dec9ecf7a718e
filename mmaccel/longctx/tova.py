"""TOVA: at every step, drop the slot the current query attends to least (head-averaged).

Oren et al., "Transformers are Multi-State RNNs", 2024, arXiv 2401.06104.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import attention_column_scores
from .base import KVScorer, LayerStep
from .owned import DecodeProbsScorer


@dataclass
class TOVA(DecodeProbsScorer, KVScorer):
    """TOVA (Oren et al., 2024, arXiv 2401.06104): keep the slots the last query attends to most.

    Score of a held slot: the attention probability the last query of this forward gives it, averaged over all query
    heads of the layer (as in the paper, so every KV head keeps the same slots), [B, Hkv, S]. Evicts after the prefill
    and after every decode step (``evicts_on_decode``), back to ``budget`` slots.

    Parameters
    ----------
    budget, ratio
        Slots kept per layer (default 256) or a kept fraction of the prompt.

    Raises
    ------
    ValueError
        On a bad budget or ratio; during prefill, for a padded batch.
    """

    method_name = "tova"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    evicts_on_decode = True
    captures_queries = True  # its decode-step score reads the queries: reuse the module's own projection

    def score(self, step: LayerStep) -> torch.Tensor:
        # [B, Hq, S]: the probabilities of the step's own attention at decode (None: the model's own attention ran)
        column = getattr(step.layer, "decode_probs", None) if step.query_length == 1 else None
        if column is None:
            column = attention_column_scores(step.queries(1), step.keys, causal=True, scaling=step.scaling)
        return column.mean(dim=1, keepdim=True).expand(-1, step.num_kv_heads, -1)
