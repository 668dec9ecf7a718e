"""The Spec bench tab (endpoint ``/spec_bench``): a small Spec-Bench run (:func:`mmaccel.eval.specbench.run_spec_bench`)
over the columns' speculative methods, beside the autoregressive baseline it always runs.

Per column: the method's Spec-Bench row for each prompt set (speedup over autoregressive decoding, tokens/s, tokens
per target forward, mean accepted length, acceptance rate, identical-to-greedy share, draft/verify seconds) and its
output on the first prompt with the accepted draft tokens coloured. Under the columns: Spec-Bench's table and a bar
plot of the two ratios (speedup; tokens per target forward). Every number comes from the harness's measured runs
(:func:`mmaccel.eval.generate_measured`).
"""
from __future__ import annotations

import html

import gradio as gr

from ..columns import column_outputs, column_row, run_buttons
from ..common import (
    AUTOREGRESSIVE,
    LOAD_FAILED,
    MEASURED,
    TEXT_STYLE,
    ColumnResult,
    InputError,
    Request,
    Tab,
    error_text,
    figure,
    rounded,
)
from .generation import accepted_mask, coloured_html, token_pieces

DEFAULTS = [AUTOREGRESSIVE, "prompt_lookup", "draft", "jacobi"]
"""The method of each column at start."""
MAX_PROMPTS = 8
"""Most prompts per set in the app (``mmaccel spec-bench`` runs more)."""
ROWS = (("speedup vs autoregressive", "speedup", 3), ("tokens/s", "tokens_per_s", 2),
        ("tokens per target forward", "forward_ratio", 3), ("mean accepted length", "mean_accepted_length", 3),
        ("acceptance rate", "acceptance_rate", 3), ("draft time (s, all prompts)", "draft_s", 4),
        ("verify time (s, all prompts)", "verify_s", 4))
"""(metric name, summary key, decimals) of a column's rows, one group per prompt set."""


def speculative_registry() -> dict:
    """The methods a column can pick: the engine's drafters and transformers' own speculative paths."""
    from mmaccel.speculative import METHODS, PEERS

    return {**METHODS, **PEERS}


def summary_rows(summary: dict, label: str) -> list[list]:
    """Metric rows of one method in a Spec-Bench summary (:func:`~mmaccel.eval.specbench.summarize_spec_bench`): for
    each prompt set, :data:`ROWS` and the share of prompts whose output is token-identical to greedy decoding."""
    rows = []
    for s, by_label in summary["sets"].items():
        r = by_label.get(label)
        if r is None:
            continue
        rows += [[f"{name} ({s})", rounded(r.get(key), nd)] for name, key, nd in ROWS]
        share = r["identical"] / r["compared"] if r.get("compared") else (1.0 if label == summary["baseline"] else None)
        rows.append([f"identical to greedy ({s})", rounded(share, 3)])
    return rows


def spec_bench_figure(summary: dict):
    """Two bar plots of a Spec-Bench summary: the speedup over autoregressive decoding and the tokens per target
    forward, one bar per method and prompt set (the baseline is 1.0 in both); ``None`` without a method row."""
    sets = list(summary["sets"])
    labels = list(dict.fromkeys(label for rows in summary["sets"].values() for label in rows))
    if len(labels) < 2:
        return None
    fig = figure(9, 3.4)
    width = 0.8 / len(sets)
    for k, (key, title) in enumerate((("speedup", "speedup vs autoregressive (tokens/s ratio)"),
                                      ("forward_ratio", "tokens per target forward"))):
        ax = fig.add_subplot(1, 2, k + 1)
        for j, s in enumerate(sets):
            ys = [(summary["sets"][s].get(label) or {}).get(key) or 0.0 for label in labels]
            xs = [i + (j - (len(sets) - 1) / 2) * width for i in range(len(labels))]
            bars = ax.bar(xs, ys, width, label=f"{s} prompts")
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        names = [AUTOREGRESSIVE if lab == summary["baseline"] else lab[:28] for lab in labels]
        ax.set_xticks(range(len(labels)), names, fontsize=7, rotation=20, ha="right")
        ax.set_title(title, fontsize=9)
        if k == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def output_html(tokenizer, record) -> str:
    """A record's output with its accepted draft tokens coloured (all grey for the autoregressive baseline); ``""``
    for a failed record."""
    if record is None or not record.ok:
        return ""
    pieces = token_pieces(tokenizer, record.output_ids)
    return coloured_html(pieces, accepted_mask(len(pieces), record.telemetry.get("accepted", [])))


