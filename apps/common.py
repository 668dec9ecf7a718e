"""What every tab of the workbench shares: the model cache, the request context, a column's result and how it is shown.

- :class:`ModelCache` loads models with :func:`mmaccel.load` and keeps the last few;
- :class:`AppContext` holds what the handlers share: the cache, the upload limit, the temp folder, the NIAH haystack,
  the preset models;
- :class:`Request` holds one request's columns (specs, results) and the steps every column handler repeats: load the
  model (an error in each column when it fails), fail every column, lay out ``[status, (html, metrics) x 4, ...]``;
- :class:`Tab` is the base of the tabs in :mod:`mmaccel.apps.tabs` (a title, an id, :meth:`Tab.build`);
- :class:`ColumnResult` is what one column shows: an HTML body (the output or an error) and its metric rows;
  :func:`error_html`, :func:`text_html`, :func:`metrics_table` and :func:`ratio_figure` render it.

Nothing here runs a measurement; the tabs do, through :func:`mmaccel.eval.generate_measured` and the harnesses built
on it.
"""
from __future__ import annotations

import html
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

MAX_COLUMNS = 4
AUTOREGRESSIVE = "autoregressive"
"""The baseline of the Generation and Spec bench tabs: plain greedy decoding, no drafter."""

FAIR_TIMING = (
    "**Fair timing.** Requests wait on one queue with concurrency 1: nothing else runs while a comparison is measured. "
    "Inside a request the configurations run one after another on the same input, each after one warm-up run; "
    "times are medians over *repeats*. Peak memory on the CPU is the sampled growth of the process RSS (an "
    "approximate lower bound); on CUDA it is exact."
)
MEASURED = {"concurrency_limit": 1, "concurrency_id": "measured"}
"""Event options of every measured endpoint: one shared queue slot, so two measurements never overlap."""

ERROR_STYLE = ("color:#8a1020;background:#fdecee;border:1px solid #e3a1aa;border-radius:6px;padding:8px;"
               "white-space:pre-wrap")
TEXT_STYLE = "white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:14px;line-height:1.5"
ACCEPTED_STYLE = "background:#b7efc5;border-radius:3px"
TARGET_STYLE = "background:#e8e8f0;border-radius:3px"
METRIC_HEADERS = ["metric", "value"]


class InputError(ValueError):
    """Bad user input (an upload, a question, a length): shown as an error in the columns."""


_PATH = re.compile(r"(?<![\w.:/~])(?:~/|/)(?:[^\s'\"`<>()\[\],;:*/]+/)*([^\s'\"`<>()\[\],;:*/]+)/?")


def scrub(text) -> str:
    """``text`` with every absolute or home-relative path cut to its last part (``/tmp/gradio/ab12/x.png`` ->
    ``x.png``), so no status line or error shows where the server keeps files (issue 33)."""
    return _PATH.sub(lambda m: m.group(1), str(text))


# --------------------------------------------------------------------------------------------------------- models
class ModelCache:
    """Loaded models by name, at most ``capacity`` of them (least recently used evicted), loaded with
    :func:`mmaccel.load`, ``trust_remote_code=False`` unless the gate allows it and the request asked.

    Parameters
    ----------
    device : str
        Where models load.
    capacity : int
        Models kept loaded.
    gate : mmaccel.apps.security.ModelGate, optional
        What names may be loaded (default: zoo names only, no hub ids, no checkpoint code).
    """

    def __init__(self, device: str = "auto", capacity: int = 2, gate=None):
        from .security import ModelGate

        self.device, self.capacity = device, capacity
        self.gate = gate if gate is not None else ModelGate()
        self._models: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str, trust_remote_code: bool = False):
        """``(model, tokenizer)`` for a name the gate accepts (a zoo name, a preset, a folder under the model roots,
        a hub id with ``--allow-hub``).

        Raises
        ------
        InputError
            An empty name, a name the gate refuses (one message whether a path exists or not), a checkpoint with
            its own code without the opt-in.
        mmaccel.models.ModelLoadError
            A bad checkpoint folder, a hub id while offline, a failed fetch.
        """
        import mmaccel

        trust = bool(trust_remote_code) and self.gate.allow_remote_code
        source = self.gate.check(name, trust)
        key = (source, trust)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            logger.info("loading model %s on %s (trust_remote_code=%s)", name, self.device, trust)
            pair = mmaccel.load(source, device=self.device, trust_remote_code=trust)
            self._models[key] = pair
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
            return pair


def text_model_choices() -> list[str]:
    """Zoo names of the models the text tabs can run: trained micro-models and fetched causal LMs."""
    from mmaccel.models import FETCHED, ZOO

    names = list(ZOO)
    names += [n for n, e in FETCHED.items() if "CausalLM" in e.model_class or "ConditionalGeneration" in e.model_class]
    return names


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


