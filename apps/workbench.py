"""The mmaccel workbench: a Gradio app that runs 2 to 4 configurations side by side and measures each one fairly.

Launch it with ``mmaccel app`` or ``python -m mmaccel.apps.workbench`` (127.0.0.1:7860 by default; ``--host``,
``--port``, ``--share``, ``--device``, ``--threads``, ``--max-upload-mb``); from a checkout, ``python -m
apps.workbench`` at the repository root also works. Tests build it with :func:`build_app` and query it with
``gradio_client``.

Everything a column offers comes from a registry: the method dropdown lists ``mmaccel.longctx.METHODS`` (or
``mmaccel.speculative.METHODS``, ``mmaccel.vision_tokens.METHODS``), and the parameter fields under it are generated
from the method class's constructor signature and docstring (:mod:`mmaccel.apps.forms`), so a method added to a
registry appears here with no edit. A filled form is shown as its method spec (``snapkv:budget=256``), which is also
what the endpoints take.

Fair timing: every measured endpoint shares one queue slot (concurrency 1), so two requests never run at once; inside
a request the configurations run one after another on the same input, each after a warm-up run. Results stream in
column by column (the Generation tab also streams each column's tokens from an untimed pass before its measured
run); the Stop button cancels between columns.

Layout of the package:

- :mod:`mmaccel.apps.common` -- the model cache, the request context, a column's result and its rendering;
- :mod:`mmaccel.apps.columns` -- configuration columns with generated forms, and the output row under them;
- :mod:`mmaccel.apps.prompts`, :mod:`mmaccel.apps.streaming`, :mod:`mmaccel.apps.vision_encoder`,
  :mod:`mmaccel.apps.overlay` -- inputs, token streaming, the vision-encoder runner and the token overlay;
- :mod:`mmaccel.apps.tabs` -- one module per tab (:data:`mmaccel.apps.tabs.TABS`), each with its handlers and its
  layout.

Endpoints (``api_name``): ``longctx``, ``niah_document``, ``generation``, ``niah_eval``, ``vision_sweep``,
``spec_bench``, ``kernels``, ``vision``.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import weakref
from pathlib import Path

import gradio as gr

from .columns import MethodColumn, column_outputs, column_row, method_column
from .common import (
    AUTOREGRESSIVE,
    FAIR_TIMING,
    MAX_COLUMNS,
    METRIC_HEADERS,
    AppContext,
    ColumnResult,
    InputError,
    ModelCache,
    checked_upload,
    error_html,
    metrics_table,
    ratio_figure,
    record_rows,
    text_html,
    text_model_choices,
)
from .overlay import OVERLAY_SIDE, scaled_view, token_overlay
from .prompts import build_prompt, niah_document, read_upload
from .security import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_VIDEO_FRAMES,
    ModelGate,
    exposure_error,
    read_auth,
)
from .tabs import TABS
from .tabs.generation import accepted_mask, coloured_html, token_pieces, with_draft_length
from .tabs.kernels import kernel_figure
from .tabs.longctx import WARMUPS
from .tabs.vision import STAGE_WHERE, VISION_DEFAULTS, VISION_RATIO_METRICS, vision_html, vision_intro, vision_rows
from .vision_encoder import (
    NO_METHOD,
    SAMPLE_PHOTOS,
    SCENE_SAMPLE,
    VISION_RUNNERS,
    VISION_SAMPLES,
    EncoderRunner,
    VisionRun,
    sample_image,
    vision_input,
    vision_model_choices,
    vision_runner,
)

logger = logging.getLogger(__name__)

_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each built app's :class:`AppContext` (its private folder), for :func:`app_lifespan`."""

__all__ = [  # the names this module has always offered, now defined in the modules above
    "AUTOREGRESSIVE", "FAIR_TIMING", "MAX_COLUMNS", "METRIC_HEADERS", "NO_METHOD", "OVERLAY_SIDE", "SAMPLE_PHOTOS",
    "SCENE_SAMPLE", "STAGE_WHERE", "VISION_DEFAULTS", "VISION_RATIO_METRICS", "VISION_RUNNERS", "VISION_SAMPLES",
    "WARMUPS", "AppContext", "ColumnResult", "EncoderRunner", "InputError", "MethodColumn", "ModelCache", "VisionRun",
    "accepted_mask", "app_lifespan", "build_app", "build_parser", "build_prompt", "checked_upload", "coloured_html",
    "column_outputs", "column_row", "error_html", "kernel_figure", "main", "method_column", "metrics_table",
    "niah_document", "private_folder", "ratio_figure", "read_upload", "record_rows", "sample_image", "scaled_view",
    "text_html", "text_model_choices", "token_overlay", "token_pieces", "vision_html", "vision_input", "vision_intro", "vision_model_choices",
    "vision_rows", "vision_runner", "with_draft_length",
]