def column_html(label: str, rows: dict, output: str = "") -> str:
    """A column's text: per prompt set the runs and the identical-to-greedy count, then ``output`` (HTML: the
    output on the first prompt, from :func:`output_html`)."""
    lines = []
    for s, r in rows.items():
        ident = ("(the baseline)" if not r.get("compared") else
                 f"identical to greedy on {r['identical']}/{r['compared']} prompts")
        lines.append(f"<b>{html.escape(s)}</b> prompts: {r['n']} run(s), {r['failed']} failed, {ident}")
    head = f'<div class="mm-output" style="{TEXT_STYLE}"><b>{html.escape(label)}</b><br>{"<br>".join(lines)}</div>'
    return head + (f"<small>output on the first prompt:</small>{output}" if output else "")


class SpecBenchTab(Tab):
    """Handler and layout of the Spec bench tab."""

    title, key = "Spec bench", "specbench"

    def spec_bench(self, model_name, prompt_sets, n_prompts, max_new_tokens, repeats, n_columns, spec1, spec2, spec3,
                   spec4, trust_remote_code=False,
                   progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Spec bench: every column's speculative method and the autoregressive baseline on the same prompts.

        Parameters
        ----------
        model_name : str
            The target causal LM.
        prompt_sets : list of str
            Of ``"free"`` and ``"copy"`` (:data:`mmaccel.eval.specbench.PROMPT_SETS`); the copy set parses the
            standard library's docstrings once per process (seconds).
        n_prompts : int
            Prompts per set, 1 to :data:`MAX_PROMPTS`.
        max_new_tokens, repeats : int
            Per generation (>= 1); timings are medians of ``repeats`` runs after one warm-up per method.
        n_columns : int
            2 to 4; ``spec1..spec4``: each column's method spec, or ``"autoregressive"`` (the baseline's row).

        Yields
        ------
        list
            ``[status, (html, metrics) x 4, table (markdown), ratio plot]``. Bad settings or a model that cannot be
            loaded put an error in every column; a bad spec (or a draft with another tokenizer) in its own column.
        """
        from mmaccel.eval.specbench import BASELINE, PROMPT_SETS, run_spec_bench
        from mmaccel.pipeline import resolve_method

        table, plot = "", None
        req = Request(self.ctx, n_columns, (spec1, spec2, spec3, spec4), empty=AUTOREGRESSIVE,
                      tail=lambda final: [table, plot])
        n, specs, results, outputs = req.n, req.specs, req.results, req.outputs
        try:
            sets = [s for s in PROMPT_SETS if s in (prompt_sets or [])]
            if not sets:
                raise InputError(f"pick at least one prompt set ({', '.join(PROMPT_SETS)})")
            count, max_new, repeats = int(n_prompts or 0), int(max_new_tokens or 0), int(repeats or 0)
            if not 1 <= count <= MAX_PROMPTS:
                raise InputError(f"prompts per set must be 1 to {MAX_PROMPTS} in the app, got {count}; use "
                                 "`mmaccel spec-bench` for more")
            if max_new < 1 or repeats < 1:
                raise InputError(f"max new tokens and repeats must be >= 1, got {max_new} and {repeats}")
        except (InputError, ValueError, TypeError) as exc:
            yield req.fail_all(str(exc))
            return
        model, tok = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield outputs(LOAD_FAILED)
            return
        labels: list = [None] * n  # each column's label in the summary
        for i, spec in enumerate(specs):
            if spec.split(":")[0] in (AUTOREGRESSIVE, BASELINE):
                labels[i] = BASELINE
                continue
            try:
                method, _ = resolve_method(spec)
                prepare = getattr(method, "prepare", None)
                if callable(prepare):  # loads a draft model, refuses another tokenizer (ValueError)
                    prepare(model, tok)
                labels[i] = spec
            except Exception as exc:  # noqa: BLE001 - unknown method, bad argument, wrong draft: this column only
                results[i] = ColumnResult.failure(error_text(exc))
        methods = list(dict.fromkeys(label for label in labels if label not in (None, BASELINE)))
        from mmaccel.data.haystack import resolve_chat_template

        progress(0.1, desc="running spec-bench")
        yield outputs(f"running spec-bench: {len(methods)} method(s) and the autoregressive baseline on "
                      f"{count} {' and '.join(sets)} prompt(s) each ...")
        try:
            res = run_spec_bench(model, tok, methods, prompts=sets, n_prompts=count, max_new_tokens=max_new,
                                 repeats=repeats, warmup=1, chat_template=resolve_chat_template(tok, "auto"))
        except Exception as exc:  # noqa: BLE001 - e.g. too few paragraphs for the copy set: every column says so
            msg = error_text(exc)
            results[:] = [r if labels[i] is None else ColumnResult.failure(msg) for i, r in enumerate(results)]
            yield outputs(f"**error**: {msg}")
            return
        summary = res.summary
        first = {rec.method: rec for rec in res.records  # each method's record of the first prompt
                 if rec.extra.get("prompt_set") == sets[0] and rec.extra.get("prompt_id") == 0}
        for i, label in enumerate(labels):
            if label is None:
                continue
            by_set = {s: rows[label] for s, rows in summary["sets"].items() if label in rows}
            rows = summary_rows(summary, label)
            ok = any(r["n"] > r["failed"] for r in by_set.values())
            name = f"{AUTOREGRESSIVE} ({label}, the baseline)" if label == BASELINE else label
            results[i] = ColumnResult(html=column_html(name, by_set, output_html(tok, first.get(label))), rows=rows,
                                      record=by_set if ok else None)
        table, plot = res.to_markdown(), spec_bench_figure(summary)
        cfg = summary["config"]
        yield outputs(f"Spec-bench: every method and the autoregressive baseline (`{BASELINE}`) on the same "
                      f"{count} prompt(s) per set ({', '.join(sets)}), greedy, {max_new} new tokens; one warm-up per "
                      f"method, then per prompt every method in turn, medians of {repeats} run(s); "
                      f"{cfg['threads']} thread(s), load {cfg['load_avg_1m_end']}. Speedups are tokens/s ratios to "
                      "the baseline; on a shared CPU the tokens per target forward are the steadier figure.")

    def build(self, model) -> None:
        """The tab: prompt sets and sizes, the columns; per-column rows, Spec-Bench's table and the ratio plot."""
        from mmaccel.eval.specbench import PROMPT_SETS

        gr.Markdown("A small [Spec-Bench](https://arxiv.org/abs/2401.07851) run (`mmaccel.eval.specbench`, also "
                    "`mmaccel spec-bench`): each column's speculative method and the autoregressive baseline on the "
                    "same prompts, each output checked token for token against greedy decoding. *free* prompts ask "
                    "open questions; *copy* prompts edit or repeat a held-out paragraph (where prompt lookup shines; "
                    "the first copy run parses the standard library's docstrings, a few seconds).")
        with gr.Row():
            sets = gr.CheckboxGroup(list(PROMPT_SETS), value=["copy"], label="prompt sets", elem_id="sb-sets")
            count = gr.Number(1, label="prompts per set", precision=0, minimum=1, maximum=MAX_PROMPTS,
                              elem_id="sb-prompts")
            max_new = gr.Number(32, label="max new tokens", precision=0, minimum=1, elem_id="sb-max-new")
            repeats = gr.Number(1, label="repeats (median)", precision=0, minimum=1, elem_id="sb-repeats")
        ncols, cols = column_row("sb", speculative_registry(), DEFAULTS,
                                 extra={AUTOREGRESSIVE: "Plain greedy decoding: the baseline (always run; this "
                                                        "column shows its row)."})
        run, stop = run_buttons("sb", "Run spec-bench")
        status = gr.Markdown(elem_id="sb-status")
        outs, _ = column_outputs("sb", cols, ncols)
        table = gr.Markdown(elem_id="sb-table")
        plot = gr.Plot(label="ratios to autoregressive decoding", elem_id="sb-plot")
        ev = run.click(self.spec_bench, [model, sets, count, max_new, repeats, ncols, *[c.spec for c in cols],
                                         *self.ctx.extra_inputs],
                       [status, *outs, table, plot], api_name="spec_bench", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")
