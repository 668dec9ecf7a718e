"""DuoAttention's optimization-based head finder on a real model, timed, and compared with the training-free finder.

Runs :func:`mmaccel.longctx.duo_gates.find_retrieval_heads_by_gates` on ``smollm2-135m`` (frozen; per-KV-head gates
trained on synthetic passkey documents), writes the pattern as ``mmaccel/longctx/head_patterns/<model>-gates.json``
(loadable as ``retrieval_heads:pattern=<model>-gates``) and reports, in a JSON file:

- the wall time of the search (seconds) with the threads and the 1-minute load average, against the issue's budget
  of 30 minutes on 2 CPU cores;
- the overlap of the heads it marks with those of the training-free pattern (``<model>.json``) at equal fraction:
  the count in common, the Jaccard index, and the Spearman rank correlation of the two score tables.

Accuracy at equal memory is measured afterwards with ``mmaccel niah`` on both patterns (see the note in the
results README).

Usage::

    python studies/duo_gates_smollm2/duo_gates_smollm2.py --threads 2 --steps 40 --out studies/duo_gates_smollm2/duo_gates_smollm2.json
    python studies/duo_gates_smollm2/duo_gates_smollm2.py --length 4096 --steps 24 --pattern-name smollm2-135m-gates-4k \
        --out studies/duo_gates_smollm2/duo_gates_smollm2_4k.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from mmaccel.longctx.duo_gates import find_retrieval_heads_by_gates
from mmaccel.longctx.head_pattern import load_head_pattern
from mmaccel.models import load

PATTERNS = Path(__file__).resolve().parents[1] / "mmaccel" / "longctx" / "head_patterns"


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two equally shaped score tables (ties broken by position)."""
    ra = a.flatten().argsort().argsort().double()
    rb = b.flatten().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def compare_patterns(found, reference, fraction: float) -> dict:
    """Heads in common between two head patterns at the same ``fraction`` of (layer, KV head) pairs."""
    a = {tuple(h) for h in found.with_fraction(fraction).retrieval_heads}
    b = {tuple(h) for h in reference.with_fraction(fraction).retrieval_heads}
    return {"fraction": fraction, "heads": len(a), "in_common": len(a & b), "jaccard": len(a & b) / max(len(a | b), 1),
            "spearman": rank_correlation(torch.tensor(found.scores), torch.tensor(reference.scores))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--out", default="studies/duo_gates_smollm2/duo_gates_smollm2.json")
    p.add_argument("--pattern-name", help="name of the written pattern (default <model>-gates, the shipped one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    pattern = find_retrieval_heads_by_gates(model, tokenizer, lengths=(args.length,), steps=args.steps,
                                            fraction=args.fraction, model_name=args.model)
    wall = time.perf_counter() - t0
    path = pattern.save(PATTERNS / f"{args.pattern_name or args.model + '-gates'}.json")
    reference = load_head_pattern(args.model)
    result = {
        "model": args.model, "device": "cpu", "threads": args.threads, "steps": args.steps, "length": args.length,
        "wall_time_s": wall, "budget_s": 30 * 60, "within_budget": wall <= 30 * 60,
        "load_avg_1m": {"start": load_before, "end": os.getloadavg()[0]},
        "pattern": str(path.relative_to(PATTERNS.parents[2])),
        "final_distill_loss": pattern.found_by["distill_loss"][-1],
        "overlap": [compare_patterns(pattern, reference, f) for f in (0.1, 0.25, 0.5)],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
