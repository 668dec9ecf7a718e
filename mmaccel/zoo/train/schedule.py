"""The one learning-rate schedule of the zoo's trainers: linear warm-up, then cosine decay to a floor."""
from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Learning rate at ``step`` (0-based) of ``total``: linear warm-up over ``warmup`` steps to ``peak``, then
    cosine decay to ``floor * peak`` at ``total`` (held there after it).

    Parameters
    ----------
    step, total, warmup : int
        Current step, planned steps and warm-up steps (``warmup`` may be 0: no warm-up).
    peak : float
        Learning rate at the end of the warm-up.
    floor : float
        Final learning rate as a fraction of ``peak`` (0.1 = 10%).

    Returns
    -------
    float
        The learning rate (same unit as ``peak``).
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
