"""Print the markdown table of a ``mmaccel vision-sweep`` folder, recomputed from its ``results.jsonl``.

Recomputing with :func:`mmaccel.eval.vision_sweep.summarize_sweep` gives folders written before a summary field
existed (the standard error, the paired count against pooling) the current table.

    python benchmarks/vision_sweep_table.py benchmarks/results/vision/smol_llava_sweep_stage2

Raises ``FileNotFoundError`` when the folder has no ``results.jsonl``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmaccel.eval.vision_sweep import summarize_sweep, sweep_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a vision-sweep output folder")
    folder = p.parse_args(argv).folder
    with open(folder / "results.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    print(sweep_table(summarize_sweep(records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
