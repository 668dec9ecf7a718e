"""The model side shared by both stages: the parts the methods hook, the layout of every image, the run state and
the hooks that record an image prefill.

- :class:`VLMParts` -- the language model, the vision tower and the image placeholder id of a LLaVA-style
  (``LlavaForConditionalGeneration``), AnyRes (``LlavaOnevisionForConditionalGeneration``,
  ``LlavaNextForConditionalGeneration``) or Qwen2-VL-style (``Qwen2VLForConditionalGeneration``) model, found by
  :func:`mmaccel.models.parts.find_parts` from config attributes and submodules, not from the model's name; it reads
  the token layout of every image as :class:`~.base.ImageGrid` s.
- :func:`_attach_outer` -- the first pre-hook of every method: the layout of an image prefill, before any method
  shortens the ids.
- The vision tower's [CLS] attention (:func:`_attach_cls_capture`), for the pre-LLM methods that rank by it and for
  ToMe's projected layer.

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
different sizes, padded to one length; kept tokens spread over a different number of crop rows) are evened out
(:func:`_even_rows`): longer rows drop padding tokens (attention-mask 0: no token attends to them, so their outputs do
not change), and rows still shorter take back dropped newline tokens of their crop grids (their outputs then differ
from a batch-1 run by those newlines); if neither suffices a ValueError says so. Left padding is carried by the 2-D
mask.
"""
from __future__ import annotations

import copy
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..kernels.hf import hooked_cache
from ..models.parts import UnsupportedModelError, find_parts, held_tower, vit_layers
from .base import ImageGrid, _hook
from .plan import TokenPlan

__all__ = ["VLMParts"]


@dataclass
class VLMParts:
    """The parts of a vision-language model that the methods hook (found by :func:`~mmaccel.models.parts.find_parts`)
    and the token layout of its images.

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
        """The parts (found by :func:`mmaccel.models.parts.find_parts`), or a string saying why ``model`` is not a
        supported VLM."""
        try:
            found = find_parts(model)
        except UnsupportedModelError:
            found = None
        inner = found.inner if found is not None else model
        image_token_id = getattr(getattr(inner, "config", None), "image_token_id", None)
        if found is None or found.language_model is None or image_token_id is None or \
                getattr(inner, "language_model", None) is not found.language_model:
            return f"it is not a vision-language model with a language_model and an image token; supported: " \
                   f"{cls.SUPPORTED}"
        video = getattr(inner.config, "video_token_id", None)
        video = None if video is None else int(video)
        if found.family == "anyres":
            if not isinstance(getattr(inner, "image_newline", None), torch.Tensor) or \
                    "mm_encoder_outputs" not in inspect.signature(inner.forward).parameters:
                return "an AnyRes model without an image_newline embedding or an mm_encoder_outputs argument; " \
                       f"supported: {cls.SUPPORTED}"
            return cls(inner, found.language_model, found.tower, int(image_token_id), "anyres", video)
        if found.family == "llava":
            return cls(inner, found.language_model, found.tower, int(image_token_id), "llava")
        if found.family == "qwen2_vl":
            return cls(inner, found.language_model, found.tower, int(image_token_id), "qwen2_vl", video)
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
    #: ``(grids, media) -> [(score [n], keys [n, d]) per grid]`` where a method reads the tower's token scores
    #: (:func:`_attach_tower_scores`)
    tower_scores: Any = None
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



# ------------------------------------------------------------------------------------- vision-tower dominance
#: The attention function registered with transformers' ``AttentionInterface`` that records the attention each
#: key receives (:func:`tower_score_attention`); set on the config copy of one tower attention module only.
SCORE_ATTENTION = "mmaccel_tower_scores"
_SCORE_ATTR = "_mmaccel_tower_scores"
_QUERY_CHUNK = 256  # queries per softmax in :func:`tower_score_attention`


def _tower_has_cls(tower: nn.Module) -> bool:
    """Whether the tower's embeddings hold a [CLS] token (``class_embedding`` / ``cls_token``), read from the module."""
    tower = held_tower(tower)
    embeddings = getattr(tower, "embeddings", None) or getattr(getattr(tower, "vision_model", None), "embeddings", None)
    return hasattr(embeddings, "class_embedding") or hasattr(embeddings, "cls_token")


def _feature_block(parts: VLMParts) -> int | str:
    """Index of the tower block whose output LLaVA projects (``vision_feature_layer``), or why there is none."""
    layers = vit_layers(parts.tower)
    if layers is None:
        return "its vision tower has no encoder.layers"
    feature_layer = parts.inner.config.vision_feature_layer
    if not isinstance(feature_layer, int):
        return "a list of vision_feature_layer values is not supported"
    h = feature_layer if feature_layer >= 0 else len(layers) + 1 + feature_layer
    if not 1 <= h <= len(layers):
        return f"vision_feature_layer {feature_layer} is not the output of a transformer block"
    return h - 1


