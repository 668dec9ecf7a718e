"""Markdown table of a ``mmaccel vision-sweep`` folder, with what ``summary.json`` leaves out.

For each cell it prints:
- accuracy with one binomial standard error;
- its share of the all-token accuracy;
- the median prefill (seconds) and the prefill speedup;
- the LM's prefill-FLOPs ratio;
- how often the answer equals the all-token answer;
- a paired count against pooling at the same budget: the questions the cell answers right and pooling wrong, and
  the reverse (the input of an exact McNemar test).

    python benchmarks/vision_sweep_table.py benchmarks/results/vision/smol_llava_sweep_stage2

Raises ``FileNotFoundError`` when the folder lacks ``results.jsonl`` or ``summary.json``.
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def paired_against(rows: dict, other: dict) -> tuple[int, int]:
    """``(won, lost)``: questions ``rows`` answers right and ``other`` wrong, and the reverse (by question index)."""
    won = sum(1 for q, r in rows.items() if r["extra"]["correct"] and q in other and not other[q]["extra"]["correct"])
    lost = sum(1 for q, r in rows.items() if not r["extra"]["correct"] and q in other and other[q]["extra"]["correct"])
    return won, lost


def table(folder: Path) -> str:
    """The markdown table (a first line on the all-token baseline, then one row per cell)."""
    by_cell = defaultdict(dict)
    with open(folder / "results.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            by_cell[r["method"]][r["extra"]["question_index"]] = r
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    base = summary["baseline"]
    acc0, n0 = base["accuracy"], base["n"]
    kinds = {k: round(v, 2) for k, v in base["by_kind"].items()}
    out = [f"All tokens: {acc0:.1%} ({round(acc0 * n0)}/{n0}), prefill {base['median_prefill_s']:.3f} s, vision "
           f"encoder {base['median_vision_encoder_s']:.3f} s; by kind {kinds}.", "",
           "| cell | visual tokens kept | accuracy (±1 SE) | share of full | prefill (s) | prefill speedup | "
           "LM FLOPs ratio | same answer as full | vs pooling, same budget (won/lost) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in summary["cells"]:
        a, n = c["accuracy"], c["n"]
        se = math.sqrt(a * (1 - a) / n)
        pool = by_cell.get(f"pooling:keep_ratio={c['budget']:g}")
        vs = "-" if pool is None or c["method"] == "pooling" else "%d/%d" % paired_against(by_cell[c["label"]], pool)
        out.append(f"| `{c['label']}` | {c['median_visual_tokens_kept']} | {a:.1%} ± {se:.1%} ({round(a * n)}/{n}) | "
                   f"{a / acc0:.0%} | {c['median_prefill_s']:.3f} | {c['prefill_speedup']:.2f}x | "
                   f"{c['flops_ratio']:.2f} | {c['agreement']:.0%} | {vs} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a vision-sweep output folder")
    print(table(p.parse_args(argv).folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
