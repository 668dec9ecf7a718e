"""Print the markdown table of a ``mmaccel vision-sweep`` folder, recomputed from its records (``results.jsonl[.gz]``).

Recomputing with :func:`mmaccel.eval.vision_sweep.summarize_sweep` gives folders written before a summary field
existed (the standard error, the paired count against pooling) the current table.

    python benchmarks/vision_sweep_table.py benchmarks/results/vision/smol_llava_sweep_stage2

Raises ``FileNotFoundError`` when the folder has neither ``results.jsonl`` nor ``results.jsonl.gz``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from mmaccel.eval.sweep import read_records
from mmaccel.eval.vision_sweep import summarize_sweep, sweep_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a vision-sweep output folder")
    folder = p.parse_args(argv).folder
    gz = folder / "results.jsonl.gz"
    records = read_records(gz if gz.is_file() else folder / "results.jsonl")
    print(sweep_table(summarize_sweep(records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