def _cls_layer(parts: VLMParts) -> int | str:
    """Index of the tower block whose output LLaVA projects, or why there is none (also: the tower has no [CLS])."""
    if vit_layers(parts.tower) is not None and not _tower_has_cls(parts.tower):
        return "its vision tower has no [CLS] token (e.g. SigLIP)"
    return _feature_block(parts)


#: Where a dominance score comes from: ``"auto"`` ([CLS] attention where the tower has a [CLS] token, else the
#: attention each token receives), ``"cls"`` or ``"received"`` (:func:`received_attention`, also on a [CLS] tower).
SCORES = ("auto", "cls", "received")


def _score_module(parts: VLMParts, score: str = "auto") -> tuple[nn.Module, bool] | str:
    """The tower attention module whose scores rank the visual tokens, and whether they are [CLS] attention; or why
    there is none.

    LLaVA-style and AnyRes towers: the block LLaVA projects (``vision_feature_layer``); [CLS] attention if the
    embeddings hold a [CLS] token (and ``score`` is not ``"received"``), else the attention each token receives.
    Qwen2-VL towers: the last block with attention over the whole image (the last of
    ``vision_config.fullatt_block_indexes`` where the tower has windowed blocks, Qwen2.5-VL; else the last block).
    """
    has_cls = parts.kind != "qwen2_vl" and _tower_has_cls(parts.tower)
    if score == "cls" and not has_cls:
        return "its vision tower has no [CLS] token (read from its embeddings): use score='auto' or 'received'"
    if parts.kind == "qwen2_vl":
        blocks = getattr(held_tower(parts.tower), "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or not len(blocks) or \
                not all(hasattr(getattr(b, "attn", None), "config") for b in blocks):
            return "its vision tower has no blocks with an attention module (blocks[i].attn)"
        full = getattr(getattr(parts.tower, "config", None), "fullatt_block_indexes", None) or [len(blocks) - 1]
        return blocks[full[-1]].attn, False
    index = _feature_block(parts)
    if isinstance(index, str):
        return index
    if parts.kind == "anyres" and not callable(getattr(parts.inner, "pack_image_features", None)):
        return "an AnyRes model without pack_image_features (how the crops' tokens are laid out)"
    layer = vit_layers(parts.tower)[index]
    attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
    if has_cls and score != "received":
        return attn, True
    if not hasattr(attn, "config"):
        return "its tower has no [CLS] token and its attention modules no config (the received-attention score is " \
               "read through transformers' AttentionInterface)"
    return attn, False


def received_attention(probs: torch.Tensor) -> torch.Tensor:
    """The CLS-free dominance score: the attention each token receives, averaged over heads and queries.

    A token that many tokens attend to carries the image's summary, as [CLS]-attended tokens do in a CLIP tower; the
    mean of the attention columns ranks the same tokens without a [CLS] query (the dominance used by
    :class:`~.visionzip.VisionZip` (Yang et al., 2024, arXiv 2412.04467), :class:`~.prumerge.PruMerge` (Shang et al.,
    2024, arXiv 2403.15388) on towers without [CLS]).

    Parameters
    ----------
    probs : torch.Tensor
        [B, H, Nq, Nk] attention probabilities (rows sum to 1).

    Returns
    -------
    torch.Tensor
        [B, Nk] float32; each row sums to 1.
    """
    return probs.float().mean(dim=(1, 2))


def tower_score_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs):
    """The attention function (``AttentionInterface``) of the one scored tower module: softmax attention that
    hands :func:`received_attention` [B, Nk] and the keys (mean over heads, [B, Nk, d], after the tower's RoPE if
    any) to the module's recorders, then returns the output of the module's own implementation (eager: computed from
    the same probabilities, with no attention weights returned; other implementations: theirs). The probabilities
    are computed 256 queries at a time (float32), so the temporaries stay [B, H, 256, Nk].

    ``query`` [B, H, Nq, d], ``key``/``value`` [B, H, Nk, d]. A Qwen2-VL tower calls it once per image (per window
    in windowed blocks): the score is the attention received within that block of tokens.

    Raises
    ------
    ValueError
        Under flash attention's packed sequences (``cu_seq_lens_k``): load the model with sdpa or eager attention.
    """
    recorders, original = getattr(module, _SCORE_ATTR, ((), None))
    if kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError("the tower's received-attention score needs sdpa or eager attention in the vision tower, "
                         "not flash attention: load the model with attn_implementation='sdpa'")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    batch, heads, n_q, _ = query.shape
    eager = original in (None, "eager", SCORE_ATTENTION)
    keys_t = key.float().transpose(-1, -2)
    received = torch.zeros(batch, key.shape[-2], device=query.device)
    outs = []
    for start in range(0, n_q, _QUERY_CHUNK):  # softmax is per query: chunks bound the [B, H, q, Nk] temporaries
        logits = (query[:, :, start: start + _QUERY_CHUNK].float() @ keys_t) * scale
        if attention_mask is not None:
            mask = attention_mask[..., : key.shape[-2]]
            if mask.dim() == 4 and mask.shape[-2] == n_q:
                mask = mask[:, :, start: start + _QUERY_CHUNK]
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
        probs = logits.softmax(dim=-1)
        received += probs.sum(dim=(1, 2))
        if eager:
            outs.append(probs.to(value.dtype) @ value)
    if recorders:
        scores, mean_keys = received / (heads * n_q), key.float().mean(dim=1)  # = received_attention(all probs)
        for record in recorders:
            record(scores, mean_keys)
    if eager:
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[original](module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)


