"""The Vision sweep tab (endpoint ``/vision_sweep``): scene-QA accuracy against the visual-token budget, each column a
method of :data:`mmaccel.vision_tokens.METHODS`, run by :func:`mmaccel.eval.vision_sweep.vision_sweep`.

The sweep asks a few held-out scene questions (:func:`mmaccel.data.scenes.make_scene_qa`) of a vision-language model
(``smol-llava`` by default) with all visual tokens (the baseline) and with every column's method at every budget
(``keep_ratio``), one run after another through :func:`mmaccel.eval.generate_measured`; plain pooling always runs
beside them (the sweep's rule). Per column: accuracy, kept visual tokens, prefill speedup, estimated LM FLOPs ratio
and agreement with the baseline at each budget; under the columns the sweep's table and its accuracy-vs-budget plot.
"""
from __future__ import annotations

import html
from pathlib import Path

import gradio as gr

from ..columns import column_outputs, column_row, run_buttons
from ..common import LOAD_FAILED, MEASURED, TEXT_STYLE, ColumnResult, InputError, Request, Tab, error_text, rounded

NO_REDUCTION = "none"
"""The column of the sweep's baseline: all visual tokens."""
DEFAULTS = [NO_REDUCTION, "fastv", "tome", "visionzip"]
"""The method of each column at start."""
MAX_QUESTIONS = 32
"""Most questions per sweep in the app (``mmaccel vision-sweep`` runs hundreds)."""


def sweep_module():
    """:mod:`mmaccel.eval.vision_sweep`, imported on use.

    Raises
    ------
    InputError
        When this mmaccel has no vision sweep yet (the message says what to update).
    """
    try:
        from mmaccel.eval import vision_sweep
    except ImportError as exc:
        raise InputError(f"this mmaccel has no vision sweep ({exc}); update mmaccel to a version with "
                         "mmaccel.eval.vision_sweep") from exc
    return vision_sweep


def vlm_model_choices() -> list[str]:
    """Zoo names of vision-language models: the built ones (``smol-llava``) and fetched ``...ForConditionalGeneration``
    models."""
    from mmaccel.models import BUILT, FETCHED

    return [*BUILT, *(n for n, e in FETCHED.items() if "ConditionalGeneration" in e.model_class)]


def parse_budgets(text) -> list[float]:
    """Budgets (fractions of visual tokens kept) from a text box, separated by spaces or commas, largest first.

    Raises
    ------
    InputError
        None given, or one that is not a number in (0, 1].
    """
    try:
        budgets = [float(x) for x in str(text or "").replace(",", " ").split()]
    except ValueError as exc:
        raise InputError(f"budgets must be numbers in (0, 1], e.g. 0.5 0.25; got {text!r}") from exc
    if not budgets or not all(0 < b <= 1 for b in budgets):
        raise InputError(f"give budgets in (0, 1], e.g. 0.5 0.25; got {text!r}")
    return sorted(set(budgets), reverse=True)


def baseline_rows(base: dict) -> list[list]:
    """Metric rows of the sweep's baseline (all visual tokens)."""
    return [["accuracy", rounded(base.get("accuracy"), 3)], ["visual tokens", base.get("visual_tokens")],
            ["vision encoder (s)", rounded(base.get("median_vision_encoder_s"))],
            ["prefill (s)", rounded(base.get("median_prefill_s"))], ["TTFT (s)", rounded(base.get("median_ttft_s"))],
            ["runs ok", base.get("n")], ["runs failed", base.get("failed")]]


def cell_rows(cells: list[dict]) -> list[list]:
    """Metric rows of one method's cells, per budget (largest first): accuracy, kept visual tokens, prefill speedup,
    estimated LM FLOPs ratio and the share of answers identical to the baseline's."""
    rows = []
    for c in sorted(cells, key=lambda c: -c["budget"]):
        b = f"{c['budget']:g}"
        rows += [[f"accuracy @ {b}", rounded(c.get("accuracy"), 3)],
                 [f"visual tokens kept @ {b}", c.get("median_visual_tokens_kept")],
                 [f"prefill speedup @ {b}", rounded(c.get("prefill_speedup"), 3)],
                 [f"FLOPs ratio @ {b}", rounded(c.get("flops_ratio"), 3)],
                 [f"same as all tokens @ {b}", rounded(c.get("agreement"), 3)]]
    return rows


