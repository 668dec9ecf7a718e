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
import logging
import tempfile
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

__all__ = [  # the names this module has always offered, now defined in the modules above
    "AUTOREGRESSIVE", "FAIR_TIMING", "MAX_COLUMNS", "METRIC_HEADERS", "NO_METHOD", "OVERLAY_SIDE", "SAMPLE_PHOTOS",
    "SCENE_SAMPLE", "STAGE_WHERE", "VISION_DEFAULTS", "VISION_RATIO_METRICS", "VISION_RUNNERS", "VISION_SAMPLES",
    "WARMUPS", "AppContext", "ColumnResult", "EncoderRunner", "InputError", "MethodColumn", "ModelCache", "VisionRun",
    "accepted_mask", "build_app", "build_parser", "build_prompt", "checked_upload", "coloured_html", "column_outputs",
    "column_row", "error_html", "kernel_figure", "main", "method_column", "metrics_table", "niah_document",
    "ratio_figure", "read_upload", "record_rows", "sample_image", "scaled_view", "text_html", "text_model_choices",
    "token_overlay", "token_pieces", "vision_html", "vision_input", "vision_intro", "vision_model_choices",
    "vision_rows", "vision_runner", "with_draft_length",
]


def build_app(default_model: str = "smollm2-135m", *, vision_model: str = "dinov2-small",
              vlm_model: str = "smol-llava", device: str = "auto", max_upload_mb: float = 2.0,
              niah_length: int = 2048, haystack=None, work_dir=None, models: ModelCache | None = None) -> gr.Blocks:
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
        Temp folder for NIAH, sweep and kernel-bench outputs (default: a new folder under the system temp dir).
    models : ModelCache, optional
        Share a model cache (e.g. between apps in one process).

    Returns
    -------
    gr.Blocks
        Not launched; measured endpoints share one concurrency-1 queue slot (``concurrency_id="measured"``).
    """
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="mmaccel-app-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = AppContext(models or ModelCache(device=device), int(max_upload_mb * 2**20), work, haystack=haystack,
                     niah_length=niah_length, vision_model=vision_model, vlm_model=vlm_model)
    with gr.Blocks(title="mmaccel workbench", delete_cache=(3600, 3600)) as demo:
        gr.Markdown("# mmaccel workbench\nSide-by-side, measured: every method and its parameters come from the "
                    "registries (`mmaccel.longctx.METHODS`, `mmaccel.speculative.METHODS`, ...).")
        with gr.Row():
            model = gr.Dropdown(choices=text_model_choices(), value=default_model, allow_custom_value=True,
                                label="model (zoo name, local checkpoint directory, or hub id when online)",
                                elem_id="model", scale=3)
        gr.Markdown(FAIR_TIMING, elem_id="fair-timing")
        with gr.Tabs():
            for cls in TABS:
                with gr.Tab(cls.title, id=cls.key, elem_id=f"tab-{cls.key}"):
                    cls(ctx).build(model)
    return demo


# ------------------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    """The ``mmaccel app`` (``python -m mmaccel.apps.workbench``) flags."""
    p = argparse.ArgumentParser(prog="mmaccel app", description="The mmaccel Gradio workbench.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    p.add_argument("--model", default="smollm2-135m", help="model preselected in the picker of the text tabs")
    p.add_argument("--vision-model", default="dinov2-small",
                   help="model preselected in the Vision encoder tab (a zoo vision encoder or a local checkpoint)")
    p.add_argument("--vlm-model", default="smol-llava",
                   help="model preselected in the Image & video QA and Vision sweep tabs (a vision-language model or "
                        "a local checkpoint)")
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
    demo = build_app(args.model, vision_model=args.vision_model, vlm_model=args.vlm_model, device=args.device,
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