def _register_score_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SCORE_ATTENTION, tower_score_attention)


_register_score_attention()


def _attach_received_capture(attn: nn.Module, record, undo: list) -> None:
    """Give one tower attention module a config copy whose implementation is :data:`SCORE_ATTENTION`, and add
    ``record`` to its recorders; undone on exit (the shared config and the other modules are not touched). Methods
    applied together each add their recorder to the one module."""
    if hasattr(attn, _SCORE_ATTR):
        recorders = getattr(attn, _SCORE_ATTR)[0]
        recorders.append(record)
        undo.append(lambda: recorders.remove(record))
        return
    config = attn.config
    own = copy.copy(config)
    own._attn_implementation_internal = SCORE_ATTENTION
    attn.config = own
    setattr(attn, _SCORE_ATTR, ([record], config._attn_implementation))

    def restore():
        attn.config = config
        delattr(attn, _SCORE_ATTR)

    undo.append(restore)


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
        state.vision.setdefault("score_calls", []).append((probs.mean(dim=1)[:, 1:], k.mean(dim=1)[:, 1:]))

    _hook(undo, attn, pre, pre=True)


def _attach_tower_scores(parts: VLMParts, state: _RunState, undo: list, score: str = "auto") -> None:
    """Capture a dominance score and the keys of every visual token the tower encodes, and set
    ``state.tower_scores(grids, media)`` to read them per grid (:func:`_grid_scores`).

    The score is the [CLS] -> patch attention where the tower has a [CLS] token (``score="auto"``), else
    :func:`received_attention` at the module :func:`_score_module` picks (on a [CLS] tower, the columns of the
    [CLS] token and any register tokens are dropped). AnyRes models: the per-crop scores are laid out as the crops'
    tokens are, by the model's own ``pack_image_features`` (unpadding and resampling included), whose arguments are
    recorded per call; a Qwen2-VL tower's scores are taken back from its window order and averaged over each merged
    group of patches.
    """
    attn, is_cls = _score_module(parts, score)
    calls = state.vision
    if is_cls:
        _attach_cls_capture(parts, state, undo)
    elif parts.kind == "qwen2_vl":
        def tower_pre(module, args, kwargs):
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            calls.setdefault("score_chunks", []).append((grid, []))

        def tower_post(module, args, kwargs, output):
            grid, chunks = calls["score_chunks"].pop()
            if chunks:
                calls.setdefault("score_calls", []).append(_merged_scores(parts, grid, chunks))

        _hook(undo, parts.tower, tower_pre, pre=True)
        _hook(undo, parts.tower, tower_post, pre=False)
        _attach_received_capture(attn, lambda s, k: calls["score_chunks"][-1][1].append((s, k))
                                 if calls.get("score_chunks") else None, undo)
    else:
        prefix = 0
        if _tower_has_cls(parts.tower):
            prefix = 1 + int(getattr(held_tower(parts.tower).config, "num_register_tokens", 0) or 0)
        _attach_received_capture(
            attn, lambda s, k: calls.setdefault("score_calls", []).append((s[:, prefix:], k[:, prefix:])), undo)
    if parts.kind == "anyres":
        _attach_pack_record(parts, state, undo)
    state.tower_scores = lambda grids, media: _grid_scores(parts, state, grids, media)


