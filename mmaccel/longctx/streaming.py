"""StreamingLLM: attention sinks plus a window of recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023, arXiv 2309.17453.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictingLayer, KVMethod, KVMethodCache, _check_int, attention_modules, has_padding


class SinkWindowLayer(EvictingLayer):
    """Cache layer that, after every update, holds the first ``sink`` tokens and the ``window`` most recent ones.

    Parameters
    ----------
    sink : int
        Number of initial tokens (attention sinks) kept forever.
    window : int
        Number of most recent tokens kept.

    Notes
    -----
    Eviction happens after the attention of the current forward: the prompt (prefill) attends fully, as in kvpress
    and HF practice, and each decode token attends to the ``sink + window`` held slots plus itself, then the oldest
    non-sink slot is dropped -- as in the reference implementation's ``StartRecentKVCache``. Held keys carry their
    original RoPE positions (no re-indexing inside the cache).
    """

    def __init__(self, sink: int, window: int, **kwargs):
        super().__init__(**kwargs)
        self.sink, self.window = sink, window

    def after_update(self, query_length: int) -> None:
        held = self.held
        if held <= self.sink + self.window:
            return
        device = self.keys.device
        keep = torch.cat([torch.arange(self.sink, device=device), torch.arange(held - self.window, held, device=device)])
        self.keep(keep)


@dataclass
class StreamingLLM(KVMethod):
    """StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): keep ``sink`` first tokens + ``window`` recent tokens.

    Parameters
    ----------
    window : int
        Recent tokens held per layer, >= 1 (default 256).
    sink : int
        Initial "attention sink" tokens held per layer, >= 0 (default 4).

    Notes
    -----
    Each layer holds at most ``sink + window`` slots of [B, Hkv, ., D] K/V after every forward. The prompt attends
    fully; decode tokens see ``sink + window`` slots plus themselves. Positions stay the true ones (keys are cached
    after RoPE; ``generate`` passes true ``position_ids``). Batch > 1 keeps the same slots in every row, which is
    exact without padding. With left padding the sinks of shorter rows would be pad tokens and the padding mask would
    be misaligned after the first eviction, so with ``sink > 0`` a padded batch is refused at prefill: in Llama-style
    decoders a forward hook on each self-attention module of the model checks the mask once and removes itself.
    ``sink=0`` (a plain sliding window) stays exact with padding.

    Raises
    ------
    ValueError
        If ``window < 1`` or ``sink < 0``; during prefill, for a left-padded batch when ``sink > 0``.
    """

    window: int = 256
    sink: int = 4

    method_name = "streaming"

    def __post_init__(self):
        _check_int("streaming", "window", self.window, 1, "pass the number of recent tokens to keep, e.g. window=256")
        _check_int("streaming", "sink", self.sink, 0, "pass the number of initial sink tokens to keep, e.g. sink=4")

    def make_layer(self, layer_idx: int) -> SinkWindowLayer:
        return SinkWindowLayer(sink=self.sink, window=self.window)

    def make_cache(self, model: torch.nn.Module) -> KVMethodCache:
        """A fresh cache; with ``sink > 0`` it refuses padded batches at prefill (see Notes)."""
        cache = KVMethodCache(model, self.make_layer, method=self)
        if self.sink and attention_modules(model):
            cache.observe_prefill(model, self._refuse_padding)
        return cache

    def _refuse_padding(self, module, layer, hidden_states, position_embeddings, attention_mask) -> None:
        if has_padding(attention_mask):
            raise ValueError(
                "streaming cannot keep attention sinks in a padded batch (the sinks of shorter rows would be pad "
                "tokens, and the padding mask no longer lines up once tokens are evicted); run prompts one at a time "
                "or with equal lengths, or use streaming:sink=0"
            )
