"""Pre-LLM reduction: plan each image's projected tokens, then hand the language model the reduced sequence.

:class:`ImageReducer` lifts the per-image plans of a subclass to one :class:`~.plan.TokenPlan` over the whole
sequence (:func:`lift_to_sequence`) and applies it at the entry of the language model to the embeddings, the position
ids (LLaVA's 1-D ids, Qwen2-VL's 3-D M-RoPE ids) and the attention mask, then keeps the 2-D mask of every later decode
step in line with the shorter cache. On fixed-grid LLaVA models the same plan is applied earlier, to the projected
features and the placeholder ids before ``LlavaModel`` merges them (:class:`PlacedFeatures`), so that no full-length
sequence is built: the language model's inputs are the same, the memory of the full-length merge is saved (1,024
video frames: see ``benchmarks/results/vision/video_peak_profile/``). The layouts, positions and batching are
described in :mod:`.base` and :mod:`.adapters`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .adapters import (
    SCORES,
    VLMParts,
    _attach_outer,
    _attach_tower_scores,
    _encode_media,
    _even_rows,
    _past_length,
    _RunState,
    _score_module,
)
from .base import ImageGrid, VisionTokenMethod, _hook
from .plan import TokenPlan

logger = logging.getLogger(__name__)

__all__ = ["POSITIONS", "ImageReducer", "PlacedFeatures", "TowerScored", "lift_to_sequence"]


def lift_to_sequence(image_mask: torch.Tensor, grids: list[ImageGrid], plans: list[TokenPlan],
                     attention_mask: torch.Tensor | None = None) -> TokenPlan:
    """Lift per-image plans to one plan over the whole sequence (text tokens are always kept).

    Parameters
    ----------
    image_mask : torch.Tensor
        [B, L] bool, the image placeholder tokens.
    grids : list of ImageGrid
        Every image (every grid of an AnyRes image) in order of appearance (row by row).
    plans : list of TokenPlan
        One batch-1 plan per grid over its ``grid.tokens`` tokens.
    attention_mask : torch.Tensor, optional
        [B, L] 2-D mask (0 = padding). If given and rows keep different numbers of tokens, they are evened out at
        the lowest count that dropping padding tokens (earliest first) reaches; rows below it take back dropped
        newline tokens of their ``ImageGrid.newline`` grids (earliest first; a row of kept tokens then ends with
        two newlines).

    Raises
    ------
    ValueError
        If rows end up with different token counts (and too little padding to even them out).
    """
    B, L = image_mask.shape
    device = image_mask.device
    rep = torch.arange(L, device=device).expand(B, L).clone()
    weight = torch.ones(B, L, device=device)
    newline = torch.zeros(B, L, dtype=torch.bool, device=device)
    has_weight = False
    k = 0
    for b in range(B):
        pos = image_mask[b].nonzero().squeeze(1)
        offset = 0
        while offset < pos.numel():
            grid, plan = grids[k], plans[k]
            seg = pos[offset: offset + grid.tokens]
            slot = plan.slot_of()[0]
            local_rep = plan.index[0]
            rep[b, seg] = torch.where(slot >= 0, seg[local_rep[slot.clamp(min=0)]], torch.full_like(slot, -1))
            newline[b, seg[grid.newline_index(device)]] = True
            if plan.weight is not None:
                weight[b, seg] = plan.weight[0].to(weight.dtype)
                has_weight = True
            offset += grid.tokens
            k += 1
    if attention_mask is not None:
        positions = torch.arange(L, device=device).expand(B, L)
        kept = rep == positions
        keep = _even_rows(kept, attention_mask == 0, spare=newline & (rep < 0))
        rep = torch.where(keep & ~kept, positions, rep)  # a newline taken back is its own token again
        rep = rep.masked_fill(kept & ~keep, -1)  # a dropped padding token represents nothing else
    return TokenPlan.from_representatives(rep, weight if has_weight else None)



def _compressed_lm_kwargs(state: _RunState, kwargs: dict) -> dict:
    """Decode step after a reduced prefill: keep the 2-D mask and default positions in line with the cache.

    Under contiguous positions (``state.scratch["position_shift"]``, [B, 1]: the prompt tokens each row dropped) the
    positions ``generate`` numbers over the full prompt are moved down by that shift, and default positions continue
    from the cache's length."""
    plan = state.plan
    embeds = kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    shift = state.scratch.get("position_shift")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= plan.length:
        kwargs["attention_mask"] = plan.extend_columns(mask)
    if kwargs.get("position_ids") is None and embeds is not None:
        past = _past_length(kwargs)
        q = embeds.shape[1]
        gap = 0 if shift is not None else plan.length - plan.num_kept
        kwargs["position_ids"] = (torch.arange(q, device=embeds.device) + past + gap)[None]
    elif shift is not None and kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"] - shift
    return kwargs


