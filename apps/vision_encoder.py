"""Images in, visual tokens out: the inputs and the runner of the Vision encoder tab.

- :func:`sample_image` / :func:`vision_input`: the image a request runs on (an upload, a scikit-image photo, a
  generated scene), size-checked and decoded by :func:`mmaccel.data.media.load_image`;
- :class:`EncoderRunner`: one image through a plain vision encoder under a visual-token method
  (:data:`mmaccel.vision_tokens.METHODS`), one warm-up forward then timed forwards, returning a :class:`VisionRun`
  with the method's token -> patch map (``VisionTokenMethod.source_map()``);
- :data:`VISION_RUNNERS` / :func:`vision_runner`: the seam for other model kinds (a vision-language-model runner is
  one more class there).
"""
from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from . import forms
from .common import InputError, checked_upload
from .security import DEFAULT_MAX_IMAGE_PIXELS, bounded_image

NO_METHOD = "none"
"""The Vision encoder tab's baseline: the unmodified encoder."""
SAMPLE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "hubble_deep_field", "immunohistochemistry")
"""scikit-image photos that ship inside the package (``skimage.data``; no download)."""
SCENE_SAMPLE = "generated scene (seed)"
VISION_SAMPLES = [*SAMPLE_PHOTOS, SCENE_SAMPLE]


def vision_model_choices() -> list[str]:
    """Zoo names of the models the Vision encoder tab lists: the fetched models that are not text-only causal LMs
    (vision encoders such as ``dinov2-small``; vision-language models once the zoo has one)."""
    from mmaccel.models import FETCHED

    return [n for n, e in FETCHED.items() if not e.model_class.endswith("CausalLM")]


def sample_image(name: str, seed: int = 0):
    """A sample image as RGB.

    Parameters
    ----------
    name : str
        One of :data:`SAMPLE_PHOTOS` (a scikit-image photo) or :data:`SCENE_SAMPLE`.
    seed : int
        For :data:`SCENE_SAMPLE`: the seed of :func:`mmaccel.data.scenes.make_scene` (>= 0; 168 px, 2-5 objects).

    Returns
    -------
    PIL.Image.Image

    Raises
    ------
    InputError
        An unknown sample name, a negative seed, or a photo this scikit-image cannot load.
    """
    from PIL import Image

    if name == SCENE_SAMPLE:
        from mmaccel.data.scenes import make_scene

        if int(seed) < 0:
            raise InputError(f"the scene seed must be >= 0, got {seed}")
        return make_scene(int(seed)).image.convert("RGB")
    if name not in SAMPLE_PHOTOS:
        raise InputError(f"unknown sample {name!r}; samples: {', '.join(VISION_SAMPLES)}")
    try:
        from skimage import data
    except ImportError as exc:
        raise InputError(f"the sample photos need scikit-image ({exc}); upload an image instead") from exc
    try:
        return Image.fromarray(getattr(data, name)()).convert("RGB")
    except (OSError, ValueError, AttributeError) as exc:  # a photo this version fetches instead of bundling
        raise InputError(f"cannot load the scikit-image photo {name!r}: {exc}") from exc


