"""ATP: an instance-adaptive visual-token budget inside the LLM, by cumulative attention mass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..kernels import attention_column_scores
from .base import ImageGrid, check_keep_ratio, kept_count
from .in_llm import LayerPruner
from .plan import TokenPlan

__all__ = ["ATP", "adaptive_keep", "image_segments", "mass_count"]


def mass_count(scores: torch.Tensor, mass: float) -> int:
    """The size of the smallest set of tokens whose scores sum to at least ``mass`` of the total.

    Parameters
    ----------
    scores : torch.Tensor
        [N] non-negative importance (attention probabilities).
    mass : float
        In (0, 1]; 1.0 keeps every token (whatever the float sums do).

    Returns
    -------
    int
        In ``[1, N]`` (``N`` for ``mass >= 1``; 1 when every score is 0).
    """
    n = scores.numel()
    if mass >= 1.0 or n == 0:
        return n
    cum = scores.float().clamp_min(0).sort(descending=True).values.cumsum(0)
    return min(n, int((cum < mass * cum[-1]).sum()) + 1)


def image_segments(image_mask: torch.Tensor, grids: list[ImageGrid] | None = None) -> torch.Tensor:
    """[B, L] long: the image number of every visual token (``-1`` for text).

    Parameters
    ----------
    image_mask : torch.Tensor
        [B, L] bool, the visual tokens.
    grids : list of ImageGrid, optional
        Every image in order of appearance (row by row), when ``image_mask`` is the prompt's own mask; then each
        image is its own segment (the grids of one image, a ``part`` 0 grid and the ones after it, are one). Without grids (or if they do not cover the mask exactly), each row's visual tokens
        are one segment (numbered by row).
    """
    B = image_mask.shape[0]
    rows = torch.arange(B, device=image_mask.device)[:, None].expand_as(image_mask)
    segments = torch.where(image_mask, rows, torch.full_like(rows, -1))
    if not grids or sum(g.tokens for g in grids) != int(image_mask.sum()):
        return segments
    sizes = torch.tensor([g.tokens for g in grids], device=image_mask.device)
    # an image is one grid, or several whose first has part 0 (a base image and its AnyRes crops)
    image_of_grid = torch.tensor([int(getattr(g, "part", 0) == 0) for g in grids], device=image_mask.device).cumsum(0)
    # the visual tokens in reading order (row by row) are the images' tokens one image after the other
    segments[image_mask] = torch.repeat_interleave(image_of_grid - 1, sizes)
    return segments


def adaptive_keep(scores: torch.Tensor, segments: torch.Tensor, mass: float, keep_ratio: float = 1.0,
                  min_keep_ratio: float = 0.0) -> tuple[torch.Tensor, list[int]]:
    """ATP's rule: per image, the smallest set of its tokens holding ``mass`` of its importance, within the bounds.

    Parameters
    ----------
    scores : torch.Tensor
        [B, L] importance of every token (higher = keep).
    segments : torch.Tensor
        [B, L] long, the image of every visual token, ``-1`` for text (always kept), e.g. from
        :func:`image_segments`.
    mass : float
        In (0, 1]: fraction of an image's total score its kept tokens must hold.
    keep_ratio : float
        The cap: at most ``kept_count(n, keep_ratio)`` of an image's ``n`` tokens.
    min_keep_ratio : float
        The floor: at least ``kept_count(n, min_keep_ratio)`` (0 = at least one). The cap wins over the floor.

    Returns
    -------
    keep : torch.Tensor
        [B, L] bool. Rows keep the same number of tokens (a plan is rectangular): a row that needs fewer than the
        row that needs most also keeps its next most important visual tokens.
    needed : list of int
        Per image (segment order), the count the rule chose, before the rows were evened out.
    """
    keep = segments < 0
    needed = []
    for k in range(int(segments.max()) + 1 if segments.numel() else 0):
        rows, cols = (segments == k).nonzero(as_tuple=True)
        s = scores[rows, cols].float()
        n = s.numel()
        count = max(mass_count(s, mass), kept_count(n, min_keep_ratio) if min_keep_ratio > 0 else 1)
        count = min(count, kept_count(n, keep_ratio))
        top = s.topk(count).indices
        keep[rows[top], cols[top]] = True
        needed.append(count)
    visual = segments >= 0
    counts = (keep & visual).sum(dim=1)
    for b in range(keep.shape[0]):
        extra = int(counts.max() - counts[b])
        if extra > int((visual[b] & ~keep[b]).sum()):
            raise ValueError(f"ATP: rows hold different numbers of visual tokens {visual.sum(dim=1).tolist()}, so "
                             "they cannot keep the same number; run the prompts one at a time")
        if extra:
            rest = scores[b].float().masked_fill(keep[b] | ~visual[b], float("-inf"))
            keep[b, rest.topk(extra).indices] = True
    return keep, needed


@dataclass
class ATP(LayerPruner):
    """Instance-adaptive in-LLM pruning after ATP-LLaVA (Ye et al., "ATP-LLaVA: Adaptive Token Pruning for Large
    Vision Language Models", 2024, arXiv 2412.00447), training-free.

    At decoder layer ``layer`` (K) every image keeps the smallest set of its tokens whose importance -- the attention
    they get at layer K - 1 from the last ``window`` queries (summed, averaged over heads, as FastV, under SDPA) --
    reaches ``mass`` of the image's total, clamped to ``[min_keep_ratio, keep_ratio]`` of its tokens. The budget is
    thus per image (instance-adaptive); wrap it in :class:`~.progressive.Progressive` for a per-layer one
    (``Progressive(ATP(mass=0.9), layers=[2, 8])``: every stage applies the rule to what is left). Text tokens are
    always kept and kept tokens keep their original positions.

    Differences from ATP-LLaVA, on purpose: its learned importance scores and thresholds become the training-free
    cumulative-mass rule; its Spatial Augmented Pruning (extra spatially uniform tokens) is not included.

    Parameters
    ----------
    keep_ratio : float
        The cap, in (0, 1]: an image keeps at most this fraction of its tokens (1.0 = no cap). Unlike the other
        methods, ``keep_ratio=1.0`` alone does not leave the model unchanged; with ``mass=1.0`` too it does.
    layer : int
        K, in ``[1, num_layers - 1]``.
    mass : float
        Fraction of an image's attention mass its kept tokens hold, in (0, 1] (default 0.9; 1.0 keeps every token).
    min_keep_ratio : float
        The floor, in (0, 1]: an image keeps at least this fraction of its tokens (default 0.1). Where it exceeds
        ``keep_ratio``, the cap wins.
    window : int
        Number of last queries whose attention is summed, >= 1 (default 8: the tail of the prompt, i.e. the text).

    Attributes
    ----------
    telemetry : dict
        FastV's keys (``image_tokens_before`` / ``image_tokens_after`` of a row, ``sequence_before`` /
        ``sequence_after``, ``kept_positions``) plus, per image: ``tokens_before``, ``tokens_needed`` (the rule's
        count) and ``tokens_after`` (kept, after the rows are evened out), and ``mass``.

    Raises
    ------
    ValueError
        If ``keep_ratio``, ``mass`` or ``min_keep_ratio`` is outside (0, 1] or ``window < 1``; at run time if rows
        hold different numbers of image tokens.
    UnsupportedModelError
        From ``apply`` on a model that is not LLaVA-style or Qwen2-VL, or a ``layer`` outside the model.

    Notes
    -----
    Per image means per image of the prompt when the layer sees the prompt's own visual tokens; after a pre-LLM
    method or an earlier :class:`~.progressive.Progressive` stage the images are no longer told apart, and each
    row's visual tokens are one group. Rows of a batch keep the same number of tokens (the reduced KV cache is
    rectangular): a row that needs fewer keeps its next most important tokens up to the largest row's count, and
    ``tokens_needed`` records what the rule asked for.
    """

    layer: int = 2
    mass: float = 0.9
    min_keep_ratio: float = 0.1
    window: int = 8
    _scores: Any = field(default=None, init=False, repr=False, compare=False)

    name: ClassVar[str] = "atp"
    paper: ClassVar[str] = "Ye et al., 2024, arXiv 2412.00447 (training-free analogue)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.mass, bool) or not isinstance(self.mass, (int, float)) or not 0.0 < float(self.mass) <= 1.0:
            raise ValueError(f"mass must be in (0, 1] (the fraction of an image's attention its kept tokens hold, "
                             f"e.g. 0.9), got {self.mass!r}")
        self.min_keep_ratio = check_keep_ratio(self.min_keep_ratio, "min_keep_ratio")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, L] float32: attention each key gets from the last ``window`` queries, summed, averaged over heads."""
        self._scores = attention_column_scores(queries, keys, causal=True, reduce="sum").mean(dim=1)
        return self._scores

    def _build_plan(self, attn: nn.Module, state) -> TokenPlan:
        # the base scores the sequence and checks it (keeping everything at keep_ratio 1.0); the budget is ours
        cap, self.keep_ratio = self.keep_ratio, 1.0
        try:
            super()._build_plan(attn, state)
        finally:
            self.keep_ratio = cap
        scores, self._scores = self._scores, None
        image_mask, grids = state.scratch["image_mask"], state.scratch.get("grids")
        if image_mask.shape[1] != scores.shape[1]:  # a pre-LLM method ran first: its record, as the base reads it
            image_mask, grids = state.scratch["lm"]._mmaccel_visual_mask, None
        segments = image_segments(image_mask, grids)
        keep, needed = adaptive_keep(scores, segments, self.mass, cap, self.min_keep_ratio)
        plan = TokenPlan.from_keep(keep)
        n_images, rows = len(needed), (keep & image_mask).sum(dim=1).tolist()
        self.telemetry.update({
            "mass": self.mass, "image_tokens_after": rows[0] if rows else 0, "rows_image_tokens_after": rows,
            "sequence_after": plan.num_kept, "kept_positions": plan.index.tolist(),
            "tokens_before": [int((segments == k).sum()) for k in range(n_images)], "tokens_needed": needed,
            "tokens_after": [int(((segments == k) & keep).sum()) for k in range(n_images)]})
        return plan
