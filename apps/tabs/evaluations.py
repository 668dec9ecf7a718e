"""The Evaluations tab (endpoint ``/niah_eval``): a small NIAH sweep (:func:`mmaccel.eval.run_niah`) over the columns'
KV-cache methods, with each column's accuracy heatmap."""
from __future__ import annotations

from pathlib import Path

import gradio as gr

from ..columns import column_outputs, column_row, run_buttons
from ..common import LOAD_FAILED, MAX_COLUMNS, MEASURED, ColumnResult, Request, Tab, error_text, mib, rounded, text_html

DEFAULTS = ["full", "snapkv", "streaming", "h2o"]
"""The method of each column at start."""
MAX_PROMPTS = 64
"""Most NIAH prompts per column in the app (lengths x depths x trials)."""
MAX_LENGTH = 32_768
"""Longest NIAH prompt in the app, tokens."""


def parse_sweep(lengths, depths, trials) -> tuple[list[int], list[float], int]:
    """``(lengths, depths, trials)`` from the text boxes (numbers separated by spaces or commas).

    Raises
    ------
    ValueError
        No length, no depth, fewer than one trial, a length that is not a whole number from 1 to :data:`MAX_LENGTH` (``"512 abc"``), a
        depth that is not a number in [0, 1], or more than :data:`MAX_PROMPTS` prompts per column (the message points
        to ``mmaccel niah``).
    """
    lens, deps = [], []
    for word in str(lengths or "").replace(",", " ").split():
        if not (word.isascii() and word.isdigit()) or not 1 <= int(word) <= MAX_LENGTH:
            raise ValueError(f"lengths must be whole numbers of tokens from 1 to {MAX_LENGTH} separated by spaces or "
                             f"commas, e.g. '512 1024'; got {word[:40]!r} (`mmaccel niah` runs longer ones)")
        lens.append(int(word))
    for word in str(depths or "").replace(",", " ").split():
        try:
            depth = float(word)
        except ValueError:
            depth = float("nan")
        if not 0 <= depth <= 1:
            raise ValueError(f"depths must be numbers from 0 to 1 separated by spaces or commas, e.g. '0 0.5 1'; "
                             f"got {word[:40]!r}")
        deps.append(depth)
    try:
        trials = int(trials)
    except (TypeError, ValueError):
        trials = 0
    if not lens or not deps or trials < 1:
        raise ValueError("give at least one length, one depth and one trial")
    if len(lens) * len(deps) * trials > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per column in the app; use `mmaccel niah` for a larger sweep")
    return lens, deps, trials


def niah_rows(m: dict) -> list[list]:
    """Metric rows of one method's NIAH summary (``run_niah(...).summary["methods"][label]``): accuracy, runs, and per
    length the median TTFT, peak memory and KV ratio to ``full``."""
    rows = [["accuracy (strict)", rounded(m.get("accuracy"), 3)],
            ["accuracy (contains)", rounded(m.get("accuracy_contains"), 3)],
            ["runs ok", m.get("n")], ["runs failed", m.get("failed")]]
    for b in m.get("by_length", []):
        rows.append([f"median TTFT (s) @ {b['length']}", rounded(b.get("median_ttft_s"))])
        rows.append([f"median peak memory (MiB) @ {b['length']}", mib(b.get("median_peak_memory_bytes"))])
        rows.append([f"KV ratio vs full @ {b['length']}", rounded(b.get("kv_ratio_prefill"), 3)])
    return rows