#: How a pre-LLM reduction numbers the tokens it keeps (``ImageReducer.positions``).
POSITIONS = ("original", "contiguous")


def _reduced_positions(method: ImageReducer, state: _RunState, plan: TokenPlan, positions: torch.Tensor,
                       kept_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of the reduced prompt: the kept tokens' original ones, or (``positions="contiguous"``) the
    kept tokens renumbered ``0, 1, ...`` over the attention mask as ``generate`` numbers a prompt (pads read 1), with
    each row's shift recorded for the decode steps (:func:`_compressed_lm_kwargs`).

    Parameters
    ----------
    positions : torch.Tensor
        [1 or B, L] position ids of the full prompt.
    kept_mask : torch.Tensor
        [B, K] attention mask of the reduced prompt.
    """
    kept = plan.take_positions(positions)
    if method.positions != "contiguous":
        state.scratch["position_shift"] = None
        return kept
    new = (kept_mask.long().cumsum(-1) - 1).masked_fill(kept_mask == 0, 1)
    state.scratch["position_shift"] = (kept[:, -1:] - new[:, -1:]).to(new.dtype)
    return new



# ------------------------------------------------------------------------------------------------ pre-LLM reduction
@dataclass
class ImageReducer(VisionTokenMethod):
    """Pre-LLM reduction: plan each image's projected tokens, then feed the LLM the reduced sequence.

    A subclass implements :meth:`plan_image`, called once per :class:`ImageGrid` (per image; per part of an AnyRes
    image) with that grid's ``t x h x w`` raster only; the base keeps the grid's prefix, suffix and newline tokens
    (see the module notes) and lifts the plans to the sequence. If it ranks tokens by the vision tower's attention
    it sets ``needs_tower_scores`` and receives, per raster token, ``dominance`` [N] and ``keys`` [N, d] (mean over
    heads) from :func:`~.adapters._attach_tower_scores`: the [CLS] -> patch attention of the layer LLaVA projects
    where the tower has a [CLS] token; else the attention each token receives, averaged over heads and queries
    (:func:`~.adapters.received_attention`), at that layer (SigLIP towers: LLaVA-OneVision) or, in a Qwen2-VL tower,
    at its last full-attention block within each image, averaged over each merged 2 x 2 group. AnyRes crops are
    scored per crop and laid out by the model's own ``pack_image_features``.

    Attributes
    ----------
    telemetry : dict
        ``tokens_before`` / ``tokens_after`` (one entry per grid, all its tokens), ``raster_before`` /
        ``raster_after`` (per grid, its ``t x h x w`` raster tokens only: what ``keep_ratio`` applies to),
        ``sequence_before`` /
        ``sequence_after``, ``kept_positions`` [B, K] (original positions of the tokens the LLM sees).
    """

    stage: ClassVar[str] = "pre-llm"
    needs_tower_scores: ClassVar[bool] = False
    #: On fixed-grid LLaVA models, reduce the projected features and the placeholder ids *before* ``LlavaModel``
    #: merges them (:func:`_attach_reduce_before_merge`), so that the full-length embeddings never exist; the
    #: language model receives the same inputs either way. ``False`` reduces at the language model's entry, as on
    #: AnyRes and Qwen2-VL models.
    reduce_before_merge: ClassVar[bool] = True
    #: ``"original"`` (default): kept tokens keep their original positions, as FastV's and ToMe's papers do, so a
    #: budget of 1.0 is the unmodified model and a reduced prompt spans as many positions as the full one.
    #: ``"contiguous"``: the reduced prompt is numbered ``0..K-1``, as VisionZip's and PruMerge's code (which hand the
    #: LLM the shorter embeddings) and LLaVA-OneVision's pooled video tokens are; this keeps a long video within the
    #: language model's trained positions (256 frames of ``smol-llava`` pooled to 9 tokens: 2,304 positions instead
    #: of 36,864). LLaVA-style models only (Qwen2-VL's M-RoPE positions are 3-D and read from the grid).
    positions: str = field(default="original", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        """Plan one image (one grid).

        Parameters
        ----------
        features : torch.Tensor
            [N, D] projected patch tokens of the ``grid.t x grid.h x grid.w`` raster (N = t*h*w, frame-major then
            raster order), without the grid's prefix, newline and suffix tokens.
        grid : ImageGrid
        info : dict
            ``image_index`` (order of appearance in the batch, counting images), ``grid_index`` (counting grids);
            ``dominance`` [N] and ``keys`` [N, d] (float32) when ``needs_tower_scores``.

        Returns
        -------
        TokenPlan
            Batch 1, over the N raster tokens.
        """
        raise NotImplementedError

    def supports(self, model: nn.Module) -> str | None:
        parts = VLMParts.find(model)
        if isinstance(parts, str):
            return parts
        if self.positions == "contiguous" and parts.kind not in ("llava", "anyres"):
            return "positions='contiguous' renumbers 1-D position ids (LLaVA-style models); Qwen2-VL's M-RoPE " \
                   "positions are 3-D: use positions='original'"
        if self.needs_tower_scores:
            reason = _score_module(parts, getattr(self, "score", "auto"))
            if isinstance(reason, str):
                return reason
        return None

    def _attach(self, model: nn.Module, undo: list) -> None:
        parts = VLMParts.find(model)
        state = _RunState()
        _attach_outer(parts, state, undo)
        if self.needs_tower_scores:
            _attach_tower_scores(parts, state, undo, getattr(self, "score", "auto"))

        def lm_pre(module, args, kwargs):
            embeds = kwargs.get("inputs_embeds")
            if state.pending is not None and embeds is not None:
                pending, state.pending = state.pending, None
                if _past_length(kwargs) != 0:
                    raise ValueError(f"{type(self).__name__}: an image prefill on a non-empty cache is not supported")
                mask = kwargs.get("attention_mask")
                if mask is None:  # an explicit all-ones mask: gapped positions must not read as packed sequences
                    mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
                if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
                    raise ValueError(f"{type(self).__name__} needs a 2-D attention mask (or none); got a prepared mask")
                plan = self._sequence_plan({**pending, "attention_mask": mask}, embeds, state)
                state.plan = plan
                # for an in-LLM method applied together with this one: which of the LLM's tokens are visual, padding
                module._mmaccel_visual_mask = plan.take(pending["image_mask"])
                kwargs["inputs_embeds"] = plan.merge(embeds)
                pos = kwargs.get("position_ids")
                if pos is None:
                    pos = torch.arange(embeds.shape[1], device=embeds.device)[None]
                kwargs["attention_mask"] = module._mmaccel_attention_mask = plan.take(mask)
                kwargs["position_ids"] = _reduced_positions(self, state, plan, pos, kwargs["attention_mask"])
            elif state.plan is not None and _past_length(kwargs) >= max(1, state.plan.num_kept):
                # a decode step; a forward on a shorter cache is a later piece of a chunked prefill of the reduced
                # prompt (its inputs are already reduced and numbered): left alone
                kwargs = _compressed_lm_kwargs(state, kwargs)
            return args, kwargs

        _hook(undo, parts.lm, lm_pre, pre=True)
        if parts.kind == "llava" and self.reduce_before_merge:
            _attach_reduce_before_merge(self, parts, state, undo)

        def forget():
            for name in ("_mmaccel_visual_mask", "_mmaccel_attention_mask"):
                if hasattr(parts.lm, name):
                    delattr(parts.lm, name)

        undo.append(forget)

    def _sequence_plan(self, pending: dict, embeds: torch.Tensor, state: _RunState) -> TokenPlan:
        image_mask, grids = pending["image_mask"], pending["grids"]
        plans, before, after, raster = [], [], [], []
        if self.needs_tower_scores:
            scores = state.tower_scores(grids, pending.get("kind", "image"))
        k, image = 0, -1
        for b in range(image_mask.shape[0]):
            pos = image_mask[b].nonzero().squeeze(1)
            offset = 0
            while offset < pos.numel():
                grid = grids[k]
                seg = pos[offset: offset + grid.tokens]
                image += int(grid.part == 0)
                feats = embeds[b, seg[grid.raster_index(seg.device)]]
                info = {"image_index": image, "grid_index": k}
                if self.needs_tower_scores:
                    info.update(dominance=scores[k][0], keys=scores[k][1])
                image_plan = self.plan_image(feats, grid, info)
                raster.append((image_plan.length, image_plan.num_kept))
                plans.append(_grid_plan(image_plan, grid))
                before.append(grid.tokens)
                after.append(plans[-1].num_kept)
                offset += grid.tokens
                k += 1
        plan = lift_to_sequence(image_mask, grids, plans, pending.get("attention_mask"))
        self._image_plans = plans
        self.telemetry = {"method": self.name, "stage": self.stage, "media": pending.get("kind", "image"),
                          "tokens_before": before, "tokens_after": after,
                          "raster_before": [n for n, _ in raster], "raster_after": [k for _, k in raster],
                          "sequence_before": plan.length, "sequence_after": plan.num_kept,
                          "kept_positions": plan.index.tolist()}
        logger.debug("%s: %d -> %d visual tokens", self.name, sum(before), sum(after))
        return plan


@dataclass
class TowerScored(ImageReducer):
    """A pre-LLM reduction that ranks each image's tokens by a dominance score from the vision tower
    (``info["dominance"]`` [N], ``info["keys"]`` [N, d]; see :class:`ImageReducer`).

    Parameters
    ----------
    score : {"auto", "cls", "received"}
        ``"auto"``: the [CLS] -> patch attention where the tower's embeddings hold a [CLS] token, else the attention
        each token receives, averaged over heads and queries (:func:`~.adapters.received_attention`); ``"cls"``
        refuses a tower without [CLS]; ``"received"`` uses received attention on any tower (to compare the two).

    Raises
    ------
    ValueError
        If ``score`` is not one of :data:`~.adapters.SCORES`.
    """

    needs_tower_scores: ClassVar[bool] = True
    score: str = field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")


class PlacedFeatures:
    """Projected image tokens in placeholder order, indexed like the [B, L, D] embeddings they would fill.

    ``LlavaModel`` scatters its image features (one [n_i, D] tensor per image, in order) into the placeholder
    positions of ``input_ids`` in row-major order. This object gives a method's planner the same view
    (``placed[b, positions]`` -> [n, D], the features at those sequence positions) and applies a sequence plan to the
    features alone (:meth:`reduce`), without building the [B, L, D] embeddings or concatenating the features: every
    temporary is one image's size.

    Parameters
    ----------
    image_mask : torch.Tensor
        [B, L] bool, the placeholder positions (N of them).
    features : torch.Tensor or list of torch.Tensor
        [N, D], [I, n, D], or a list of [n_i, D] (``pooler_output``), in placeholder order.

    Raises
    ------
    ValueError
        If the mask holds a different number of placeholders than there are feature rows.
    """

    def __init__(self, image_mask: torch.Tensor, features: Any):
        if isinstance(features, torch.Tensor):
            features = [features.reshape(-1, features.shape[-1])]
        self.parts = [f.reshape(-1, f.shape[-1]) for f in features]
        sizes = torch.tensor([0] + [f.shape[0] for f in self.parts], device=image_mask.device)
        self.offsets = sizes.cumsum(0)
        n = int(image_mask.sum())
        if n != int(self.offsets[-1]):
            raise ValueError(f"the ids hold {n} image placeholders but the encoder gave {int(self.offsets[-1])} tokens")
        self.image_mask = image_mask
        self.row = torch.full(image_mask.shape, -1, dtype=torch.long, device=image_mask.device)
        self.row[image_mask] = torch.arange(n, device=image_mask.device)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Feature rows ``rows`` ([r] long) -> [r, D], gathered from the images that hold them."""
        part = torch.searchsorted(self.offsets[1:], rows, right=True)
        first = self.parts[0]
        out = first.new_empty((rows.shape[0], first.shape[-1]))
        for p in part.unique().tolist():
            sel = part == p
            out[sel] = self.parts[p][(rows[sel] - self.offsets[p]).to(first.device)]
        return out

    def __getitem__(self, key: tuple[int, torch.Tensor]) -> torch.Tensor:
        b, positions = key
        return self.rows(self.row[b, positions])

    def reduce(self, plan: TokenPlan) -> torch.Tensor:
        """The image tokens the language model sees under ``plan`` (a [B, L] sequence plan whose merges stay within
        image spans): [K_img, D], in the row-major order of the kept placeholders, equal bit for bit to
        ``plan.merge(embeds)`` at those positions (a kept token is its own row; a merged one the weighted mean of its
        sources, summed in the same order)."""
        slot = plan.slot_of()
        representative = torch.where(slot >= 0, plan.index.gather(1, slot.clamp(min=0)), -1)
        rep_rows = torch.where(representative >= 0, self.row.gather(1, representative.clamp(min=0)), -1)
        weight = None if plan.weight is None else plan.weight[self.image_mask][None]
        image_plan = TokenPlan.from_representatives(rep_rows[self.image_mask][None], weight)
        first = self.parts[0]
        merged = image_plan.sources()[0] > 1
        out = self.rows(image_plan.index[0])
        if not bool(merged.any()):
            return out
        assign = image_plan.slot_of()[0]
        w = torch.ones(assign.shape, dtype=first.dtype, device=first.device) if weight is None else \
            weight[0].to(first.device, first.dtype)
        num = torch.zeros_like(out)
        den = torch.zeros(out.shape[0], dtype=first.dtype, device=first.device)
        for p, part in enumerate(self.parts):
            a = assign[int(self.offsets[p]): int(self.offsets[p + 1])].to(first.device)
            take = (a >= 0) & merged[a.clamp(min=0)]
            if bool(take.any()):
                ww = w[int(self.offsets[p]): int(self.offsets[p + 1])][take]
                num.index_add_(0, a[take], part[take] * ww[:, None])
                den.index_add_(0, a[take], ww)
        mean = num / den.clamp_min(torch.finfo(first.dtype).tiny)[:, None]
        return torch.where(merged[:, None], mean, out)


def _attach_reduce_before_merge(method: ImageReducer, parts: VLMParts, state: _RunState, undo: list) -> None:
    """Fixed-grid LLaVA: apply the method's plan to the projected features and the ids before ``LlavaModel`` merges
    them.

    A pre-hook on ``LlavaModel`` (after the layout hook of :func:`_attach_outer`) takes an image prefill given as
    ``input_ids``, encodes its pixels (or takes what ``generate`` encoded, ``mm_encoder_outputs``), plans every image
    on its projected tokens, replaces ``pooler_output`` by the kept (merged) tokens -- by item assignment, so that
    ``generate``'s reference to it lets the full features go too -- and passes the kept ids, positions and mask on.
    ``LlavaModel`` then embeds and fills the short sequence only, so the full-length embeddings, the full features
    and their concatenation (about 1 GB for 1,024 frames of ``smol-llava``) are never alive while the language model
    runs. The language model's inputs are those of the late path (reduction at its entry) bit for bit. Prefills given
    as ``inputs_embeds``, or with positional arguments, take the late path.
    """

    def pre(module, args, kwargs):
        pending = state.pending
        input_ids = kwargs.get("input_ids")
        if pending is None or args or input_ids is None or kwargs.get("inputs_embeds") is not None \
                or _past_length(kwargs) != 0:
            return args, kwargs
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(input_ids.shape, dtype=torch.long, device=input_ids.device)
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return args, kwargs  # the late path raises its error
        kind = pending["kind"]
        if kwargs.get("pixel_values") is not None:
            kwargs = _encode_media(parts, kwargs, kind)
        encoded = kwargs["mm_encoder_outputs"][kind]
        placed = PlacedFeatures(pending["image_mask"], encoded.pooler_output)
        plan = method._sequence_plan({**pending, "attention_mask": mask}, placed, state)
        encoded["pooler_output"] = [placed.reduce(plan)]
        del placed
        state.pending, state.plan = None, plan
        parts.lm._mmaccel_visual_mask = plan.take(pending["image_mask"])
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        kept_mask = parts.lm._mmaccel_attention_mask = plan.take(mask)
        kwargs = {**kwargs, "input_ids": plan.take(input_ids), "attention_mask": kept_mask,
                  "position_ids": _reduced_positions(method, state, plan, positions, kept_mask)}
        return args, kwargs

    _hook(undo, parts.inner, pre, pre=True)



def _grid_plan(plan: TokenPlan, grid: ImageGrid) -> TokenPlan:
    """Place a batch-1 plan over a grid's ``t*h*w`` raster into the grid's whole span (``grid.tokens``).

    Prefix and suffix tokens are kept; a row's newline token is kept iff a kept token (a representative) lies in
    that row, so the reduced span reads as rows of kept tokens, each closed by its newline. Merge weights of the
    added tokens are 1.
    """
    if grid.tokens == plan.length:
        return plan
    device = plan.index.device
    raster = grid.raster_index(device)
    slot, local_rep = plan.slot_of()[0], plan.index[0]
    rep = torch.arange(grid.tokens, device=device)  # prefix, suffix (and newlines, decided below) stay
    rep[raster] = torch.where(slot >= 0, raster[local_rep[slot.clamp(min=0)]], torch.full_like(slot, -1))
    if grid.newline:
        row_kept = torch.zeros(grid.t * grid.h, dtype=torch.bool, device=device)
        row_kept[local_rep // grid.w] = True
        newlines = grid.newline_index(device)
        rep[newlines] = torch.where(row_kept, newlines, torch.full_like(newlines, -1))
    weight = None
    if plan.weight is not None:
        weight = torch.ones(grid.tokens, device=device, dtype=plan.weight.dtype)
        weight[raster] = plan.weight[0]
        weight = weight[None]
    return TokenPlan.from_representatives(rep[None], weight)


def _with_prefix(plan: TokenPlan, prefix: int) -> TokenPlan:
    """Prepend ``prefix`` always-kept tokens to a batch-1 plan."""
    return _grid_plan(plan, ImageGrid(1, 1, plan.length, prefix))

