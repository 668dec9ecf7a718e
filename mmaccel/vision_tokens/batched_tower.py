"""Encode many images (a long video's frames) through a LLaVA vision tower a batch at a time, keeping only the hidden
states the projector reads, so that the tower's peak memory no longer grows with every layer of every frame."""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .adapters import VLMParts


def _kept_layers(inner: nn.Module, tower: nn.Module) -> set[int]:
    """Indices (non-negative) of the tower's hidden states that ``get_image_features`` reads."""
    layers = getattr(inner.config, "vision_feature_layer", -1)
    layers = [layers] if isinstance(layers, int) else list(layers)
    n = int(tower.config.num_hidden_layers) + 1  # the embeddings, then every block
    return {i % n for i in layers}


def _copy_into(outputs: dict, name, value: torch.Tensor | None, start: int, total: int) -> None:
    """Copy one slice's ``value`` [b, ...] into ``outputs[name]`` [total, ...] at ``start``, allocating that tensor
    at the first slice: a sliced run then holds one output, not a list of slices plus their concatenation."""
    if value is None:
        return
    if name not in outputs:
        outputs[name] = value.new_empty((total, *value.shape[1:]))
    outputs[name][start: start + value.shape[0]] = value


def fixed_grid_llava(model: nn.Module, what: str) -> VLMParts:
    """``model``'s parts if it is a fixed-grid LLaVA (one tensor of pixels per image), for ``what`` needs one.

    Raises
    ------
    ValueError
        Any other model (AnyRes and Qwen2-VL pack their pixels differently; a text-only model has no tower).
    """
    parts = VLMParts.find(model)
    if isinstance(parts, str) or parts.kind != "llava":
        why = parts if isinstance(parts, str) else f"it is a {parts.kind} model"
        raise ValueError(f"{what} supports fixed-grid LLaVA models only; {why}")
    return parts


class BatchedTower(nn.Module):
    """A LLaVA vision tower run on at most ``batch`` images per call.

    ``forward(pixel_values [N, 3, S, S], **kwargs)`` runs the wrapped tower on ``ceil(N / batch)`` slices and returns
    one ``BaseModelOutputWithPooling`` with ``hidden_states`` holding only the ``keep`` layers (the others ``None``):
    what ``LlavaModel.get_image_features`` reads (``hidden_states[vision_feature_layer]``); ``last_hidden_state``
    [N, P, D] and ``pooler_output`` (if the tower gives one) when ``keep_last``, else ``None``. Each slice is copied
    into outputs allocated once, so no list of slices and no concatenation exist beside them, and the other layers'
    hidden states are dropped as soon as their slice is done.
    """

    def __init__(self, tower: nn.Module, batch: int, keep: set[int], keep_last: bool = True):
        super().__init__()
        self.tower, self.batch, self.keep, self.keep_last = tower, batch, keep, keep_last
        self.config = tower.config
        self.last_output: BaseModelOutputWithPooling | None = None

    def release(self) -> None:
        """Drop the tensors of the last output (its ``last_hidden_state`` and ``hidden_states``), which LLaVA keeps
        referenced until its language model has run although only the projector reads them (see
        :class:`BatchedVisionEncoding`)."""
        out, self.last_output = self.last_output, None
        for name in ("last_hidden_state", "hidden_states"):
            # item assignment sets the attribute too; attribute assignment of None would leave the dict entry alive
            if out is not None and name in out:
                out[name] = None

    def forward(self, pixel_values: torch.Tensor, *args, **kwargs) -> BaseModelOutputWithPooling:
        n_images = pixel_values.shape[0]
        outputs: dict = {}
        for start in range(0, n_images, self.batch):
            out = self.tower(pixel_values[start: start + self.batch], *args, **kwargs)
            if self.keep_last:
                _copy_into(outputs, "last", out.last_hidden_state, start, n_images)
                _copy_into(outputs, "pooled", getattr(out, "pooler_output", None), start, n_images)
            for i in self.keep:
                _copy_into(outputs, i, out.hidden_states[i], start, n_images)
            del out
        n = int(self.config.num_hidden_layers) + 1
        self.last_output = BaseModelOutputWithPooling(last_hidden_state=outputs.get("last"),
                                                      pooler_output=outputs.get("pooled"),
                                                      hidden_states=tuple(outputs.get(i) for i in range(n)))
        return self.last_output


