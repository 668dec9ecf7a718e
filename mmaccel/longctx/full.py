"""Full attention: the uncompressed baseline every KV-cache method is compared with."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .base import KVMethod


@dataclass
class FullAttention(KVMethod):
    """Keep every token: transformers' own ``DynamicCache`` (the reference for outputs and ``kv_cache_bytes``)."""

    method_name = "full"

    def make_cache(self, model: torch.nn.Module) -> DynamicCache:
        """A fresh ``DynamicCache(config=model.config)``."""
        return DynamicCache(config=model.config)