def vision_input(upload, sample: str, seed: int, max_bytes: int, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """The image a request runs on: the upload if there is one, else the sample.

    Parameters
    ----------
    upload : path or None
        An uploaded image (the handler's private copy).
    sample, seed
        A sample of :data:`VISION_SAMPLES` and the seed of a generated scene.
    max_bytes : int
        Upload size limit, bytes.
    max_pixels : int
        Pixel cap, read from the header before anything is decoded (:func:`mmaccel.apps.security.bounded_image`).

    Returns
    -------
    (PIL.Image.Image, str)
        The RGB image and where it came from (for the status line).

    Raises
    ------
    InputError
        An upload over ``max_bytes`` or ``max_pixels`` (a pixel bomb), an upload that is not a readable image (the
        message of :func:`mmaccel.data.media.load_image`, without the server path), or a bad sample (see
        :func:`sample_image`).
    """
    seed = 0 if seed is None else seed
    if upload:
        path = checked_upload(upload, max_bytes)
        return bounded_image(path, max_pixels, f"the uploaded image {path.name}"), f"the uploaded image {path.name}"
    what = f"scene seed {int(seed)}" if sample == SCENE_SAMPLE else f"the scikit-image photo {sample!r}"
    return sample_image(sample, seed), what


@dataclass
class VisionRun:
    """One configuration of the Vision encoder tab measured on one image.

    Attributes
    ----------
    seconds : float
        Median seconds of one encoder forward (``nan`` with no timed forward).
    times : list of float
        Every timed forward, seconds.
    tokens_in, tokens_out : int
        The encoder's tokens before and after the method ([CLS] and registers included).
    pooled : torch.Tensor
        [D] the pooled embedding: ``pooler_output`` (Dinov2's and CLIP's normalised [CLS], SigLIP's attention pool),
        else the first output token.
    patch_mean : torch.Tensor
        [D] the mean of the output patch tokens, each weighted by the input patches it holds: the mean over the
        original patches (pruned patches do not count).
    source : TokenPlan
        Batch 1 over the ``tokens_in`` input tokens: the output token of each (identity when nothing changed).
    prefix : int
        Leading non-patch tokens ([CLS], registers).
    grid : (int, int)
        The ``h x w`` patch grid.
    telemetry : dict
        The method's telemetry (schedule, tokens per layer...).
    """

    seconds: float
    times: list
    tokens_in: int
    tokens_out: int
    pooled: Any
    patch_mean: Any
    source: Any
    prefix: int
    grid: tuple
    telemetry: dict = field(default_factory=dict)

    def patch_slots(self):
        """[h, w] int numpy array: the output token of every patch, ``-1`` where the patch was pruned."""
        h, w = self.grid
        return self.source.slot_of()[0, self.prefix:].cpu().numpy().reshape(h, w)


class EncoderRunner:
    """Runs one image through a plain vision encoder under a visual-token method, timed.

    The seam for other model kinds: :data:`VISION_RUNNERS` lists runner classes, each with ``kind``, ``stages``,
    ``accepts(model)``, ``pixels(image)``, ``view(pixels)``, ``grid(pixels)`` and
    ``run(pixels, method, repeats) -> VisionRun``; a vision-language-model runner (all three stages, an answer,
    TTFT) is one more class there.

    Parameters
    ----------
    model : torch.nn.Module
        A module whose ``forward`` takes ``pixel_values`` and no ``input_ids`` and returns ``last_hidden_state``
        [B, L, D] (HF ``Dinov2Model``, ``CLIPVisionModel``, ``SiglipVisionModel``); ``config.patch_size`` gives the
        patch grid.
    processor : image processor
        Turns an image into ``pixel_values`` [1, 3, H, W]; its ``image_mean`` / ``image_std`` undo the normalisation
        for the overlay.
    """

    kind = "vision encoder"
    stages = ("vision",)
    """The method stages (``VisionTokenMethod.stage``) this runner can apply: inside the tower only."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    @classmethod
    def methods(cls) -> list[str]:
        """Names of the :data:`mmaccel.vision_tokens.METHODS` whose stage this runner applies."""
        from mmaccel.vision_tokens import METHODS

        return [n for n in forms.unique_names(METHODS) if METHODS[n].stage in cls.stages]

    @staticmethod
    def accepts(model) -> bool:
        """Whether ``model`` is a plain vision encoder: its forward takes ``pixel_values`` and no ``input_ids``."""
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            return False
        return "pixel_values" in params and "input_ids" not in params

    @property
    def patch_size(self) -> int:
        """Pixels per patch side."""
        config = self.model.config
        size = getattr(config, "patch_size", None) or getattr(getattr(config, "vision_config", None), "patch_size", 0)
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    def pixels(self, image):
        """``pixel_values`` [1, 3, H, W] of a PIL image, on the model's device and dtype."""
        param = next(self.model.parameters())
        values = self.processor(images=image, return_tensors="pt")["pixel_values"]
        return values.to(param.device, param.dtype)

    def view(self, pixels):
        """The image as the encoder sees it (after resize, crop and normalisation are undone), cropped to the patch
        grid: a PIL RGB image of ``h * patch x w * patch`` pixels."""
        import numpy as np
        from PIL import Image

        x = pixels[0].float().cpu()
        mean, std = getattr(self.processor, "image_mean", None), getattr(self.processor, "image_std", None)
        if mean is not None and std is not None:
            x = x * _channels(std) + _channels(mean)
        else:  # no normalisation known: stretch to [0, 1]
            x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-6)
        h, w = self.grid(pixels)
        p = self.patch_size
        arr = (x.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        return Image.fromarray(arr[: h * p, : w * p])

    def grid(self, pixels) -> tuple[int, int]:
        """The ``(h, w)`` patch grid of ``pixels``."""
        p = self.patch_size
        return pixels.shape[-2] // p, pixels.shape[-1] // p

    def run(self, pixels, method=None, repeats: int = 3) -> VisionRun:
        """One warm-up forward, then ``repeats`` timed forwards, under ``method`` (``None`` = unmodified).

        Raises
        ------
        mmaccel.vision_tokens.UnsupportedModelError
            (a ``ValueError``) if ``method`` does not support this model's class.
        RuntimeError
            If the method's source map does not match the tokens the encoder returned.
        """
        import torch

        from mmaccel.vision_tokens import TokenPlan

        times = []
        with torch.no_grad(), (method.apply(self.model) if method is not None else contextlib.nullcontext()):
            out = self.model(pixel_values=pixels)  # warm-up
            for _ in range(int(repeats)):
                _sync(pixels)
                start = time.perf_counter()
                out = self.model(pixel_values=pixels)
                _sync(pixels)
                times.append(time.perf_counter() - start)
        hidden = out.last_hidden_state[0].float()
        maps = method.source_map() if method is not None else []
        source = maps[0] if maps else TokenPlan.identity(1, hidden.shape[0], hidden.device)
        if source.num_kept != hidden.shape[0]:
            raise RuntimeError(f"the source map has {source.num_kept} output tokens, the encoder returned "
                               f"{hidden.shape[0]}")
        h, w = self.grid(pixels)
        prefix = source.length - h * w
        if prefix < 0:
            raise RuntimeError(f"{source.length} tokens cannot hold a {h} x {w} patch grid")
        slot = source.slot_of()[0].to(hidden.device)
        patch_slot = slot[prefix:]
        counts = torch.bincount(patch_slot[patch_slot >= 0], minlength=hidden.shape[0]).float()
        pooled = getattr(out, "pooler_output", None)
        return VisionRun(
            seconds=statistics.median(times) if times else float("nan"), times=times, tokens_in=source.length,
            tokens_out=hidden.shape[0], pooled=(hidden[0] if pooled is None else pooled[0].float()),
            patch_mean=(counts[:, None] * hidden).sum(0) / counts.sum().clamp_min(1), source=source, prefix=prefix,
            grid=(h, w), telemetry=dict(method.telemetry) if method is not None else {})


def _channels(values):
    import torch

    return torch.tensor(list(values), dtype=torch.float32)[:, None, None]


def _sync(tensor) -> None:
    if tensor.device.type == "cuda":
        import torch

        torch.cuda.synchronize(tensor.device)


VISION_RUNNERS: tuple[type, ...] = (EncoderRunner,)
"""Runner classes of the Vision encoder tab, tried in order (see :class:`EncoderRunner`)."""


def vision_runner(model, processor):
    """The runner of :data:`VISION_RUNNERS` that accepts ``model``.

    Raises
    ------
    InputError
        For a vision-language model (no runner for it yet) or a model that takes no images.
    """
    for runner in VISION_RUNNERS:
        if runner.accepts(model):
            return runner(model, processor)
    from mmaccel.vision_tokens import VLMParts

    name = type(model).__name__
    if not isinstance(VLMParts.find(model), str):
        raise InputError(f"{name} is a vision-language model; this tab runs vision encoders (answers from a VLM "
                         "are in the Image & video QA tab): pick a vision encoder such as dinov2-small")
    raise InputError(f"{name} takes no images: pick a vision encoder (dinov2-small, or a local Dinov2, CLIP or "
                     "SigLIP vision checkpoint)")