class EvaluationsTab(Tab):
    """Handlers and layout of the Evaluations (NIAH) tab."""

    title, key = "Evaluations", "evaluations"

    def niah_eval(self, model_name, lengths, depths, trials, max_new_tokens, n_columns, spec1, spec2, spec3, spec4,
                  trust_remote_code=False, progress=gr.Progress(track_tqdm=True)):  # noqa: B008 - how Gradio injects progress
        """Evaluations: a small NIAH sweep per column (:func:`mmaccel.eval.run_niah`), its heatmap and accuracy.

        Yields
        ------
        list
            ``[status, (html, metrics) x 4, heatmap x 4]``.
        """
        ctx = self.ctx
        images: list = [None] * MAX_COLUMNS
        req = Request(ctx, n_columns, (spec1, spec2, spec3, spec4), tail=lambda final: images)
        specs, results, outputs = req.specs, req.results, req.outputs
        try:
            lens, deps, trials = parse_sweep(lengths, depths, trials)
        except ValueError as exc:
            yield req.fail_all(f"bad sweep: {exc}")
            return
        model, tok = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield outputs(LOAD_FAILED)
            return
        from mmaccel.eval import run_niah
        from mmaccel.longctx import build_method

        valid = []
        for i, spec in enumerate(specs):
            try:
                build_method(spec)
                valid.append(spec)
            except ValueError as exc:
                results[i] = ColumnResult.failure(error_text(exc))
        labels = list(dict.fromkeys(valid))
        if not labels:
            yield outputs("**error**: no column has a valid method (see the columns).")
            return
        with ctx.request_folder("niah-") as out_root:  # heatmaps are shown from here, then the folder is removed
            yield outputs(f"running the NIAH sweep over {len(labels)} configuration(s) ...")
            try:
                res = run_niah(model, tok, labels, lens, deps, trials, max_new_tokens=int(max_new_tokens),
                               out_dir=Path(out_root), progress=True, haystack=ctx.haystack_tokens(tok))
            except Exception as exc:  # noqa: BLE001 - a bad sweep (e.g. a length too small): every column says so
                msg = error_text(exc)
                for i, spec in enumerate(specs):
                    if spec in labels:
                        results[i] = ColumnResult.failure(msg)
                yield outputs(f"**error**: {msg}")
                return
            for i, spec in enumerate(specs):
                if spec not in labels:
                    continue
                m = res.summary["methods"][spec]
                acc = m.get("accuracy")
                results[i] = ColumnResult(html=text_html(f"{spec}: {m.get('n')} runs, strict accuracy "
                                                         f"{'-' if acc is None else f'{acc:.2f}'}"), rows=niah_rows(m))
                images[i] = str(res.heatmaps[spec]) if res.heatmaps.get(spec) else None
            yield outputs(f"NIAH: {len(lens)} length(s) x {len(deps)} depth(s) x {trials} trial(s), every "
                          "configuration run one after another on the same prompts (KV ratios need a `full` column); "
                          "for saved results and heatmaps run `mmaccel niah --out DIR`.")

    def build(self, model) -> None:
        """The tab: lengths, depths, trials; the columns; accuracy tables and heatmaps."""
        from mmaccel import longctx

        gr.Markdown("A small needle-in-a-haystack sweep per column (`mmaccel.eval.run_niah`); for real sweeps use "
                    "`mmaccel niah` (it writes the same heatmaps).")
        with gr.Row():
            lengths = gr.Textbox("512 1024", label="lengths (tokens)", elem_id="ev-lengths")
            depths = gr.Textbox("0 0.5 1", label="depths", elem_id="ev-depths")
            trials = gr.Number(1, label="trials", precision=0, minimum=1)
            max_new = gr.Number(12, label="max new tokens", precision=0, minimum=1, elem_id="ev-max-new")
        ncols, cols = column_row("ev", longctx.METHODS, DEFAULTS)
        run, stop = run_buttons("ev", "Run NIAH")
        status = gr.Markdown(elem_id="ev-status")
        outs, imgs = column_outputs("ev", cols, ncols, image=True)
        ev = run.click(self.niah_eval, [model, lengths, depths, trials, max_new, ncols, *[c.spec for c in cols],
                                        *self.ctx.extra_inputs],
                       [status, *outs, *imgs], api_name="niah_eval", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")
