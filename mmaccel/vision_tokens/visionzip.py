"""VisionZip: dominant tokens by the tower's attention ([CLS] or received) plus contextual merging, between
projector and LLM."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import ImageGrid, kept_count
from .plan import TokenPlan
from .pre_llm import TowerScored

__all__ = ["VisionZip", "visionzip_plan"]


def visionzip_plan(dominance: torch.Tensor, keys: torch.Tensor, keep: int, contextual: int) -> TokenPlan:
    """Plan one image: ``keep - contextual`` dominant tokens plus ``contextual`` merged context tokens.

    Parameters
    ----------
    dominance : torch.Tensor
        [N] dominance score, higher = kept first: the attention each patch gets from [CLS] (mean over heads), or
        on a tower without [CLS] the attention it receives, averaged over heads and queries.
    keys : torch.Tensor
        [N, d] keys of the same layer (mean over heads), the similarity metric.
    keep : int
        Output tokens, ``1 <= keep <= N``.
    contextual : int
        How many of them are contextual, ``0 <= contextual < keep``.

    Returns
    -------
    TokenPlan
        Batch 1 over N: dominant tokens kept as they are; the remaining tokens are split into ``contextual``
        uniformly strided targets, every other remaining token is assigned to its most similar target (key cosine)
        and each target becomes the average of itself and its assigned tokens. Everything else is dropped.
    """
    N = dominance.shape[0]
    device = dominance.device
    if keep >= N:
        return TokenPlan.identity(1, N, device)
    dominant = dominance.topk(keep - contextual).indices
    rep = torch.full((N,), -1, dtype=torch.long, device=device)
    rep[dominant] = dominant
    if contextual > 0:
        is_rest = torch.ones(N, dtype=torch.bool, device=device)
        is_rest[dominant] = False
        rest = is_rest.nonzero().squeeze(1)  # ascending
        step = max(1, rest.numel() // contextual)
        target_pos = torch.arange(0, rest.numel(), step, device=device)[:contextual]
        targets = rest[target_pos]
        is_target = torch.zeros(N, dtype=torch.bool, device=device)
        is_target[targets] = True
        others = rest[~is_target[rest]]
        rep[targets] = targets
        if others.numel():
            metric = F.normalize(keys.float(), dim=-1)
            choice = (metric[others] @ metric[targets].T).argmax(dim=-1)
            rep[others] = targets[choice]
    return TokenPlan.from_representatives(rep[None])


@dataclass
class VisionZip(TowerScored):
    """VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models", 2024,
    arXiv 2412.04467), between the projector and the LLM.

    Dominant tokens are the patches with the most [CLS] attention at the layer LLaVA projects
    (``vision_feature_layer``); the rest are merged into a few uniformly strided contextual tokens by key
    similarity. Text-agnostic. The scores come from that layer's own q/k projections (one extra [CLS] query), so the
    tower runs under SDPA.

    Without a [CLS] token (read from the tower's embeddings: SigLIP in LLaVA-OneVision, Qwen2-VL / Qwen2.5-VL), the
    dominance of a patch is the attention it *receives*, averaged over heads and over all queries
    (:func:`~.adapters.received_attention`), at the layer LLaVA projects, or in a Qwen2-VL tower at its last
    full-attention block (within each image), averaged over each merged 2 x 2 group. VisionZip's own motivation is
    that attention concentrates on a few tokens that every query reads; the column mean measures that directly.
    AnyRes images (LLaVA-NeXT, OneVision) are scored per crop and the scores are laid out like the crops' tokens by
    the model's own ``pack_image_features``; base image and crops are planned as separate grids.

    Differences from the reference code, on purpose: the merge is applied to the *projected* tokens (the issue's
    "between projector and LLM"), not to the tower's features before the projector; a contextual token is the plain
    average of its target and assigned tokens (VisionZip adds the target to the mean of the others).

    Parameters
    ----------
    keep_ratio : float
        Fraction of visual tokens kept, in (0, 1]. VisionZip's 64 of 576 is ``keep_ratio=0.111``.
    contextual_ratio : float
        Share of the kept tokens that are contextual, in [0, 1) (VisionZip's default is 10 of 64).
    score : {"auto", "cls", "received"}
        Source of the dominance score (:class:`~.pre_llm.TowerScored`); ``"received"`` on a [CLS] tower compares
        the CLS-free score with [CLS] attention.

    Raises
    ------
    ValueError
        If ``score`` is not auto/cls/received, ``keep_ratio`` is outside (0, 1] or ``contextual_ratio`` outside [0, 1).
    UnsupportedModelError
        From ``apply`` on a model that is not a supported VLM (:class:`~.adapters.VLMParts`), or whose tower's
        scored layer cannot be found (a list ``vision_feature_layer``).
    """

    contextual_ratio: float = 10 / 64

    name: ClassVar[str] = "visionzip"
    paper: ClassVar[str] = "Yang et al., 2024, arXiv 2412.04467"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.contextual_ratio, bool) or not isinstance(self.contextual_ratio, (int, float)) \
                or not 0.0 <= float(self.contextual_ratio) < 1.0:
            raise ValueError(f"contextual_ratio must be in [0, 1), got {self.contextual_ratio!r}")

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        n = features.shape[0]
        keep = kept_count(n, self.keep_ratio)
        contextual = min(keep - 1, round(keep * self.contextual_ratio))
        return visionzip_plan(info["dominance"], info["keys"], keep, contextual)
