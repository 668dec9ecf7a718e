"""The contract of the visual-token methods: what every method is, and the image layout it plans over.

A method is a small dataclass that says only what is new about it (how it picks or merges tokens); everything that
touches a transformers model lives once, in the base of its stage:

- :class:`VisionTokenMethod` (here) -- ``keep_ratio`` in (0, 1] and ``apply(model)``, a context manager that attaches
  per-instance forward hooks (or swaps ``__class__`` on one instance's modules, as ToMe does) and removes them on exit.
  Nothing is patched at class level.
- :class:`ImageGrid` (here) -- the LLM-side token layout of one image, the unit a method plans over.
- :class:`~.adapters.VLMParts` (:mod:`.adapters`) -- the parts the methods hook and the layout of every image,
  shared by both stages, with the run state and the hooks both attach.
- :class:`~.pre_llm.ImageReducer` (:mod:`.pre_llm`) -- pre-LLM reduction (between projector and LLM).
- :class:`~.in_llm.LayerPruner` (:mod:`.in_llm`) -- in-LLM pruning at decoder layer ``K``.

Positions. Kept tokens keep their original positions: ``generate`` passes the original ``position_ids`` (or, for
Qwen2-VL, the 4-row text + M-RoPE ids) and every plan gathers them, never renumbers them. A forward without
``position_ids`` on a reduced cache gets ``arange(q) + past + (L - K)``, i.e. the original positions too (Qwen2-VL
derives its own ids before the language model and needs ``generate``'s ids after a reduction). A pre-LLM method
built with ``positions="contiguous"`` instead renumbers the reduced prompt ``0..K-1`` (LLaVA-style models; decode
steps continue from ``K``), as the LLM sees a prompt whose visual tokens were reduced before it was built.

Composition: a pre-LLM and an in-LLM method can be applied together (``with Pooling(...).apply(m), FastV(...).apply(m)``
in either order); the in-LLM method then prunes among the visual tokens the pre-LLM one kept. Two methods of the same
stage on one model are not supported.

Outputs: a forward under a reduction returns hidden states / logits for the kept positions only (``generate`` reads
the last one); ``method.telemetry["kept_positions"]`` maps them back to the prompt.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..models.parts import UnsupportedModelError
from .plan import TokenPlan

__all__ = [
    "ImageGrid",
    "UnsupportedModelError",
    "VisionTokenMethod",
    "check_keep_ratio",
    "kept_count",
]


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
    """Tokens kept out of ``n`` at ``keep_ratio``: ``round(keep_ratio * n)``, at least 1, exactly ``n`` at 1.0 (and 0
    of 0).

    Raises
    ------
    ValueError
        If ``n`` is negative or ``keep_ratio`` is not in (0, 1] (:func:`check_keep_ratio`).
    """
    keep_ratio = check_keep_ratio(keep_ratio)
    if n < 0:
        raise ValueError(f"a token count must be >= 0, got {n}")
    return n if keep_ratio >= 1.0 or n == 0 else max(1, min(n, round(keep_ratio * n)))


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



def _plan_row(plan: TokenPlan, b: int) -> TokenPlan:
    """Row ``b`` of a batched plan, as a batch-1 plan."""
    def row(t):
        return None if t is None else t[b: b + 1]

    return TokenPlan(index=row(plan.index), length=plan.length, assign=row(plan.assign), weight=row(plan.weight))



# ------------------------------------------------------------------------------------------------ the image layout
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

