"""Fit the MInference head patterns of smollm2-135m on train-split prose NIAH prompts; validate on the eval split."""
import sys
import time

import torch

import mmaccel
from mmaccel.data.haystack import HaystackTokens, make_niah_sample, stdlib_paragraphs
from mmaccel.longctx.minference import pattern_recall, search_patterns

torch.set_num_threads(1)
L = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
out = sys.argv[2] if len(sys.argv) > 2 else "/work/runs/minf/minference-smollm2-135m.json"
density = float(sys.argv[3]) if len(sys.argv) > 3 else 0.25
rows_at = sys.argv[4] if len(sys.argv) > 4 else "spread"  # "end": recall on the question's (last) rows
model, tok = mmaccel.load("smollm2-135m", device="cpu")
train = HaystackTokens(tok, " ".join(stdlib_paragraphs("train")))
cal = [torch.tensor([make_niah_sample(tok, L, d, seed=100 + i, haystack=train, chat_template=True).input_ids])
       for i, d in enumerate((0.25, 0.75))]
t = time.time()
pattern = search_patterns(model, cal, density=density, rows=128 if rows_at == "spread" else 64, rows_at=rows_at,
                          label="smollm2-135m",
                          found_by={"haystack": "stdlib docstrings, train split (mmaccel.data.stdlib_paragraphs('train'))",
                                    "prompts_kind": "NIAH, chat template, depths 0.25/0.75, seeds 100-101",
                                    "command": "python benchmarks/results/longctx/minference_smollm2_search/"
                                               f"search_smollm2.py {L} {out} {density} {rows_at}"})
print("search s", time.time() - t, pattern.kind_counts(), flush=True)
val = [torch.tensor([make_niah_sample(tok, L, d, seed=200 + i, chat_template=True).input_ids])
       for i, d in enumerate((0.5,))]
v = pattern_recall(model, pattern, val, rows=128 if rows_at == "spread" else 64, rows_at=rows_at)
v["haystack"] = "stdlib docstrings, eval split (the default NIAH haystack)"
v["prompts_kind"] = "NIAH, chat template, depth 0.5, seed 200"
pattern.validation = v
import numpy as np

pattern.found_by["calibration_recall"] = float(np.mean([x for r in pattern.recall for x in r]))
pattern.found_by["calibration_density"] = float(np.mean([x for r in pattern.density for x in r]))
print("validation", v, "cal", pattern.found_by["calibration_recall"], pattern.found_by["calibration_density"], flush=True)
pattern.save(out)