class BatchedProjector(nn.Module):
    """A LLaVA projector run on at most ``batch`` images per call, written into one preallocated output.

    ``forward(features [N, P, D_vision])`` -> [N, P, D_text], the wrapped projector's output: LLaVA's projector
    (Linear -> GELU -> Linear) treats every token alone, so slicing over images changes nothing. Only one slice's
    hidden activation ([batch, P, D_text] after the first Linear and the GELU) is alive at a time instead of two
    [N, P, D_text] tensors (648 MiB for 1,024 frames of ``smol-llava``).
    """

    def __init__(self, projector: nn.Module, batch: int):
        super().__init__()
        self.projector, self.batch = projector, batch

    def forward(self, features: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if features.dim() < 3 or features.shape[0] <= self.batch:
            return self.projector(features, *args, **kwargs)
        outputs: dict = {}
        for start in range(0, features.shape[0], self.batch):
            _copy_into(outputs, "out", self.projector(features[start: start + self.batch], *args, **kwargs), start,
                       features.shape[0])
        return outputs["out"]


class BatchedVisionEncoding:
    """Run one LLaVA model's vision tower ``batch`` images at a time, and put the tower back on exit.

    >>> with BatchedVisionEncoding(model, batch=64):
    ...     out = model.generate(**inputs)  # a 1,024-frame clip: the tower's peak is one batch's, not every frame's

    ``LlavaModel.get_image_features`` asks the tower for all hidden states (13 layers for DINOv2 ViT-S/14); for N
    frames that is ``13 * N * P * D`` floats at once (2.9 GB for 1,024 frames of 145 x 384 tokens in fp32, if they
    are all alive together). Batched, only the layers the projector reads are kept for all frames. Measured on
    ``smol-llava`` with 1,024 frames and pooling to 1/16 (exact tensor bytes, ``benchmarks/peak_profile.py``): the
    unbatched peak is the tower's MLP on every frame (2.6 GB); batched, with the projector batched too and a pre-LLM
    reducer shortening the sequence before ``LlavaModel`` merges it (:class:`~.pre_llm.PlacedFeatures`), the peak is
    the language model's prefill (773 MiB: its K/V of the ~9,800 pooled tokens and one layer's activations).
    LLaVA also keeps the tower's output (``image_outputs``) until its language model is done, although only the projector reads it: here a hook on the projector drops its ``last_hidden_state`` and
    ``hidden_states`` once the projector has run, so in this context the model's ``image_outputs`` holds only the
    projected features. The projector runs ``batch`` images at a time too (:class:`BatchedProjector`). The features
    are the same (the tower and the projector see each image alone: no cross-image interaction). Only this model
    instance changes (its ``vision_tower`` and ``multi_modal_projector`` attributes are swapped for a
    :class:`BatchedTower` and a :class:`BatchedProjector` holding them).

    Notes
    -----
    Methods that hook the tower's own output see one batch per call; apply them inside this context (their hooks on
    the tower's inner blocks, e.g. ToMe, are unaffected). Pre-LLM and in-LLM methods (pooling, VisionZip, FastV, ...)
    are unaffected.

    Parameters
    ----------
    model : nn.Module
        A LLaVA-1.5-style model (``LlavaForConditionalGeneration``: one tensor per image).
    batch : int
        Images per tower call, ``>= 1``.

    Raises
    ------
    ValueError
        ``batch`` not an integer ``>= 1``, or a model that is not a fixed-grid LLaVA (AnyRes and Qwen2-VL pack
        their pixels differently).
    """

    def __init__(self, model: nn.Module, batch: int = 64):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"vision batch must be an integer >= 1, got {batch!r}; e.g. 64")
        parts = fixed_grid_llava(model, "batched vision encoding")
        self.inner, self.batch = parts.inner, batch
        self._original = None
        self._original_projector = None
        self._hook = None

    def __enter__(self) -> BatchedVisionEncoding:  # noqa: PYI034 - Python 3.10 has no typing.Self
        tower = self.inner.vision_tower
        self._original = tower
        # LlavaModel.get_image_features reads hidden_states[vision_feature_layer] only
        batched = BatchedTower(tower, self.batch, _kept_layers(self.inner, tower), keep_last=False)
        self.inner.vision_tower = batched
        self._original_projector = self.inner.multi_modal_projector
        projector = BatchedProjector(self._original_projector, self.batch)
        self.inner.multi_modal_projector = projector
        self._hook = projector.register_forward_hook(lambda *_: batched.release())
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._original is not None:
            self.inner.vision_tower.last_output = None  # a caller's own tower output is left as it is
            self.inner.vision_tower = self._original
            self._original = None
        if self._original_projector is not None:
            self.inner.multi_modal_projector = self._original_projector
            self._original_projector = None


