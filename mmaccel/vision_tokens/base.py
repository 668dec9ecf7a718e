"""Shared mechanics of the visual-token methods: the method contract, the model adapters and the hooks.

A method is a small dataclass that says only what is new about it (how it picks or merges tokens); everything that
touches a transformers model lives here once:

- :class:`VisionTokenMethod` -- ``keep_ratio`` in (0, 1] and ``apply(model)``, a context manager that attaches
  per-instance forward hooks (or swaps ``__class__`` on one instance's modules, as ToMe does) and removes them on exit.
  Nothing is patched at class level.
- :class:`VLMParts` -- finds the language model, the vision tower and the image placeholder id of a LLaVA-style
  (``LlavaForConditionalGeneration``), AnyRes (``LlavaOnevisionForConditionalGeneration``,
  ``LlavaNextForConditionalGeneration``) or Qwen2-VL-style (``Qwen2VLForConditionalGeneration``) model from its
  config attributes and submodules, not from its name, and reads the token layout of every image as
  :class:`ImageGrid` s.
- :class:`ImageReducer` -- pre-LLM reduction (between projector and LLM). A subclass plans each image
  (:meth:`ImageReducer.plan_image`); the base lifts the per-image plans to one :class:`~.plan.TokenPlan` over the
  whole sequence and applies it at the entry of the language model to the embeddings, the position ids (LLaVA's
  1-D ids, Qwen2-VL's 3-D M-RoPE ids) and the attention mask, then keeps the 2-D mask of every later decode step in
  line with the shorter cache. On fixed-grid LLaVA models the same plan is applied earlier, to the projected
  features and the placeholder ids before ``LlavaModel`` merges them (:class:`PlacedFeatures`), so that no
  full-length sequence is built: the language model's inputs are the same, the memory of the full-length merge is
  saved (1,024 video frames: see ``benchmarks/results/vision/video_peak_profile/``).
- :class:`LayerPruner` -- in-LLM pruning at decoder layer ``K``: layers ``>= K`` see the reduced sequence; their
  rotary tables, position ids and 4-D masks are reduced by the same plan, at prefill and at every decode step.

Positions. Kept tokens keep their original positions: ``generate`` passes the original ``position_ids`` (or, for
Qwen2-VL, the 4-row text + M-RoPE ids) and every plan gathers them, never renumbers them. A forward without
``position_ids`` on a reduced cache gets ``arange(q) + past + (L - K)``, i.e. the original positions too (Qwen2-VL
derives its own ids before the language model and needs ``generate``'s ids after a reduction). A pre-LLM method
built with ``positions="contiguous"`` instead renumbers the reduced prompt ``0..K-1`` (LLaVA-style models; decode
steps continue from ``K``), as the LLM sees a prompt whose visual tokens were reduced before it was built.

AnyRes layouts (LLaVA-OneVision, LLaVA-NeXT). An image's span in the sequence is one or two grids: the base image
(``side x side`` patches), then for an image alone in its prompt the unpadded crops (downsampled past OneVision's
``vision_aspect_ratio``) as an ``h x w`` raster whose every row is closed by an ``image_newline`` token
(``ImageGrid(newline=True)``). An image of a multi-image prompt is the base grid plus one trailing newline, a
OneVision video ``frames x ceil(side/2) x ceil(side/2)`` plus one (``suffix=1``). The layout is read from the packed
features (newline tokens equal ``image_newline``), because ``generate`` drops ``image_sizes`` once the tower has run;
a plain forward with ``pixel_values`` is encoded by the hook first, with ``get_image_features``, as ``generate``
does. Newline tokens are structural, never merged or scored by pre-LLM methods: each grid's raster is planned on its
own, a row's newline is kept iff the row keeps at least one token (a pooled crop grid then reads like the model's own
downsampled layout: ``h'`` rows of ``w'`` tokens, each closed by a newline) and a trailing newline is always kept.
In-LLM pruning (FastV) ranks the whole placeholder span, newline tokens included, as FastV's code does.

Batch > 1 works: rows are reduced independently. Rows that keep different numbers of tokens (AnyRes images of
different sizes, padded to one length; kept tokens spread over a different number of crop rows) are evened out:
longer rows drop padding tokens (attention-mask 0: no token attends to them, so their outputs do not change), and
rows still shorter take back dropped newline tokens of their crop grids (their outputs then differ from a batch-1
run by those newlines); if neither suffices a ValueError says so. Left padding is carried by the 2-D mask.

Composition: a pre-LLM and an in-LLM method can be applied together (``with Pooling(...).apply(m), FastV(...).apply(m)``
in either order); the in-LLM method then prunes among the visual tokens the pre-LLM one kept. Two methods of the same
stage on one model are not supported.

Outputs: a forward under a reduction returns hidden states / logits for the kept positions only (``generate`` reads
the last one); ``method.telemetry["kept_positions"]`` maps them back to the prompt.
"""
from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..kernels.hf import hooked_cache
from .plan import TokenPlan

