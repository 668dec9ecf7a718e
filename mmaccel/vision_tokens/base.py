"""Shared mechanics of the visual-token methods: the method contract, the model adapters and the hooks.

A method is a small dataclass that says only what is new about it (how it picks or merges tokens); everything that
touches a transformers model lives here once:

- :class:`VisionTokenMethod` -- ``keep_ratio`` in (0, 1] and ``apply(model)``, a context manager that attaches
  per-instance forward hooks (or swaps ``__class__`` on one instance's modules, as ToMe does) and removes them on exit.
  Nothing is patched at class level.
- :class:`VLMParts` -- finds the language model, the vision tower and the image placeholder id of a LLaVA-style
  (``LlavaForConditionalGeneration``) or Qwen2-VL-style (``Qwen2VLForConditionalGeneration``) model from its config
  attributes and submodules, not from its name.
- :class:`ImageReducer` -- pre-LLM reduction (between projector and LLM). A subclass plans each image
  (:meth:`ImageReducer.plan_image`); the base lifts the per-image plans to one :class:`~.plan.TokenPlan` over the
  whole sequence and applies it at the entry of the language model to the embeddings, the position ids (LLaVA's
  1-D ids, Qwen2-VL's 3-D M-RoPE ids) and the attention mask, then keeps the 2-D mask of every later decode step in
  line with the shorter cache.
- :class:`LayerPruner` -- in-LLM pruning at decoder layer ``K``: layers ``>= K`` see the reduced sequence; their
  rotary tables, position ids and 4-D masks are reduced by the same plan, at prefill and at every decode step.

Positions. Kept tokens keep their original positions: ``generate`` passes the original ``position_ids`` (or, for
Qwen2-VL, the 4-row text + M-RoPE ids) and every plan gathers them, never renumbers them. A forward without
``position_ids`` on a reduced cache gets ``arange(q) + past + (L - K)``, i.e. the original positions too (Qwen2-VL
derives its own ids before the language model and needs ``generate``'s ids after a reduction).

Batch > 1 works: rows are reduced independently but must keep the same number of tokens (the same number of images
per row, as LLaVA's processor produces); left padding is carried by the 2-D mask.

Composition: a pre-LLM and an in-LLM method can be applied together (``with Pooling(...).apply(m), FastV(...).apply(m)``
in either order); the in-LLM method then prunes among the visual tokens the pre-LLM one kept. Two methods of the same
stage on one model are not supported.

Outputs: a forward under a reduction returns hidden states / logits for the kept positions only (``generate`` reads
the last one); ``method.telemetry["kept_positions"]`` maps them back to the prompt.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .plan import TokenPlan

logger = logging.getLogger(__name__)

__all__ = [
    "ImageGrid",
    "ImageReducer",
    "LayerPruner",
    "UnsupportedModelError",
    "VLMParts",
    "VisionTokenMethod",
    "check_keep_ratio",
    "kept_count",
    "lift_to_sequence",
    "vit_layers",
]


class UnsupportedModelError(ValueError):
    """A method was applied to a model class it does not support (the message names the class and what is)."""


def check_keep_ratio(value: Any, name: str = "keep_ratio") -> float:
    """Validate a kept fraction of visual tokens.

    Raises
    ------
    ValueError
        If ``value`` is not a real number in (0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1] (the fraction of visual tokens kept), got {value!r}")
    return float(value)


def kept_count(n: int, keep_ratio: float) -> int:
    """Tokens kept out of ``n`` at ``keep_ratio``: ``round(keep_ratio * n)``, at least 1, exactly ``n`` at 1.0."""
    return n if keep_ratio >= 1.0 else max(1, min(n, round(keep_ratio * n)))


