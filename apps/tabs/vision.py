"""The Vision encoder tab (endpoint ``/vision``): one image through a vision encoder (``dinov2-small`` by default)
under each column's :data:`mmaccel.vision_tokens.METHODS` method; per column the merged / pruned patches overlaid on
the image (:mod:`mmaccel.apps.overlay`), tokens kept, encoder seconds, throughput ratio and cosines to the unmodified
encoder.
"""
from __future__ import annotations

import html

import gradio as gr

from .. import forms
from ..columns import column_outputs, column_row, run_buttons
from ..common import (
    LOAD_FAILED,
    MAX_COLUMNS,
    MEASURED,
    TEXT_STYLE,
    ColumnResult,
    InputError,
    Request,
    Tab,
    error_text,
    ratio_figure,
    rounded,
)
from ..overlay import scaled_view, token_overlay
from ..vision_encoder import (
    NO_METHOD,
    VISION_SAMPLES,
    EncoderRunner,
    VisionRun,
    vision_input,
    vision_model_choices,
    vision_runner,
)

VISION_RATIO_METRICS = ("vision encoder (s)", "images/s", "visual tokens kept")
"""Metrics of the Vision encoder tab's ratio plot."""
VISION_DEFAULTS = [(NO_METHOD, None), ("tome", {"keep_ratio": 0.5}), ("tome", {"keep_ratio": 0.25}), ("tome", {"r": 8})]
"""The method and starting field values of each column of the Vision encoder tab."""
STAGE_WHERE = {"vision": "inside the ViT tower", "pre-llm": "between a VLM's projector and its language model",
               "in-llm": "inside a VLM's language model"}


def vision_rows(run: VisionRun, reference: VisionRun, first: VisionRun | None) -> list[list]:
    """Metric rows ``[name, number]`` of one column of the Vision encoder tab.

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
        ["vision encoder (s)", rounded(run.seconds)],
        ["images/s", rounded(per_s, 2)],
        ["throughput ratio to column 1", rounded(per_s / first_per_s, 3) if per_s and first_per_s else None],
        ["cosine [CLS]/pooled vs unmodified", rounded(F.cosine_similarity(run.pooled, reference.pooled, dim=0), 5)],
        ["cosine patch mean vs unmodified",
         rounded(F.cosine_similarity(run.patch_mean, reference.patch_mean, dim=0), 5)],
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
    return (f'<div class="mm-output" style="{TEXT_STYLE}"><b>{html.escape(spec)}</b>: {run.tokens_in} &rarr; '
            f"{run.tokens_out} tokens ({100 * run.tokens_out / run.tokens_in:.0f}% kept)<br>"
            f"{merged_patches} patches merged into {merged_tokens} tokens (coloured, one colour per token) &middot; "
            f"{pruned} pruned (grey) &middot; {alone} kept alone (unchanged){extra}</div>")


def vision_intro() -> str:
    """The Vision encoder tab's text: how a column runs, what the overlay shows, where each registered method of
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
            "**Video and answers:** `temporal-tome` merges tokens across the frames of a video-LLM; videos, and "
            "questions answered by a vision-language model (`smol-llava`), are in the Image & video QA tab. This tab "
            "takes images.")


class VisionTab(Tab):
    """Handler and layout of the Vision encoder tab."""

    title, key = "Vision encoder", "vision"

    def vision(self, model_name, upload, sample, scene_seed, repeats, n_columns, spec1, spec2, spec3, spec4,
               trust_remote_code=False, progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Vision encoder: the same image through the encoder under each column's visual-token method, one column
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

        ctx = self.ctx
        overlays: list = [None] * MAX_COLUMNS
        preview = None

        def tail(final):
            plot = ratio_figure(specs, results, VISION_RATIO_METRICS) if final else None
            if plot is not None:
                plot.axes[0].set_title("ratios to the first column (lower is better, except images/s)", fontsize=9)
            return [*overlays, plot]

        req = Request(ctx, n_columns, (spec1, spec2, spec3, spec4), empty=NO_METHOD, head=lambda: [preview], tail=tail)
        n, specs, results, outputs, fail_all = req.n, req.specs, req.results, req.outputs, req.fail_all
        model, processor = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield outputs(LOAD_FAILED)
            return
        try:
            runner = vision_runner(model, processor)
            with ctx.request_folder("upload-") as folder:
                image, source = vision_input(ctx.upload(upload, folder), sample, scene_seed, ctx.max_upload_bytes,
                                             ctx.max_image_pixels)
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
                results[i] = ColumnResult.failure(error_text(exc))
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

    def build(self, model) -> None:
        """The tab: its own vision-model picker, the image (sample, scene seed or upload), the columns; the overlays,
        metrics and the ratio plot."""
        from mmaccel import vision_tokens

        ctx = self.ctx
        gr.Markdown(vision_intro(), elem_id="vis-about")
        with gr.Row():
            with gr.Column(scale=3):
                vis_model = gr.Dropdown(choices=vision_model_choices(), value=ctx.vision_model,
                                        allow_custom_value=True, elem_id="vis-model",
                                        label="vision model (zoo name or local checkpoint directory)")
                with gr.Row():
                    sample = gr.Dropdown(VISION_SAMPLES, value=VISION_SAMPLES[0], label="sample", elem_id="vis-sample")
                    seed = gr.Number(0, label="scene seed", precision=0, minimum=0, elem_id="vis-seed")
                    repeats = gr.Number(5, label="repeats (median)", precision=0, minimum=1, elem_id="vis-repeats")
                upload = gr.File(label=f"or upload an image (up to {ctx.max_upload_mb:g} MiB and "
                                       f"{ctx.max_image_pixels / 1e6:g} megapixels; wins over the sample)",
                                 type="filepath", elem_id="vis-upload")
            with gr.Column(scale=2):
                preview = gr.Image(label="input as the encoder sees it (resized, cropped)", type="pil", format="png",
                                   interactive=False, elem_id="vis-input")
        ncols, cols = column_row("vis", vision_tokens.METHODS, [m for m, _ in VISION_DEFAULTS],
                                 extra={NO_METHOD: "The unmodified encoder: the baseline of the cosines."},
                                 initial=[v for _, v in VISION_DEFAULTS])
        run, stop = run_buttons("vis")
        status = gr.Markdown(elem_id="vis-status")
        outs, imgs = column_outputs("vis", cols, ncols, image="kept and merged tokens over the input")
        plot = gr.Plot(label="ratios to column 1", elem_id="vis-plot")
        ev = run.click(self.vision, [vis_model, upload, sample, seed, repeats, ncols, *[c.spec for c in cols],
                                     *self.ctx.extra_inputs],
                       [status, preview, *outs, *imgs, plot], api_name="vision", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")