def column_html(label: str, accuracies: list[tuple[str, float | None]], n: int, error: str | None = None) -> str:
    """A column's text: the accuracy at each budget over ``n`` questions, and the first error of a failed run."""
    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}%"

    parts = " &middot; ".join(f"{html.escape(b)}: {pct(a)}" for b, a in accuracies)
    err = f"<br><small>first failed run: {html.escape(error)}</small>" if error else ""
    return (f'<div class="mm-output" style="{TEXT_STYLE}"><b>{html.escape(label)}</b> on {n} question(s)<br>'
            f"accuracy &mdash; {parts}{err}</div>")


class VisionSweepTab(Tab):
    """Handler and layout of the Vision sweep tab."""

    title, key = "Vision sweep", "vision_sweep"

    def vision_sweep(self, model_name, budgets, n_questions, seed, n_columns, spec1, spec2, spec3, spec4,
                     trust_remote_code=False, progress=gr.Progress(track_tqdm=True)):  # noqa: B008 - how Gradio injects progress
        """Vision sweep: accuracy and prefill speed against the visual-token budget, one column per method.

        Parameters
        ----------
        model_name : str
            A vision-language model (``smol-llava``, or a local LLaVA-style checkpoint directory).
        budgets : str
            Fractions of visual tokens kept, e.g. ``"0.5 0.25"``.
        n_questions : int
            Held-out scene questions, 1 to :data:`MAX_QUESTIONS`.
        seed : int
            Which draw of the test split.
        n_columns : int
            2 to 4; ``spec1..spec4``: a visual-token method without ``keep_ratio`` (the budgets set it), or
            ``"none"`` (the baseline's column).

        Yields
        ------
        list
            ``[status, (html, metrics) x 4, table (markdown), plot (PNG path)]``. Bad settings, a model that cannot
            be loaded or is not a vision-language model put an error in every column; a bad spec or a method the
            model does not support, in its own column.
        """
        ctx = self.ctx
        table, plot = "", None
        req = Request(ctx, n_columns, (spec1, spec2, spec3, spec4), empty=NO_REDUCTION,
                      tail=lambda final: [table, plot])
        n, specs, results, outputs, fail_all = req.n, req.specs, req.results, req.outputs, req.fail_all
        try:
            vs = sweep_module()
            levels = parse_budgets(budgets)
            count = int(n_questions or 0)
            if not 1 <= count <= MAX_QUESTIONS:
                raise InputError(f"questions must be 1 to {MAX_QUESTIONS} in the app, got {count}; use "
                                 "`mmaccel vision-sweep` for more")
            seed = int(seed or 0)
        except (InputError, ValueError, TypeError) as exc:
            yield fail_all(str(exc))
            return
        model, processor = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield outputs(LOAD_FAILED)
            return
        from mmaccel.eval.visual import check_vlm_processor

        try:
            check_vlm_processor(processor)
        except ValueError as exc:
            yield fail_all(str(exc))
            return
        methods: list = [None] * n  # each column's method spec, None for the baseline or a failed column
        for i, spec in enumerate(specs):
            if spec.split(":")[0] == NO_REDUCTION:
                continue
            try:
                for cell in vs.build_cells([spec], levels):
                    cell.vision.check(model)  # UnsupportedModelError (a ValueError), e.g. FastV past the last layer
                methods[i] = spec
            except Exception as exc:  # noqa: BLE001 - unknown method, bad argument, keep_ratio given: this column only
                results[i] = ColumnResult.failure(error_text(exc))
        chosen = list(dict.fromkeys(m for m in methods if m is not None))
        with ctx.request_folder("vision-sweep-") as out_dir:  # the plot is shown from here, then removed
            yield outputs(f"running the vision sweep: all tokens and {len(set(chosen) | {'pooling'})} method(s) at "
                          f"{len(levels)} budget(s) on {count} question(s) ...")
            try:
                res = vs.vision_sweep(model, processor, chosen or ["pooling"], levels, n=count, seed=seed,
                                      max_new_tokens=4, repeats=1, warmup=1, out_dir=Path(out_dir), progress=True)
            except Exception as exc:  # noqa: BLE001 - every column shares the sweep: each says why it stopped
                msg = error_text(exc)
                results[:] = [ColumnResult.failure(msg) if r is None or r.error is None else r for r in results]
                yield outputs(f"**error**: {msg}")
                return
            summary = res.summary
            base = summary["baseline"]
            for i, spec in enumerate(specs):
                if results[i] is not None:
                    continue
                if methods[i] is None:  # the baseline's column
                    results[i] = ColumnResult(html=column_html("all visual tokens", [("all", base["accuracy"])],
                                                               base["n"] + base["failed"]),
                                              rows=baseline_rows(base), record=base)
                    continue
                cells = [c for c in summary["cells"] if c["method"] == methods[i]]
                error = next((c["error"] for c in cells if c.get("error")), None)
                results[i] = ColumnResult(
                    html=column_html(methods[i], [(f"{c['budget']:g}", c["accuracy"]) for c in cells],
                                     base["n"] + base["failed"], error),
                    rows=cell_rows(cells), record=cells if any(c["n"] for c in cells) else None)
            table = vs.sweep_table(summary)
            plot = str(res.plot) if res.plot is not None else None
            yield outputs(f"Vision sweep on {count} held-out scene question(s) (seed {seed}): all visual tokens, then "
                          f"every method at budgets {', '.join(f'{b:g}' for b in levels)} (pooling always beside them), "
                          "one run after another per question through the measured path; greedy, first word scored. "
                          "Speedups are the baseline's median prefill seconds over the cell's; `mmaccel vision-sweep "
                          "--out DIR` saves the records.")

    def build(self, model) -> None:
        """The tab: its own VLM picker, budgets, questions; the columns; the table and the accuracy plot."""
        from mmaccel import vision_tokens

        ctx = self.ctx
        gr.Markdown("**Accuracy against visual-token budget** (`mmaccel.eval.vision_sweep`, also `mmaccel "
                    "vision-sweep`): a few held-out scene questions asked of a vision-language model with all visual "
                    "tokens and with each column's method at each budget (its `keep_ratio`); plain pooling always "
                    "runs beside them. Needs a vision-language model: `smol-llava` once its projector is trained "
                    "(`mmaccel zoo train smol-llava`), or a local LLaVA-style checkpoint. Leave a method's "
                    "`keep_ratio` at its default: the budgets set it.")
        with gr.Row():
            vlm = gr.Dropdown(choices=vlm_model_choices(), value=ctx.vlm_model, allow_custom_value=True,
                              label="vision-language model (zoo name or local checkpoint directory)",
                              elem_id="vs-model", scale=3)
            budgets = gr.Textbox("0.5 0.25", label="budgets (fraction of visual tokens kept)", elem_id="vs-budgets")
            questions = gr.Number(4, label="questions", precision=0, minimum=1, maximum=MAX_QUESTIONS,
                                  elem_id="vs-questions")
            seed = gr.Number(0, label="seed", precision=0, minimum=0, elem_id="vs-seed")
        ncols, cols = column_row("vs", vision_tokens.METHODS, DEFAULTS,
                                 extra={NO_REDUCTION: "All visual tokens: the sweep's baseline (always run)."})
        run, stop = run_buttons("vs", "Run the sweep")
        status = gr.Markdown(elem_id="vs-status")
        outs, _ = column_outputs("vs", cols, ncols)
        table = gr.Markdown(elem_id="vs-table")
        plot = gr.Image(label="accuracy and prefill speedup vs budget", type="filepath", interactive=False,
                        elem_id="vs-plot")
        ev = run.click(self.vision_sweep, [vlm, budgets, questions, seed, ncols, *[c.spec for c in cols],
                                           *self.ctx.extra_inputs],
                       [status, *outs, table, plot], api_name="vision_sweep", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")