logger = logging.getLogger(__name__)

__all__ = [
    "ImageGrid",
    "ImageReducer",
    "LayerPruner",
    "PlacedFeatures",
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
            strategy), then the ``t x h x w`` patch raster (AnyRes: one plan per :class:`ImageGrid`, i.e. the base
            image, then the crops with every raster row followed by its newline token; trailing newline tokens
            last). ``plan.slot_of()[0]`` [L] is the output token of every
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


def _hook(undo: list, module: nn.Module, fn: Callable, *, pre: bool, with_kwargs: bool = True,
          first: bool = False) -> None:
    if pre:
        handle = module.register_forward_pre_hook(fn, with_kwargs=with_kwargs, prepend=first)
    else:
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs)
    undo.append(handle.remove)


# ---------------------------------------------------------------------------------------------------- model adapters
@dataclass(frozen=True)
class ImageGrid:
    """The LLM-side token layout of one image, or of one part of an AnyRes image.

    ``prefix`` leading non-spatial tokens (a kept [CLS]), then a ``t x h x w`` raster of patch tokens (frame-major,
    then rows, then columns; t > 1 for Qwen2-VL and OneVision video frames), each of its ``t * h`` rows followed by
    one newline token when ``newline`` (the ``image_newline`` column of AnyRes crops), then ``suffix`` trailing
    non-spatial tokens (the one ``image_newline`` after a OneVision multi-image item or video).

    Attributes
    ----------
    t, h, w : int
        The raster.
    prefix, suffix : int
        Leading / trailing tokens outside the raster, always kept by pre-LLM methods.
    newline : bool
        Every raster row is closed by a newline token (``tokens`` counts them).
    part : int
        Index of the grid within its image: 0 for the first (the whole image for LLaVA and Qwen2-VL, the base image
        for AnyRes), 1 for an AnyRes image's crops.
    """

    t: int
    h: int
    w: int
    prefix: int = 0
    newline: bool = False
    suffix: int = 0
    part: int = 0

    @property
    def tokens(self) -> int:
        """All tokens of the grid's span: ``prefix + t * h * (w + newline) + suffix``."""
        return self.prefix + self.t * self.h * (self.w + int(self.newline)) + self.suffix

    def raster_index(self, device=None) -> torch.Tensor:
        """[t * h * w] long: the offset of every raster token within the grid's ``tokens`` (skips prefix and
        newlines)."""
        rows = torch.arange(self.t * self.h, device=device)[:, None] * (self.w + int(self.newline))
        return (self.prefix + rows + torch.arange(self.w, device=device)[None]).reshape(-1)

    def newline_index(self, device=None) -> torch.Tensor:
        """[t * h] long (empty without ``newline``): the offset of every row's newline token."""
        if not self.newline:
            return torch.zeros(0, dtype=torch.long, device=device)
        return self.prefix + torch.arange(self.t * self.h, device=device) * (self.w + 1) + self.w


