"""Prefill speedup at 25% and 10% without, with, and again without prepacked linear layers, in one process
(30 held-out questions, 3 repeats). Usage: ``PYTHONPATH=. python run.py [OUT_DIR]`` (default ``runs/packed_prefill``);
writes each pass's sweep folder and ``summary.json`` there."""
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

import mmaccel
from mmaccel.eval.vision_sweep import vision_sweep
from mmaccel.kernels import PackedLinears

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/packed_prefill")
torch.set_num_threads(2)
model, proc = mmaccel.load("smol-llava", device="cpu")
model.eval()
out = {}
for tag in ("plain", "packed", "plain2"):
    t0 = time.perf_counter()
    with PackedLinears(model) if tag == "packed" else contextlib.nullcontext():
        r = vision_sweep(model, proc, methods=["prumerge", "visionzip"], budgets=[0.25, 0.1], n=30, repeats=3,
                         warmup=1, out_dir=out_dir / tag, progress=False)
    out[tag] = {"baseline_prefill_s": r.summary["baseline"]["median_prefill_s"],
                "acc": r.summary["baseline"]["accuracy"],
                "cells": {c["label"]: [c["median_prefill_s"], c["prefill_speedup"], c["accuracy"]]
                          for c in r.summary["cells"]},
                "seconds": time.perf_counter() - t0}
    print(tag, json.dumps(out[tag]), flush=True)
(out_dir / "summary.json").write_text(json.dumps(out, indent=1))
