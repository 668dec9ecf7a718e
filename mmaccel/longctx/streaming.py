"""StreamingLLM: attention sinks plus a window of recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023, arXiv 2309.17453.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KVScorer, LayerStep, _check_int


@dataclass
class StreamingLLM(KVScorer):
    """StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): keep ``sink`` first tokens + the most recent ones.

    Parameters
    ----------
    window : int or None
        Recent tokens held per layer, >= 1 (default 256, i.e. ``budget = window + sink``).
    sink : int
        Initial "attention sink" tokens held per layer, >= 0 (default 4).
    budget, ratio
        Alternatively the total slots (``window = budget - sink``) or a kept fraction of the prompt
        (``window = ceil(ratio * prompt) - sink``); see :class:`~mmaccel.longctx.base.KVScorer`.

    Notes
    -----
    Score of a held slot: ``inf`` for the sinks (position < ``sink``), else its position, so the base keeps the sinks
    and the most recent slots, after the prefill and after every decode step (``evicts_on_decode``). Each layer holds
    at most ``sink + window`` slots of [B, Hkv, ., D] K/V after every forward. The prompt attends fully; decode tokens
    see ``sink + window`` slots plus themselves, as in the reference ``StartRecentKVCache``. Positions stay the true
    ones (keys are cached after RoPE; ``generate`` passes true ``position_ids``). With ``sink = 0`` (a plain sliding
    window) left-padded batches are exact; with sinks, the sinks of shorter rows would be pad tokens, so a padded batch
    is refused at prefill.

    Raises
    ------
    ValueError
        If ``window < 1``, ``sink < 0``, or ``window`` and ``budget`` disagree; during prefill, for a left-padded batch
        when ``sink > 0``.
    """

    window: int | None = None
    sink: int = 4

    method_name = "streaming"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    evicts_on_decode = True

    def __post_init__(self):
        _check_int("streaming", "sink", self.sink, 0, "pass the number of initial sink tokens to keep, e.g. sink=4")
        if self.window is not None:
            _check_int("streaming", "window", self.window, 1,
                       "pass the number of recent tokens to keep, e.g. window=256")
            if self.budget is not None and self.budget != self.window + self.sink:
                raise ValueError(f"streaming: budget ({self.budget}) must be window + sink "
                                 f"({self.window} + {self.sink}); give one of them, e.g. streaming:window=256")
            if self.ratio is not None:
                raise ValueError("streaming: give window (tokens) or ratio (kept fraction), not both")
            self.budget = self.window + self.sink
        elif self.budget is None and self.ratio is None:
            self.window = 256
            self.budget = self.window + self.sink
        super().__post_init__()
        if self.budget is not None:
            if self.budget <= self.sink:
                raise ValueError(f"streaming: budget ({self.budget}) must exceed sink ({self.sink})")
            self.window = self.budget - self.sink

    @property
    def padding_safe(self) -> bool:
        """Exact on left-padded batches only without sinks."""
        return self.sink == 0

    def min_budget(self, step: LayerStep) -> int:
        return self.sink + 1

    def score(self, step: LayerStep) -> torch.Tensor:
        """[B, Hkv, S]: ``inf`` for sink positions, else the position (recent = high)."""
        pos = step.layer.positions.float()
        return pos.masked_fill(step.layer.positions < self.sink, float("inf"))
