"""The Generation tab (endpoint ``/generation``): greedy decoding of one prompt, each column the autoregressive baseline
or a drafter of :data:`mmaccel.speculative.METHODS`; accepted draft tokens are coloured.

Per column the text first streams from an untimed pass (:class:`mmaccel.apps.streaming.TokenStream`); then the
measured run (:func:`mmaccel.eval.generate_measured`, one warm-up, ``repeats`` timed runs) replaces it and fills the
metrics. No number shown comes from the streamed pass.
"""
from __future__ import annotations

import html

import gradio as gr

from ..columns import column_outputs, column_row, run_buttons
from ..common import (
    ACCEPTED_STYLE,
    AUTOREGRESSIVE,
    LOAD_FAILED,
    MEASURED,
    TARGET_STYLE,
    TEXT_STYLE,
    ColumnResult,
    InputError,
    Request,
    Tab,
    error_text,
    record_result,
)
from ..prompts import build_prompt
from ..streaming import StreamState, TokenStream

DEFAULTS = [AUTOREGRESSIVE, "prompt_lookup", "draft", "jacobi"]
"""The method of each column at start."""
STREAM_NOTE = ("<small><i>streaming an untimed pass; the measured run follows and replaces this text</i></small>")


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


def coloured_html(pieces: list[str], mask: list[bool], note: str = "") -> str:
    """Generated text as HTML: accepted draft tokens on green, target tokens on grey; ``note`` (HTML) under it."""
    spans = []
    for text, acc in zip(pieces, mask):
        cls, style = ("mm-accepted", ACCEPTED_STYLE) if acc else ("mm-target", TARGET_STYLE)
        spans.append(f'<span class="{cls}" style="{style}">{html.escape(text)}</span>')
    extra = f'<div class="mm-note" style="margin-top:6px">{note}</div>' if note else ""
    return f'<div class="mm-output" style="{TEXT_STYLE}">{"".join(spans)}</div>{extra}'


def stream_html(tokenizer, state: StreamState) -> str:
    """A column while its untimed pass streams: the text so far, coloured as far as the acceptance is known."""
    pieces = token_pieces(tokenizer, state.ids)
    return coloured_html(pieces, accepted_mask(len(pieces), state.accepted), STREAM_NOTE)


def with_draft_length(spec: str, num_draft_tokens: int) -> str:
    """``spec`` with ``k=num_draft_tokens`` appended unless the spec sets its own draft length."""
    from mmaccel.specs import parse_method_spec

    return spec if "k" in parse_method_spec(spec).kwargs else f"{spec}:k={int(num_draft_tokens)}"


class GenerationTab(Tab):
    """Handlers and layout of the Generation tab."""

    title, key = "Generation", "generation"

    def generation(self, model_name, prompt, max_new_tokens, num_draft_tokens, repeats, n_columns, spec1, spec2,
                   spec3, spec4, trust_remote_code=False,
                   progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Generation: each column's drafter (or the autoregressive baseline) on the same prompt, greedy; accepted
        draft tokens are coloured in the output.

        Yields
        ------
        list
            ``[status, (html, metrics) x 4, ratio plot]``: while a column runs, its text as the untimed pass streams
            it (no metrics); then the measured run's text and metrics.
        """
        from mmaccel.eval.generation import generate_measured
        from mmaccel.pipeline import resolve_method

        req = Request(self.ctx, n_columns, (spec1, spec2, spec3, spec4))
        n, specs, results = req.n, req.specs, req.results
        model, tok = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield req.outputs(LOAD_FAILED, final=True)
            return
        try:
            if not (prompt or "").strip():
                raise InputError("the prompt is empty")
            ids = build_prompt(tok, "", prompt)
        except InputError as exc:
            yield req.fail_all(str(exc))
            return
        max_new = int(max_new_tokens)
        for i, spec in enumerate(specs):
            progress((i, n), desc=f"column {i + 1}: {spec}")
            yield req.outputs(f"running column {i + 1} of {n} ({spec}) ...")
            try:
                baseline = spec.split(":")[0] == AUTOREGRESSIVE
                method, _ = resolve_method(None if baseline else with_draft_length(spec, num_draft_tokens))
                prepare = getattr(method, "prepare", None)
                if callable(prepare):  # loads a draft model once, refuses another vocabulary (ValueError)
                    prepare(model, tok)
                for state in TokenStream(model, tok, ids, method, max_new_tokens=max_new):
                    results[i] = ColumnResult(html=stream_html(tok, state))
                    yield req.outputs(f"column {i + 1} of {n} ({spec}): streaming an untimed pass "
                                      f"({len(state.ids)} tokens); the measured run follows ...")
                rec = generate_measured(model, tok, ids, method=method, label=AUTOREGRESSIVE if baseline else spec,
                                        max_new_tokens=max_new, repeats=int(repeats), warmup=1)
                body = None
                if rec.ok:
                    if baseline:
                        rec.method_name = AUTOREGRESSIVE
                    pieces = token_pieces(tok, rec.output_ids)
                    accepted = [] if baseline else rec.telemetry.get("accepted", [])
                    body = coloured_html(pieces, accepted_mask(len(pieces), accepted))
                results[i] = record_result(rec, body=body)
            except Exception as exc:  # noqa: BLE001 - bad spec etc.: this column only
                results[i] = ColumnResult.failure(error_text(exc))
        same = {r.record.output_text for r in results if r and r.record is not None}
        status = (f"Ran {n} configurations one after another on the same {len(ids)}-token prompt, greedy, each after "
                  f"one warm-up run; medians of {int(repeats)} run(s). The text streamed while a column ran came from "
                  "an extra untimed pass; the text and metrics shown now are the measured run's. "
                  + ("All outputs are identical (greedy speculative decoding is lossless)." if len(same) == 1 else
                     "Outputs differ between columns." if same else ""))
        yield req.outputs(status, final=True)

    def build(self, model) -> None:
        """The tab: prompt, lengths, the columns; the coloured outputs, metrics and the ratio plot."""
        from mmaccel import speculative

        gr.Markdown("Greedy decoding with speculative drafters from `mmaccel.speculative.METHODS`. In the output, "
                    f"<span style='{ACCEPTED_STYLE}'>green</span> tokens are draft tokens the target accepted; "
                    f"<span style='{TARGET_STYLE}'>grey</span> tokens came from the target's own verification forward "
                    "(every token, in the autoregressive column). The text streams from an untimed pass first; the "
                    "measured run then replaces it and fills the metrics.")
        prompt = gr.Textbox(label="prompt", lines=3, elem_id="gen-prompt",
                            value="The secret number of the cat is 12345. The secret number of the dog is")
        with gr.Row():
            max_new = gr.Number(32, label="max new tokens", precision=0, minimum=1, elem_id="gen-max-new")
            k = gr.Number(4, label="draft tokens per step", precision=0, minimum=1)
            repeats = gr.Number(1, label="repeats (median)", precision=0, minimum=1)
        ncols, cols = column_row("gen", speculative.METHODS, DEFAULTS,
                                 extra={AUTOREGRESSIVE: "Plain greedy decoding (model.generate): the baseline."})
        run, stop = run_buttons("gen")
        status = gr.Markdown(elem_id="gen-status")
        outs, _ = column_outputs("gen", cols, ncols)
        plot = gr.Plot(label="ratios to column 1", elem_id="gen-plot")
        ev = run.click(self.generation, [model, prompt, max_new, k, repeats, ncols, *[c.spec for c in cols],
                                         *self.ctx.extra_inputs],
                       [status, *outs, plot], api_name="generation", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")
