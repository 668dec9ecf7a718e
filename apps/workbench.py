"""The mmaccel workbench: a Gradio app that runs 2 to 4 configurations side by side and measures each one fairly.

Launch it with ``python -m apps.workbench`` (127.0.0.1:7860 by default; ``--host``, ``--port``, ``--share``,
``--device``, ``--threads``, ``--max-upload-mb``). Tests build it with :func:`build_app` and query it with
``gradio_client``.

Everything a column offers comes from a registry: the method dropdown lists ``mmaccel.longctx.METHODS`` (or
``mmaccel.speculative.METHODS``), and the parameter fields under it are generated from the method class's
constructor signature and docstring (:mod:`apps.forms`), so a method added to a registry appears here with no edit.
A filled form is shown as its method spec (``snapkv:budget=256``), which is also what the endpoints take.

Fair timing: every measured endpoint shares one queue slot (concurrency 1), so two requests never run at once; inside
a request the configurations run one after another on the same input, each after a warm-up run. Results stream in
column by column; the Stop button cancels between columns.

Endpoints (``api_name``): ``longctx``, ``niah_document``, ``generation``, ``niah_eval``, ``kernels``, ``vision``.

The Image & video tab runs a vision encoder (default ``dinov2-small``) under ``mmaccel.vision_tokens.METHODS`` and
draws each column's final token -> patch assignment (``VisionTokenMethod.source_map()``) over the input.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import inspect
import io
import json
import logging
import statistics
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from . import forms

logger = logging.getLogger(__name__)

MAX_COLUMNS = 4
AUTOREGRESSIVE = "autoregressive"
"""The Generation tab's baseline: plain greedy decoding, no drafter."""

FAIR_TIMING = (
    "**Fair timing.** Requests wait on one queue with concurrency 1: nothing else runs while a comparison is measured. "
    "Inside a request the configurations run one after another on the same input, each after one warm-up run; "
    "times are medians over *repeats*. Peak memory on the CPU is the sampled growth of the process RSS (an "
    "approximate lower bound); on CUDA it is exact."
)

_ERROR_STYLE = ("color:#8a1020;background:#fdecee;border:1px solid #e3a1aa;border-radius:6px;padding:8px;"
                "white-space:pre-wrap")
_TEXT_STYLE = "white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:14px;line-height:1.5"
_ACCEPTED_STYLE = "background:#b7efc5;border-radius:3px"
_TARGET_STYLE = "background:#e8e8f0;border-radius:3px"
METRIC_HEADERS = ["metric", "value"]
WARMUPS = ["full input", "short prompt (last 64 tokens)"]


class InputError(ValueError):
    """Bad user input (an upload, a question, a length): shown as an error in the columns."""


# --------------------------------------------------------------------------------------------------------- models
class ModelCache:
    """Loaded models by name, at most ``capacity`` of them (least recently used evicted), loaded with
    :func:`mmaccel.load` (never with ``trust_remote_code``)."""

    def __init__(self, device: str = "auto", capacity: int = 2):
        self.device, self.capacity = device, capacity
        self._models: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str):
        """``(model, tokenizer)`` for a zoo name, a local checkpoint directory or a hub id.

        Raises
        ------
        mmaccel.models.ModelLoadError
            An unknown model (the message lists the zoo), a bad directory, a hub id while offline, a failed fetch.
        """
        import mmaccel

        name = (name or "").strip()
        if not name:
            raise InputError("no model given: pick a zoo model or type a local checkpoint directory")
        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            logger.info("loading model %s on %s", name, self.device)
            pair = mmaccel.load(name, device=self.device)
            self._models[name] = pair
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
            return pair


def text_model_choices() -> list[str]:
    """Zoo names of the models the text tabs can run: trained micro-models and fetched causal LMs."""
    from mmaccel.models import FETCHED, ZOO

    names = list(ZOO)
    names += [n for n, e in FETCHED.items() if "CausalLM" in e.model_class or "ConditionalGeneration" in e.model_class]
    return names


# ------------------------------------------------------------------------------------------------------ documents
def checked_upload(path, max_bytes: int) -> Path:
    """The path of an uploaded file after the size check.

    Raises
    ------
    InputError
        A file over ``max_bytes`` (the message gives both sizes in MiB).
    """
    p = Path(path)
    size = p.stat().st_size
    if size > max_bytes:
        raise InputError(f"the uploaded file {p.name} is {size / 2**20:.1f} MiB; the limit is "
                         f"{max_bytes / 2**20:.1f} MiB")
    return p