# ------------------------------------------------------------------------------------------------------ the contract
@dataclass
class VisionTokenMethod:
    """Base of every visual-token method: a budget and a reversible attachment to one model instance.

    Parameters
    ----------
    keep_ratio : float
        Fraction of visual tokens kept, in (0, 1]. At 1.0 every method leaves the model's outputs unchanged.

    Attributes
    ----------
    telemetry : dict
        What the last forward did (tokens before/after, kept indices...), for run records.

    Raises
    ------
    ValueError
        If ``keep_ratio`` is outside (0, 1].
    UnsupportedModelError
        From :meth:`apply`, if the model's class is not one the method supports.
    """

    keep_ratio: float = 1.0
    telemetry: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _image_plans: list = field(default_factory=list, init=False, repr=False, compare=False)

    name: ClassVar[str] = ""
    stage: ClassVar[str] = ""  # "vision" (inside the tower), "pre-llm", "in-llm"
    paper: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.keep_ratio = check_keep_ratio(self.keep_ratio)

    def supports(self, model: nn.Module) -> str | None:
        """``None`` if the method can run on ``model``, else the reason it cannot."""
        raise NotImplementedError

    def source_map(self) -> list[TokenPlan]:
        """The final token -> patch assignment of the last forward: one batch-1 plan per image (or video).

        Returns
        -------
        list of TokenPlan
            In the order the forward saw the images. Each plan is over that image's tokens as the method saw them:
            leading non-spatial tokens first ([CLS] and registers inside a tower, a kept [CLS] of LLaVA's ``"full"``
            strategy), then the ``t x h x w`` patch raster. ``plan.slot_of()[0]`` [L] is the output token of every
            input token (``-1`` = pruned), ``plan.index[0]`` [K] the representatives, ``plan.sources()[0]`` [K] how
            many input tokens each output token holds. In-tower merging (ToMe) gives its source map (``last_source``,
            one row per image); pre-LLM methods (:class:`ImageReducer`) their per-image plans. Empty before the first
            forward, after an in-tower forward that merged nothing (every token is its own output), and for in-LLM
            methods, which prune the whole sequence (read ``telemetry["kept_positions"]``).
        """
        source = getattr(self, "last_source", None)  # in-tower merging keeps one batched map (ToMe's source)
        if isinstance(source, TokenPlan):
            return [_plan_row(source, b) for b in range(source.batch)]
        return list(self._image_plans)

    def check(self, model: nn.Module) -> None:
        """Raise :class:`UnsupportedModelError` with a clear message if the method cannot run on ``model``."""
        reason = self.supports(model)
        if reason is not None:
            raise UnsupportedModelError(f"{type(self).__name__} does not support {type(model).__name__}: {reason}")

    def _attach(self, model: nn.Module, undo: list[Callable[[], None]]) -> None:
        """Attach to ``model``; append to ``undo`` one callable per change (run in reverse on exit)."""
        raise NotImplementedError

    @contextmanager
    def apply(self, model: nn.Module) -> Iterator[nn.Module]:
        """Attach the method to this one model instance for the duration of a ``with`` block.

        >>> with FastV(layer=2, keep_ratio=0.25).apply(model):
        ...     out = model.generate(**inputs, max_new_tokens=16, do_sample=False)

        Raises
        ------
        UnsupportedModelError
            If the model's class is not supported.
        """
        self.check(model)
        undo: list[Callable[[], None]] = []
        try:
            self._attach(model, undo)
            yield model
        finally:
            for fn in reversed(undo):
                fn()


def _hook(undo: list, module: nn.Module, fn: Callable, *, pre: bool, with_kwargs: bool = True) -> None:
    if pre:
        handle = module.register_forward_pre_hook(fn, with_kwargs=with_kwargs)
    else:
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs)
    undo.append(handle.remove)


# ---------------------------------------------------------------------------------------------------- model adapters
@dataclass(frozen=True)
class ImageGrid:
    """The LLM-side token layout of one image: ``prefix`` leading non-spatial tokens (a kept [CLS]) then a
    ``t x h x w`` raster of patch tokens (t > 1 for Qwen2-VL frames)."""

    t: int
    h: int
    w: int
    prefix: int = 0

    @property
    def tokens(self) -> int:
        return self.prefix + self.t * self.h * self.w