def build_app(default_model: str = "smollm2-135m", *, vision_model: str = "dinov2-small",
              vlm_model: str = "smol-llava", device: str = "auto", max_upload_mb: float = 2.0,
              niah_length: int = 2048, haystack=None, work_dir=None, models: ModelCache | None = None,
              model_roots=(), allow_hub: bool = False, allow_remote_code: bool = False,
              max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
              max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES) -> gr.Blocks:
    """Build the workbench.

    Parameters
    ----------
    default_model : str
        Model preselected in the picker of the text tabs (tests use ``"micro-lm"``).
    vision_model : str
        Model preselected in the Vision encoder tab: a zoo vision encoder or a local checkpoint directory (tests use a
        tiny random Dinov2 saved to a temp folder).
    vlm_model : str
        Model preselected in the Image & video QA and Vision sweep tabs: a vision-language model (``smol-llava``, or
        a local LLaVA-style checkpoint directory; tests use a tiny random one).
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
        The app's private temp folder (made mode 0700; uploads and per-request outputs go to folders inside it that
        are removed when their request ends). Default: a new ``mmaccel-app-*`` folder, removed at exit and when the
        server stops (:func:`app_lifespan`).
    models : ModelCache, optional
        Share a model cache (e.g. between apps in one process); it keeps its own gate.
    model_roots : iterable of path
        ``--model-root``: the pickers also load checkpoint folders under these (:class:`ModelGate`); the preset
        models above are always allowed.
    allow_hub : bool
        ``--allow-hub``: the pickers also load hub ids.
    allow_remote_code : bool
        ``--allow-remote-code``: offer a "trust remote code" box; ticked, it is passed to
        ``mmaccel.load(..., trust_remote_code=True)``. Otherwise ``False`` is always passed.
    max_image_pixels : int
        Pixel cap of an uploaded image and of a video frame, read from the header before decoding.
    max_video_frames : int
        Most frames an uploaded video may have.

    Returns
    -------
    gr.Blocks
        Not launched; measured endpoints share one concurrency-1 queue slot (``concurrency_id="measured"``).
    """
    if models is None:
        gate = ModelGate(tuple(Path(r) for r in model_roots), bool(allow_hub),
                         tuple(str(m) for m in (default_model, vision_model, vlm_model) if m), bool(allow_remote_code))
        models = ModelCache(device=device, gate=gate)
    ctx = AppContext(models, int(max_upload_mb * 2**20), work_dir, haystack=haystack, niah_length=niah_length,
                     vision_model=vision_model, vlm_model=vlm_model, max_image_pixels=max_image_pixels,
                     max_video_frames=max_video_frames)
    with gr.Blocks(title="mmaccel workbench", delete_cache=(3600, 3600)) as demo:
        gr.Markdown("# mmaccel workbench\nSide-by-side, measured: every method and its parameters come from the "
                    "registries (`mmaccel.longctx.METHODS`, `mmaccel.speculative.METHODS`, ...).")
        label = "model (zoo name" + (", folder under a model root" if model_roots else "") + \
            (", or hub id" if allow_hub else "") + ")"
        with gr.Row():
            model = gr.Dropdown(choices=text_model_choices(), value=default_model, allow_custom_value=True,
                                label=label, elem_id="model", scale=3)
            if models.gate.allow_remote_code:
                ctx.extra_inputs.append(gr.Checkbox(False, label="trust remote code (runs the checkpoint's own "
                                                    "Python code)", elem_id="trust-remote-code", scale=1))
        gr.Markdown(FAIR_TIMING, elem_id="fair-timing")
        with gr.Tabs():
            for cls in TABS:
                with gr.Tab(cls.title, id=cls.key, elem_id=f"tab-{cls.key}"):
                    cls(ctx).build(model)
    _CONTEXTS[demo] = ctx
    weakref.finalize(demo, ctx.close)
    return demo


