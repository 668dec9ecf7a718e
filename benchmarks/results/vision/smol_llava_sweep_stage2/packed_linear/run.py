"""Prefill speedup at 25% with and without prepacked linear layers, one process (n=30, repeats 3)."""
import json, sys, time
import torch
import mmaccel
from mmaccel.eval.vision_sweep import vision_sweep
from mmaccel.kernels import PackedLinears
torch.set_num_threads(2)
model, proc = mmaccel.load("smol-llava", device="cpu")
model.eval()
out = {}
for tag in ("plain", "packed", "plain2"):
    ctx = PackedLinears(model) if tag == "packed" else None
    if ctx: ctx.__enter__()
    t0 = time.perf_counter()
    r = vision_sweep(model, proc, methods=["prumerge", "visionzip"], budgets=[0.25, 0.1], n=30, repeats=3, warmup=1,
                     out_dir=f"/tmp/s30/packed/{tag}", progress=False)
    if ctx: ctx.__exit__(None, None, None)
    out[tag] = {"baseline_prefill_s": r.summary["baseline"]["median_prefill_s"], "acc": r.summary["baseline"]["accuracy"],
                "cells": {c["label"]: [c["median_prefill_s"], c["prefill_speedup"], c["accuracy"]] for c in r.summary["cells"]},
                "seconds": time.perf_counter() - t0}
    print(tag, json.dumps(out[tag]), flush=True)
json.dump(out, open("/tmp/s30/packed/summary.json", "w"), indent=1)