@dataclass
class VLMParts:
    """The parts of a vision-language model that the methods hook, found from attributes.

    Attributes
    ----------
    inner : nn.Module
        The module that receives ``input_ids`` and ``pixel_values`` and calls the language model
        (``LlavaModel``, ``Qwen2VLModel``).
    lm : nn.Module
        The text decoder, with ``.layers`` (each with ``self_attn.q_proj/k_proj`` and rotate-half RoPE).
    tower : nn.Module
        The vision tower.
    image_token_id : int
    kind : {"llava", "qwen2_vl"}
        The token layout family, decided by the config (``vision_feature_select_strategy`` vs ``image_grid_thw``).
    """

    inner: nn.Module
    lm: nn.Module
    tower: nn.Module
    image_token_id: int
    kind: str
    video_token_id: int | None = None

    SUPPORTED: ClassVar[str] = (
        "LLaVA-1.5-style models (LlavaForConditionalGeneration / LlavaModel: a fixed grid per image) and "
        "Qwen2-VL (Qwen2VLForConditionalGeneration / Qwen2VLModel)"
    )

    @classmethod
    def find(cls, model: nn.Module) -> VLMParts | str:
        """The parts, or a string saying why ``model`` is not a supported VLM."""
        inner = model.model if isinstance(getattr(model, "model", None), nn.Module) else model
        config = getattr(inner, "config", None)
        lm = getattr(inner, "language_model", None)
        image_token_id = getattr(config, "image_token_id", None)
        if config is None or lm is None or image_token_id is None or not hasattr(lm, "layers"):
            return f"it is not a vision-language model with a language_model and an image token; supported: " \
                   f"{cls.SUPPORTED}"
        if getattr(config, "image_grid_pinpoints", None) is not None:
            return "AnyRes models (LLaVA-NeXT / OneVision: a variable number of crops per image) are not supported " \
                   f"yet; supported: {cls.SUPPORTED}"
        if hasattr(inner, "vision_tower") and hasattr(inner, "multi_modal_projector") and \
                getattr(config, "vision_feature_select_strategy", None) in ("default", "full"):
            return cls(inner, lm, inner.vision_tower, int(image_token_id), "llava")
        if hasattr(inner, "visual") and hasattr(getattr(config, "vision_config", None), "spatial_merge_size"):
            video = getattr(config, "video_token_id", None)
            return cls(inner, lm, inner.visual, int(image_token_id), "qwen2_vl", None if video is None else int(video))
        return f"unrecognised vision-language layout; supported: {cls.SUPPORTED}"

    def grids(self, n_image_tokens: int, image_grid_thw: torch.Tensor | None) -> list[ImageGrid]:
        """The layout of every image (or video) in a prefill, in the order their tokens appear.

        Raises
        ------
        ValueError
            If the number of image tokens does not fit whole images.
        """
        config = self.inner.config
        if self.kind == "llava":
            vc = config.vision_config
            side = vc.image_size // vc.patch_size
            prefix = 1 if config.vision_feature_select_strategy == "full" else 0
            per_image = prefix + side * side
            if n_image_tokens % per_image:
                raise ValueError(f"{n_image_tokens} image tokens is not a whole number of {per_image}-token images")
            return [ImageGrid(1, side, side, prefix)] * (n_image_tokens // per_image)
        merge = config.vision_config.spatial_merge_size
        if image_grid_thw is None:
            raise ValueError("Qwen2-VL input with image/video tokens but no image_grid_thw/video_grid_thw")
        grids = [ImageGrid(int(t), int(h) // merge, int(w) // merge) for t, h, w in image_grid_thw.tolist()]
        if sum(g.tokens for g in grids) != n_image_tokens:
            raise ValueError(f"the grid gives {sum(g.tokens for g in grids)} tokens, the input has {n_image_tokens}")
        return grids


# ----------------------------------------------------------------------------------------------------- the run state
@dataclass
class _RunState:
    """What one ``apply`` block knows about the forward in flight."""

    pending: dict | None = None  # set by the outer pre-hook on an image prefill, consumed by the LM pre-hook
    plan: TokenPlan | None = None  # the sequence plan of the current prompt (prefix of ``plan.length`` tokens)
    vision: dict = field(default_factory=dict)  # per-forward captures from the vision tower
    scratch: dict = field(default_factory=dict)


def _past_length(kwargs: dict) -> int:
    cache = kwargs.get("past_key_values")
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


def _attach_outer(parts: VLMParts, state: _RunState, undo: list) -> None:
    """Record the image layout of every image prefill (the forward that carries ``pixel_values``)."""

    def pre(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        encoded = kwargs.get("mm_encoder_outputs") or {}  # generate() runs the tower before the first forward
        has_images = kwargs.get("pixel_values") is not None or encoded.get("image") is not None
        has_videos = kwargs.get("pixel_values_videos") is not None or encoded.get("video") is not None
        if (has_images or has_videos) and input_ids is not None:
            if has_images and has_videos:
                raise ValueError("visual-token methods take images or videos in one prompt, not both (yet)")
            kind = "image" if has_images else "video"
            token_id = parts.image_token_id if has_images else parts.video_token_id
            image_mask = input_ids == token_id
            grids = parts.grids(int(image_mask.sum()), _grid_thw(parts, state, kwargs, kind))
            state.pending = {"image_mask": image_mask, "grids": grids, "kind": kind}
            state.vision.pop("grid_thw_calls", None)
        elif _past_length(kwargs) == 0:
            state.pending, state.plan = None, None  # a new prompt without images: nothing to reduce

    _hook(undo, parts.inner, pre, pre=True)
    if parts.kind == "qwen2_vl":  # generate() drops image_grid_thw once the tower has run: record it there

        def tower_pre(module, args, kwargs):
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if grid is not None:
                state.vision.setdefault("grid_thw_calls", []).append(grid)

        _hook(undo, parts.tower, tower_pre, pre=True)


def _grid_thw(parts: VLMParts, state: _RunState, kwargs: dict, kind: str) -> torch.Tensor | None:
    """Qwen2-VL's ``image_grid_thw`` / ``video_grid_thw`` of this prefill: passed in, or recorded when the tower
    encoded the pixels (``generate`` drops it once the tower has run)."""
    key = f"{kind}_grid_thw"
    if kwargs.get(key) is not None or parts.kind != "qwen2_vl":
        return kwargs.get(key)
    encoded = (kwargs.get("mm_encoder_outputs") or {}).get(kind)
    counts = [int(x.shape[0]) for x in getattr(encoded, "pooler_output", None) or []]
    merge = parts.inner.config.vision_config.spatial_merge_size
    for grid in reversed(state.vision.get("grid_thw_calls", [])):
        if [int(t * h * w) // merge ** 2 for t, h, w in grid.tolist()] == counts:
            return grid
    return None


def lift_to_sequence(image_mask: torch.Tensor, grids: list[ImageGrid], plans: list[TokenPlan]) -> TokenPlan:
    """Lift per-image plans to one plan over the whole sequence (text tokens are always kept).

    Parameters
    ----------
    image_mask : torch.Tensor
        [B, L] bool, the image placeholder tokens.
    grids : list of ImageGrid
        Every image in order of appearance (row by row).
    plans : list of TokenPlan
        One batch-1 plan per image over its ``grid.tokens`` tokens.

    Raises
    ------
    ValueError
        If rows end up with different token counts.
    """
    B, L = image_mask.shape
    device = image_mask.device
    rep = torch.arange(L, device=device).expand(B, L).clone()
    weight = torch.ones(B, L, device=device)
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
            if plan.weight is not None:
                weight[b, seg] = plan.weight[0].to(weight.dtype)
                has_weight = True
            offset += grid.tokens
            k += 1
    return TokenPlan.from_representatives(rep, weight if has_weight else None)


def _compressed_lm_kwargs(state: _RunState, kwargs: dict) -> dict:
    """Decode step after a reduced prefill: keep the 2-D mask and default positions in line with the cache."""
    plan = state.plan
    embeds = kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= plan.length:
        kwargs["attention_mask"] = plan.extend_columns(mask)
    if kwargs.get("position_ids") is None and embeds is not None:
        past = _past_length(kwargs)
        q = embeds.shape[1]
        kwargs["position_ids"] = (torch.arange(q, device=embeds.device) + past + plan.length - plan.num_kept)[None]
    return kwargs


# ------------------------------------------------------------------------------------------------ pre-LLM reduction
@dataclass
class ImageReducer(VisionTokenMethod):
    """Pre-LLM reduction: plan each image's projected tokens, then feed the LLM the reduced sequence.

    A subclass implements :meth:`plan_image`; if it needs the vision tower's [CLS] attention it sets
    ``needs_cls_attention`` and receives ``cls_attention`` [N] (mean over heads) and ``keys`` [N, d] (mean over
    heads) of the layer whose output LLaVA feeds the projector.
    """

    stage: ClassVar[str] = "pre-llm"
    needs_cls_attention: ClassVar[bool] = False

    def plan_image(self, features: torch.Tensor, grid: ImageGrid, info: dict) -> TokenPlan:
        """Plan one image.

        Parameters
        ----------
        features : torch.Tensor
            [N, D] projected patch tokens (without the ``grid.prefix`` tokens).
        grid : ImageGrid
        info : dict
            ``image_index`` (order of appearance in the batch); ``cls_attention`` [N] and ``keys`` [N, d] when
            ``needs_cls_attention``.

        Returns
        -------
        TokenPlan
            Batch 1, over the N patch tokens.
        """
        raise NotImplementedError

    def supports(self, model: nn.Module) -> str | None:
        parts = VLMParts.find(model)
        if isinstance(parts, str):
            return parts
        if self.needs_cls_attention:
            if parts.kind != "llava":
                return "it needs a [CLS] token in the vision tower (LLaVA-style CLIP/SigLIP towers); Qwen2-VL has none"
            reason = _cls_layer(parts)
            if isinstance(reason, str):
                return reason
        return None

    def _attach(self, model: nn.Module, undo: list) -> None:
        parts = VLMParts.find(model)
        state = _RunState()
        _attach_outer(parts, state, undo)
        if self.needs_cls_attention:
            _attach_cls_capture(parts, state, undo)

        def lm_pre(module, args, kwargs):
            embeds = kwargs.get("inputs_embeds")
            if state.pending is not None and embeds is not None:
                pending, state.pending = state.pending, None
                if _past_length(kwargs) != 0:
                    raise ValueError(f"{type(self).__name__}: an image prefill on a non-empty cache is not supported")
                plan = self._sequence_plan(pending, embeds, state)
                state.plan = plan
                # for an in-LLM method applied together with this one: which of the LLM's tokens are visual
                module._mmaccel_visual_mask = plan.take(pending["image_mask"])
                kwargs["inputs_embeds"] = plan.merge(embeds)
                pos = kwargs.get("position_ids")
                if pos is None:
                    pos = torch.arange(embeds.shape[1], device=embeds.device)[None]
                kwargs["position_ids"] = plan.take_positions(pos)
                mask = kwargs.get("attention_mask")
                if mask is None:  # an explicit all-ones mask: gapped positions must not read as packed sequences
                    mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
                if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
                    raise ValueError(f"{type(self).__name__} needs a 2-D attention mask (or none); got a prepared mask")
                kwargs["attention_mask"] = plan.take(mask)
            elif state.plan is not None and _past_length(kwargs) > 0:
                kwargs = _compressed_lm_kwargs(state, kwargs)
            return args, kwargs

        _hook(undo, parts.lm, lm_pre, pre=True)

        def forget():
            if hasattr(parts.lm, "_mmaccel_visual_mask"):
                del parts.lm._mmaccel_visual_mask

        undo.append(forget)

    def _sequence_plan(self, pending: dict, embeds: torch.Tensor, state: _RunState) -> TokenPlan:
        image_mask, grids = pending["image_mask"], pending["grids"]
        plans, before, after = [], [], []
        k = 0
        for b in range(image_mask.shape[0]):
            pos = image_mask[b].nonzero().squeeze(1)
            offset = 0
            while offset < pos.numel():
                grid = grids[k]
                seg = pos[offset: offset + grid.tokens]
                feats = embeds[b, seg]
                info = {"image_index": k}
                if self.needs_cls_attention:
                    info.update(cls_attention=state.vision["cls_attention"][k], keys=state.vision["keys"][k])
                local = self.plan_image(feats[grid.prefix:], grid, info)
                plans.append(_with_prefix(local, grid.prefix))
                before.append(grid.tokens)
                after.append(plans[-1].num_kept)
                offset += grid.tokens
                k += 1
        plan = lift_to_sequence(image_mask, grids, plans)
        self._image_plans = plans
        self.telemetry = {"method": self.name, "stage": self.stage, "media": pending.get("kind", "image"),
                          "tokens_before": before, "tokens_after": after,
                          "sequence_before": plan.length, "sequence_after": plan.num_kept,
                          "kept_positions": plan.index.tolist()}
        logger.debug("%s: %d -> %d visual tokens", self.name, sum(before), sum(after))
        return plan


def _plan_row(plan: TokenPlan, b: int) -> TokenPlan:
    """Row ``b`` of a batched plan, as a batch-1 plan."""
    def row(t):
        return None if t is None else t[b: b + 1]

    return TokenPlan(index=row(plan.index), length=plan.length, assign=row(plan.assign), weight=row(plan.weight))


def _with_prefix(plan: TokenPlan, prefix: int) -> TokenPlan:
    """Prepend ``prefix`` always-kept tokens to a batch-1 plan."""
    if prefix == 0:
        return plan
    device = plan.index.device
    rep = torch.cat([torch.arange(prefix, device=device),
                     torch.where(plan.slot_of()[0] >= 0, plan.index[0][plan.slot_of()[0].clamp(min=0)] + prefix,
                                 torch.full((plan.length,), -1, dtype=torch.long, device=device))])
    weight = None
    if plan.weight is not None:
        weight = torch.cat([torch.ones(prefix, device=device, dtype=plan.weight.dtype), plan.weight[0]])[None]
    return TokenPlan.from_representatives(rep[None], weight)


# ------------------------------------------------------------------------------------- vision-tower [CLS] attention
def vit_layers(tower: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks of a ViT: ``encoder.layers`` (HF CLIP/SigLIP), ``encoder.layer`` (HF Dinov2),
    ``visual.transformer.resblocks`` / ``transformer.resblocks`` (an open_clip model / its ``VisionTransformer``)."""
    for path in ("vision_model.encoder.layers", "encoder.layers", "encoder.layer", "vision_model.encoder.layer",
                 "visual.transformer.resblocks", "transformer.resblocks"):
        obj = tower
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    return None


def _cls_layer(parts: VLMParts) -> int | str:
    """Index of the tower block whose output LLaVA projects (``vision_feature_layer``), or why there is none."""
    layers = vit_layers(parts.tower)
    if layers is None:
        return "its vision tower has no encoder.layers"
    embeddings = getattr(parts.tower, "embeddings", None) or getattr(getattr(parts.tower, "vision_model", None),
                                                                     "embeddings", None)
    if not (hasattr(embeddings, "class_embedding") or hasattr(embeddings, "cls_token")):
        return "its vision tower has no [CLS] token (e.g. SigLIP)"
    feature_layer = parts.inner.config.vision_feature_layer
    if not isinstance(feature_layer, int):
        return "a list of vision_feature_layer values is not supported"
    h = feature_layer if feature_layer >= 0 else len(layers) + 1 + feature_layer
    if not 1 <= h <= len(layers):
        return f"vision_feature_layer {feature_layer} is not the output of a transformer block"
    return h - 1


def _attach_cls_capture(parts: VLMParts, state: _RunState, undo: list) -> None:
    """Capture, at the projected layer, the [CLS] -> patch attention (mean over heads) and the keys."""
    layer = vit_layers(parts.tower)[_cls_layer(parts)]
    attn = layer.self_attn

    def pre(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        n_img, n, _ = hidden.shape
        heads = getattr(module, "num_heads", None) or module.config.num_attention_heads
        q = module.q_proj(hidden[:, :1]).view(n_img, 1, heads, -1).transpose(1, 2)  # [I, H, 1, d]
        k = module.k_proj(hidden).view(n_img, n, heads, -1).transpose(1, 2)  # [I, H, N+1, d]
        scale = getattr(module, "scale", None) or q.shape[-1] ** -0.5
        probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * scale, dim=-1)[:, :, 0]  # [I, H, N+1]
        state.vision["cls_attention"] = probs.mean(dim=1)[:, 1:]  # [I, N]
        state.vision["keys"] = k.mean(dim=1)[:, 1:]  # [I, N, d]

    _hook(undo, attn, pre, pre=True)


# ------------------------------------------------------------------------------------------------ in-LLM pruning
@dataclass
class LayerPruner(VisionTokenMethod):
    """In-LLM pruning at decoder layer ``layer``: a subclass scores the sequence at layer ``layer - 1``
    (:meth:`score`) and the base keeps all text tokens plus the top ``keep_ratio`` of each row's image tokens.

    Parameters
    ----------
    layer : int
        ``K``: layers ``0..K-1`` see all tokens, layers ``K..`` the kept ones. ``1 <= K < num_layers``.
    """

    layer: int = 2
    stage: ClassVar[str] = "in-llm"

    def supports(self, model: nn.Module) -> str | None:
        parts = VLMParts.find(model)
        if isinstance(parts, str):
            return parts
        n = len(parts.lm.layers)
        if not isinstance(self.layer, int) or not 1 <= self.layer < n:
            return f"layer must be an int in [1, {n - 1}] for a {n}-layer language model, got {self.layer!r}"
        attn = parts.lm.layers[self.layer - 1].self_attn
        if not (hasattr(attn, "q_proj") and hasattr(attn, "k_proj") and hasattr(attn, "head_dim")):
            return "its decoder attention has no q_proj/k_proj/head_dim"
        return None

    def score(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores [B, L] (higher = keep) from RoPE'd ``queries`` [B, Hq, W, D] (last W positions) and ``keys``
        [B, Hkv, L, D] of layer ``K - 1``."""
        raise NotImplementedError

    def _attach(self, model: nn.Module, undo: list) -> None:
        parts = VLMParts.find(model)
        state = _RunState()
        _attach_outer(parts, state, undo)
        layers = parts.lm.layers
        K = self.layer

        def lm_pre(module, args, kwargs):
            if state.pending is not None and kwargs.get("inputs_embeds") is not None:
                state.scratch = {"phase": "prefill", "lm": module, **state.pending}
                state.pending = None
                state.plan = None
            elif state.plan is not None and _past_length(kwargs) > 0:
                state.scratch["phase"] = "decode"
            else:
                state.scratch = {"phase": "off"}

        _hook(undo, parts.lm, lm_pre, pre=True)

        def capture(module, args, kwargs):  # self_attn of layer K-1, before it runs
            if state.scratch.get("phase") == "prefill":
                state.scratch["attn_in"] = kwargs.get("hidden_states", args[0] if args else None)
                state.scratch["rope"] = kwargs.get("position_embeddings")

        _hook(undo, layers[K - 1].self_attn, capture, pre=True)
        attn = layers[K - 1].self_attn

        def layer_pre(index):
            def pre(module, args, kwargs):
                phase = state.scratch.get("phase")
                if phase == "prefill":
                    if index == K:
                        state.plan = self._build_plan(attn, state)
                    plan = state.plan
                    args, kwargs = _reduce_layer_inputs(plan, args, kwargs, state.scratch, index == K)
                elif phase == "decode":
                    mask = kwargs.get("attention_mask")
                    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
                        kwargs["attention_mask"] = state.plan.extend_columns(mask)
                return args, kwargs
            return pre

        for i in range(K, len(layers)):
            _hook(undo, layers[i], layer_pre(i), pre=True)

    def _build_plan(self, attn: nn.Module, state: _RunState) -> TokenPlan:
        hidden = state.scratch.pop("attn_in")
        cos, sin = state.scratch.pop("rope")
        B, L, _ = hidden.shape
        d = attn.head_dim
        W = min(int(getattr(self, "window", 1)), L)
        q = attn.q_proj(hidden[:, L - W:]).view(B, W, -1, d).transpose(1, 2)
        k = attn.k_proj(hidden).view(B, L, -1, d).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rope(q, cos[:, L - W:], sin[:, L - W:])
        k = _rope(k, cos, sin)
        scores = self.score(q, k)  # [B, L]
        image_mask = state.scratch["image_mask"]
        reduced = getattr(state.scratch["lm"], "_mmaccel_visual_mask", None)  # a pre-LLM method ran before us
        if image_mask.shape[1] != L and reduced is not None and reduced.shape == (B, L):
            image_mask = reduced
        if image_mask.shape[1] != L:
            raise ValueError(f"{type(self).__name__}: the language model got {L} tokens for a {image_mask.shape[1]}-"
                             "token prompt and no record of which are visual")
        counts = image_mask.sum(dim=1)
        if not bool((counts == counts[0]).all()):
            raise ValueError(f"{type(self).__name__}: rows hold different numbers of image tokens {counts.tolist()}")
        n_img = int(counts[0])
        n_keep = kept_count(n_img, self.keep_ratio) if n_img else 0
        masked = scores.float().masked_fill(~image_mask, float("-inf"))
        top = masked.topk(n_keep, dim=1).indices
        keep = ~image_mask
        keep = keep.scatter(1, top, True)
        plan = TokenPlan.from_keep(keep)
        self.telemetry = {"method": self.name, "stage": self.stage, "layer": self.layer,
                          "image_tokens_before": n_img, "image_tokens_after": n_keep,
                          "sequence_before": L, "sequence_after": plan.num_kept,
                          "kept_positions": plan.index.tolist()}
        return plan


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, H, L, D], cos/sin [b, L, D]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _reduce_layer_inputs(plan: TokenPlan, args: tuple, kwargs: dict, scratch: dict, first: bool):
    """Reduce a decoder layer's inputs at prefill: hidden states (at the first reduced layer), rotary tables,
    position ids and a 4-D mask; the reduced kwargs are computed once and reused by the later layers."""
    if first:
        if args:
            args = (plan.take(args[0]),) + tuple(args[1:])
        else:
            kwargs["hidden_states"] = plan.take(kwargs["hidden_states"])
    cached = scratch.setdefault("reduced", {})
    for key in ("position_embeddings", "position_ids", "attention_mask"):
        value = kwargs.get(key)
        if value is None:
            continue
        if key not in cached or cached[key][0] is not value:
            if key == "position_embeddings":
                new = tuple(plan.take(t) for t in value)
            elif key == "position_ids":
                new = plan.take_positions(value)
            elif isinstance(value, torch.Tensor) and value.dim() == 4:
                new = plan.take_mask4d(value)
            else:
                raise ValueError("in-LLM pruning needs a 4-D attention mask or none (SDPA/eager); got another kind")
            cached[key] = (value, new)
        kwargs[key] = cached[key][1]
    return args, kwargs
