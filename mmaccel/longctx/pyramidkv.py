"""PyramidKV: SnapKV's scores with layer-wise budgets, large in the lower layers and small in the upper ones.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024,
arXiv 2406.02069.
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import LayerStep, _check_int
from .snapkv import SnapKV


def pyramid_budgets(average: int, num_layers: int, window: int, beta: int = 20) -> list[int]:
    """Per-layer budgets of PyramidKV (the arithmetic schedule of its reference implementation).

    Parameters
    ----------
    average : int
        Mean slots per layer (the budget SnapKV would give every layer), >= ``window``.
    num_layers : int
        Number of decoder layers.
    window : int
        Observation window, kept in every layer on top of the schedule.
    beta : int
        The top layer keeps ``(average - window) // beta`` slots besides the window.

    Returns
    -------
    list of int
        ``num_layers`` budgets, decreasing linearly from layer 0; their mean is ``average`` up to rounding.
    """
    if num_layers == 1:
        return [average]
    low = (average - window) // beta
    high = 2 * (average - window) - low
    step = (high - low) // (num_layers - 1)
    return [high - i * step + window for i in range(num_layers)]


@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV with a pyramid of layer budgets.

    Scores are SnapKV's (:class:`~mmaccel.longctx.snapkv.SnapKV`); layer ``l`` keeps
    :func:`pyramid_budgets` ``(budget, L, window, beta)[l]`` slots per KV head, so the K/V bytes summed over layers
    match SnapKV at the same ``budget`` (up to rounding) while lower layers keep more.

    Parameters
    ----------
    budget, ratio, window, kernel_size, pooling
        As in SnapKV; ``budget`` (or ``ratio`` of the prompt) is the *mean* per layer.
    beta : int
        Steepness, >= 1 (default 20, as in the reference implementation).

    Raises
    ------
    ValueError
        On a bad hyper-parameter; during prefill, for a padded batch.
    """

    beta: int = 20

    method_name = "pyramidkv"
    prefill_is_full = True  # full-attention prefill, then it only chooses what to keep (shared_prefill)
    per_layer_lengths = True  # the cache fits eager's one mask per layer type to each layer's own length

    def __post_init__(self):
        super().__post_init__()
        _check_int("pyramidkv", "beta", self.beta, 1, "e.g. beta=20")

    def layer_budget(self, step: LayerStep) -> int:
        average = self.context_budget(step.layer.cumulative_length)
        window = min(self.window, step.query_length)
        if average <= window:
            return average
        return pyramid_budgets(average, step.cache.num_layers, window, self.beta)[step.layer_idx]
