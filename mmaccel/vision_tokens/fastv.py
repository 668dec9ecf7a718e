"""FastV: prune visual tokens inside the LLM by the attention they receive at layer K - 1, under SDPA."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..kernels import attention_column_scores
from .in_llm import LayerPruner

__all__ = ["FastV"]


@dataclass
class FastV(LayerPruner):
    """FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for
    Large Vision-Language Models", 2024, arXiv 2403.06764).

    At decoder layer ``layer`` (K) keep all text tokens and the ``keep_ratio`` fraction of each row's image tokens
    that receive the most attention, at layer K - 1, from the last ``window`` queries (FastV's code uses the last
    token; averaged over heads). Scores come from :func:`mmaccel.kernels.attention_column_scores` on the layer's own
    q/k projections, so the model runs under SDPA/flash: no eager attention, no ``output_attentions``. Layers
    ``< K`` keep the full KV cache; layers ``>= K`` hold only the kept tokens, at prefill and through decoding.

    Parameters
    ----------
    keep_ratio : float
        Fraction of image tokens kept from layer K on, in (0, 1] (FastV's ``R`` is ``1 - keep_ratio``).
    layer : int
        K, in ``[1, num_layers - 1]`` (FastV's default K = 2).
    window : int
        Number of last queries whose attention is summed (1 = FastV).

    Raises
    ------
    ValueError
        If ``keep_ratio`` is outside (0, 1] or ``window < 1``; at run time if rows hold different numbers of image
        tokens.
    UnsupportedModelError
        From ``apply`` on a model that is not LLaVA-style or Qwen2-VL, or a ``layer`` outside the model.
    """

    layer: int = 2
    window: int = 1

    name: ClassVar[str] = "fastv"
    paper: ClassVar[str] = "Chen et al., 2024, arXiv 2403.06764"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, L] float32: attention each key gets from the last ``window`` queries, summed, averaged over heads."""
        return attention_column_scores(queries, keys, causal=True, reduce="sum").mean(dim=1)
