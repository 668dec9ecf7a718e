"""Temporal ToMe: merge the most similar tokens across adjacent frames of a video, between projector and LLM."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import ImageGrid, ImageReducer, kept_count
from .plan import TokenPlan

__all__ = ["TemporalToMe", "temporal_merge_plan"]


def temporal_merge_plan(features: torch.Tensor, grid: ImageGrid, keep: int) -> TokenPlan:
    """Merge each token into the same spatial position of the previous frame, most similar pairs first.

    Parameters
    ----------
    features : torch.Tensor
        [t * h * w, D] tokens, frame-major then raster order.
    grid : ImageGrid
        The ``t x h x w`` layout (``prefix`` must be 0).
    keep : int
        Output tokens, ``h * w <= keep <= t * h * w`` (at least the first frame is kept); a smaller ``keep`` is
        raised to ``h * w``.

    Returns
    -------
    TokenPlan
        Batch 1. The ``t*h*w - keep`` pairs (frame f, position p) ~ (frame f-1, p) of highest cosine similarity
        are merged; a chain of merges over several frames averages into the earliest frame's token, which keeps its
        position (so a static background costs one token per position, whatever the clip length).
    """
    t, hw = grid.t, grid.h * grid.w
    n = t * hw
    device = features.device
    keep = max(keep, hw)
    if keep >= n or t < 2:
        return TokenPlan.identity(1, n, device)
    frames = F.normalize(features.float().view(t, hw, -1), dim=-1)
    sim = (frames[1:] * frames[:-1]).sum(-1).reshape(-1)  # [(t-1) * hw]: frame f+1 vs f at each position
    merge = torch.zeros((t - 1) * hw, dtype=torch.bool, device=device)
    merge[sim.topk(n - keep).indices] = True
    merge = merge.view(t - 1, hw)
    rep = torch.arange(n, device=device).view(t, hw).clone()
    for f in range(1, t):  # follow chains: a merged token takes its predecessor's representative
        rep[f] = torch.where(merge[f - 1], rep[f - 1], rep[f])
    return TokenPlan.from_representatives(rep.reshape(1, n))


@dataclass
class TemporalToMe(ImageReducer):
    """Temporal token merging for video, between the projector and the LLM: the Temporal Dimension Token Merging
    (TDTM) of "On-device Sora: Enabling Diffusion-Based Text-to-Video Generation for Mobile Devices" (2025; arXiv id
    not recorded in our references) applied to video-LLM frame tokens, with ToMe's similarity-ordered merging
    (Bolya et al., "Token Merging: Your ViT But Faster", 2023, arXiv 2210.09461).

    Each frame's tokens are compared with the same spatial position in the previous frame (cosine of the
    projected tokens); the most similar pairs over the whole clip are merged until ``keep_ratio`` of the tokens are
    left, so static regions collapse and moving ones stay. Works on Qwen2-VL videos (``pixel_values_videos``; the
    merged token keeps its earliest frame's 3-D M-RoPE position). Single images (t = 1) are left unchanged.

    Parameters
    ----------
    keep_ratio : float
        Fraction of a clip's tokens kept, in (0, 1]; never below one frame's worth.

    Raises
    ------
    ValueError
        If ``keep_ratio`` is outside (0, 1].
    UnsupportedModelError
        From ``apply`` on a model that is not LLaVA-style or Qwen2-VL.
    """

    name: ClassVar[str] = "temporal-tome"
    paper: ClassVar[str] = "TDTM (On-device Sora, 2025) + ToMe (Bolya et al., 2023, arXiv 2210.09461)"

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        spatial = ImageGrid(grid.t, grid.h, grid.w)
        return temporal_merge_plan(features, spatial, kept_count(spatial.tokens, self.keep_ratio))
