"""Build this record from the run folders of `mmaccel compare --task niah` on three real models (see README.md).

    python benchmarks/results/longctx/real_models_4k/build.py /work/runs/lctab

Reads `<runs>/<model>/results.jsonl` for each model, writes here `results_<model>.jsonl.gz` (the raw records),
`summary.json` (per model: the rows of `mmaccel.eval.compare.niah_docs_rows`, documents finished, methods not run
and why), `tables.md` (one Markdown table per model, without the speed columns: measured on a loaded machine) and
`accuracy_vs_kv.png` (correct answers against K/V bytes held, one panel per model).
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from mmaccel.eval.compare import niah_docs_markdown, niah_docs_rows
from mmaccel.eval.sweep import read_records, save_figure, write_atomic

HERE = Path(__file__).resolve().parent
MODELS = ("qwen2.5-coder-0.5b", "gemma3-270m", "smollm2-135m")
RUN_DIRS = {"qwen2.5-coder-0.5b": "qwen", "gemma3-270m": "gemma", "smollm2-135m": "smollm2"}
NO_PATTERN = "needs a head pattern fitted to this model (only micro-lm and smollm2-135m have one committed)"
#: methods of longctx.METHODS not in a model's run, and why (every other method is in its records)
NOT_RUN = {
    "qwen2.5-coder-0.5b": {
        "retrieval_heads / duo / razor": NO_PATTERN,
        "chunked, chunked_ffn, bilevel, longheads, kvzip": "own prefill per method: not run in the time this record "
                                                           "had (about 1 min per 4k prefill on the loaded machine)",
    },
    "gemma3-270m": {"retrieval_heads / duo / razor": NO_PATTERN},
    "smollm2-135m": {},
}
ALIASES = "streamingllm is streaming's alias (same class), chunked is run with its default inner method (full)"


def _final_kv_table(records: list) -> str:
    """Per method: the median K/V bytes held at the end of the decode and the median per-document ratio to full's.

    After the prefill a sliding-window layer of transformers still holds a view of the whole prompt's K/V (its
    storage lives until the layer's next update), so on Gemma 3 the K/V after prefill counts 15 of its 18 layers at
    4,096 tokens for every method; at the end of the decode those layers hold their 511-token windows.
    """
    import statistics

    by_doc, methods = {}, []
    for r in records:
        if r["status"] != "ok" or r.get("kv_cache_bytes_final") is None:
            continue
        doc = (r["extra"]["depth"], r["extra"].get("trial"))
        by_doc.setdefault(doc, {})[r["method"]] = r["kv_cache_bytes_final"]
        methods += [r["method"]] if r["method"] not in methods else []
    lines = ["| method | K/V bytes at the end | vs full |", "|---|---|---|"]
    for m in methods:
        held = [d[m] for d in by_doc.values() if m in d]
        ratios = [d[m] / d["full"] for d in by_doc.values() if m in d and d.get("full")]
        ratio = f"{statistics.median(ratios):.3f}" if ratios else "-"
        lines.append(f"| {m} | {statistics.median(held) / 2**20:.1f} MiB | {ratio} |")
    return "\n".join(lines) + "\n"


def _plot(rows_by_model: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * len(rows_by_model), 4.2), dpi=100)
    FigureCanvasAgg(fig)
    for i, (model, rows) in enumerate(rows_by_model.items()):
        ax = fig.add_subplot(1, len(rows_by_model), i + 1)
        for r in rows:
            if not r["n"] or r["kv_ratio"] is None:
                continue
            ax.scatter(r["kv_ratio"], r["correct"] / r["n"], s=28)
            ax.annotate(r["method"].split(":")[0], (r["kv_ratio"], r["correct"] / r["n"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        n = max((r["n"] for r in rows), default=0)
        ax.set_title(f"{model}: 4k NIAH, {n} documents", fontsize=9)
        ax.set_xlabel("K/V bytes held after prefill / full's")
        ax.set_ylabel("correct (strict)")
        ax.set_xlim(0, 1.1)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="folder holding qwen/, gemma/ and smollm2/ run folders")
    ap.add_argument("--out", type=Path, default=HERE, help="where the record goes (default: this folder)")
    args = ap.parse_args(argv)
    out = args.out
    summary, tables, rows_by_model = {}, [], {}
    for model in MODELS:
        run = args.runs / RUN_DIRS[model]
        found = [run / name for name in ("results.jsonl", "results.jsonl.gz") if (run / name).exists()]
        if not found:
            continue
        records = read_records(found[0])
        rows = niah_docs_rows(records)
        rows_by_model[model] = rows
        docs = sorted({(r["extra"]["depth"], r["extra"].get("trial")) for r in records})
        first = records[0]
        summary[model] = {"documents": len(docs), "depths": sorted({d for d, _ in docs}), "device": first["device"],
                          "threads": first["threads"], "dtype": first["dtype"],
                          "shared_prefill": any(r["shared_prefill"] for r in rows),
                          "rows": rows, "not_run": NOT_RUN[model]}
        with gzip.open(out / f"results_{model}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        not_run = "".join(f"\n- not run: {k}: {v}" for k, v in NOT_RUN[model].items())
        tables.append(f"### {model} ({len(docs)} documents of 4096 tokens, {first['device']}, {first['dtype']}, "
                      f"{first['threads']} thread{'s' * (first['threads'] != 1)})\n\n{niah_docs_markdown(rows, speed=False)}\n{not_run}\n\n"
                      f"K/V held at the end of the decode (medians over documents):\n\n{_final_kv_table(records)}")
    summary["notes"] = ALIASES
    write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_atomic(out / "tables.md", "\n".join(tables))
    if rows_by_model:
        _plot(rows_by_model, out / "accuracy_vs_kv.png")
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