@dataclass
class VLMParts:
    """The parts of a vision-language model that the methods hook, found from attributes.

    Attributes
    ----------
    inner : nn.Module
        The module that receives ``input_ids`` and ``pixel_values`` and calls the language model
        (``LlavaModel``, ``LlavaOnevisionModel``, ``Qwen2VLModel``).
    lm : nn.Module
        The text decoder, with ``.layers`` (each with ``self_attn.q_proj/k_proj`` and rotate-half RoPE).
    tower : nn.Module
        The vision tower.
    image_token_id : int
    kind : {"llava", "anyres", "qwen2_vl"}
        The token layout family, decided by the config: ``vision_feature_select_strategy`` (a fixed grid per image),
        plus ``image_grid_pinpoints`` (AnyRes: base image + crops with ``image_newline`` tokens), or
        ``vision_config.spatial_merge_size`` (Qwen2-VL's ``image_grid_thw``).
    video_token_id : int or None
    """

    inner: nn.Module
    lm: nn.Module
    tower: nn.Module
    image_token_id: int
    kind: str
    video_token_id: int | None = None

    SUPPORTED: ClassVar[str] = (
        "LLaVA-1.5-style models (LlavaForConditionalGeneration / LlavaModel: a fixed grid per image), AnyRes "
        "LLaVA-OneVision / LLaVA-NeXT (LlavaOnevisionForConditionalGeneration, LlavaNextForConditionalGeneration: a "
        "base image plus unpadded crops with newline tokens) and Qwen2-VL (Qwen2VLForConditionalGeneration / "
        "Qwen2VLModel)"
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
        llava_like = hasattr(inner, "vision_tower") and hasattr(inner, "multi_modal_projector") and \
            getattr(config, "vision_feature_select_strategy", None) in ("default", "full")
        video = getattr(config, "video_token_id", None)
        video = None if video is None else int(video)
        if llava_like and getattr(config, "image_grid_pinpoints", None) is not None:
            if not isinstance(getattr(inner, "image_newline", None), torch.Tensor) or \
                    "mm_encoder_outputs" not in inspect.signature(inner.forward).parameters:
                return "an AnyRes model without an image_newline embedding or an mm_encoder_outputs argument; " \
                       f"supported: {cls.SUPPORTED}"
            return cls(inner, lm, inner.vision_tower, int(image_token_id), "anyres", video)
        if llava_like:
            return cls(inner, lm, inner.vision_tower, int(image_token_id), "llava")
        if hasattr(inner, "visual") and hasattr(getattr(config, "vision_config", None), "spatial_merge_size"):
            return cls(inner, lm, inner.visual, int(image_token_id), "qwen2_vl", video)
        return f"unrecognised vision-language layout; supported: {cls.SUPPORTED}"

    def grids(self, n_image_tokens: int, image_grid_thw: torch.Tensor | None = None, *,
              features: Any = None, media: str = "image") -> list[ImageGrid]:
        """The layout of every image (or video) in a prefill, in the order their tokens appear.

        Parameters
        ----------
        n_image_tokens : int
            Placeholder tokens of ``media`` in the batch.
        image_grid_thw : torch.Tensor, optional
            Qwen2-VL: [n, 3] ``(t, h, w)`` patches per image (or video).
        features : list of torch.Tensor or torch.Tensor, optional
            AnyRes: the packed features the language model receives, one [n_i, D] tensor per image (a list) or
            [V, n, D] for videos (``mm_encoder_outputs[media].pooler_output``); the layout is read from where they
            equal ``image_newline``.
        media : {"image", "video"}

        Returns
        -------
        list of ImageGrid
            One per image for LLaVA and Qwen2-VL; an AnyRes image alone in its prompt gives two (``part`` 0: the base
            image, ``part`` 1: the crops with their newline column).

        Raises
        ------
        ValueError
            If the number of image tokens does not fit whole images, Qwen2-VL grids are missing, or AnyRes features
            are missing or do not have the base + crops + newline layout.
        """
        config = self.inner.config
        if self.kind == "anyres":
            grids = self._anyres_grids(features, media)
        elif self.kind == "llava":
            vc = config.vision_config
            side = vc.image_size // vc.patch_size
            prefix = 1 if config.vision_feature_select_strategy == "full" else 0
            per_image = prefix + side * side
            if n_image_tokens % per_image:
                raise ValueError(f"{n_image_tokens} image tokens is not a whole number of {per_image}-token images")
            return [ImageGrid(1, side, side, prefix)] * (n_image_tokens // per_image)
        else:
            merge = config.vision_config.spatial_merge_size
            if image_grid_thw is None:
                raise ValueError("Qwen2-VL input with image/video tokens but no image_grid_thw/video_grid_thw")
            grids = [ImageGrid(int(t), int(h) // merge, int(w) // merge) for t, h, w in image_grid_thw.tolist()]
        if sum(g.tokens for g in grids) != n_image_tokens:
            raise ValueError(f"the grid gives {sum(g.tokens for g in grids)} tokens, the input has {n_image_tokens}")
        return grids

    def _anyres_grids(self, features: Any, media: str) -> list[ImageGrid]:
        """Read the AnyRes packing (transformers' ``pack_image_features`` / OneVision's ``get_video_features``)
        back from the packed features: ``side^2`` base tokens, then either one newline (an image of a multi-image
        prompt) or ``h`` rows of ``w`` crop tokens + newline; a video is ``frames x ceil(side/2)^2`` + one newline."""
        if features is None:
            raise ValueError("an AnyRes layout is read from the packed features: pass features=pooler_output")
        vc = self.inner.config.vision_config
        side = vc.image_size // vc.patch_size
        newline = self.inner.image_newline
        grids = []
        for k, feats in enumerate(features):
            is_newline = (feats == newline.to(feats.device, feats.dtype)).all(dim=-1)  # [n]
            n = int(is_newline.shape[0])
            if media == "video":
                pooled = math.ceil(side / 2)  # OneVision's apply_pooling: bilinear to ceil(side / 2) per frame
                frames = (n - 1) // (pooled * pooled)
                if n < 2 or frames * pooled * pooled != n - 1 or not bool(is_newline[-1]) or \
                        bool(is_newline[:-1].any()):
                    raise ValueError(f"video {k}: {n} tokens are not frames of {pooled}x{pooled} pooled tokens plus "
                                     "one image_newline (the LLaVA-OneVision video layout)")
                grids.append(ImageGrid(frames, pooled, pooled, suffix=1))
                continue
            base, rest = side * side, is_newline[side * side:]
            if n <= base or bool(is_newline[:base].any()):
                raise ValueError(f"image {k}: {n} tokens do not start with a {side}x{side} base image")
            if rest.numel() == 1 and bool(rest[0]):
                grids.append(ImageGrid(1, side, side, suffix=1))
                continue
            width = int(rest.long().argmax()) + 1  # crop tokens per row + its newline
            rows = rest.numel() // width
            expected = torch.zeros(width, dtype=torch.bool, device=rest.device)
            expected[-1] = True
            if width < 2 or rows * width != rest.numel() or not bool((rest.view(rows, width) == expected).all()):
                raise ValueError(f"image {k}: the {rest.numel()} tokens after the base image are not rows of crop "
                                 "tokens closed by image_newline (the AnyRes layout)")
            grids += [ImageGrid(1, side, side), ImageGrid(1, rows, width - 1, newline=True, part=1)]
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
    cache = hooked_cache(kwargs)
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
            features = None
            if parts.kind == "anyres":  # the layout is read from the packed features: encode now if not yet done
                if encoded.get(kind) is None:
                    kwargs = _encode_media(parts, kwargs, kind)
                features = kwargs["mm_encoder_outputs"][kind].pooler_output
            grids = parts.grids(int(image_mask.sum()), _grid_thw(parts, state, kwargs, kind), features=features,
                                media=kind)
            state.pending = {"image_mask": image_mask, "grids": grids, "kind": kind}
            state.vision.pop("grid_thw_calls", None)
        elif _past_length(kwargs) == 0:
            state.pending, state.plan = None, None  # a new prompt without images: nothing to reduce
        return args, kwargs

    # first: every method reads the layout of the ids as given, before a pre-LLM method shortens them
    # (:func:`_attach_reduce_before_merge`), whichever method was applied first
    _hook(undo, parts.inner, pre, pre=True, first=True)
    if parts.kind == "qwen2_vl":  # generate() drops image_grid_thw once the tower has run: record it there

        def tower_pre(module, args, kwargs):
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if grid is not None:
                state.vision.setdefault("grid_thw_calls", []).append(grid)

        _hook(undo, parts.tower, tower_pre, pre=True)


def _encode_media(parts: VLMParts, kwargs: dict, media: str) -> dict:
    """Run ``get_image_features`` / ``get_video_features`` on the pixels of a forward and hand the result over as
    ``mm_encoder_outputs`` -- what ``generate`` does before its first forward -- so that the packed features (and
    with them the AnyRes layout) are known before the model runs. The model's outputs are the same."""
    encode = getattr(parts.inner, f"get_{media}_features")
    pixels = "pixel_values" if media == "image" else "pixel_values_videos"
    wanted = inspect.signature(encode).parameters
    args = {key: value for key, value in kwargs.items() if key in wanted and key != "kwargs" and value is not None}
    kwargs = dict(kwargs)
    kwargs.pop(pixels)
    kwargs["mm_encoder_outputs"] = {**(kwargs.get("mm_encoder_outputs") or {}),
                                    media: encode(**args, return_dict=True)}
    return kwargs


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


def _even_rows(keep: torch.Tensor, padding: torch.Tensor | None, spare: torch.Tensor | None = None) -> torch.Tensor:
    """Even out the kept counts of a batch at the lowest count that dropping kept ``padding`` tokens ([B, L] bool;
    attention-mask 0, so no token attends to them) reaches; rows below it take back ``spare`` tokens ([B, L] bool:
    dropped tokens that may be kept, AnyRes newlines). Both earliest first.

    ``keep`` [B, L] bool -> [B, L] bool. Raises ValueError if a row can be evened out neither way.
    """
    counts = keep.sum(dim=1)
    if not keep.shape[0] or bool((counts == counts[0]).all()):
        return keep
    droppable = keep & padding if padding is not None else torch.zeros_like(keep)
    spare = spare if spare is not None else torch.zeros_like(keep)
    target = max(int((counts - droppable.sum(dim=1)).max()), int(counts.min()))
    keep = keep.clone()
    for b in range(keep.shape[0]):
        change = int(counts[b]) - target
        pool = (droppable[b] if change > 0 else spare[b]).nonzero().squeeze(1)
        if abs(change) > pool.numel():
            raise ValueError(f"batch rows keep {counts.tolist()} tokens, and row {b} cannot get to {target} (too few "
                             "padding tokens to drop or newline tokens to take back): give a 2-D attention mask with "
                             "enough left padding, images that give the same token counts, or run the prompts one at "
                             "a time")
        keep[b, pool[: abs(change)]] = change < 0
    return keep


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


def _reduced_positions(method: "ImageReducer", state: _RunState, plan: TokenPlan, positions: torch.Tensor,
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
    (see the module notes) and lifts the plans to the sequence. If it needs the vision tower's [CLS] attention it
    sets ``needs_cls_attention`` and receives ``cls_attention`` [N] (mean over heads) and ``keys`` [N, d] (mean over
    heads) of the layer whose output LLaVA feeds the projector (LLaVA-1.5-style models only).

    Attributes
    ----------
    telemetry : dict
        ``tokens_before`` / ``tokens_after`` (one entry per grid, all its tokens), ``sequence_before`` /
        ``sequence_after``, ``kept_positions`` [B, K] (original positions of the tokens the LLM sees).
    """

    stage: ClassVar[str] = "pre-llm"
    needs_cls_attention: ClassVar[bool] = False
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
            ``cls_attention`` [N] and ``keys`` [N, d] when ``needs_cls_attention``.

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
        if self.needs_cls_attention:
            if parts.kind == "anyres":
                return "it needs one [CLS] attention map per image from the vision tower, and AnyRes models encode " \
                       "an image as several crops (LLaVA-OneVision's SigLIP tower has no [CLS] at all); supported: " \
                       "LLaVA-1.5-style models (LlavaForConditionalGeneration) with a [CLS]-token tower"
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
            elif state.plan is not None and _past_length(kwargs) > 0:
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
        plans, before, after = [], [], []
        if self.needs_cls_attention:
            cls_attention, keys = _cls_captures(state, len(grids))
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
                if self.needs_cls_attention:
                    info.update(cls_attention=cls_attention[k], keys=keys[k])
                plans.append(_grid_plan(self.plan_image(feats, grid, info), grid))
                before.append(grid.tokens)
                after.append(plans[-1].num_kept)
                offset += grid.tokens
                k += 1
        plan = lift_to_sequence(image_mask, grids, plans, pending.get("attention_mask"))
        self._image_plans = plans
        self.telemetry = {"method": self.name, "stage": self.stage, "media": pending.get("kind", "image"),
                          "tokens_before": before, "tokens_after": after,
                          "sequence_before": plan.length, "sequence_after": plan.num_kept,
                          "kept_positions": plan.index.tolist()}
        logger.debug("%s: %d -> %d visual tokens", self.name, sum(before), sum(after))
        return plan


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


def _plan_row(plan: TokenPlan, b: int) -> TokenPlan:
    """Row ``b`` of a batched plan, as a batch-1 plan."""
    def row(t):
        return None if t is None else t[b: b + 1]

    return TokenPlan(index=row(plan.index), length=plan.length, assign=row(plan.assign), weight=row(plan.weight))


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


# ------------------------------------------------------------------------------------- vision-tower [CLS] attention
def vit_layers(tower: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks of a ViT: ``encoder.layers`` (HF CLIP/SigLIP), ``encoder.layer`` (HF Dinov2),
    ``visual.transformer.resblocks`` / ``transformer.resblocks`` (an open_clip model / its ``VisionTransformer``);
    for a :class:`~.batched_tower.BatchedTower`, those of the tower it holds (``.tower``)."""
    tower = _inner_tower(tower)
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


def _inner_tower(tower: nn.Module) -> nn.Module:
    """The tower itself, or the one a :class:`~.batched_tower.BatchedTower` holds."""
    held = getattr(tower, "tower", None)
    return held if isinstance(held, nn.Module) and hasattr(tower, "release") else tower


def _cls_layer(parts: VLMParts) -> int | str:
    """Index of the tower block whose output LLaVA projects (``vision_feature_layer``), or why there is none."""
    layers = vit_layers(parts.tower)
    if layers is None:
        return "its vision tower has no encoder.layers"
    tower = _inner_tower(parts.tower)
    embeddings = getattr(tower, "embeddings", None) or getattr(getattr(tower, "vision_model", None), "embeddings", None)
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
    attn = getattr(layer, "self_attn", None) or layer.attention  # CLIP / SigLIP: self_attn; DINOv2: attention

    def pre(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        n_img, n, _ = hidden.shape
        heads = getattr(module, "num_heads", None) or module.config.num_attention_heads
        q = module.q_proj(hidden[:, :1]).view(n_img, 1, heads, -1).transpose(1, 2)  # [I, H, 1, d]
        k = module.k_proj(hidden).view(n_img, n, heads, -1).transpose(1, 2)  # [I, H, N+1, d]
        scale = getattr(module, "scale", None) or getattr(module, "scaling", None) or q.shape[-1] ** -0.5
        probs = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * scale, dim=-1)[:, :, 0]  # [I, H, N+1]
        # one entry per tower call: a tower run in slices (BatchedVisionEncoding) calls the layer once per slice
        state.vision.setdefault("cls_calls", []).append((probs.mean(dim=1)[:, 1:], k.mean(dim=1)[:, 1:]))

    _hook(undo, attn, pre, pre=True)


def _cls_captures(state: _RunState, n_images: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [CLS] attention [I, N] and keys [I, N, d] of the last ``n_images`` images the tower encoded (over as many
    calls as it took), and forget the captures.

    Raises
    ------
    ValueError
        If fewer images were captured (the tower did not run through the hooked layer).
    """
    calls = state.vision.pop("cls_calls", [])
    attention = torch.cat([a for a, _ in calls]) if calls else torch.empty(0)
    if attention.shape[0] < n_images:
        raise ValueError(f"the vision tower's [CLS] attention was captured for {attention.shape[0]} images, the prompt "
                         f"has {n_images}: apply the method to the model whose tower encodes the images")
    return attention[-n_images:], torch.cat([k for _, k in calls])[-n_images:]


# ------------------------------------------------------------------------------------------------ in-LLM pruning
@dataclass
class LayerPruner(VisionTokenMethod):
    """In-LLM pruning at decoder layer ``layer``: a subclass scores the sequence at layer ``layer - 1``
    (:meth:`score`) and the base keeps all text tokens plus the top ``keep_ratio`` of each row's image tokens
    (every placeholder token, AnyRes newline tokens included). Rows with different numbers of image tokens (AnyRes
    images of different sizes) keep ``keep_ratio`` of their own and are evened out by dropping padding.

    ``telemetry``: ``image_tokens_before`` / ``image_tokens_after`` (row 0; per row in ``rows_image_tokens_before``
    / ``rows_image_tokens_after``), ``sequence_before`` / ``sequence_after``, ``kept_positions`` [B, K].

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
                state.scratch = {"phase": "prefill", "lm": module, "attention_mask": kwargs.get("attention_mask"),
                                 **state.pending}
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
        counts = image_mask.sum(dim=1).tolist()
        n_keep = [kept_count(n, self.keep_ratio) if n else 0 for n in counts]
        masked = scores.float().masked_fill(~image_mask, float("-inf"))
        keep = ~image_mask
        for b in range(B):
            keep[b, masked[b].topk(n_keep[b]).indices] = True
        keep = _even_rows(keep, _padding(state.scratch, B, L))
        plan = TokenPlan.from_keep(keep)
        self.telemetry = {"method": self.name, "stage": self.stage, "layer": self.layer,
                          "image_tokens_before": counts[0] if B else 0, "image_tokens_after": n_keep[0] if B else 0,
                          "rows_image_tokens_before": counts, "rows_image_tokens_after": n_keep,
                          "sequence_before": L, "sequence_after": plan.num_kept,
                          "kept_positions": plan.index.tolist()}
        return plan


def _padding(scratch: dict, B: int, L: int) -> torch.Tensor | None:
    """[B, L] bool padding tokens of the sequence the language model runs on (its 2-D mask, or the reduced mask a
    pre-LLM method handed on), or ``None`` if unknown or there is no 2-D mask."""
    for mask in (scratch.get("attention_mask"), getattr(scratch.get("lm"), "_mmaccel_attention_mask", None)):
        if isinstance(mask, torch.Tensor) and mask.shape == (B, L):
            return mask == 0
    return None


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