def encode_frames(model: nn.Module, pixel_batches, reducer=None):
    """Encode a stream of frames batch by batch through a fixed-grid LLaVA model's tower and projector, reducing each
    frame's projected tokens at once: what a streamed long-video prefill feeds the language model.

    Nothing of the whole video is held: each batch's tower activations, hidden states and full projected tokens are
    dropped before the next batch is encoded, so the memory is one batch's, whatever the number of frames.

    Parameters
    ----------
    model : nn.Module
        A LLaVA-1.5-style model (``LlavaForConditionalGeneration``).
    pixel_batches : iterable of torch.Tensor
        [b, 3, S, S] processed frames per batch (any ``b >= 1``), e.g. from the image processor a batch at a time.
    reducer : ImageReducer, optional
        A pre-LLM reduction planned on each frame alone (:meth:`~.pre_llm.ImageReducer.plan_image`, e.g.
        :class:`~.pooling.Pooling`); ``None`` keeps every token.

    Yields
    ------
    torch.Tensor
        [b, K, D_text] per batch: each frame's kept (merged) projected tokens, the frame's prefix token (a kept [CLS])
        first, in raster order, the same tokens as the method's plan gives the unstreamed path for that frame.

    Raises
    ------
    ValueError
        A model that is not a fixed-grid LLaVA, or a reducer that ranks by the tower's attention
        (``needs_tower_scores``: VisionZip, PruMerge) or plans across frames (temporal ToMe): neither plans one frame
        from its projected tokens alone.
    """
    from .pre_llm import _grid_plan

    parts = fixed_grid_llava(model, "streamed frame encoding")
    if reducer is not None and not per_frame_reducer(reducer):
        raise ValueError(f"{getattr(reducer, 'name', reducer)!r} cannot reduce a streamed frame alone; use a pre-LLM "
                         "method planned on one frame's projected tokens, e.g. pooling:keep_ratio=0.0625")
    inner, config = parts.inner, parts.inner.config
    grid = None
    for pixels in pixel_batches:
        tower = next(inner.vision_tower.parameters())
        out = inner.get_image_features(pixel_values=pixels.to(tower.device, tower.dtype),
                                       vision_feature_layer=config.vision_feature_layer,
                                       vision_feature_select_strategy=config.vision_feature_select_strategy)
        features = torch.stack(list(out.pooler_output))  # [b, P, D_text]
        del out
        if reducer is None:
            yield features
            continue
        grid = grid or parts.grids(int(features.shape[1]))[0]
        raster = grid.raster_index(features.device)
        reduced = [_grid_plan(reducer.plan_image(features[i, raster], grid, {"image_index": i, "grid_index": i}),
                              grid).merge(features[i: i + 1]) for i in range(features.shape[0])]
        del features
        yield torch.cat(reduced)


def per_frame_reducer(method) -> bool:
    """Whether a visual-token method reduces each frame from that frame's projected tokens alone (pooling, AIM's
    merging without pruning layers, ...): a pre-LLM :class:`~.pre_llm.ImageReducer` that needs no tower scores, keeps
    the base's per-image sequence plan (temporal ToMe plans across frames) and prunes nothing inside the LLM."""
    from .pre_llm import ImageReducer

    return (isinstance(method, ImageReducer) and not method.needs_tower_scores
            and type(method)._sequence_plan is ImageReducer._sequence_plan
            and getattr(method, "layers", None) is None)