# ------------------------------------------------------------------------------------------------- result display
@dataclass
class ColumnResult:
    """What one column shows: an HTML body (output or error) and its metric rows.

    Attributes
    ----------
    html : str
        The column's output (``class="mm-output"``) or error box (``class="mm-error"``).
    rows : list of [str, number]
        The metrics table; empty while the column runs or when it failed.
    record : object
        What the rows were read from (a :class:`~mmaccel.eval.generation.RunRecord`, a vision run, a summary row);
        ``None`` when the column failed, so the ratio plot leaves it out.
    error : str or None
        The error message of a failed column.
    """

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
    return f'<div class="mm-error" style="{ERROR_STYLE}"><b>error</b>: {html.escape(scrub(message))}</div>'


def error_text(exc: BaseException) -> str:
    """The message a column shows for ``exc``: a ``ValueError``'s own message (bad input names its fix), else
    ``"Type: message"`` (an OOM, a bug); server paths cut to their last part (:func:`scrub`)."""
    return scrub(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")


def mib(n) -> float | None:
    """Bytes as MiB, 3 decimals (``None`` stays ``None``)."""
    return None if n is None else round(n / 2**20, 3)


def rounded(x, nd: int = 4) -> float | None:
    """``round(float(x), nd)`` (``None`` stays ``None``)."""
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


def text_html(text: str, note: str = "") -> str:
    """Plain generated text as HTML, with an optional note under it."""
    body = html.escape(text) if text else "<i>(no tokens generated)</i>"
    extra = f'<div style="margin-top:6px;font-size:13px">{note}</div>' if note else ""
    return f'<div class="mm-output" style="{TEXT_STYLE}">{body}</div>{extra}'


def record_result(rec, expected: str | None = None, body: str | None = None) -> ColumnResult:
    """The column of one :class:`~mmaccel.eval.generation.RunRecord`: its error, or ``body`` (default: the output
    text, with a found / not found note when an ``expected`` answer is given) and :func:`record_rows`."""
    if not rec.ok:
        return ColumnResult(html=error_html(rec.error), rows=[], record=None, error=rec.error)
    note = ""
    if expected is not None:
        ok = rec.extra.get("correct")
        note = (f'<span style="color:#126b2e">✓ answer {html.escape(expected)} found</span>' if ok else
                f'<span style="color:#8a1020">✗ expected {html.escape(expected)}</span>')
    return ColumnResult(html=body if body is not None else text_html(rec.output_text, note),
                        rows=record_rows(rec), record=rec)


def figure(width: float, height: float):
    """A matplotlib ``Figure`` on the Agg canvas (no pyplot state, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


# --------------------------------------------------------------------------------------------------------- context
class AppContext:
    """What every tab's handlers share, and the steps every column handler repeats.

    Parameters
    ----------
    models : ModelCache
        Where models are loaded and kept.
    max_upload_bytes : int
        Size limit of an uploaded document or image, bytes.
    work_dir : path or None
        The app's private temp folder (:class:`~mmaccel.apps.security.PrivateFolder`, mode 0700): uploads are copied
        into a per-request folder there, and NIAH heatmaps, kernel-bench JSON and sweep results are written to one;
        each is removed when its request ends, the whole folder by :meth:`close` and at exit. ``None``: a new
        ``mmaccel-app-*`` folder.
    haystack : path, optional
        A UTF-8 text file used as the NIAH haystack (default: the held-out standard-library prose, which takes
        seconds to build the first time).
    niah_length : int
        Default length of a generated NIAH document, tokens.
    vision_model : str
        Model preselected in the Vision encoder tab (a vision encoder).
    vlm_model : str
        Model preselected in the Vision sweep tab (a vision-language model).
    max_image_pixels : int
        Pixel cap of an uploaded image and of a video frame (``--max-image-pixels``), checked from the header.
    max_video_frames : int
        Most frames an uploaded video may have.

    Attributes
    ----------
    extra_inputs : list
        Components every model-loading endpoint takes last (the "trust remote code" box when the app was launched
        with ``--allow-remote-code``, else none).
    """

    def __init__(self, models: ModelCache, max_upload_bytes: int, work_dir=None, haystack=None, *,
                 niah_length: int = 2048, vision_model: str = "dinov2-small", vlm_model: str = "smol-llava",
                 max_image_pixels: int | None = None, max_video_frames: int | None = None):
        from .security import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_FRAMES, PrivateFolder

        self.folder = PrivateFolder(work_dir)
        self.models, self.max_upload_bytes, self.work_dir = models, int(max_upload_bytes), self.folder.path
        self.haystack = None if haystack is None else str(haystack)
        self.niah_length, self.vision_model, self.vlm_model = int(niah_length), vision_model, vlm_model
        self.max_image_pixels = int(max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)
        self.max_video_frames = int(max_video_frames or DEFAULT_MAX_VIDEO_FRAMES)
        self.extra_inputs: list = []
        self._haystacks: dict = {}

    def request_folder(self, prefix: str):
        """A per-request folder in the private temp folder, removed when the ``with`` block ends."""
        return self.folder.request(prefix)

    def upload(self, path, folder) -> Path | None:
        """An upload copied into ``folder`` (0600) and size-checked (:func:`checked_upload`); ``None`` for none.

        Raises
        ------
        InputError
            Over the size limit, or no longer on the server.
        """
        copy = self.folder.take(path, folder)
        return None if copy is None else checked_upload(copy, self.max_upload_bytes)

    def close(self) -> None:
        """Remove the private temp folder (the app has stopped)."""
        self.folder.close()

    @property
    def max_upload_mb(self) -> float:
        """The upload limit, MiB (for labels)."""
        return self.max_upload_bytes / 2**20

    def haystack_tokens(self, tokenizer):
        """The NIAH haystack for ``tokenizer`` (``None`` = the default prose), built once per tokenizer."""
        if self.haystack is None:
            return None
        key = id(tokenizer)
        if key not in self._haystacks:
            from mmaccel.data.haystack import HaystackTokens

            self._haystacks[key] = HaystackTokens(tokenizer, Path(self.haystack).read_text(encoding="utf-8"))
        return self._haystacks[key]


LOAD_FAILED = "**error**: the model could not be loaded (see the columns)."
"""The status line of a request whose model could not be loaded."""


class Request:
    """One request of a column tab: the columns' specs and results, and the endpoint's outputs built from them.

    The outputs are ``[status, *head(), (html, metrics) x 4, *tail(final)]``; columns past ``n`` are empty.

    Parameters
    ----------
    ctx : AppContext
    n_columns : int
        Columns the request runs, clamped to 1..:data:`MAX_COLUMNS`.
    specs : sequence of str
        The columns' specs (the first ``n`` are used, stripped; an empty one becomes ``empty``).
    empty : str
        The spec of an empty column (a tab's baseline, e.g. ``"none"``).
    head : callable, optional
        ``head() -> list``: outputs between the status and the columns (e.g. the input image).
    tail : callable, optional
        ``tail(final) -> list``: outputs after the columns; default the ratio plot (:func:`ratio_figure`), drawn when
        ``final``.
    """

    def __init__(self, ctx: AppContext, n_columns, specs, *, empty: str = "", head=None, tail=None):
        self.ctx = ctx
        self.n = max(1, min(MAX_COLUMNS, int(n_columns)))
        self.specs = [(s or "").strip() or empty for s in list(specs)[: self.n]]
        self.results: list = [None] * self.n
        self.head = head or list
        self.tail = tail or (lambda final: [ratio_figure(self.specs, self.results) if final else None])

    def outputs(self, status: str, final: bool = False) -> list:
        """The endpoint's outputs now (``final``: the last yield, which draws the plots)."""
        out: list = [scrub(status), *self.head()]
        for i in range(MAX_COLUMNS):
            r = self.results[i] if i < self.n else None
            out += [r.html if r else "", metrics_table(r.rows if r else [])]
        return out + list(self.tail(final))

    def fail_all(self, message: str) -> list:
        """Every column shows ``message`` as its error; the outputs, with the status ``**error**: message``."""
        self.results[:] = [ColumnResult.failure(message) for _ in range(self.n)]
        return self.outputs(f"**error**: {message}")

    def load(self, model_name: str, progress, trust_remote_code: bool = False) -> tuple:
        """``(model, tokenizer)`` from the context's cache, or ``(None, None)`` when the model cannot be loaded
        (a name the gate refuses, a column spec naming a path it refuses, a checkpoint with its own code without
        the opt-in, offline hub id, failed fetch, OOM): every column then shows why (yield ``outputs(LOAD_FAILED)``).
        ``trust_remote_code`` counts only when the app was launched with ``--allow-remote-code``."""
        progress(0.0, desc="loading the model (a fetched zoo model is downloaded once)")
        try:
            for spec in self.specs:
                self.ctx.models.gate.check_spec(spec)
            return self.ctx.models.get(model_name, trust_remote_code=bool(trust_remote_code))
        except Exception as exc:  # noqa: BLE001 - unknown model, offline hub id, failed fetch, OOM: shown per column
            msg = str(exc) if isinstance(exc, InputError) else f"cannot load model {model_name!r}: {exc}"
            logger.warning(msg)
            self.results[:] = [ColumnResult.failure(msg) for _ in range(self.n)]
            return None, None


class Tab:
    """Base of a workbench tab (:mod:`mmaccel.apps.tabs`): its handlers are methods, :meth:`build` lays it out.

    Attributes
    ----------
    title : str
        The tab's label.
    key : str
        The tab's id (``elem_id="tab-{key}"``).
    """

    title: ClassVar[str] = ""
    key: ClassVar[str] = ""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def build(self, model) -> None:
        """Lay out the tab's components inside the current ``gr.Tab`` and wire its endpoints.

        Parameters
        ----------
        model : gradio.Dropdown
            The app's text-model picker (the tabs that run a causal LM take it as their first input).
        """
        raise NotImplementedError