def _merged_scores(parts: VLMParts, grid_thw: torch.Tensor, chunks: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One Qwen2-VL tower call: the per-patch scores and keys of its attention calls (in the tower's order) -> [1, T]
    scores and [1, T, d] keys of its T merged tokens (mean over each ``merge x merge`` group), in the merger's output
    order. A windowed tower (``vision_config.window_size``, Qwen2.5-VL) orders its patches by window: that order is
    undone with transformers' own ``get_vision_window_index``."""
    scores = torch.cat([s.reshape(-1) for s, _ in chunks])
    keys = torch.cat([k.reshape(-1, k.shape[-1]) for _, k in chunks])
    config = parts.tower.config
    unit = config.spatial_merge_size ** 2
    scores, keys = scores.view(-1, unit).mean(dim=1), keys.view(-1, unit, keys.shape[-1]).mean(dim=1)
    if getattr(config, "window_size", None) and grid_thw is not None:
        from transformers.vision_utils import get_vision_window_index

        window_index, _ = get_vision_window_index(grid_thw, spatial_merge_size=config.spatial_merge_size,
                                                  window_size=config.window_size, patch_size=config.patch_size)
        order = torch.argsort(window_index.to(scores.device))
        scores, keys = scores[order], keys[order]
    return scores[None], keys[None]


def _attach_pack_record(parts: VLMParts, state: _RunState, undo: list) -> None:
    """AnyRes: record the arguments of every ``pack_image_features`` call of this one instance (an instance attribute
    wrapping the bound method, removed on exit), so that the crops' scores can be packed the same way."""
    inner = parts.inner
    previous = inner.__dict__.get("pack_image_features")  # another method's record (methods applied together)
    original = inner.pack_image_features
    signature = inspect.signature(original)

    @functools.wraps(original)
    def pack(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        crops = [int(f.shape[0]) for f in bound.arguments["image_features"]]
        state.vision["pack"] = (crops, bound, inspect.unwrap(original))
        return original(*args, **kwargs)

    def restore():
        if previous is None:
            del inner.pack_image_features
        else:
            inner.pack_image_features = previous

    inner.pack_image_features = pack
    undo.append(restore)


def _grid_scores(parts: VLMParts, state: _RunState, grids: list[ImageGrid], media: str) -> list[tuple]:
    """The dominance score [n] and keys [n, d] of every grid's ``t x h x w`` raster (the tokens
    :meth:`~.pre_llm.ImageReducer.plan_image` gets), from the last tower calls, which are then forgotten.

    Raises
    ------
    ValueError
        If the tower's scores were captured for fewer tokens than the prompt has (the tower did not run through the
        hooked module), or for an AnyRes video on a model without ``apply_pooling``.
    """
    calls = state.vision.pop("score_calls", [])
    pack = state.vision.pop("pack", None)
    scores = torch.cat([s for s, _ in calls]) if calls else torch.empty(0, 0)
    keys = torch.cat([k for _, k in calls]) if calls else torch.empty(0, 0, 0)
    short = ValueError("the vision tower's token scores were not captured for every image of the prompt: apply the "
                       "method to the model whose tower encodes the images")
    if parts.kind == "qwen2_vl":
        scores, keys = scores.reshape(-1), keys.reshape(-1, keys.shape[-1])
        sizes = [g.tokens for g in grids]
        if scores.numel() < sum(sizes):
            raise short
        start = scores.numel() - sum(sizes)
        return list(zip(scores[start:].split(sizes), keys[start:].split(sizes)))
    if parts.kind == "llava":
        if scores.shape[0] < len(grids):
            raise short
        return list(zip(scores[-len(grids):], keys[-len(grids):]))
    both = torch.cat([scores[..., None], keys], dim=-1)  # [crops, N, 1 + d]: packed together, split after
    if media == "video":
        pooling = getattr(parts.inner, "apply_pooling", None)
        frames = sum(g.t for g in grids)
        if pooling is None:
            raise ValueError("this AnyRes model pools video frames without apply_pooling: the tower's scores cannot "
                             "be laid out like its video tokens")
        if both.shape[0] < frames:
            raise short
        packed = [f.reshape(-1, f.shape[-1]) for f in pooling(both[-frames:]).split([g.t for g in grids])]
    else:
        if pack is None or both.shape[0] < sum(pack[0]):
            raise short
        crops, bound, original = pack
        args = {**bound.arguments, "image_features": list(both[-sum(crops):].split(crops))}
        if "image_newline" in bound.signature.parameters:
            args["image_newline"] = None  # the newline column is structural: grids exclude it
        call = bound.signature.bind(**args)
        packed = original(*call.args, **call.kwargs)[0]
    out, k = [], 0
    for feats in packed:
        offset = 0
        while offset < feats.shape[0]:
            g = grids[k]
            n = g.t * g.h * g.w
            out.append((feats[offset: offset + n, 0], feats[offset: offset + n, 1:]))
            offset += n
            k += 1
    if k != len(grids):
        raise short
    return out
