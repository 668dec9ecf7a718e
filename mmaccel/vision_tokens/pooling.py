"""Plain spatial average pooling of the projected visual tokens to the same token count: the baseline.

VTC-Bench (Liao et al., 2025, github.com/Chenfei-Liao/VTC-Bench; no arXiv id recorded in our references) finds that
"simple image downsampling consistently outperforms many advanced compression methods", so every sweep shows it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import ImageGrid, kept_count
from .plan import TokenPlan
from .pre_llm import ImageReducer

__all__ = ["Pooling", "pooled_grid", "pooling_plan"]


def pooled_grid(h: int, w: int, keep: int) -> tuple[int, int]:
    """The ``h' x w'`` grid closest to ``keep`` cells with the aspect of ``h x w`` (``h' <= h``, ``w' <= w``)."""
    if keep >= h * w:
        return h, w
    hp = max(1, min(h, round(h * math.sqrt(keep / (h * w)))))
    wp = max(1, min(w, round(keep / hp)))
    return hp, wp


def pooling_plan(grid: ImageGrid, keep: int, device=None) -> TokenPlan:
    """A plan that averages a ``t x h x w`` raster into non-overlapping cells of a ``t x h' x w'`` grid.

    Parameters
    ----------
    grid : ImageGrid
        The token raster (frame-major, then rows, then columns).
    keep : int
        Target tokens per frame (the grid gets as close as a rectangle can).

    Returns
    -------
    TokenPlan
        Batch 1 over ``t * h * w`` tokens; each cell's representative is its top-left token, so the pooled token
        keeps that token's position.
    """
    t, h, w = grid.t, grid.h, grid.w
    hp, wp = pooled_grid(h, w, keep)
    rows = torch.arange(h, device=device) * hp // h  # cell row of each token row
    cols = torch.arange(w, device=device) * wp // w
    cell = rows[:, None] * wp + cols[None, :]  # [h, w]
    flat = torch.arange(h * w, device=device).view(h, w)
    first = torch.full((hp * wp,), h * w, dtype=torch.long, device=device)
    first = first.scatter_reduce(0, cell.reshape(-1), flat.reshape(-1), reduce="amin")  # top-left token per cell
    rep = first[cell.reshape(-1)]  # [h * w]
    rep = torch.cat([rep + f * h * w for f in range(t)])
    return TokenPlan.from_representatives(rep[None])


@dataclass
class Pooling(ImageReducer):
    """Spatial average pooling of each image's projected tokens to ``keep_ratio`` of them (per frame for video).

    The baseline every method is shown beside (VTC-Bench, Liao et al., 2025: "simple image downsampling
    consistently outperforms many advanced compression methods"). Not a paper's method; no arXiv id.

    Parameters
    ----------
    keep_ratio : float
        Fraction of visual tokens kept, in (0, 1]; the pooled grid is the rectangle closest to it.

    Raises
    ------
    ValueError
        If ``keep_ratio`` is outside (0, 1].
    UnsupportedModelError
        From ``apply`` on a model that is not LLaVA-style or Qwen2-VL.
    """

    name: ClassVar[str] = "pooling"
    paper: ClassVar[str] = "baseline (VTC-Bench, Liao et al., 2025)"

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        spatial = ImageGrid(grid.t, grid.h, grid.w)
        return pooling_plan(spatial, kept_count(grid.h * grid.w, self.keep_ratio), device=features.device)