def app_lifespan(demo: gr.Blocks):
    """A lifespan for ``demo.launch(app_kwargs={"lifespan": app_lifespan(demo)})``: when the server stops
    (``demo.close()``, Ctrl-C), the app's private temp folder is removed.

    Raises
    ------
    KeyError
        ``demo`` was not built by :func:`build_app`.
    """
    ctx = _CONTEXTS[demo]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            ctx.close()

    return lifespan


def private_folder(demo: gr.Blocks) -> Path:
    """The private temp folder of an app built by :func:`build_app` (tests check it is gone after a stop)."""
    return _CONTEXTS[demo].work_dir


# ------------------------------------------------------------------------------------------------------------ CLI
def _positive(kind):
    """An argparse type: ``kind(text)`` that must be > 0 (``--threads -1`` is an argparse error, not a crash)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``mmaccel app`` (``python -m mmaccel.apps.workbench``) flags."""
    p = argparse.ArgumentParser(prog="mmaccel app", description="The mmaccel Gradio workbench.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; any other needs --auth)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link (needs --auth)")
    p.add_argument("--auth", action="append", default=[], metavar="USER:PASSWORD",
                   help="a login for Gradio's own auth (repeatable); required off the loopback and with --share")
    p.add_argument("--auth-file", metavar="FILE", help="a file of USER:PASSWORD lines, one login each")
    p.add_argument("--model", default="smollm2-135m", help="model preselected in the picker of the text tabs")
    p.add_argument("--vision-model", default="dinov2-small",
                   help="model preselected in the Vision encoder tab (a zoo vision encoder or a local checkpoint)")
    p.add_argument("--vlm-model", default="smol-llava",
                   help="model preselected in the Image & video QA and Vision sweep tabs (a vision-language model or "
                        "a local checkpoint)")
    p.add_argument("--model-root", action="append", default=[], metavar="DIR",
                   help="the model pickers also load checkpoint folders under DIR (repeatable); by default only zoo "
                        "names and the preset models")
    p.add_argument("--allow-hub", action="store_true", help="the model pickers also load hub ids (org/name)")
    p.add_argument("--allow-remote-code", action="store_true",
                   help="offer a 'trust remote code' box: ticked, a checkpoint's own Python code may run")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=_positive(int), help="torch CPU threads, >= 1 (default: torch's choice)")
    p.add_argument("--max-upload-mb", type=_positive(float), default=2.0,
                   help="size limit of an uploaded document, image or video, MiB (> 0)")
    p.add_argument("--max-image-pixels", type=_positive(int), default=DEFAULT_MAX_IMAGE_PIXELS,
                   help=f"pixel cap of an uploaded image and of a video frame (default {DEFAULT_MAX_IMAGE_PIXELS:,})")
    p.add_argument("--haystack", help="UTF-8 text file used as the NIAH haystack (default: held-out stdlib prose)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Launch the workbench (blocks until interrupted); bad flags exit 2 with one ``error:`` line before anything
    is loaded, including a non-loopback ``--host`` or ``--share`` without ``--auth``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        auth = read_auth(args.auth, args.auth_file)
    except ValueError as exc:
        parser.error(str(exc))
    why = exposure_error(args.host, args.share, auth)
    if why:
        parser.error(f"refusing to start: {why}")
    for root in args.model_root:
        if not Path(root).is_dir():
            parser.error(f"--model-root {root}: not a folder; give an existing folder of checkpoints")
    if args.haystack and not Path(args.haystack).is_file():
        parser.error(f"--haystack {args.haystack}: no such file")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    demo = build_app(args.model, vision_model=args.vision_model, vlm_model=args.vlm_model, device=args.device,
                     max_upload_mb=args.max_upload_mb, haystack=args.haystack, model_roots=args.model_root,
                     allow_hub=args.allow_hub, allow_remote_code=args.allow_remote_code,
                     max_image_pixels=args.max_image_pixels)
    demo.queue(default_concurrency_limit=1)
    # Gradio's own limit is a backstop against huge uploads filling the temp folder; files between the two limits
    # reach the handler, which reports them in the columns.
    limit = int(args.max_upload_mb * 2**20)
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, auth=auth or None,
                    max_file_size=max(2 * limit, limit + 2**20), app_kwargs={"lifespan": app_lifespan(demo)})
    finally:
        _CONTEXTS[demo].close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
