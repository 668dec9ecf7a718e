"""Find the parts of a model -- vision tower, projector, language model, LM head, text config -- in one place.

Every caller that needs a piece of a vision-language model (the visual-token methods, the measuring harness, the
speculative drafters, the app) asks :func:`find_parts` instead of walking attributes itself. The layout is read from
the module's submodules and its config, never from the model's name:

============  ==========================================================================  ===========================
family        found by                                                                    examples
============  ==========================================================================  ===========================
``llava``     ``vision_tower`` + ``multi_modal_projector`` + ``language_model``, config    LlavaForConditionalGeneration
              ``vision_feature_select_strategy`` and no ``image_grid_pinpoints``           (a fixed grid per image)
``anyres``    as ``llava``, with ``image_grid_pinpoints`` (base image + crops)             LLaVA-NeXT, LLaVA-OneVision
``qwen2_vl``  ``visual`` (projector: its ``merger``) + ``language_model``, config          Qwen2-VL, Qwen2.5-VL
              ``vision_config.spatial_merge_size``
``vlm``       another ``language_model`` beside a ``vision_tower`` / ``visual`` /          (tower and LM only)
              ``vision_model``
``causal_lm`` a decoder with ``layers`` (``get_decoder()``, ``model`` or the module)       Llama, Qwen2, SmolLM2
``vision``    a bare ViT (``encoder.layer(s)``) or an open_clip model (``visual``)         CLIPVisionModel, Dinov2Model
============  ==========================================================================  ===========================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

__all__ = [
    "FAMILIES",
    "ModelParts",
    "UnsupportedModelError",
    "find_parts",
    "held_tower",
    "language_model",
    "vision_tower",
    "vit_layers",
]

#: The layouts :func:`find_parts` recognises (``ModelParts.family``).
FAMILIES = ("llava", "anyres", "qwen2_vl", "vlm", "causal_lm", "vision")

_TOWER_NAMES = ("vision_tower", "visual", "vision_model")


class UnsupportedModelError(ValueError):
    """A model's layout is not one a caller supports (the message names the model's class and what is supported)."""


@dataclass(frozen=True)
class ModelParts:
    """The parts of one model instance, found from its submodules and config.

    Attributes
    ----------
    model : nn.Module
        The model as given.
    family : str
        One of :data:`FAMILIES`.
    inner : nn.Module
        The module that holds the parts: ``model.model`` of a ``*ForConditionalGeneration`` / ``*ForCausalLM``
        (``LlavaModel``, ``Qwen2VLModel``, ``LlamaModel``), else ``model``. For ``vision``: the tower.
    language_model : nn.Module or None
        The decoder stack, with ``.layers`` (an ``nn.ModuleList``); ``None`` for a bare vision model.
    lm_head : nn.Module or None
        The output embeddings (``get_output_embeddings()``), ``None`` when the model given has none (e.g. a
        ``LlavaModel`` without its head, a bare decoder).
    text_config : Any or None
        The language model's config (``config.get_text_config()``), ``None`` for a bare vision model.
    tower : nn.Module or None
        The vision encoder; ``None`` for a text-only model.
    projector : nn.Module or None
        What maps tower features into the LM's embedding space: LLaVA's ``multi_modal_projector``, Qwen2-VL's
        ``visual.merger``; ``None`` where there is none (text-only, bare towers) or it is not known (``vlm``).
    """

    model: nn.Module
    family: str
    inner: nn.Module
    language_model: nn.Module | None = None
    lm_head: nn.Module | None = None
    text_config: Any = None
    tower: nn.Module | None = None
    projector: nn.Module | None = None

    SUPPORTED: ClassVar[str] = (
        "LLaVA (LlavaForConditionalGeneration / LlavaModel), AnyRes LLaVA-NeXT / LLaVA-OneVision, Qwen2-VL / "
        "Qwen2.5-VL, other models with a language_model beside a vision_tower / visual / vision_model, causal LMs "
        "whose decoder has an nn.ModuleList 'layers' (Llama, Qwen2, ...), and bare ViTs (HF CLIP / SigLIP / DINOv2 "
        "vision models, open_clip)"
    )

    @property
    def is_vlm(self) -> bool:
        """Whether the model has both a vision tower and a language model."""
        return self.tower is not None and self.language_model is not None

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers of the language model.

        Raises
        ------
        UnsupportedModelError
            For a bare vision model (no language model).
        """
        if self.language_model is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} has no language model (family "
                                        f"{self.family!r}): pass a causal LM or a vision-language model")
        return self.language_model.layers


def _module(obj: Any, name: str) -> nn.Module | None:
    value = getattr(obj, name, None)
    return value if isinstance(value, nn.Module) else None


def _has_layers(module: nn.Module | None) -> bool:
    return module is not None and isinstance(getattr(module, "layers", None), nn.ModuleList)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else getattr(config, "text_config", config)


