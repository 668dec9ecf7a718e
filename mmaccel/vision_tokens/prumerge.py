"""PruMerge: keep the outliers (IQR) of the tower's attention ([CLS] or received), fill spatially, merge the pruned
tokens into them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import ImageGrid, kept_count
from .plan import TokenPlan
from .pre_llm import TowerScored

__all__ = ["PruMerge", "iqr_outliers", "prumerge_plan"]


def iqr_outliers(scores: torch.Tensor, k: float = 1.5) -> torch.Tensor:
    """[N] bool: scores above ``Q3 + k * IQR`` (Tukey's fence), PruMerge's adaptive selection."""
    q1, q3 = torch.quantile(scores.float(), torch.tensor([0.25, 0.75], device=scores.device))
    return scores.float() > q3 + k * (q3 - q1)


def prumerge_plan(dominance: torch.Tensor, keys: torch.Tensor, keep: int, fence: float = 1.5) -> TokenPlan:
    """Plan one image.

    Parameters
    ----------
    dominance : torch.Tensor
        [N] [CLS] -> patch attention (mean over heads), or on a tower without [CLS] the attention each patch receives
        (mean over heads and queries).
    keys : torch.Tensor
        [N, d] keys of the same layer (mean over heads).
    keep : int
        Output tokens, ``1 <= keep <= N``.
    fence : float
        IQR multiplier of the outlier fence.

    Returns
    -------
    TokenPlan
        Batch 1 over N. Kept: the IQR outliers, highest attention first, capped at ``keep``; then (PruMerge+)
        spatially uniform samples of the other tokens up to ``keep``. Every pruned token is merged into its most
        similar kept token (key cosine), weighted by its dominance.
    """
    N = dominance.shape[0]
    device = dominance.device
    if keep >= N:
        return TokenPlan.identity(1, N, device)
    outliers = iqr_outliers(dominance, fence)
    order = dominance.float().masked_fill(~outliers, float("-inf")).argsort(descending=True)
    chosen = order[: min(keep, int(outliers.sum()))]
    is_kept = torch.zeros(N, dtype=torch.bool, device=device)
    is_kept[chosen] = True
    need = keep - chosen.numel()
    if need > 0:
        rest = (~is_kept).nonzero().squeeze(1)
        pick = torch.linspace(0, rest.numel() - 1, need, device=device).round().long()
        is_kept[rest[pick]] = True
    kept = is_kept.nonzero().squeeze(1)
    pruned = (~is_kept).nonzero().squeeze(1)
    rep = torch.arange(N, device=device)
    metric = F.normalize(keys.float(), dim=-1)
    rep[pruned] = kept[(metric[pruned] @ metric[kept].T).argmax(dim=-1)]
    weight = dominance.float().clamp_min(1e-12)
    return TokenPlan.from_representatives(rep[None], weight[None])


@dataclass
class PruMerge(TowerScored):
    """LLaVA-PruMerge (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal
    Models", 2024, arXiv 2403.15388), between the projector and the LLM, with a fixed budget.

    Tokens whose [CLS] attention (at the layer LLaVA projects) lies above the IQR fence are kept first; PruMerge+'s
    spatially uniform samples fill the budget; every pruned token is merged into its most similar kept token (key
    cosine), weighted by its attention. Differences from the reference code: a fixed budget (``keep_ratio``) so
    that batches stay rectangular (the paper's count is adaptive: the outliers only); each pruned token joins one
    kept token (the paper's kept tokens each average their 32 nearest neighbours, which may overlap); merging is on
    the projected tokens.

    Without a [CLS] token (read from the tower's embeddings: SigLIP in LLaVA-OneVision, Qwen2-VL / Qwen2.5-VL), the
    attention a patch *receives*, averaged over heads and over all queries (:func:`~.adapters.received_attention`),
    takes the place of [CLS] attention, for the outliers and as merge weights: at the layer LLaVA projects, or in a
    Qwen2-VL tower at its last full-attention block (within each image), averaged over each merged 2 x 2 group.
    PruMerge's premise is that [CLS] attention is sparse with a few outliers; the same fence is applied to received
    attention unchanged (how heavy its tail is on real towers is not measured here). AnyRes crops are scored per
    crop and laid out by the model's own ``pack_image_features``.

    Parameters
    ----------
    keep_ratio : float
        Fraction of visual tokens kept, in (0, 1].
    fence : float
        IQR multiplier (1.5 in the paper).
    score : {"auto", "cls", "received"}
        Source of the dominance score (:class:`~.pre_llm.TowerScored`); ``"received"`` on a [CLS] tower compares
        the CLS-free score with [CLS] attention.

    Raises
    ------
    ValueError
        If ``score`` is not auto/cls/received, ``keep_ratio`` is outside (0, 1] or ``fence < 0``.
    UnsupportedModelError
        From ``apply`` on a model that is not a supported VLM (:class:`~.adapters.VLMParts`), or whose tower's
        scored layer cannot be found (a list ``vision_feature_layer``).
    """

    fence: float = 1.5

    name: ClassVar[str] = "prumerge"
    paper: ClassVar[str] = "Shang et al., 2024, arXiv 2403.15388"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.fence, bool) or not isinstance(self.fence, (int, float)) or self.fence < 0:
            raise ValueError(f"fence must be a number >= 0, got {self.fence!r}")

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        keep = kept_count(features.shape[0], self.keep_ratio)
        return prumerge_plan(info["dominance"], info["keys"], keep, self.fence)
