"""AIM: iterative similarity merging of the projected visual tokens before the LLM, then optional progressive
pruning inside it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .base import ImageGrid, check_keep_ratio, kept_count
from .fastv import FastV
from .plan import TokenPlan
from .pre_llm import ImageReducer
from .progressive import Progressive
from .tome import bipartite_soft_matching

__all__ = ["AIM", "iterative_merge_plan"]


def iterative_merge_plan(features: torch.Tensor, keep: int) -> TokenPlan:
    """Merge the most similar tokens, round after round, until ``keep`` are left (AIM's pre-LLM merging).

    Every round is ToMe's bipartite soft matching (:func:`~.tome.bipartite_soft_matching`: tokens at even positions
    merge into their most similar token at an odd position, cosine of the current embeddings, strongest pairs
    first), removing ``min(excess, N // 2)`` tokens; merged embeddings are size-weighted averages, which are then
    the next round's metric.

    Parameters
    ----------
    features : torch.Tensor
        [N, D] tokens (one frame's projected visual tokens).
    keep : int
        Output tokens, ``1 <= keep <= N``.

    Returns
    -------
    TokenPlan
        Batch 1 over N with ``keep`` outputs and no weights: an output token is the plain mean of the tokens it
        holds, which is what the size-weighted rounds compute. Each output keeps the position of its
        representative (the odd-position token everything merged into).
    """
    n = features.shape[0]
    plan = TokenPlan.identity(1, n, features.device)
    x = features[None].float()
    size = torch.ones(1, n, device=features.device)
    while x.shape[1] > keep:
        step = bipartite_soft_matching(x, x.shape[1] - keep)
        x, size = step.merge(x, size), step.merge_weights(size)
        plan = plan.then(step)
    return plan


@dataclass
class AIM(ImageReducer):
    """AIM (Zhong et al., "AIM: Adaptive Inference of Multi-Modal LLMs via Token Merging and Pruning", 2024,
    arXiv 2412.03248), training-free.

    (a) Before the LLM, each image's (each video frame's) projected tokens are merged by embedding similarity,
    round after round (:func:`iterative_merge_plan`), until ``keep_ratio`` of them are left; a merged token is the
    mean of its patches and takes one of their positions. (b) Optionally, inside the LLM, the merged tokens are
    pruned progressively at ``layers`` (:class:`~.progressive.Progressive` over :class:`~.fastv.FastV` scoring by the
    attention of the last ``window`` queries), down to ``prune_keep_ratio`` of them after the last layer.

    Differences from the paper, on purpose: the in-LLM importance is the last queries' attention (observation-window
    scores, so the model runs under SDPA), not PageRank over the full attention matrix; the schedule is the
    geometric one of :class:`~.progressive.Progressive` at the given layers, not a piecewise-linear one at every
    layer. As in the paper, video frames are merged within each frame, never across frames.

    Parameters
    ----------
    keep_ratio : float
        Fraction of each image's (frame's) visual tokens left after merging, in (0, 1].
    layers : str or list of int, optional
        Decoder layers that prune, strictly increasing, each >= 1 (e.g. ``"2,8"``); ``None`` (default) = merging
        only.
    prune_keep_ratio : float, optional
        Fraction of the merged tokens left after the last pruning layer, in (0, 1] (default: ``keep_ratio``, so that
        ``keep_ratio=1.0`` leaves the model unchanged).
    window : int
        Number of last queries whose attention scores the in-LLM pruning, >= 1 (default 8).

    Attributes
    ----------
    pruner : Progressive or None
        The in-LLM part; ``telemetry["in_llm"]`` is its telemetry (set as the pruning layers run).
    telemetry : dict
        The pre-LLM keys (``tokens_before`` / ``tokens_after`` per image, ``sequence_before`` / ``sequence_after``,
        ``kept_positions``), plus ``in_llm`` when ``layers`` is set.

    Raises
    ------
    ValueError
        If ``keep_ratio`` or ``prune_keep_ratio`` is outside (0, 1], ``layers`` is not strictly increasing, or
        ``window < 1``.
    UnsupportedModelError
        From ``apply`` on a model that is not LLaVA-style or Qwen2-VL, or a pruning layer outside the model.
    """

    layers: str | list | None = None
    prune_keep_ratio: float | None = None
    window: int = 8
    pruner: Any = field(default=None, init=False, repr=False, compare=False)

    name: ClassVar[str] = "aim"
    paper: ClassVar[str] = "Zhong et al., 2024, arXiv 2412.03248"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prune_keep_ratio is not None:
            self.prune_keep_ratio = check_keep_ratio(self.prune_keep_ratio, "prune_keep_ratio")
        scorer = FastV(window=self.window)  # checks window
        if self.layers is not None:
            self.pruner = Progressive(scorer, layers=self.layers, keep_ratio=self.prune_keep_ratio or self.keep_ratio)
            self.pruner.on_telemetry = self._file_in_llm
            self.layers = self.pruner.layers

    def supports(self, model: nn.Module) -> str | None:
        reason = super().supports(model)
        if reason is None and self.pruner is not None:
            reason = self.pruner.supports(model)
        return reason

    def _attach(self, model: nn.Module, undo: list) -> None:
        super()._attach(model, undo)
        if self.pruner is not None:
            self.pruner._attach(model, undo)

    def _file_in_llm(self, telemetry: dict) -> None:
        """The in-LLM part's telemetry after each pruning layer, under ``telemetry["in_llm"]``."""
        self.telemetry["in_llm"] = telemetry

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        hw = grid.h * grid.w
        keep = kept_count(hw, self.keep_ratio)
        if keep >= hw:
            return TokenPlan.identity(1, features.shape[0], features.device)
        reps = []
        for f in range(grid.t):  # merge within each frame (AIM: never across frames)
            plan = iterative_merge_plan(features[f * hw: (f + 1) * hw], keep)
            reps.append(plan.index[0][plan.slot_of()[0]] + f * hw)
        return TokenPlan.from_representatives(torch.cat(reps)[None])
