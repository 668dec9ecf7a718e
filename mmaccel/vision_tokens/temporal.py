"""Temporal ToMe: merge the most similar tokens across adjacent frames of a video, between projector and LLM."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import ImageGrid, check_keep_ratio, kept_count
from .plan import TokenPlan
from .pooling import pooled_grid, pooling_plan
from .pre_llm import ImageReducer

__all__ = ["TemporalToMe", "frame_grids", "temporal_merge_plan"]


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


def _is_frame(grid: ImageGrid) -> bool:
    """A grid that can be one frame of a clip: a plain raster, one frame, nothing around it, a whole image."""
    return grid.t == 1 and grid.prefix == 0 and grid.suffix == 0 and not grid.newline and grid.part == 0


def frame_grids(grids: list[ImageGrid], row_tokens: list[int]) -> list[ImageGrid]:
    """Read consecutive images of the same size in one prompt as the frames of one clip.

    Within each batch row, a run of consecutive single-frame grids with the same ``h x w`` (a plain raster: no
    prefix, suffix or newline tokens, and not the base image of an AnyRes image, whose crops follow as ``part`` 1)
    becomes one ``t x h x w`` grid, ``t`` the length of the run. Text between the images does not break a run: the
    grids name the image tokens in order, wherever they are. Other grids, and grids that are already clips
    (``t > 1``: Qwen2-VL or OneVision videos), stay as they are.

    Parameters
    ----------
    grids : list of ImageGrid
        Every grid of a prefill in order of appearance, row by row (:meth:`VLMParts.grids`).
    row_tokens : list of int
        Image tokens of each batch row (their grids' ``tokens`` add up to it).

    Returns
    -------
    list of ImageGrid
        The same tokens, row by row, with every run of frames as one grid.

    Raises
    ------
    ValueError
        If the grids do not add up to the rows' token counts.
    """
    out: list[ImageGrid] = []
    k = 0
    for count in row_tokens:
        row, total = [], 0
        while total < count and k < len(grids):
            row.append(grids[k])
            total += grids[k].tokens
            k += 1
        if total != count:
            raise ValueError(f"the image grids give {total} tokens for a row with {count} image tokens")
        i = 0
        while i < len(row):
            j = i
            frame = _is_frame(row[i]) and (i + 1 == len(row) or row[i + 1].part == 0)
            while frame and j + 1 < len(row) and _is_frame(row[j + 1]) and \
                    (row[j + 1].h, row[j + 1].w) == (row[i].h, row[i].w) and \
                    (j + 2 == len(row) or row[j + 2].part == 0):
                j += 1
            out.append(row[i] if j == i else ImageGrid(j - i + 1, row[i].h, row[i].w))
            i = j + 1
    if k != len(grids):
        raise ValueError(f"{len(grids) - k} image grids are left over after the rows' image tokens")
    return out


@dataclass
class TemporalToMe(ImageReducer):
    """Temporal token merging for video, between the projector and the LLM: the Temporal Dimension Token Merging
    (TDTM) of "On-device Sora: Enabling Diffusion-Based Text-to-Video Generation for Mobile Devices" (2025; arXiv id
    not recorded in our references) applied to video-LLM frame tokens, with ToMe's similarity-ordered merging
    (Bolya et al., "Token Merging: Your ViT But Faster", 2023, arXiv 2210.09461).

    Each frame's tokens are compared with the same spatial position in the previous frame (cosine of the
    projected tokens); the most similar pairs over the whole clip are merged until ``keep_ratio`` of the tokens are
    left, so static regions collapse and moving ones stay. A merged token is the mean of its frames' tokens and
    keeps the position of the earliest (Qwen2-VL: its 3-D M-RoPE position).

    What a clip is: a video input (Qwen2-VL ``pixel_values_videos``, a OneVision video), or a run of consecutive
    images of the same size in one prompt (:func:`frame_grids`) -- how a LLaVA-1.5-style model, which has no video
    input, is fed a video: one ``<image>`` per frame. A single image (a one-frame clip) is left unchanged, and at
    ``keep_ratio < 1`` a ``UserWarning`` says so (how many clips of the prompt are single frames, and what to use for
    still images instead).

    ``telemetry``: as :class:`~.pre_llm.ImageReducer` (``tokens_before`` / ``tokens_after`` per clip), plus
    ``frames``: the frames of each clip. :meth:`source_map` gives one plan per clip.

    With ``pool < 1`` every frame is first average-pooled to ``pool`` of its tokens (the pooling baseline's cells,
    :func:`~.pooling.pooling_plan`), and the temporal merge then runs on the pooled ``t x h' x w'`` raster, the two
    plans chained into one (``pooled.then(merged)``): pooling, then merging across frames. A merged token is the
    mean of every patch token it covers.

    Parameters
    ----------
    keep_ratio : float
        Fraction of a clip's tokens kept, in (0, 1]; never below one (pooled) frame's worth.
    pool : float
        Fraction of each frame's tokens the spatial pooling keeps before the temporal merge, in (0, 1]; 1 (default)
        pools nothing. With ``pool < 1``, ``keep_ratio`` (still a fraction of the clip's unpooled tokens) must be
        at most ``pool``: the merge then keeps ``keep_ratio / pool`` of the pooled tokens.

    Raises
    ------
    ValueError
        If ``keep_ratio`` or ``pool`` is outside (0, 1], or ``keep_ratio > pool < 1`` (the merge would keep every
        pooled token: that is plain ``pooling:keep_ratio=POOL``).
    UnsupportedModelError
        From ``apply`` on a model that is not LLaVA-style or Qwen2-VL.
    """

    pool: float = 1.0

    name: ClassVar[str] = "temporal-tome"
    paper: ClassVar[str] = "TDTM (On-device Sora, 2025) + ToMe (Bolya et al., 2023, arXiv 2210.09461)"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pool = check_keep_ratio(self.pool, "pool")
        if self.pool < 1.0 and self.keep_ratio > self.pool:
            raise ValueError(f"temporal-tome: keep_ratio={self.keep_ratio:g} is above pool={self.pool:g}, so the "
                             f"temporal merge would keep every pooled token; give keep_ratio <= pool (e.g. "
                             f"keep_ratio={self.pool / 2:g}), or use pooling:keep_ratio={self.pool:g} alone")

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        spatial = ImageGrid(grid.t, grid.h, grid.w)
        keep = kept_count(spatial.tokens, self.keep_ratio)
        if self.pool >= 1.0:
            return temporal_merge_plan(features, spatial, keep)
        per_frame = kept_count(grid.h * grid.w, self.pool)
        pooled = pooling_plan(spatial, per_frame, device=features.device)
        hp, wp = pooled_grid(grid.h, grid.w, per_frame)
        cells = pooled.merge(features[None])[0]  # [t * hp * wp, D], frame-major, cells in raster order
        return pooled.then(temporal_merge_plan(cells, ImageGrid(grid.t, hp, wp), keep))

    def _sequence_plan(self, pending: dict, embeds: torch.Tensor, state) -> TokenPlan:
        """The base's sequence plan over clips: consecutive same-size images of a row are planned as one clip."""
        grids = pending["grids"]
        if pending.get("kind", "image") == "image":
            grids = frame_grids(grids, pending["image_mask"].sum(dim=1).tolist())
        single = sum(g.t == 1 for g in grids)
        if single and self.keep_ratio < 1.0:
            warnings.warn(f"temporal-tome merges across the frames of a clip, and {single} of the {len(grids)} clips "
                          "of this prompt are single frames (still images): their tokens are all kept; for still "
                          "images use a spatial method (pooling, visionzip, prumerge, tome)", UserWarning,
                          stacklevel=2)
        plan = super()._sequence_plan({**pending, "grids": grids}, embeds, state)
        self.telemetry["frames"] = [g.t for g in grids]
        return plan
