"""Full attention: the uncompressed baseline every KV-cache method is compared with."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .base import KVMethod


@dataclass
class FullAttention(KVMethod):
    """Keep every token: transformers' own ``DynamicCache`` (the reference for outputs and ``kv_cache_bytes``).

    Vaswani et al., "Attention Is All You Need", 2017, arXiv 1706.03762. Exact on padded batches, under every
    attention implementation and under chunked prefill.
    """

    method_name = "full"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    uses_hooks = False
    padding_safe = True

    def make_layer(self, layer_idx: int) -> DynamicLayer:
        """transformers' own ``DynamicLayer`` (used when a wrapper such as ``Chunked`` builds the cache)."""
        return DynamicLayer()

    def make_cache(self, model: torch.nn.Module) -> DynamicCache:
        """A fresh ``DynamicCache(config=model.config)``."""
        return DynamicCache(config=model.config)
