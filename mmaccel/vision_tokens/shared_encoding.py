"""Encode one video's frames through a LLaVA vision tower once, and hand that output to every method that only reads
it: a sweep of post-encoder methods on a long clip then pays the tower once per clip instead of once per method."""
from __future__ import annotations

import contextlib
import time

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..kernels._common import synchronize
from ..models.parts import held_tower
from .batched_tower import BatchedTower, _kept_layers, fixed_grid_llava

__all__ = ["SharedVisionEncoding", "reads_tower_output_only"]


def reads_tower_output_only(method) -> bool:
    """Whether a visual-token method leaves the vision tower's forward alone and only reads what it returns, so it
    can be given a tower output computed earlier: no method (all tokens), a pre-LLM reducer that needs no tower
    attention scores (pooling, temporal ToMe, AIM's merging), or an in-LLM pruner (FastV, ATP, ...). In-tower
    methods (ToMe) and tower-scored reducers (VisionZip, PruMerge) hook the tower's blocks and need it to run."""
    if method is None:
        return True
    return (getattr(method, "stage", "") in ("pre-llm", "in-llm")
            and not getattr(method, "needs_tower_scores", False))


class _StoredTower(nn.Module):
    """The model's tower, answering a call with the stored output when it gets the stored pixels again."""

    def __init__(self, tower: nn.Module, owner: SharedVisionEncoding):
        super().__init__()
        self.tower, self.owner = tower, owner
        self.config = tower.config

    def forward(self, pixel_values: torch.Tensor, *args, **kwargs):
        stored = self.owner.stored(pixel_values)
        if stored is None:
            return self.tower(pixel_values, *args, **kwargs)
        self.owner.hits += 1
        # a new output object per call: a caller (BatchedVisionEncoding's release) may clear the one it got
        return BaseModelOutputWithPooling(last_hidden_state=stored.last_hidden_state,
                                          pooler_output=stored.pooler_output, hidden_states=stored.hidden_states)


class SharedVisionEncoding:
    """One vision-tower pass over a clip's frames, reused by every run that gets the same ``pixel_values``.

    >>> shared = SharedVisionEncoding(model)
    >>> seconds = shared.encode(inputs["pixel_values"])  # the tower runs here, once
    >>> for method in ("pooling:keep_ratio=0.0625", "temporal-tome:keep_ratio=0.0625"):
    ...     with shared.applied():  # the tower is not run again for these pixels
    ...         out = generate(model, inputs, vision=method)
    >>> shared.clear()

    :meth:`encode` runs the tower ``batch`` frames at a time (:class:`~.batched_tower.BatchedTower`) and stores only
    the hidden states LLaVA's projector reads (``vision_feature_layer``): ``[N, P, D_vision]`` per kept layer, e.g.
    228 MB for 1,024 frames of DINOv2 ViT-S/14 (145 x 384 fp32). Inside :meth:`applied` the model's
    ``vision_tower`` attribute is a wrapper that returns the stored output when it is called with pixels equal to the
    encoded ones (same shape and values: ``torch.equal``) and runs the real tower on any other input (a warm-up
    clip). The projector, the visual-token method and the language model run as usual, so a run's output is the
    output of the unshared run (tested token for token). Only this model instance changes, and only inside
    :meth:`applied`.

    Use it only for methods that leave the tower alone (:func:`reads_tower_output_only`); a method that hooks the
    tower's blocks would see no forward. A run inside :meth:`applied` times the tower at almost zero: the caller adds
    :attr:`encode_s` to that run's vision-encoder seconds, and its peak memory does not see the stored output (it
    was allocated before the run).

    Parameters
    ----------
    model : nn.Module
        A LLaVA-1.5-style model (``LlavaForConditionalGeneration``: one tensor of fixed-grid pixels per image).
    batch : int, optional
        Frames per tower call in :meth:`encode`, ``>= 1`` (default: all at once). Give the unshared runs' batch
        (:class:`~.batched_tower.BatchedVisionEncoding`'s) for outputs equal to theirs bit for bit.

    Attributes
    ----------
    encode_s : float or None
        Seconds of the last :meth:`encode`'s tower forwards (after a device synchronize); ``None`` before one.
    hits : int
        Calls answered from the stored output since the last :meth:`encode`.

    Raises
    ------
    ValueError
        ``batch`` given and not an integer ``>= 1``, or a model that is not a fixed-grid LLaVA (AnyRes and Qwen2-VL pack their
        pixels differently).
    """

    def __init__(self, model: nn.Module, batch: int | None = None):
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(f"vision batch must be an integer >= 1, got {batch!r}; e.g. 64")
        parts = fixed_grid_llava(model, "a shared vision encoding")
        self.inner, self.batch = parts.inner, batch
        self._pixels: torch.Tensor | None = None
        self._output: BaseModelOutputWithPooling | None = None
        self.encode_s: float | None = None
        self.hits = 0

    def stored(self, pixel_values: torch.Tensor) -> BaseModelOutputWithPooling | None:
        """The stored output if ``pixel_values`` are the encoded pixels (in any dtype or device), else ``None``."""
        pixels = self._pixels
        if pixels is None or pixel_values.shape != pixels.shape:
            return None
        if pixel_values is not pixels and not torch.equal(pixel_values.to(pixels.device, pixels.dtype), pixels):
            return None
        return self._output

    def encode(self, pixel_values: torch.Tensor) -> float:
        """Run the tower on ``pixel_values`` [N, 3, S, S] (the model's device and dtype) and store what the projector
        reads, replacing any earlier encoding; returns (and keeps in :attr:`encode_s`) the tower seconds."""
        self.clear()
        tower = held_tower(self.inner.vision_tower)  # the model's own tower, under a BatchedTower if one is there
        param = next(tower.parameters())
        pixels = pixel_values.to(param.device, param.dtype)
        batched = BatchedTower(tower, self.batch or max(1, int(pixels.shape[0])), _kept_layers(self.inner, tower),
                               keep_last=False)
        with torch.no_grad():
            synchronize(param.device)
            t0 = time.perf_counter()
            out = batched(pixels, output_hidden_states=True)
            synchronize(param.device)
            self.encode_s = time.perf_counter() - t0
        self._pixels, self._output = pixels, out
        return self.encode_s

    def clear(self) -> None:
        """Drop the stored pixels and output (their memory is freed once no run holds them)."""
        self._pixels, self._output, self.encode_s, self.hits = None, None, None, 0

    @contextlib.contextmanager
    def applied(self):
        """Inside: the model's tower answers the encoded pixels from the store (see the class docstring); on exit
        the model's own tower (or whatever wrapper was there, e.g. a :class:`~.batched_tower.BatchedTower`) is back."""
        original = self.inner.vision_tower
        self.inner.vision_tower = _StoredTower(original, self)
        try:
            yield self
        finally:
            self.inner.vision_tower = original
