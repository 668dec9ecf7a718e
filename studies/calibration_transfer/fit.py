"""Refit smollm2-135m's two retrieval-head patterns on the calibration mix, and write the haystack files of the study.

The shipped ``smollm2-135m`` (training-free) and ``smollm2-135m-gates`` (DuoAttention gates) patterns were fitted on
the default NIAH haystack, the eval split of the standard-library docstrings, which is also the haystack every NIAH
figure is measured on. This script fits the same two finders with the same settings on
:func:`mmaccel.data.haystack.calibration_haystacks` (the docstrings' train split and random-word sentences, taken
in turn), so that the eval split and RULER's haystacks are sources the new patterns never saw. It writes:

- ``OUT/smollm2-135m-mix.json`` and ``OUT/smollm2-135m-gates-mix.json`` (loadable as ``pattern=PATH``);
- ``--prose`` (default ``runs/calibration_transfer/fit_prose.txt``, not tracked: 1 MB): the train-split prose, to
  measure the patterns on their fitting source (``mmaccel niah --haystack``);
- ``OUT/fit.json``: wall times, threads and load average, and the overlap of old and new heads.

Usage::

    python studies/calibration_transfer/fit.py --out studies/calibration_transfer --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from mmaccel.data.haystack import stdlib_paragraphs
from mmaccel.longctx.duo_gates import find_retrieval_heads_by_gates
from mmaccel.longctx.head_finder import find_retrieval_heads
from mmaccel.longctx.head_pattern import load_head_pattern
from mmaccel.models import load


def overlap(a, b, fraction: float) -> dict:
    """Heads in common between two patterns at one ``fraction`` of (layer, KV head) pairs."""
    x = {tuple(h) for h in a.with_fraction(fraction).retrieval_heads}
    y = {tuple(h) for h in b.with_fraction(fraction).retrieval_heads}
    return {"fraction": fraction, "heads": len(x), "in_common": len(x & y), "jaccard": len(x & y) / max(len(x | y), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prose", type=Path, default=Path("runs/calibration_transfer/fit_prose.txt"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    args.prose.parent.mkdir(parents=True, exist_ok=True)
    args.prose.write_text(" ".join(stdlib_paragraphs("train")), encoding="utf-8")
    model, tok = load(args.model, device="cpu")
    record = {"model": args.model, "threads": args.threads}
    fits = {
        "mix": lambda: find_retrieval_heads(model, tok, lengths=(1024,), depths=(0.1, 0.5, 0.9), samples=2,
                                           copy_length=128, copy_samples=2, fraction=0.25, model_name=args.model),
        "gates-mix": lambda: find_retrieval_heads_by_gates(model, tok, lengths=(1024,), steps=args.steps,
                                                           fraction=0.25, model_name=args.model),
    }
    for suffix, fit in fits.items():
        start = time.perf_counter()
        pattern = fit()
        seconds = time.perf_counter() - start
        path = args.out / f"{args.model}-{suffix}.json"
        pattern.save(path)
        old = load_head_pattern(args.model + ("-gates" if suffix.startswith("gates") else ""))
        record[suffix] = {"path": path.name, "seconds": round(seconds, 1), "load_avg_1m": os.getloadavg()[0],
                          "haystacks": pattern.found_by["haystacks"],
                          "old_haystack": "stdlib docstrings, eval split (the finders' default then)",
                          "overlap_with_old": [overlap(pattern, old, f) for f in (0.1, 0.2, 0.25)]}
        print(json.dumps(record[suffix]), flush=True)
    (args.out / "fit.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
