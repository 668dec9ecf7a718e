"""The charts of measured runs, drawn once for the API (:meth:`mmaccel.eval.Comparison.plot`) and the app.

- :func:`metric_rows` -- the metrics table of one :class:`~mmaccel.eval.generation.RunRecord` (what each app column
  shows under its output);
- :func:`ratio_figure` -- a grouped bar plot of each metric relative to the first column;
- :func:`niah_figure` -- the NIAH accuracy heatmaps (drawn by :func:`mmaccel.eval.niah.draw_heatmap`), one panel per
  method.

Figures are ``matplotlib.figure.Figure`` objects on the Agg canvas: no pyplot state, no display needed.
"""
from __future__ import annotations

from collections.abc import Sequence

RATIO_METRICS = ("TTFT (s)", "vision encoder (s)", "prefill (s)", "decode time (s)", "tokens/s", "peak memory (MiB)",
                 "KV at end (MiB)")
"""Metrics of the ratio plot, in order; a metric is drawn when the first column has a non-zero value for it."""


def _mib(n) -> float | None:
    return None if n is None else round(n / 2**20, 3)


def _round(x, nd: int = 4):
    return None if x is None else round(float(x), nd)


def metric_rows(rec, *, mean_accepted_default: float | None = None) -> list[list]:
    """Metric rows ``[name, number]`` of a run record (``None`` where unknown).

    Parameters
    ----------
    rec : RunRecord
    mean_accepted_default : float, optional
        The "mean accepted length" to show when the record has none (the app's autoregressive baseline shows 1.0);
        without one the row is left out.

    Returns
    -------
    list of [str, number]
        TTFT, decode time (s), tokens/s, peak memory, KV after prefill and at the end (MiB), prompt and new tokens;
        for vision-language runs also the vision-encoder and prefill seconds and the visual tokens before and after
        the visual-token method; the mean accepted length of speculative runs; ``correct (strict)`` when known.
    """
    tel = rec.telemetry or {}
    rows = [
        ["TTFT (s)", _round(rec.ttft_s)],
        ["decode time (s)", _round(rec.decode_s)],
        ["tokens/s", _round(rec.tokens_per_s, 2)],
        ["peak memory (MiB)", _mib(rec.peak_memory_bytes)],
        ["KV after prefill (MiB)", _mib(rec.kv_cache_bytes_prefill)],
        ["KV at end (MiB)", _mib(rec.kv_cache_bytes_final)],
        ["prompt tokens", rec.prompt_tokens],
        ["new tokens", rec.new_tokens],
    ]
    if getattr(rec, "vision_encoder_s", None) is not None:
        rows[1:1] = [["vision encoder (s)", _round(rec.vision_encoder_s)], ["prefill (s)", _round(rec.prefill_s)]]
    if getattr(rec, "visual_tokens_kept", None) is not None:
        rows.append(["visual tokens", rec.visual_tokens])
        rows.append(["visual tokens kept", rec.visual_tokens_kept])
    accepted = tel.get("mean_accepted_length", mean_accepted_default)
    if accepted is not None:
        rows.append(["mean accepted length", _round(accepted, 3)])
    if "correct" in rec.extra:
        rows.append(["correct (strict)", 1 if rec.extra["correct"] else 0])
    return rows


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def ratio_figure(labels: Sequence[str], rows: Sequence, metrics: Sequence[str] = RATIO_METRICS):
    """A grouped bar plot: each metric as a ratio to the first column (1.0 = the same), one bar per column.

    Parameters
    ----------
    labels : sequence of str
        Column labels (the legend), the first being the reference.
    rows : sequence of (list of [name, value]) or None
        Each column's :func:`metric_rows`; ``None`` for a column that failed (left out).
    metrics : sequence of str
        Metric names to draw, in order (default :data:`RATIO_METRICS`); only those with a non-zero value in the
        first column are drawn, one bar group each.

    Returns
    -------
    matplotlib.figure.Figure or None
        ``None`` when fewer than two columns have rows, the first column has none, or no metric can be drawn.
    """
    ok = [(lab, r) for lab, r in zip(labels, rows) if r is not None]
    if len(ok) < 2 or not rows or rows[0] is None:
        return None
    base = dict(rows[0])
    drawn = [m for m in metrics if base.get(m)]
    if not drawn:
        return None
    fig = _figure(8, 3.2)
    ax = fig.add_subplot()
    width = 0.8 / len(ok)
    for j, (lab, r) in enumerate(ok):
        vals = dict(r)
        ys = [(vals.get(m) or 0) / base[m] for m in drawn]
        xs = [i + (j - (len(ok) - 1) / 2) * width for i in range(len(drawn))]
        bars = ax.bar(xs, ys, width, label=lab[:40])
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(drawn)), drawn, fontsize=8)
    ax.set_ylabel(f"ratio to column 1 ({labels[0][:30]})", fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("ratios to the first column (lower is better, except tokens/s)", fontsize=9)
    fig.tight_layout()
    return fig


def niah_figure(records: Sequence[dict]):
    """NIAH accuracy heatmaps (length x depth), one panel per method, each drawn by
    :func:`mmaccel.eval.niah.draw_heatmap`, the same drawing ``mmaccel niah`` and the app save as PNGs.

    Parameters
    ----------
    records : sequence of dict
        ``RunRecord.to_dict()`` rows whose ``extra`` holds the NIAH ``length`` and ``depth`` (and ``correct``), e.g.
        ``run_niah(...).records``.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    ValueError
        If no record carries a NIAH length and depth.
    """
    from .niah import draw_heatmap, summarize

    rows = [r for r in records if "length" in r.get("extra", {}) and "depth" in r.get("extra", {})]
    if not rows:
        raise ValueError("NIAH heatmaps need records of NIAH prompts (extra['length'] and extra['depth']): compare "
                         "on a make_niah_sample(...) prompt, or build Comparison(records=...) from run_niah(...)")
    lengths = sorted({r["extra"]["length"] for r in rows})
    depths = sorted({r["extra"]["depth"] for r in rows})
    summary = summarize(rows, lengths, depths)
    labels = list(summary["methods"])
    cols = min(2, len(labels))
    nrows = -(-len(labels) // cols)
    fig = _figure(max(5.0, 1.8 + 0.9 * len(lengths)) * cols, max(3.0, 1.4 + 0.5 * len(depths)) * nrows)
    for i, label in enumerate(labels):
        ax = fig.add_subplot(nrows, cols, i + 1)
        image = draw_heatmap(ax, summary["methods"][label]["cells"], lengths, depths, f"NIAH accuracy: {label}")
        fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    return fig
