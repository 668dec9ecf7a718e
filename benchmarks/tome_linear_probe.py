"""ToMe on the real dinov2-small: linear-probe accuracy on seeded scenes beside image throughput.

``python benchmarks/tome_linear_probe.py --out FILE.json [--schedules tome:r=8 tome:r=16] [--train 400 --test 200]
[--probes count shape colour size]``

A thin caller of :func:`mmaccel.eval.tome_sweep.tome_sweep` (the same as ``mmaccel tome-sweep``), which holds the
method: probes on scene attributes (object count; shape, colour and size of the top-left object) from disjoint
train/test seeds, features = [CLS] + size-weighted patch mean under each schedule, L-BFGS logistic regression per
schedule and attribute, interleaved throughput, and the cosine of pooled features to the unmerged model on held-out
clip frames. This script writes the summary to one JSON file and prints the table.

ToMe: Bolya et al., 2023, arXiv 2210.09461. DINOv2: Oquab et al., 2023, arXiv 2304.07193. A measurement script.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv=None) -> int:
    from mmaccel.eval.tome_sweep import DEFAULT_SCHEDULES, PROBES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES))
    parser.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--l2", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import mmaccel
    from mmaccel.eval.tome_sweep import tome_sweep, tome_table

    torch.set_num_threads(args.threads)
    model, image_processor = mmaccel.load("dinov2-small")
    result = tome_sweep(model.eval(), image_processor, args.schedules, train=args.train, test=args.test,
                        frames=args.frames, probes=args.probes, batch=args.batch, repeats=args.repeats, l2=args.l2)
    summary = {"model": "dinov2-small", **result.summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(tome_table(result.summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
