"""The Long context tab (endpoints ``/longctx`` and ``/niah_document``): a document and a question; each column a
KV-cache method of :data:`mmaccel.longctx.METHODS`, measured by :func:`mmaccel.compare` one column after another."""
from __future__ import annotations

from pathlib import Path

import gradio as gr

from ..columns import column_outputs, column_row, run_buttons
from ..common import LOAD_FAILED, MEASURED, ColumnResult, InputError, Request, Tab, error_text, record_result
from ..prompts import build_prompt, niah_document, read_upload

WARMUPS = ["full input", "short prompt (last 64 tokens)"]
"""What each column's warm-up run is fed."""
DEFAULTS = ["full", "snapkv", "streaming", "h2o"]
"""The method of each column at start."""


class LongContextTab(Tab):
    """Handlers and layout of the Long context tab."""

    title, key = "Long context", "longctx"

    def longctx(self, model_name, document, upload, question, expected, max_new_tokens, repeats, warmup, n_columns,
                spec1, spec2, spec3, spec4, trust_remote_code=False,
                progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Long context: every column's KV-cache method on the same document + question (streams column by column).

        An upload is copied into a private per-request folder (0600), removed when the request ends.
        ``trust_remote_code``: the "trust remote code" box (only offered, and only honoured, with
        ``--allow-remote-code``).

        Yields
        ------
        list
            ``[status, (html, metrics) x 4, ratio plot]``.
        """
        req = Request(self.ctx, n_columns, (spec1, spec2, spec3, spec4))
        n, specs, results = req.n, req.specs, req.results
        model, tok = req.load(model_name, progress, trust_remote_code)
        if model is None:
            yield req.outputs(LOAD_FAILED, final=True)
            return
        try:
            with self.ctx.request_folder("upload-") as folder:
                text = read_upload(self.ctx.upload(upload, folder), self.ctx.max_upload_bytes)
            if text is None:
                text = document
            ids = build_prompt(tok, text, question)
        except (InputError, OSError) as exc:
            yield req.fail_all(str(exc))
            return
        import mmaccel
        from mmaccel.longctx import build_method

        short = str(warmup).startswith("short")
        warm = ids[-min(len(ids), 64):] if short else ids
        expected = (expected or "").strip() or None
        src = f"uploaded file {Path(upload).name}" if upload else "the document box"
        for i, spec in enumerate(specs):
            progress((i, n), desc=f"column {i + 1}: {spec}")
            yield req.outputs(f"running column {i + 1} of {n} ({spec}) ...")
            try:
                build_method(spec)
                cmp = mmaccel.compare(model, tok, ids, [spec], max_new_tokens=int(max_new_tokens),
                                      repeats=int(repeats), warmup=1, warmup_inputs=warm, answer=expected)
                rec = cmp.records[0]
            except Exception as exc:  # noqa: BLE001 - bad spec, bad value, anything else: this column only
                results[i] = ColumnResult.failure(error_text(exc))
                continue
            results[i] = record_result(rec, expected)
        how = f"on its last {len(warm)} tokens" if short else "on the same input"
        status = (f"Ran {n} configurations one after another on the same {len(ids)}-token prompt (from {src}), each "
                  f"after one warm-up run {how}; medians of {int(repeats)} run(s).")
        yield req.outputs(status, final=True)

    def niah_document(self, model_name, length, depth, seed, trust_remote_code=False):
        """Generate a NIAH document for the model's tokenizer: ``(document, question, expected answer)``.

        Raises
        ------
        gradio.Error
            The model cannot be loaded, or the length is too small for the needle or over
            :data:`~mmaccel.apps.tabs.evaluations.MAX_LENGTH` (shown as a toast).
        """
        from .evaluations import MAX_LENGTH

        try:
            if not 1 <= int(length or 0) <= MAX_LENGTH:
                raise InputError(f"the NIAH length must be 1 to {MAX_LENGTH} tokens, got {length}")
            _, tok = self.ctx.models.get(model_name, trust_remote_code=bool(trust_remote_code))
            return niah_document(tok, int(length), float(depth), int(seed), haystack=self.ctx.haystack_tokens(tok))
        except Exception as exc:
            raise gr.Error(f"cannot generate a NIAH document: {error_text(exc)}") from exc

    def build(self, model) -> None:
        """The tab: document, question, upload, NIAH generator; the columns; the outputs and the ratio plot."""
        from mmaccel import longctx

        ctx = self.ctx
        with gr.Row():
            with gr.Column(scale=3):
                document = gr.Textbox(label="document", lines=6, max_lines=12, elem_id="lc-document",
                                      placeholder="paste a document, upload a text file, or generate one")
                question = gr.Textbox(label="question", lines=1, elem_id="lc-question")
            with gr.Column(scale=2):
                upload = gr.File(label=f"or upload a UTF-8 text file (up to {ctx.max_upload_mb:g} MiB; copied to the "
                                       "app's private folder for the run)", type="filepath", elem_id="lc-upload")
                with gr.Row():
                    niah_len = gr.Number(ctx.niah_length, label="NIAH length (tokens)", precision=0, minimum=64)
                    niah_depth = gr.Slider(0, 1, 0.5, step=0.05, label="needle depth")
                    niah_seed = gr.Number(0, label="seed", precision=0)
                gen_doc = gr.Button("Generate a NIAH document", elem_id="lc-gen-doc")
                expected = gr.Textbox(label="expected answer (optional; scored when given)", elem_id="lc-expected")
        with gr.Row():
            max_new = gr.Number(24, label="max new tokens", precision=0, minimum=1, elem_id="lc-max-new")
            repeats = gr.Number(1, label="repeats (median)", precision=0, minimum=1)
            warmup = gr.Radio(WARMUPS, value=WARMUPS[0], label="warm-up run per configuration",
                              info="the full input is fairer (every code path is warm); a short prompt halves the "
                                   "time of long documents")
        ncols, cols = column_row("lc", longctx.METHODS, DEFAULTS)
        run, stop = run_buttons("lc")
        status = gr.Markdown(elem_id="lc-status")
        outs, _ = column_outputs("lc", cols, ncols)
        plot = gr.Plot(label="ratios to column 1", elem_id="lc-plot")
        ev = run.click(self.longctx, [model, document, upload, question, expected, max_new, repeats, warmup, ncols,
                                      *[c.spec for c in cols], *ctx.extra_inputs],
                       [status, *outs, plot], api_name="longctx", **MEASURED)
        stop.click(None, cancels=[ev], api_visibility="private")
        gen_doc.click(self.niah_document, [model, niah_len, niah_depth, niah_seed, *ctx.extra_inputs],
                      [document, question, expected],
                      api_name="niah_document", **MEASURED)