def read_upload(path: str | None, max_bytes: int) -> str | None:
    """The text of an uploaded file (Gradio keeps it in its temp folder), or ``None`` when there is none.

    Raises
    ------
    InputError
        A file over ``max_bytes``, a binary file (a NUL byte) or a file that is not UTF-8 text.
    """
    if not path:
        return None
    p = checked_upload(path, max_bytes)
    data = p.read_bytes()
    if b"\x00" in data:
        raise InputError(f"the uploaded file {p.name} is not a text file (it contains NUL bytes); upload UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"the uploaded file {p.name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise InputError(f"the uploaded file {p.name} is empty")
    return text


def build_prompt(tokenizer, document: str, question: str, chat_template: str = "auto") -> list[int]:
    """Token ids of ``document`` followed by ``question``: one user turn of the chat template when the tokenizer has
    one (``"auto"``), else the plain text ``document + "\\n" + question`` after BOS (the micro-models' layout)."""
    from mmaccel.eval.haystack import resolve_chat_template

    document, question = (document or "").strip(), (question or "").strip()
    if not document and not question:
        raise InputError("the document and the question are both empty: paste or upload a document, or generate one")
    text = f"{document}\n{question}".strip()
    if resolve_chat_template(tokenizer, chat_template):
        msgs = [{"role": "user", "content": f"{document}\n\n{question}".strip()}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
        ids = list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
    return [int(i) for i in ids]


def niah_document(tokenizer, length: int, depth: float, seed: int, haystack=None) -> tuple[str, str, str]:
    """A NIAH document (held-out prose with one planted fact), its question and the expected answer.

    ``haystack`` is a :class:`~mmaccel.eval.haystack.HaystackTokens` (default: the held-out standard-library prose).

    The document is the haystack with the needle, decoded to text; the question is the completion sentence for a
    tokenizer without a chat template and the plain question with one (see :mod:`mmaccel.eval.haystack`).
    """
    from mmaccel.eval.haystack import CHAT_QUESTION_TEMPLATE, QUESTION_TEMPLATE, make_niah_sample, resolve_chat_template

    sample = make_niah_sample(tokenizer, int(length), float(depth), seed=int(seed), chat_template=False,
                              haystack=haystack)
    needle = sample.needles[0]
    plain_q = needle.question(QUESTION_TEMPLATE)
    q_ids = tokenizer.encode("\n" + plain_q, add_special_tokens=False)
    start = 1 if tokenizer.bos_token_id is not None and sample.input_ids[0] == tokenizer.bos_token_id else 0
    document = tokenizer.decode(sample.input_ids[start: len(sample.input_ids) - len(q_ids)])
    use_chat = resolve_chat_template(tokenizer, "auto")
    question = needle.question(CHAT_QUESTION_TEMPLATE) if use_chat else plain_q
    return document.strip(), question, sample.answer


# ------------------------------------------------------------------------------------------------- result display
@dataclass
class ColumnResult:
    """What one column shows: an HTML body (output or error) and its metric rows."""

    html: str = ""
    rows: list = field(default_factory=list)
    record: Any = None
    error: str | None = None

    @classmethod
    def failure(cls, message: str) -> ColumnResult:
        """A column that shows ``error: message``."""
        return cls(html=error_html(message), error=message)


def error_html(message: str) -> str:
    """An error box for a column."""
    return f'<div class="mm-error" style="{_ERROR_STYLE}"><b>error</b>: {html.escape(str(message))}</div>'


def _mib(n) -> float | None:
    return None if n is None else round(n / 2**20, 3)


def _round(x, nd=4):
    return None if x is None else round(float(x), nd)


def record_rows(rec) -> list[list]:
    """Metric rows ``[name, number]`` of a :class:`~mmaccel.eval.generation.RunRecord` (``None`` where unknown):
    :func:`mmaccel.eval.plots.metric_rows`, with mean accepted length 1.0 for the autoregressive baseline."""
    from mmaccel.eval.plots import metric_rows

    return metric_rows(rec, mean_accepted_default=1.0 if rec.method_name == AUTOREGRESSIVE else None)


def metrics_table(rows: list) -> dict:
    """The value of a metrics ``gr.Dataframe``."""
    return {"headers": METRIC_HEADERS, "data": rows or [["-", None]]}


def ratio_figure(labels: list[str], results: list[ColumnResult], metrics: tuple[str, ...] | None = None):
    """The ratio bar plot of :func:`mmaccel.eval.plots.ratio_figure` over the columns that produced a record;
    ``None`` when fewer than two columns succeeded or the first failed. ``metrics``: the metric rows to draw
    (default :data:`mmaccel.eval.plots.RATIO_METRICS`)."""
    from mmaccel.eval.plots import RATIO_METRICS
    from mmaccel.eval.plots import ratio_figure as plot_ratios

    return plot_ratios(labels, [r.rows if r is not None and r.record is not None else None for r in results],
                       metrics or RATIO_METRICS)


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, by incremental decoding (so spaces and multi-byte characters come out right)."""
    pieces, prev = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        pieces.append(text[len(prev):] if text.startswith(prev) else tokenizer.decode([ids[i]]))
        prev = text
    return pieces


def accepted_mask(new_tokens: int, accepted: list[int]) -> list[bool]:
    """Per generated token: ``True`` when it is a draft token the target accepted, ``False`` when the target's own
    verification produced it. Each verification step commits its ``m`` accepted drafts, then one target token
    (the engine's layout; the last step may be cut by ``max_new_tokens`` or EOS)."""
    mask: list[bool] = []
    for m in accepted:
        mask += [True] * m + [False]
    return mask[:new_tokens] + [False] * max(0, new_tokens - len(mask))


def coloured_html(pieces: list[str], mask: list[bool]) -> str:
    """Generated text as HTML: accepted draft tokens on green, target tokens on grey."""
    spans = []
    for text, acc in zip(pieces, mask):
        cls, style = ("mm-accepted", _ACCEPTED_STYLE) if acc else ("mm-target", _TARGET_STYLE)
        spans.append(f'<span class="{cls}" style="{style}">{html.escape(text)}</span>')
    return f'<div class="mm-output" style="{_TEXT_STYLE}">{"".join(spans)}</div>'


def text_html(text: str, note: str = "") -> str:
    """Plain generated text as HTML, with an optional note under it."""
    body = html.escape(text) if text else "<i>(no tokens generated)</i>"
    extra = f'<div style="margin-top:6px;font-size:13px">{note}</div>' if note else ""
    return f'<div class="mm-output" style="{_TEXT_STYLE}">{body}</div>{extra}'


# -------------------------------------------------------------------------------------------------- measurement
def with_draft_length(spec: str, num_draft_tokens: int) -> str:
    """``spec`` with ``k=num_draft_tokens`` appended unless the spec sets its own draft length."""
    from mmaccel.specs import parse_method_spec

    return spec if "k" in parse_method_spec(spec).kwargs else f"{spec}:k={int(num_draft_tokens)}"


# -------------------------------------------------------------------------------------------------- image & video
NO_METHOD = "none"
"""The Image & video tab's baseline: the unmodified encoder."""
SAMPLE_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "hubble_deep_field", "immunohistochemistry")
"""scikit-image photos that ship inside the package (``skimage.data``; no download)."""
SCENE_SAMPLE = "generated scene (seed)"
VISION_SAMPLES = [*SAMPLE_PHOTOS, SCENE_SAMPLE]
VISION_RATIO_METRICS = ("vision encoder (s)", "images/s", "visual tokens kept")
"""Metrics of the Image & video tab's ratio plot."""
VISION_DEFAULTS = [(NO_METHOD, None), ("tome", {"keep_ratio": 0.5}), ("tome", {"keep_ratio": 0.25}), ("tome", {"r": 8})]
"""The method and starting field values of each column of the Image & video tab."""
OVERLAY_SIDE = 448
"""Overlays are the encoder's input upscaled by a whole factor to at least this many pixels on the long side."""
STAGE_WHERE = {"vision": "inside the ViT tower", "pre-llm": "between a VLM's projector and its language model",
               "in-llm": "inside a VLM's language model"}
_MERGE_ALPHA = 0.55  # share of a merged token's colour in its patches
_EDGE_RGB = (20, 20, 20)


def vision_model_choices() -> list[str]:
    """Zoo names of the models the Image & video tab lists: the fetched models that are not text-only causal LMs
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


def vision_input(upload, sample: str, seed: int, max_bytes: int):
    """The image a request runs on: the upload if there is one, else the sample.

    Returns
    -------
    (PIL.Image.Image, str)
        The RGB image and where it came from (for the status line).

    Raises
    ------
    InputError
        An upload over ``max_bytes``, an upload that is not a readable image (the message of
        :func:`mmaccel.data.media.load_image`), or a bad sample (see :func:`sample_image`).
    """
    from mmaccel.data.media import load_image

    seed = 0 if seed is None else seed
    if upload:
        path = checked_upload(upload, max_bytes)
        try:
            return load_image(path), f"the uploaded image {path.name}"
        except (ValueError, OSError) as exc:
            raise InputError(str(exc).replace(str(path), path.name)) from exc
    what = f"scene seed {int(seed)}" if sample == SCENE_SAMPLE else f"the scikit-image photo {sample!r}"
    return sample_image(sample, seed), what


@dataclass
class VisionRun:
    """One configuration of the Image & video tab measured on one image.

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
"""Runner classes of the Image & video tab, tried in order (see :class:`EncoderRunner`)."""


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
        raise InputError(f"{name} is a vision-language model; this tab runs vision encoders so far (columns with an "
                         "answer from a VLM come with the smol-llava zoo model): pick a vision encoder such as "
                         "dinov2-small")
    raise InputError(f"{name} takes no images: pick a vision encoder (dinov2-small, or a local Dinov2, CLIP or "
                     "SigLIP vision checkpoint)")


def scaled_view(view, side: int = OVERLAY_SIDE):
    """``view`` upscaled by the smallest whole factor that makes its long side at least ``side`` pixels (bicubic),
    so that every patch stays a square of whole pixels; the overlay is drawn on the same picture."""
    from PIL import Image

    factor = max(1, -(-side // max(view.size)))
    return view if factor == 1 else view.resize((view.width * factor, view.height * factor), Image.BICUBIC)


def token_overlay(view, slots, side: int = OVERLAY_SIDE):
    """The encoder's input with its output tokens drawn over the patches.

    Parameters
    ----------
    view : PIL.Image.Image
        The image as the encoder saw it, ``h * patch x w * patch`` pixels (:meth:`EncoderRunner.view`).
    slots : numpy.ndarray
        [h, w] int: the output token of every patch, ``-1`` for a pruned patch (:meth:`VisionRun.patch_slots`).
    side : int
        Upscale as :func:`scaled_view` does.

    Returns
    -------
    PIL.Image.Image
        RGB, the size of ``scaled_view(view, side)``. A patch that is its own token is left as it is; the patches
        merged into one token are tinted with that token's colour (one hue per token, by the golden ratio) and
        outlined where the group ends; a pruned patch is greyed out. With no merged and no pruned patch the result
        equals ``scaled_view(view, side)`` pixel for pixel.
    """
    import numpy as np
    from matplotlib.colors import hsv_to_rgb
    from PIL import Image

    base = scaled_view(view, side)
    step = base.height // slots.shape[0]  # pixels per patch side
    arr = np.asarray(base, dtype=np.float32)
    px = np.repeat(np.repeat(slots, step, axis=0), step, axis=1)
    sizes = np.bincount(slots[slots >= 0].ravel(), minlength=int(slots.max()) + 1) if (slots >= 0).any() \
        else np.zeros(1, dtype=int)
    merged = (px >= 0) & (sizes[px.clip(min=0)] > 1)
    pruned = px < 0
    hue = (px.clip(min=0) * 0.6180339887) % 1.0
    colour = hsv_to_rgb(np.stack([hue, np.full_like(hue, 0.85), np.ones_like(hue)], axis=-1)) * 255
    out = arr.copy()
    out[merged] = (1 - _MERGE_ALPHA) * arr[merged] + _MERGE_ALPHA * colour[merged]
    luminance = arr @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    out[pruned] = (90 + 0.25 * luminance[pruned])[:, None]
    marked = merged | pruned
    edge = np.zeros(px.shape, dtype=bool)
    for axis in (0, 1):  # a 2-pixel line where the token changes next to a merged or pruned patch
        a = [slice(None), slice(None)]
        b = [slice(None), slice(None)]
        a[axis], b[axis] = slice(1, None), slice(None, -1)
        change = (px[tuple(a)] != px[tuple(b)]) & (marked[tuple(a)] | marked[tuple(b)])
        edge[tuple(a)] |= change
        edge[tuple(b)] |= change
    out[edge] = _EDGE_RGB
    return Image.fromarray(out.round().clip(0, 255).astype(np.uint8))


def vision_rows(run: VisionRun, reference: VisionRun, first: VisionRun | None) -> list[list]:
    """Metric rows ``[name, number]`` of one column of the Image & video tab.

    Tokens (in and kept), the median encoder seconds and images/s, the throughput ratio to ``first`` (column 1's
    run; ``None`` when it failed), and the cosine similarity of the pooled embedding and of the patch mean to
    ``reference`` (the unmodified encoder on the same input), then the merged and pruned patch counts.
    """
    import numpy as np
    import torch.nn.functional as F

    slots = run.patch_slots()
    counts = np.unique(slots[slots >= 0], return_counts=True)[1]
    per_s = 1.0 / run.seconds if run.seconds > 0 else None
    first_per_s = 1.0 / first.seconds if first is not None and first.seconds > 0 else None
    return [
        ["visual tokens", run.tokens_in],
        ["visual tokens kept", run.tokens_out],
        ["vision encoder (s)", _round(run.seconds)],
        ["images/s", _round(per_s, 2)],
        ["throughput ratio to column 1", _round(per_s / first_per_s, 3) if per_s and first_per_s else None],
        ["cosine [CLS]/pooled vs unmodified", _round(F.cosine_similarity(run.pooled, reference.pooled, dim=0), 5)],
        ["cosine patch mean vs unmodified", _round(F.cosine_similarity(run.patch_mean, reference.patch_mean, dim=0),
                                                   5)],
        ["merged patches", int(counts[counts > 1].sum())],
        ["pruned patches", int((slots < 0).sum())],
    ]


def vision_html(spec: str, run: VisionRun) -> str:
    """The text of one column: tokens in and out, and what the overlay's colours mean for this run."""
    import numpy as np

    slots = run.patch_slots()
    counts = np.unique(slots[slots >= 0], return_counts=True)[1]
    merged_tokens, merged_patches = int((counts > 1).sum()), int(counts[counts > 1].sum())
    alone, pruned = int((counts == 1).sum()), int((slots < 0).sum())
    schedule = run.telemetry.get("schedule")
    extra = f"<br><small>merges per block: {html.escape(','.join(map(str, schedule)))}</small>" if schedule else ""
    return (f'<div class="mm-output" style="{_TEXT_STYLE}"><b>{html.escape(spec)}</b>: {run.tokens_in} &rarr; '
            f"{run.tokens_out} tokens ({100 * run.tokens_out / run.tokens_in:.0f}% kept)<br>"
            f"{merged_patches} patches merged into {merged_tokens} tokens (coloured, one colour per token) &middot; "
            f"{pruned} pruned (grey) &middot; {alone} kept alone (unchanged){extra}</div>")


def vision_intro() -> str:
    """The Image & video tab's text: how a column runs, what the overlay shows, where each registered method of
    :data:`mmaccel.vision_tokens.METHODS` applies (by its ``stage``), and that video is not offered yet."""
    from mmaccel.vision_tokens import METHODS

    by_stage: dict[str, list[str]] = {stage: [] for stage in STAGE_WHERE}
    for name in forms.unique_names(METHODS):
        by_stage.setdefault(METHODS[name].stage, []).append(f"`{name}`")
    stages = "\n".join(f"- {STAGE_WHERE.get(stage, stage)}: {', '.join(names)}"
                       + (" (runs on a vision encoder)" if stage in EncoderRunner.stages
                          else " (needs a vision-language model)")
                       for stage, names in by_stage.items() if names)
    return ("**Visual tokens of a vision encoder.** Each column runs the same image through the encoder under one "
            "method of `mmaccel.vision_tokens.METHODS` (its form is generated from the class) or `none`, the "
            "unmodified encoder. In the overlay, the patches merged into one output token share a colour (one colour "
            "per token, outlined), pruned patches are grey, and patches kept alone are unchanged. Cosines compare "
            "with the unmodified encoder on the same input.\n\nWhere the methods work:\n\n" + stages + "\n\n"
            "**Video: not yet.** `temporal-tome` merges tokens across the frames of a video-LLM, so video input comes "
            "with vision-language models (`smol-llava`); this tab takes images.")


# ------------------------------------------------------------------------------------------------- column forms
@dataclass
class MethodColumn:
    """The components of one configuration column: a method dropdown, one generated parameter group per method,
    the composed spec, and the output components the tab adds."""

    index: int
    container: Any
    dropdown: Any
    spec: Any
    groups: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)


def _component(f: forms.Field, key: str, value: Any = None):
    """A Gradio component for a generated field (``key`` is also its element id), showing ``value`` (default: the
    field's default)."""
    common = {"label": f.label, "info": f.help[:300] if f.help else None, "key": key, "elem_id": key}
    value = f.default if value is None else value
    if f.kind == "int":
        return gr.Number(value=value, precision=0, minimum=f.minimum, **common)
    if f.kind == "float":
        return gr.Number(value=value, minimum=f.minimum, **common)
    if f.kind == "bool":
        return gr.Checkbox(value=bool(value), **common)
    if f.kind == "choice":
        return gr.Dropdown(choices=f.choices, value=value, **common)
    return gr.Textbox(value="" if value is None else str(value), **common)


def method_column(tab: str, index: int, registry: Mapping[str, type], default: str, *,
                  extra: Mapping[str, str] | None = None, initial: Mapping[str, Any] | None = None) -> MethodColumn:
    """Build one configuration column inside the current Blocks context, its form generated from ``registry``.

    Parameters
    ----------
    tab : str
        Tab key (used in element ids: ``{tab}-col{index}-...``).
    index : int
        Column number, 0-based.
    registry : mapping
        Name -> method class, e.g. ``mmaccel.longctx.METHODS``; aliases are listed once.
    default : str
        The method selected at start.
    extra : mapping, optional
        Choices that are not registry classes (name -> description), e.g. the autoregressive baseline.
    initial : mapping, optional
        Starting values of some of the ``default`` method's fields (field name -> value, e.g. ``{"keep_ratio": 0.5}``);
        the starting spec is composed from them. The form itself is still generated from the class.

    Raises
    ------
    ValueError
        If an ``initial`` value does not fit its field (see :func:`apps.forms.compose_spec`).
    """
    extra, initial = dict(extra or {}), dict(initial or {})
    names = list(extra) + forms.unique_names(registry)
    with gr.Column(visible=index < 2, min_width=260, elem_id=f"{tab}-col{index}", key=f"{tab}-col{index}") as box:
        gr.Markdown(f"### Column {index + 1}" + (" (baseline of the ratios)" if index == 0 else ""))
        dropdown = gr.Dropdown(choices=names, value=default, label="method", elem_id=f"{tab}-col{index}-method",
                               key=f"{tab}-col{index}-method")
        col = MethodColumn(index=index, container=box, dropdown=dropdown, spec=None)
        for name in names:
            cls = registry.get(name)
            fields = forms.method_fields(cls) if cls is not None else []
            about = extra.get(name) or (forms.summary(cls) if cls is not None else "")
            with gr.Group(visible=name == default, key=f"{tab}-col{index}-{name}") as group:
                if about:
                    gr.Markdown(f"<small>{html.escape(about[:400])}</small>")
                start = initial if name == default else {}
                comps = [_component(f, key=f"{tab}-col{index}-{name}-{f.name}", value=start.get(f.name))
                         for f in fields]
            col.groups[name] = group
            col.inputs[name] = (fields, comps)
        fields = col.inputs[default][0]
        spec = forms.compose_spec(default, fields, [initial.get(f.name, f.default) for f in fields])
        col.spec = gr.Textbox(value=spec, label="spec (composed from the form; editable)",
                              elem_id=f"{tab}-col{index}-spec", key=f"{tab}-col{index}-spec")
    _wire_column(col)
    return col


def _wire_column(col: MethodColumn) -> None:
    """Events: the dropdown shows its method's group; any field change recomposes the spec."""
    names = list(col.groups)
    all_comps = [c for name in names for c in col.inputs[name][1]]

    def on_method(name, *values):
        updates = [gr.update(visible=n == name) for n in names]
        pos = 0
        spec = name
        for n in names:
            fields, comps = col.inputs[n]
            if n == name:
                spec = _safe_compose(n, fields, values[pos: pos + len(comps)])
            pos += len(comps)
        return [*updates, spec]

    col.dropdown.change(on_method, [col.dropdown, *all_comps], [*col.groups.values(), col.spec], queue=False,
                        api_visibility="private", show_progress="hidden")
    for name in names:
        fields, comps = col.inputs[name]
        if not comps:
            continue

        def on_field(*values, _name=name, _fields=fields):
            return _safe_compose(_name, _fields, values)

        gr.on([c.change for c in comps], on_field, comps, col.spec, queue=False, api_visibility="private",
              show_progress="hidden")


def _safe_compose(name: str, fields, values) -> str:
    try:
        return forms.compose_spec(name, fields, list(values))
    except ValueError as exc:
        gr.Warning(str(exc))
        return name


def _columns_visibility(n) -> list:
    n = int(n)
    return [gr.update(visible=i < n) for i in range(MAX_COLUMNS)]


# --------------------------------------------------------------------------------------------------------- the app
class Workbench:
    """The handlers behind the app's endpoints; each is also callable directly (tests, scripts).

    Parameters
    ----------
    models : ModelCache
        Where models are loaded and kept.
    max_upload_bytes : int
        Size limit of an uploaded document or image, bytes.
    work_dir : path
        Temp folder for outputs (NIAH heatmaps, kernel-bench JSON).
    haystack : path, optional
        A UTF-8 text file used as the NIAH haystack (default: the held-out standard-library prose, which takes
        seconds to build the first time).
    """

    def __init__(self, models: ModelCache, max_upload_bytes: int, work_dir: Path, haystack=None):
        self.models, self.max_upload_bytes, self.work_dir = models, max_upload_bytes, Path(work_dir)
        self.haystack = None if haystack is None else str(haystack)
        self._haystacks: dict = {}

    def haystack_tokens(self, tokenizer):
        """The NIAH haystack for ``tokenizer`` (``None`` = the default prose), built once per tokenizer."""
        if self.haystack is None:
            return None
        key = id(tokenizer)
        if key not in self._haystacks:
            from mmaccel.eval.haystack import HaystackTokens

            self._haystacks[key] = HaystackTokens(tokenizer, Path(self.haystack).read_text(encoding="utf-8"))
        return self._haystacks[key]

    # ---------------------------------------------------------------- shared
    @staticmethod
    def _outputs(status: str, results: list, labels: list[str], with_plot: bool = True, final: bool = True) -> list:
        """``[status, (html, metrics) x 4]`` plus, ``with_plot``, the ratio plot (drawn only when ``final``)."""
        out: list = [status]
        for i in range(MAX_COLUMNS):
            r = results[i] if i < len(results) else None
            out += [r.html if r else "", metrics_table(r.rows if r else [])]
        if with_plot:
            out.append(ratio_figure(labels, results) if results and final else None)
        return out

    def _load(self, model_name: str, n: int, progress):
        """``(model, tokenizer, None)`` or ``(None, None, [failure per column])``."""
        progress(0.0, desc=f"loading {model_name} (a fetched zoo model is downloaded once)")
        try:
            model, tok = self.models.get(model_name)
        except Exception as exc:  # noqa: BLE001 - unknown model, offline hub id, failed fetch, OOM: shown per column
            msg = f"cannot load model {model_name!r}: {exc}"
            logger.warning(msg)
            return None, None, [ColumnResult.failure(msg) for _ in range(n)]
        return model, tok, None

    # ---------------------------------------------------------------- long context
    def longctx(self, model_name, document, upload, question, expected, max_new_tokens, repeats, warmup, n_columns,
                spec1, spec2, spec3, spec4, progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Long context: every column's KV-cache method on the same document + question (streams column by column).

        Yields
        ------
        list
            ``[status, (html, metrics) x 4, ratio plot]``.
        """
        n = max(1, min(MAX_COLUMNS, int(n_columns)))
        specs = [(s or "").strip() for s in (spec1, spec2, spec3, spec4)[:n]]
        results: list = [None] * n
        model, tok, failed = self._load(model_name, n, progress)
        if failed:
            yield self._outputs("**error**: the model could not be loaded (see the columns).", failed, specs)
            return
        try:
            text = read_upload(upload, self.max_upload_bytes)
            if text is None:
                text = document
            ids = build_prompt(tok, text, question)
        except (InputError, OSError) as exc:
            yield self._outputs(f"**error**: {exc}", [ColumnResult.failure(str(exc)) for _ in range(n)], specs)
            return
        import mmaccel
        from mmaccel.longctx import build_method

        short = str(warmup).startswith("short")
        warm = ids[-min(len(ids), 64):] if short else ids
        expected = (expected or "").strip() or None
        src = f"uploaded file {Path(upload).name}" if upload else "the document box"
        for i, spec in enumerate(specs):
            progress((i, n), desc=f"column {i + 1}: {spec}")
            yield self._outputs(f"running column {i + 1} of {n} ({spec}) ...", results, specs, final=False)
            try:
                build_method(spec)
                cmp = mmaccel.compare(model, tok, ids, [spec], max_new_tokens=int(max_new_tokens),
                                      repeats=int(repeats), warmup=1, warmup_inputs=warm, answer=expected)
                rec = cmp.records[0]
            except Exception as exc:  # noqa: BLE001 - bad spec, bad value, anything else: this column only
                results[i] = ColumnResult.failure(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError)
                                                  else str(exc))
                continue
            results[i] = self._record_result(rec, expected)
        how = f"on its last {len(warm)} tokens" if short else "on the same input"
        status = (f"Ran {n} configurations one after another on the same {len(ids)}-token prompt (from {src}), each "
                  f"after one warm-up run {how}; medians of {int(repeats)} run(s).")
        yield self._outputs(status, results, specs)

    @staticmethod
    def _record_result(rec, expected=None, body: str | None = None) -> ColumnResult:
        if not rec.ok:
            return ColumnResult(html=error_html(rec.error), rows=[], record=None, error=rec.error)
        note = ""
        if expected is not None:
            ok = rec.extra.get("correct")
            note = (f'<span style="color:#126b2e">✓ answer {html.escape(expected)} found</span>' if ok else
                    f'<span style="color:#8a1020">✗ expected {html.escape(expected)}</span>')
        return ColumnResult(html=body if body is not None else text_html(rec.output_text, note),
                            rows=record_rows(rec), record=rec)

    def niah_document(self, model_name, length, depth, seed):
        """Generate a NIAH document for the model's tokenizer: ``(document, question, expected answer)``."""
        try:
            _, tok = self.models.get(model_name)
            return niah_document(tok, int(length), float(depth), int(seed), haystack=self.haystack_tokens(tok))
        except Exception as exc:
            raise gr.Error(f"cannot generate a NIAH document: {exc}") from exc

    # ---------------------------------------------------------------- generation
    def generation(self, model_name, prompt, max_new_tokens, num_draft_tokens, repeats, n_columns, spec1, spec2,
                   spec3, spec4, progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Generation: each column's drafter (or the autoregressive baseline) on the same prompt, greedy; accepted
        draft tokens are coloured in the output."""
        n = max(1, min(MAX_COLUMNS, int(n_columns)))
        specs = [(s or "").strip() for s in (spec1, spec2, spec3, spec4)[:n]]
        results: list = [None] * n
        model, tok, failed = self._load(model_name, n, progress)
        if failed:
            yield self._outputs("**error**: the model could not be loaded (see the columns).", failed, specs)
            return
        try:
            if not (prompt or "").strip():
                raise InputError("the prompt is empty")
            ids = build_prompt(tok, "", prompt)
        except InputError as exc:
            yield self._outputs(f"**error**: {exc}", [ColumnResult.failure(str(exc)) for _ in range(n)], specs)
            return
        from mmaccel.eval.generation import generate_measured

        for i, spec in enumerate(specs):
            progress((i, n), desc=f"column {i + 1}: {spec}")
            yield self._outputs(f"running column {i + 1} of {n} ({spec}) ...", results, specs, final=False)
            try:
                if spec.split(":")[0] == AUTOREGRESSIVE:
                    rec = generate_measured(model, tok, ids, method=None, label=AUTOREGRESSIVE,
                                            max_new_tokens=int(max_new_tokens), repeats=int(repeats), warmup=1)
                    rec.method_name = AUTOREGRESSIVE
                    body = None
                    if rec.ok:
                        pieces = token_pieces(tok, rec.output_ids)
                        body = coloured_html(pieces, [False] * len(pieces))
                else:
                    rec = generate_measured(model, tok, ids, method=with_draft_length(spec, num_draft_tokens),
                                            label=spec, max_new_tokens=int(max_new_tokens), repeats=int(repeats),
                                            warmup=1)
                    body = None
                    if rec.ok:
                        pieces = token_pieces(tok, rec.output_ids)
                        body = coloured_html(pieces, accepted_mask(len(pieces), rec.telemetry.get("accepted", [])))
                results[i] = self._record_result(rec, body=body)
            except Exception as exc:  # noqa: BLE001 - bad spec etc.: this column only
                results[i] = ColumnResult.failure(str(exc) if isinstance(exc, ValueError)
                                                  else f"{type(exc).__name__}: {exc}")
        same = {r.record.output_text for r in results if r and r.record is not None}
        status = (f"Ran {n} configurations one after another on the same {len(ids)}-token prompt, greedy, each after "
                  f"one warm-up run; medians of {int(repeats)} run(s). "
                  + ("All outputs are identical (greedy speculative decoding is lossless)." if len(same) == 1 else
                     "Outputs differ between columns." if same else ""))
        yield self._outputs(status, results, specs)

    # ---------------------------------------------------------------- evaluations
    def niah_eval(self, model_name, lengths, depths, trials, max_new_tokens, n_columns, spec1, spec2, spec3, spec4,
                  progress=gr.Progress(track_tqdm=True)):  # noqa: B008 - how Gradio injects progress
        """Evaluations: a small NIAH sweep per column (:func:`mmaccel.eval.run_niah`), its heatmap and accuracy."""
        n = max(1, min(MAX_COLUMNS, int(n_columns)))
        specs = [(s or "").strip() for s in (spec1, spec2, spec3, spec4)[:n]]
        results: list = [None] * n
        images: list = [None] * n

        def outputs(status):
            out = self._outputs(status, results, specs, with_plot=False)
            return out + [images[i] if i < n else None for i in range(MAX_COLUMNS)]

        try:
            lens = [int(x) for x in str(lengths).replace(",", " ").split()]
            deps = [float(x) for x in str(depths).replace(",", " ").split()]
            if not lens or not deps or int(trials) < 1:
                raise ValueError("give at least one length, one depth and one trial")
            if len(lens) * len(deps) * int(trials) > 64:
                raise ValueError("at most 64 prompts per column in the app; use `mmaccel niah` for a larger sweep")
        except ValueError as exc:
            results[:] = [ColumnResult.failure(f"bad sweep: {exc}") for _ in range(n)]
            yield outputs(f"**error**: {exc}")
            return
        model, tok, failed = self._load(model_name, n, progress)
        if failed:
            results[:] = failed
            yield outputs("**error**: the model could not be loaded (see the columns).")
            return
        from mmaccel.eval import run_niah
        from mmaccel.longctx import build_method

        valid = []
        for i, spec in enumerate(specs):
            try:
                build_method(spec)
                valid.append(spec)
            except ValueError as exc:
                results[i] = ColumnResult.failure(str(exc))
        out_root = Path(tempfile.mkdtemp(prefix="niah-", dir=self.work_dir))
        labels = list(dict.fromkeys(valid))
        if labels:
            yield outputs(f"running the NIAH sweep over {len(labels)} configuration(s) ...")
            try:
                res = run_niah(model, tok, labels, lens, deps, int(trials), max_new_tokens=int(max_new_tokens),
                               out_dir=out_root, progress=True, haystack=self.haystack_tokens(tok))
            except Exception as exc:  # noqa: BLE001 - a bad sweep (e.g. a length too small): every column says so
                msg = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                for i, spec in enumerate(specs):
                    if spec in labels:
                        results[i] = ColumnResult.failure(msg)
                yield outputs(f"**error**: {msg}")
                return
            for i, spec in enumerate(specs):
                if spec not in labels:
                    continue
                m = res.summary["methods"][spec]
                rows = [["accuracy (strict)", _round(m.get("accuracy"), 3)],
                        ["accuracy (contains)", _round(m.get("accuracy_contains"), 3)],
                        ["runs ok", m.get("n")], ["runs failed", m.get("failed")]]
                for b in m.get("by_length", []):
                    rows.append([f"median TTFT (s) @ {b['length']}", _round(b.get("median_ttft_s"))])
                    rows.append([f"median peak memory (MiB) @ {b['length']}", _mib(b.get("median_peak_memory_bytes"))])
                    rows.append([f"KV ratio vs full @ {b['length']}", _round(b.get("kv_ratio_prefill"), 3)])
                acc = m.get("accuracy")
                results[i] = ColumnResult(html=text_html(f"{spec}: {m.get('n')} runs, strict accuracy "
                                                         f"{'-' if acc is None else f'{acc:.2f}'}"), rows=rows)
                images[i] = str(res.heatmaps[spec]) if res.heatmaps.get(spec) else None
        yield outputs(f"NIAH: {len(lens)} length(s) x {len(deps)} depth(s) x {int(trials)} trial(s), every configuration "
                      f"run one after another on the same prompts (KV ratios need a `full` column); heatmaps and "
                      f"results in {out_root}.")

    # ---------------------------------------------------------------- kernels
    def kernels(self, lengths, cache_lengths, budgets, ops, repeats,
                progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Kernels: :mod:`mmaccel.kernels.bench` on small sizes; every figure is a speed ratio to dense SDPA."""
        from mmaccel.kernels import bench

        try:
            argv = ["--lengths", *str(lengths).replace(",", " ").split(),
                    "--cache-lengths", *str(cache_lengths).replace(",", " ").split(),
                    "--budgets", *str(budgets).replace(",", " ").split(),
                    "--ops", *(ops or ["prefill"]), "--repeats", str(int(repeats)), "--densities", "0.5",
                    "--column-window", "0"]
            for group in (lengths, cache_lengths, budgets):
                if not all(x.isdigit() and int(x) > 0 for x in str(group).replace(",", " ").split()):
                    raise ValueError(f"sizes must be positive integers, got {group!r}")
            import torch

            if not torch.cuda.is_available():
                argv.insert(0, "--cpu")
            out = Path(tempfile.mkdtemp(prefix="kbench-", dir=self.work_dir)) / "bench.json"
            progress(0.1, desc="running the kernel micro-benchmark")
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                bench.main([*argv, "--out", str(out)])
            payload = json.loads(out.read_text())
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - argparse exits on bad input
            return f'**error**: {exc}', {"headers": ["op", "method", "backend", "length", "ms", "speedup"],
                                         "data": []}, None
        recs = payload["records"]
        rows = [[r["op"], r["method"], r["backend"], r["length"], round(r["ms"], 4), round(r["speedup"], 3)]
                for r in recs]
        status = (f"Ran on {payload['device']} ({payload['dtype']}); speedup = dense SDPA time / time, same process, "
                  f"median of {int(repeats)}.\n\n```\n{buf.getvalue().strip()}\n```")
        return (status,
                {"headers": ["op", "method", "backend", "length", "ms", "speedup"], "data": rows},
                kernel_figure(recs))


    # ---------------------------------------------------------------- image & video
    def vision(self, model_name, upload, sample, scene_seed, repeats, n_columns, spec1, spec2, spec3, spec4,
               progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Image & video: the same image through the encoder under each column's visual-token method, one column
        after another; per column the kept/merged-token overlay and the metrics (:func:`vision_rows`).

        Parameters
        ----------
        model_name : str
            A vision encoder: a zoo name (``dinov2-small``) or a local checkpoint directory.
        upload : str or None
            An uploaded image file (wins over the sample).
        sample, scene_seed
            A sample of :data:`VISION_SAMPLES` and the seed of a generated scene.
        repeats : int
            Timed forwards per column (>= 1), after one warm-up forward; the median is reported.
        n_columns : int
            2 to 4; ``spec1..spec4``: each column's method spec, or ``"none"`` (the unmodified encoder).

        Yields
        ------
        list
            ``[status, input image, (html, metrics) x 4, overlay x 4, ratio plot]``. An unknown model, a bad file
            or a bad sample puts an error in every column; a bad spec or a method that does not support the model's
            class puts one in its own column only.
        """
        from mmaccel.vision_tokens import UnsupportedModelError, build_method

        n = max(1, min(MAX_COLUMNS, int(n_columns)))
        specs = [(s or "").strip() or NO_METHOD for s in (spec1, spec2, spec3, spec4)[:n]]
        results: list = [None] * n
        overlays: list = [None] * n
        preview = None

        def outputs(status, final=False):
            out = self._outputs(status, results, specs, with_plot=False)
            out[1:1] = [preview]
            out += [overlays[i] if i < n else None for i in range(MAX_COLUMNS)]
            plot = ratio_figure(specs, results, VISION_RATIO_METRICS) if final else None
            if plot is not None:
                plot.axes[0].set_title("ratios to the first column (lower is better, except images/s)", fontsize=9)
            return out + [plot]

        def fail_all(message):
            results[:] = [ColumnResult.failure(message) for _ in range(n)]
            return outputs(f"**error**: {message}")

        model, processor, failed = self._load(model_name, n, progress)
        if failed:
            results[:] = failed
            yield outputs("**error**: the model could not be loaded (see the columns).")
            return
        try:
            runner = vision_runner(model, processor)
            image, source = vision_input(upload, sample, scene_seed, self.max_upload_bytes)
            repeats = 0 if repeats is None else int(repeats)
            if repeats < 1:
                raise InputError(f"repeats must be >= 1, got {repeats}")
            pixels = runner.pixels(image)
            view = runner.view(pixels)
        except InputError as exc:
            yield fail_all(str(exc))
            return
        preview = scaled_view(view)
        progress(0.0, desc="the unmodified encoder (the reference of the cosines)")
        try:
            reference = runner.run(pixels, None, repeats=0)
        except Exception as exc:  # noqa: BLE001 - e.g. a checkpoint whose encoder does not run on this input
            yield fail_all(f"the unmodified {runner.kind} failed on this input: {type(exc).__name__}: {exc}")
            return
        first = None
        for i, spec in enumerate(specs):
            progress((i, n), desc=f"column {i + 1}: {spec}")
            yield outputs(f"running column {i + 1} of {n} ({spec}) ...")
            method = None
            try:
                method = None if spec.split(":")[0] == NO_METHOD else build_method(spec)
                run = runner.run(pixels, method, repeats=repeats)
            except UnsupportedModelError as exc:
                where = STAGE_WHERE.get(method.stage, method.stage)
                results[i] = ColumnResult.failure(f"{exc}. {method.name} works {where}; on a {runner.kind} use "
                                                  f"{' or '.join(runner.methods())}.")
                continue
            except Exception as exc:  # noqa: BLE001 - bad spec, bad value, anything else: this column only
                results[i] = ColumnResult.failure(str(exc) if isinstance(exc, ValueError)
                                                  else f"{type(exc).__name__}: {exc}")
                continue
            if i == 0:
                first = run
            results[i] = ColumnResult(html=vision_html(spec, run), rows=vision_rows(run, reference, first), record=run)
            overlays[i] = token_overlay(view, run.patch_slots())
        h, w = reference.grid
        status = (f"Ran {n} configurations one after another on the same input ({source}: {view.width} x "
                  f"{view.height} px as the {runner.kind} sees it, {h} x {w} patches), each after one warm-up "
                  f"forward; encoder seconds are medians of {repeats} forward(s); cosines compare with the "
                  "unmodified encoder on the same input.")
        yield outputs(status, final=True)


def kernel_figure(records: list[dict]):
    """Bar plot of kernel speedups vs dense SDPA, one bar per (op, method, backend, length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r["backend"] != "sdpa"]  # the baselines themselves are 1.0
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    labels = [f"{r['op']} {r['method']} [{r['backend']}] L={r['length']}" for r in recs]
    ys = [r["speedup"] for r in recs]
    bars = ax.barh(range(len(ys)), ys, color=["#4c72b0" if y >= 1 else "#dd8452" for y in ys])
    ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=7)
    ax.set_yticks(range(len(ys)), labels, fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("speedup vs dense SDPA (higher is faster)", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    plt.close(fig)
    return fig


def _column_outputs(tab: str, cols: list[MethodColumn], n_cols, image: bool | str = False) -> tuple[list, list]:
    """A row of output columns under the configuration columns, aligned with them: per column an ``output`` (HTML),
    a ``metrics`` table and, with ``image``, an image under them; shown for the first ``n_cols`` columns.

    ``image``: ``True`` for a heatmap (element id ``{tab}-col{i}-heatmap``), or a label for another image (element id
    ``{tab}-col{i}-image``; PNG, so what the handler drew comes back pixel for pixel).

    Returns
    -------
    (outputs, images)
        ``[html, table] * 4`` and the 4 image components (empty without ``image``).
    """
    outs, images, boxes = [], [], []
    with gr.Row(equal_height=False):
        for col in cols:
            with gr.Column(visible=col.index < 2, min_width=260, elem_id=f"{tab}-out{col.index}") as box:
                out_html = gr.HTML(label="output", elem_id=f"{tab}-col{col.index}-output",
                                   elem_classes=["mm-column-output"])
                table = gr.Dataframe(value=metrics_table([]), headers=METRIC_HEADERS, datatype=["str", "number"],
                                     label=f"metrics, column {col.index + 1}", interactive=False,
                                     elem_id=f"{tab}-col{col.index}-metrics")
                if image is True:
                    images.append(gr.Image(label="heatmap", type="filepath", elem_id=f"{tab}-col{col.index}-heatmap"))
                elif image:
                    images.append(gr.Image(label=image, type="pil", format="png", interactive=False,
                                           elem_id=f"{tab}-col{col.index}-image"))
            boxes.append(box)
            col.outputs = [out_html, table]
            outs += col.outputs
    n_cols.change(_columns_visibility, n_cols, boxes, queue=False, api_visibility="private")
    return outs, images


def _columns(tab: str, registry, defaults: list[str], extra=None, initial=None) -> tuple[Any, list[MethodColumn]]:
    n_cols = gr.Radio([2, 3, 4], value=2, label="columns", elem_id=f"{tab}-ncols")
    initial = list(initial or [None] * MAX_COLUMNS)
    with gr.Row(equal_height=False):
        cols = [method_column(tab, i, registry, defaults[i], extra=extra, initial=initial[i])
                for i in range(MAX_COLUMNS)]
    n_cols.change(_columns_visibility, n_cols, [c.container for c in cols], queue=False, api_visibility="private")
    return n_cols, cols


def build_app(default_model: str = "smollm2-135m", *, vision_model: str = "dinov2-small", device: str = "auto",
              max_upload_mb: float = 2.0, niah_length: int = 2048, haystack=None, work_dir=None,
              models: ModelCache | None = None) -> gr.Blocks:
    """Build the workbench.

    Parameters
    ----------
    default_model : str
        Model preselected in the picker of the text tabs (tests use ``"micro-lm"``).
    vision_model : str
        Model preselected in the Image & video tab: a zoo vision encoder or a local checkpoint directory (tests use a
        tiny random Dinov2 saved to a temp folder).
    device : str
        Where models load (``"auto"``, ``"cpu"``, ``"cuda"``).
    max_upload_mb : float
        Size limit of an uploaded document or image, MiB (checked by the handler; ``--max-upload-mb`` also passes it to
        Gradio's own upload limit).
    niah_length : int
        Default length of a generated NIAH document, tokens.
    haystack : path, optional
        A UTF-8 text file for NIAH documents and sweeps (``--haystack``; default the held-out standard-library prose).
    work_dir : path, optional
        Temp folder for NIAH and kernel-bench outputs (default: a new folder under the system temp dir).
    models : ModelCache, optional
        Share a model cache (e.g. between apps in one process).

    Returns
    -------
    gr.Blocks
        Not launched; measured endpoints share one concurrency-1 queue slot (``concurrency_id="measured"``).
    """
    from mmaccel import longctx, speculative, vision_tokens

    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="mmaccel-app-"))
    work.mkdir(parents=True, exist_ok=True)
    wb = Workbench(models or ModelCache(device=device), int(max_upload_mb * 2**20), work, haystack=haystack)
    measured = {"concurrency_limit": 1, "concurrency_id": "measured"}

    with gr.Blocks(title="mmaccel workbench", delete_cache=(3600, 3600)) as demo:
        gr.Markdown("# mmaccel workbench\nSide-by-side, measured: every method and its parameters come from the "
                    "registries (`mmaccel.longctx.METHODS`, `mmaccel.speculative.METHODS`, ...).")
        with gr.Row():
            model = gr.Dropdown(choices=text_model_choices(), value=default_model, allow_custom_value=True,
                                label="model (zoo name, local checkpoint directory, or hub id when online)",
                                elem_id="model", scale=3)
        gr.Markdown(FAIR_TIMING, elem_id="fair-timing")

        with gr.Tabs():
            # ------------------------------------------------------------ long context
            with gr.Tab("Long context", id="longctx", elem_id="tab-longctx"):
                with gr.Row():
                    with gr.Column(scale=3):
                        document = gr.Textbox(label="document", lines=6, max_lines=12, elem_id="lc-document",
                                              placeholder="paste a document, upload a text file, or generate one")
                        question = gr.Textbox(label="question", lines=1, elem_id="lc-question")
                    with gr.Column(scale=2):
                        upload = gr.File(label=f"or upload a UTF-8 text file (up to {max_upload_mb:g} MiB; kept in "
                                               "Gradio's temp folder)", type="filepath", elem_id="lc-upload")
                        with gr.Row():
                            niah_len = gr.Number(niah_length, label="NIAH length (tokens)", precision=0, minimum=64)
                            niah_depth = gr.Slider(0, 1, 0.5, step=0.05, label="needle depth")
                            niah_seed = gr.Number(0, label="seed", precision=0)
                        gen_doc = gr.Button("Generate a NIAH document", elem_id="lc-gen-doc")
                        expected = gr.Textbox(label="expected answer (optional; scored when given)",
                                              elem_id="lc-expected")
                with gr.Row():
                    lc_max_new = gr.Number(24, label="max new tokens", precision=0, minimum=1, elem_id="lc-max-new")
                    lc_repeats = gr.Number(1, label="repeats (median)", precision=0, minimum=1)
                    lc_warmup = gr.Radio(WARMUPS, value=WARMUPS[0], label="warm-up run per configuration",
                                         info="the full input is fairer (every code path is warm); a short prompt "
                                              "halves the time of long documents")
                lc_ncols, lc_cols = _columns("lc", longctx.METHODS, ["full", "snapkv", "streaming", "h2o"])
                with gr.Row():
                    lc_run = gr.Button("Run side by side", variant="primary", elem_id="lc-run")
                    lc_stop = gr.Button("Stop", elem_id="lc-stop")
                lc_status = gr.Markdown(elem_id="lc-status")
                lc_outs, _ = _column_outputs("lc", lc_cols, lc_ncols)
                lc_plot = gr.Plot(label="ratios to column 1", elem_id="lc-plot")
                ev = lc_run.click(wb.longctx, [model, document, upload, question, expected, lc_max_new, lc_repeats,
                                               lc_warmup, lc_ncols, *[c.spec for c in lc_cols]],
                                  [lc_status, *lc_outs, lc_plot], api_name="longctx", **measured)
                lc_stop.click(None, cancels=[ev], api_visibility="private")
                gen_doc.click(wb.niah_document, [model, niah_len, niah_depth, niah_seed],
                              [document, question, expected], api_name="niah_document", **measured)

            # ------------------------------------------------------------ generation
            with gr.Tab("Generation", id="generation", elem_id="tab-generation"):
                gr.Markdown("Greedy decoding with speculative drafters from `mmaccel.speculative.METHODS`. In the "
                            "output, <span style='" + _ACCEPTED_STYLE + "'>green</span> tokens are draft tokens "
                            "the target accepted; <span style='" + _TARGET_STYLE + "'>grey</span> tokens came from "
                            "the target's own verification forward (every token, in the autoregressive column).")
                prompt = gr.Textbox(label="prompt", lines=3, elem_id="gen-prompt",
                                    value="The secret number of the cat is 12345. The secret number of the dog is")
                with gr.Row():
                    gen_max_new = gr.Number(32, label="max new tokens", precision=0, minimum=1, elem_id="gen-max-new")
                    gen_k = gr.Number(4, label="draft tokens per step", precision=0, minimum=1)
                    gen_repeats = gr.Number(1, label="repeats (median)", precision=0, minimum=1)
                gen_ncols, gen_cols = _columns(
                    "gen", speculative.METHODS, [AUTOREGRESSIVE, "prompt_lookup", "draft", "jacobi"],
                    extra={AUTOREGRESSIVE: "Plain greedy decoding (model.generate): the baseline."})
                with gr.Row():
                    gen_run = gr.Button("Run side by side", variant="primary", elem_id="gen-run")
                    gen_stop = gr.Button("Stop", elem_id="gen-stop")
                gen_status = gr.Markdown(elem_id="gen-status")
                gen_outs, _ = _column_outputs("gen", gen_cols, gen_ncols)
                gen_plot = gr.Plot(label="ratios to column 1", elem_id="gen-plot")
                ev = gen_run.click(wb.generation, [model, prompt, gen_max_new, gen_k, gen_repeats, gen_ncols,
                                                   *[c.spec for c in gen_cols]],
                                   [gen_status, *gen_outs, gen_plot], api_name="generation", **measured)
                gen_stop.click(None, cancels=[ev], api_visibility="private")

            # ------------------------------------------------------------ evaluations
            with gr.Tab("Evaluations", id="evaluations", elem_id="tab-evaluations"):
                gr.Markdown("A small needle-in-a-haystack sweep per column (`mmaccel.eval.run_niah`); for real sweeps "
                            "use `mmaccel niah` (it writes the same heatmaps).")
                with gr.Row():
                    ev_lengths = gr.Textbox("512 1024", label="lengths (tokens)", elem_id="ev-lengths")
                    ev_depths = gr.Textbox("0 0.5 1", label="depths", elem_id="ev-depths")
                    ev_trials = gr.Number(1, label="trials", precision=0, minimum=1)
                    ev_max_new = gr.Number(12, label="max new tokens", precision=0, minimum=1, elem_id="ev-max-new")
                ev_ncols, ev_cols = _columns("ev", longctx.METHODS, ["full", "snapkv", "streaming", "h2o"])
                with gr.Row():
                    ev_run = gr.Button("Run NIAH", variant="primary", elem_id="ev-run")
                    ev_stop = gr.Button("Stop", elem_id="ev-stop")
                ev_status = gr.Markdown(elem_id="ev-status")
                ev_outs, ev_imgs = _column_outputs("ev", ev_cols, ev_ncols, image=True)
                ev = ev_run.click(wb.niah_eval, [model, ev_lengths, ev_depths, ev_trials, ev_max_new, ev_ncols,
                                                 *[c.spec for c in ev_cols]],
                                  [ev_status, *ev_outs, *ev_imgs], api_name="niah_eval", **measured)
                ev_stop.click(None, cancels=[ev], api_visibility="private")

            # ------------------------------------------------------------ kernels
            with gr.Tab("Kernels", id="kernels", elem_id="tab-kernels"):
                gr.Markdown("The attention-kernel micro-benchmark (`mmaccel.kernels.bench`, also `mmaccel "
                            "kernel-bench`): sparse prefill patterns and budgeted decode, as speed ratios to dense "
                            "SDPA measured in the same process.")
                with gr.Row():
                    kb_lengths = gr.Textbox("1024 2048", label="prefill lengths", elem_id="kb-lengths")
                    kb_cache = gr.Textbox("2048", label="decode cache lengths", elem_id="kb-cache")
                    kb_budgets = gr.Textbox("256", label="decode budgets", elem_id="kb-budgets")
                    kb_ops = gr.CheckboxGroup(["prefill", "decode"], value=["prefill", "decode"], label="ops")
                    kb_repeats = gr.Number(3, label="repeats", precision=0, minimum=1, elem_id="kb-repeats")
                kb_run = gr.Button("Run the micro-benchmark", variant="primary", elem_id="kb-run")
                kb_status = gr.Markdown(elem_id="kb-status")
                kb_table = gr.Dataframe(label="records", interactive=False, elem_id="kb-table")
                kb_plot = gr.Plot(label="speedup vs SDPA", elem_id="kb-plot")
                kb_run.click(wb.kernels, [kb_lengths, kb_cache, kb_budgets, kb_ops, kb_repeats],
                             [kb_status, kb_table, kb_plot], api_name="kernels", **measured)

            # ------------------------------------------------------------ image & video
            with gr.Tab("Image & video", id="vision", elem_id="tab-vision"):
                gr.Markdown(vision_intro(), elem_id="vis-about")
                with gr.Row():
                    with gr.Column(scale=3):
                        vis_model = gr.Dropdown(choices=vision_model_choices(), value=vision_model,
                                                allow_custom_value=True, elem_id="vis-model",
                                                label="vision model (zoo name or local checkpoint directory)")
                        with gr.Row():
                            vis_sample = gr.Dropdown(VISION_SAMPLES, value=VISION_SAMPLES[0], label="sample",
                                                     elem_id="vis-sample")
                            vis_seed = gr.Number(0, label="scene seed", precision=0, minimum=0, elem_id="vis-seed")
                            vis_repeats = gr.Number(5, label="repeats (median)", precision=0, minimum=1,
                                                    elem_id="vis-repeats")
                        vis_upload = gr.File(label=f"or upload an image (up to {max_upload_mb:g} MiB; wins over the "
                                                   "sample; kept in Gradio's temp folder)", type="filepath",
                                             elem_id="vis-upload")
                    with gr.Column(scale=2):
                        vis_input = gr.Image(label="input as the encoder sees it (resized, cropped)", type="pil",
                                             format="png", interactive=False, elem_id="vis-input")
                vis_ncols, vis_cols = _columns(
                    "vis", vision_tokens.METHODS, [m for m, _ in VISION_DEFAULTS],
                    extra={NO_METHOD: "The unmodified encoder: the baseline of the cosines."},
                    initial=[v for _, v in VISION_DEFAULTS])
                with gr.Row():
                    vis_run = gr.Button("Run side by side", variant="primary", elem_id="vis-run")
                    vis_stop = gr.Button("Stop", elem_id="vis-stop")
                vis_status = gr.Markdown(elem_id="vis-status")
                vis_outs, vis_imgs = _column_outputs("vis", vis_cols, vis_ncols,
                                                     image="kept and merged tokens over the input")
                vis_plot = gr.Plot(label="ratios to column 1", elem_id="vis-plot")
                ev = vis_run.click(wb.vision, [vis_model, vis_upload, vis_sample, vis_seed, vis_repeats, vis_ncols,
                                               *[c.spec for c in vis_cols]],
                                   [vis_status, vis_input, *vis_outs, *vis_imgs, vis_plot], api_name="vision",
                                   **measured)
                vis_stop.click(None, cancels=[ev], api_visibility="private")
    return demo


# ------------------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    """The ``python -m apps.workbench`` flags."""
    p = argparse.ArgumentParser(prog="python -m apps.workbench", description="The mmaccel Gradio workbench.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    p.add_argument("--model", default="smollm2-135m", help="model preselected in the picker of the text tabs")
    p.add_argument("--vision-model", default="dinov2-small",
                   help="model preselected in the Image & video tab (a zoo vision encoder or a local checkpoint)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-upload-mb", type=float, default=2.0, help="size limit of an uploaded document or image, MiB")
    p.add_argument("--haystack", help="UTF-8 text file used as the NIAH haystack (default: held-out stdlib prose)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Launch the workbench (blocks until interrupted)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.haystack and not Path(args.haystack).is_file():
        build_parser().error(f"--haystack {args.haystack}: no such file")
    demo = build_app(args.model, vision_model=args.vision_model, device=args.device,
                     max_upload_mb=args.max_upload_mb, haystack=args.haystack)
    demo.queue(default_concurrency_limit=1)
    # Gradio's own limit is a backstop against huge uploads filling the temp folder; files between the two limits
    # reach the handler, which reports them in the columns.
    limit = int(args.max_upload_mb * 2**20)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share,
                max_file_size=max(2 * limit, limit + 2**20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