def _lm_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def find_parts(model: nn.Module) -> ModelParts:
    """The parts of ``model`` (see the module notes for the layouts), read from its submodules and config.

    Parameters
    ----------
    model : nn.Module
        A transformers model (``*ForConditionalGeneration``, its inner ``*Model``, ``*ForCausalLM``, a bare decoder
        or vision model) or an open_clip model.

    Returns
    -------
    ModelParts

    Raises
    ------
    UnsupportedModelError
        If ``model`` is not an ``nn.Module`` or has none of the layouts; the message lists the supported ones.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"expected a torch nn.Module, got {type(model).__name__}")
    owners = [m for m in (_module(model, "model"), model) if m is not None]
    for inner in owners:
        lm = _module(inner, "language_model")
        if lm is not None and _has_layers(lm):
            return _vlm_parts(model, inner, lm)
    decoder = _decoder(model)
    if decoder is not None:
        config = getattr(model, "config", None) or getattr(decoder, "config", None)
        return ModelParts(model, "causal_lm", decoder, decoder, _lm_head(model), _text_config(config))
    if vit_layers(model) is not None:
        visual = _module(model, "visual")  # open_clip: the CLIP model's image tower
        tower = visual if visual is not None and vit_layers(visual) is not None else model
        return ModelParts(model, "vision", tower, tower=tower)
    raise UnsupportedModelError(f"cannot find the parts of {type(model).__name__}: no language_model, no decoder "
                                f"with 'layers' and no ViT blocks; supported: {ModelParts.SUPPORTED}")


def _vlm_parts(model: nn.Module, inner: nn.Module, lm: nn.Module) -> ModelParts:
    """A model with a ``language_model``: LLaVA-family, Qwen2-VL-family or another tower + LM layout."""
    config = getattr(inner, "config", None) or getattr(model, "config", None)
    found = {"model": model, "inner": inner, "language_model": lm, "lm_head": _lm_head(model),
             "text_config": _text_config(config) if config is not None else getattr(lm, "config", None)}
    tower, projector = _module(inner, "vision_tower"), _module(inner, "multi_modal_projector")
    if tower is not None and projector is not None and \
            getattr(config, "vision_feature_select_strategy", None) in ("default", "full"):
        family = "anyres" if getattr(config, "image_grid_pinpoints", None) is not None else "llava"
        return ModelParts(family=family, tower=tower, projector=projector, **found)
    visual = _module(inner, "visual")
    if visual is not None and hasattr(getattr(config, "vision_config", None), "spatial_merge_size"):
        return ModelParts(family="qwen2_vl", tower=visual, projector=_module(visual, "merger"), **found)
    for name in _TOWER_NAMES:
        if _module(inner, name) is not None:
            return ModelParts(family="vlm", tower=_module(inner, name), projector=projector, **found)
    return ModelParts(family="causal_lm", **found)  # a language_model alone: a text model in a VLM's clothes


def _decoder(model: nn.Module) -> nn.Module | None:
    """The decoder stack of a text model (``get_decoder()``, ``model.model`` or the module itself), or ``None``."""
    get = getattr(model, "get_decoder", None)
    candidates = []
    if callable(get):
        try:
            candidates.append(get())
        except (AttributeError, NotImplementedError, TypeError):  # a base class without a decoder
            pass
    candidates += [_module(model, "model"), model]
    return next((c for c in candidates if isinstance(c, nn.Module) and _has_layers(c)), None)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of ``model`` (see :func:`find_parts`), or ``None`` for a text-only or unknown model."""
    try:
        return find_parts(model).tower
    except UnsupportedModelError:
        return None


def language_model(model: nn.Module) -> nn.Module | None:
    """The decoder stack (with ``.layers``) of ``model`` (see :func:`find_parts`): a VLM's ``language_model``, a
    causal LM's decoder; ``None`` for a bare vision model or an unknown one."""
    try:
        return find_parts(model).language_model
    except UnsupportedModelError:
        return None


def held_tower(tower: nn.Module) -> nn.Module:
    """The tower itself, or the one a wrapper that holds it as ``.tower`` and can ``release()`` it holds
    (:class:`mmaccel.vision_tokens.BatchedTower`)."""
    held = getattr(tower, "tower", None)
    return held if isinstance(held, nn.Module) and hasattr(tower, "release") else tower


def vit_layers(tower: nn.Module) -> nn.ModuleList | None:
    """The transformer blocks of a ViT, or ``None`` if it has none.

    Looks for ``encoder.layers`` (HF CLIP / SigLIP), ``encoder.layer`` (HF DINOv2), the same under ``vision_model``,
    ``visual.transformer.resblocks`` / ``transformer.resblocks`` (an open_clip model / its ``VisionTransformer``);
    for a wrapper such as :class:`~mmaccel.vision_tokens.BatchedTower`, those of the tower it holds
    (:func:`held_tower`).
    """
    tower = held_tower(tower)
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
