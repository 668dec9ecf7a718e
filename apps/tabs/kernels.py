"""The Kernels tab (endpoint ``/kernels``): :mod:`mmaccel.kernels.bench` on small sizes, every figure a speed ratio to
dense SDPA measured in the same process."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import gradio as gr

from ..common import MEASURED, Tab, scrub

HEADERS = ["op", "method", "backend", "length", "ms", "speedup"]
MAX_SIZE = 16_384
"""Largest length, cache length or budget the app benchmarks (bigger ones: ``mmaccel kernel-bench``)."""
MAX_REPEATS = 20
"""Most timed repeats per kernel in the app."""


def kernel_figure(records: list[dict]):
    """Bar plot of kernel speedups vs dense SDPA, one bar per (op, method, backend, length); ``None`` when only the
    SDPA baselines ran."""
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


class KernelsTab(Tab):
    """Handler and layout of the Kernels tab."""

    title, key = "Kernels", "kernels"

    def kernels(self, lengths, cache_lengths, budgets, ops, repeats,
                progress=gr.Progress()):  # noqa: B008 - how Gradio injects progress
        """Kernels: :mod:`mmaccel.kernels.bench` on small sizes; every figure is a speed ratio to dense SDPA.

        Returns
        -------
        (str, dict, Figure or None)
            The status (or ``**error**: ...`` for bad sizes), the records table and the speedup bar plot.
        """
        from mmaccel.kernels import bench

        try:
            argv = ["--lengths", *str(lengths).replace(",", " ").split(),
                    "--cache-lengths", *str(cache_lengths).replace(",", " ").split(),
                    "--budgets", *str(budgets).replace(",", " ").split(),
                    "--ops", *(ops or ["prefill"]), "--repeats", str(int(repeats)), "--densities", "0.5",
                    "--column-window", "0"]
            for group in (lengths, cache_lengths, budgets):
                if not all(x.isascii() and x.isdigit() and 0 < int(x) <= MAX_SIZE
                           for x in str(group).replace(",", " ").split()):
                    raise ValueError(f"sizes must be whole numbers from 1 to {MAX_SIZE}, got {str(group)[:60]!r} "
                                     "(`mmaccel kernel-bench` runs larger ones)")
            if not set(ops or ["prefill"]) <= {"prefill", "decode"} or not 1 <= int(repeats) <= MAX_REPEATS:
                raise ValueError(f"ops are prefill and/or decode, repeats 1 to {MAX_REPEATS}")
            import torch

            if not torch.cuda.is_available():
                argv.insert(0, "--cpu")
            progress(0.1, desc="running the kernel micro-benchmark")
            buf = io.StringIO()
            with self.ctx.request_folder("kbench-") as folder, contextlib.redirect_stdout(buf):
                out = Path(folder) / "bench.json"
                bench.main([*argv, "--out", str(out)])
                payload = json.loads(out.read_text())
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - argparse exits on bad input
            return f'**error**: {scrub(exc)}', {"headers": HEADERS, "data": []}, None
        recs = payload["records"]
        rows = [[r["op"], r["method"], r["backend"], r["length"], round(r["ms"], 4), round(r["speedup"], 3)]
                for r in recs]
        status = (f"Ran on {payload['device']} ({payload['dtype']}); speedup = dense SDPA time / time, same process, "
                  f"median of {int(repeats)}.\n\n```\n{scrub(buf.getvalue().strip())}\n```")
        return status, {"headers": HEADERS, "data": rows}, kernel_figure(recs)

    def build(self, model) -> None:
        """The tab: sizes, ops, repeats; the records table and the speedup plot."""
        gr.Markdown("The attention-kernel micro-benchmark (`mmaccel.kernels.bench`, also `mmaccel kernel-bench`): "
                    "sparse prefill patterns and budgeted decode, as speed ratios to dense SDPA measured in the same "
                    "process.")
        with gr.Row():
            lengths = gr.Textbox("1024 2048", label="prefill lengths", elem_id="kb-lengths")
            cache = gr.Textbox("2048", label="decode cache lengths", elem_id="kb-cache")
            budgets = gr.Textbox("256", label="decode budgets", elem_id="kb-budgets")
            ops = gr.CheckboxGroup(["prefill", "decode"], value=["prefill", "decode"], label="ops")
            repeats = gr.Number(3, label="repeats", precision=0, minimum=1, elem_id="kb-repeats")
        run = gr.Button("Run the micro-benchmark", variant="primary", elem_id="kb-run")
        status = gr.Markdown(elem_id="kb-status")
        table = gr.Dataframe(label="records", interactive=False, elem_id="kb-table")
        plot = gr.Plot(label="speedup vs SDPA", elem_id="kb-plot")
        run.click(self.kernels, [lengths, cache, budgets, ops, repeats], [status, table, plot], api_name="kernels",
                  **MEASURED)
