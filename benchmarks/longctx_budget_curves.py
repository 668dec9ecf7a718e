"""Accuracy-vs-budget curves of the KV methods from NIAH sweeps: one plot per sweep, one heatmap per method, a table.

Reads the ``results.jsonl`` of one or more ``mmaccel niah`` sweeps (run the methods at ``ratio=0.05 0.1 0.25 0.5``,
with ``full`` in one of them; ``kvquant:bits=B`` has no ratio and is placed at its measured byte fraction), and writes
to ``--out``:

- ``curves.png``: NIAH accuracy against the KV budget, one panel per context length, full attention as a line;
- ``heatmap_<method>.png``: accuracy per (length, budget) for each method;
- ``table.md`` / ``summary.json``: per (method, length, budget): correct/n, the K/V bytes held after prefill and the
  measured peak memory as ratios to ``full`` on the same prompts (medians), Quest's fraction of the K/V *read* per
  decode step, TTFT and tokens/s ratios, and each method's smallest budget that keeps >= 95% of full's accuracy.

Usage::

    python benchmarks/longctx_budget_curves.py runs/grid/4k_a runs/grid/4k_b runs/grid/8k_a ... \\
        --out benchmarks/results/longctx/budget_curves

Timing ratios are only as good as the machine was quiet: each record carries ``threads`` and ``load_avg_1m``, and the
table prints the median load of each row's runs.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

BUDGETS = (0.05, 0.1, 0.25, 0.5)
HOLD = 0.95


def family_and_budget(spec: str) -> tuple[str, float | None]:
    """``"snapkv:ratio=0.1"`` -> ``("snapkv", 0.1)``; ``"adakv:method=snapkv,ratio=0.25"`` -> ``("adakv(snapkv)",
    0.25)``; a spec without ``ratio=`` -> ``(spec, None)`` (placed at its measured K/V fraction)."""
    name = spec.split(":", 1)[0]
    match = re.search(r"ratio=([0-9.]+)", spec)
    inner = re.search(r"method=([a-z_0-9]+)", spec)
    if name in ("adakv", "chunked") and inner:
        name = f"{name}({inner.group(1)})"
    if match is None:
        return spec, None
    return name, float(match.group(1))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict]) -> dict:
    """Rows per (method spec, length) with ratios to ``full`` on the same (length, depth, trial) prompts.

    Returns
    -------
    dict
        ``{"rows": [...], "full": {length: accuracy}, "smallest_budget_holding_95": {family: {length: budget}}}``.
    """
    def key(r):
        return r["extra"]["length"], r["extra"]["depth"], r["extra"].get("trial")

    full = {key(r): r for r in records if r["method"] == "full" and r["status"] == "ok"}
    rows = []
    for spec in dict.fromkeys(r["method"] for r in records):
        family, budget = family_and_budget(spec)
        for length in sorted({r["extra"]["length"] for r in records if r["method"] == spec}):
            mine = [r for r in records if r["method"] == spec and r["extra"]["length"] == length]
            ok = [r for r in mine if r["status"] == "ok"]
            pairs = [(r, full.get(key(r))) for r in ok]
            pairs = [(r, f) for r, f in pairs if f is not None]

            def ratio(field, pairs=pairs):
                return _median([r[field] / f[field] for r, f in pairs if r.get(field) and f.get(field)])

            kv = _median([(r["kv_cache_bytes_prefill"] + r["telemetry"].get("bookkeeping_bytes", 0))
                          / f["kv_cache_bytes_prefill"] for r, f in pairs if r.get("kv_cache_bytes_prefill")])
            read = _median([r["telemetry"].get("kv_read_fraction") for r in ok])
            rows.append({
                "method": spec, "family": family, "budget": budget, "length": length,
                "correct": sum(bool(r["extra"].get("correct")) for r in ok), "n": len(ok),
                "failed": len(mine) - len(ok),
                "errors": sorted({r["error"] for r in mine if r["status"] != "ok"}),
                "kv_bytes_ratio": kv, "kv_read_fraction": read,
                "peak_memory_ratio": ratio("peak_memory_bytes"), "ttft_ratio": ratio("ttft_s"),
                "tokens_per_s_ratio": ratio("tokens_per_s"),
                "load_avg_1m": _median([r.get("load_avg_1m") for r in ok]),
                "threads": _median([r.get("threads") for r in ok]),
            })
    full_acc = {row["length"]: row["correct"] / row["n"] for row in rows if row["method"] == "full" and row["n"]}
    smallest: dict[str, dict] = {}
    for row in rows:
        if row["budget"] is None or not row["n"] or row["length"] not in full_acc:
            continue
        holds = row["correct"] / row["n"] >= HOLD * full_acc[row["length"]]
        best = smallest.setdefault(row["family"], {}).get(row["length"])
        if holds and (best is None or row["budget"] < best):
            smallest[row["family"]][row["length"]] = row["budget"]
    for family in {r["family"] for r in rows if r["budget"] is not None}:
        smallest.setdefault(family, {})
    return {"rows": rows, "full": full_acc, "smallest_budget_holding_95": smallest}


def _fmt(x, spec="{:.2f}"):
    return "–" if x is None else spec.format(x)


def write_table(summary: dict, path: Path) -> None:
    """The summary as a Markdown table (one row per method spec and length)."""
    lines = [("| method | length | budget | correct | K/V held vs full | K/V read / step | peak mem vs full "
              "| TTFT vs full | tok/s vs full | load (1 min) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary["rows"], key=lambda r: (r["length"], r["family"] != "full", r["family"],
                                                    r["budget"] or 0)):
        acc = f"{r['correct']}/{r['n']}" + (f" ({r['failed']} failed)" if r["failed"] else "")
        lines.append(f"| `{r['method']}` | {r['length']} | {_fmt(r['budget'])} | {acc} | {_fmt(r['kv_bytes_ratio'], '{:.3f}')} "
                     f"| {_fmt(r['kv_read_fraction'], '{:.3f}')} | {_fmt(r['peak_memory_ratio'])} "
                     f"| {_fmt(r['ttft_ratio'])} | {_fmt(r['tokens_per_s_ratio'])} | {_fmt(r['load_avg_1m'], '{:.1f}')} |")
    lines += ["", "Smallest budget (kept fraction of the context) holding >= 95% of full attention's accuracy:", "",
              "| method | " + " | ".join(str(l) for l in sorted(summary["full"])) + " |",
              "|---|" + "---|" * len(summary["full"])]
    for family, by_len in sorted(summary["smallest_budget_holding_95"].items()):
        lines.append(f"| {family} | " + " | ".join(_fmt(by_len.get(l)) if by_len.get(l) is not None else "none of those run"
                                                   for l in sorted(summary["full"])) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def plot(summary: dict, out: Path) -> None:
    """``curves.png`` and ``heatmap_<family>.png`` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, lengths = summary["rows"], sorted(summary["full"])
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        at = [r for r in rows if r["length"] == length and r["n"]]
        for family in sorted({r["family"] for r in at if r["budget"] is not None}):
            pts = sorted((r["budget"], r["correct"] / r["n"]) for r in at if r["family"] == family)
            reads = family == "quest"  # Quest holds everything and bounds what each decode step reads
            ax.plot(*zip(*pts), marker="o", ls="--" if reads else "-",
                    label=f"{family} (K/V read per step)" if reads else family)
        quant = [r for r in at if r["budget"] is None and r["family"] != "full" and r["kv_bytes_ratio"]]
        for r in quant:
            ax.scatter(r["kv_bytes_ratio"], r["correct"] / r["n"], marker="s", label=r["method"])
        ax.axhline(summary["full"][length], color="black", ls="--", label="full")
        ax.set(xscale="log", ylim=(-0.03, 1.03), ylabel="NIAH accuracy", title=f"smollm2-135m, {length} tokens",
               xlabel="K/V budget (kept fraction; kvquant, razor: byte fraction)")
        ax.minorticks_off()
        ax.set_xticks(list(BUDGETS), [str(b) for b in BUDGETS])
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    for family in sorted({r["family"] for r in rows if r["budget"] is not None}):
        grid = [[None] * len(BUDGETS) for _ in lengths]
        for r in rows:
            if r["family"] == family and r["budget"] in BUDGETS and r["n"]:
                grid[lengths.index(r["length"])][BUDGETS.index(r["budget"])] = r["correct"] / r["n"]
        fig, ax = plt.subplots(figsize=(5, 1.2 + 0.6 * len(lengths)))
        ax.imshow([[float("nan") if v is None else v for v in row] for row in grid], vmin=0, vmax=1, cmap="RdYlGn",
                  aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "–" if v is None else f"{v:.0%}", ha="center", va="center", fontsize=9)
        ax.set(xticks=range(len(BUDGETS)), xticklabels=[str(b) for b in BUDGETS], yticks=range(len(lengths)),
               yticklabels=[str(l) for l in lengths], xlabel="budget (kept fraction)", title=f"{family}: NIAH accuracy")
        fig.tight_layout()
        fig.savefig(out / f"heatmap_{family.replace('(', '_').replace(')', '')}.png", dpi=110)
        plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", help="sweep folders written by `mmaccel niah --out`")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from mmaccel.eval.niah import read_sweeps

    summary = summarize(read_sweeps(args.dirs)[0])
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    write_table(summary, out / "table.md")
    plot(summary, out)
    print((out / "table.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
