"""KVzip's compress time on smollm2-135m at 2,048 tokens: column scores in query tiles (one softmax per tile, the
default since 2026-11-29) against the two-pass key blocks (the default before at this size), interleaved, three
repeats each, one process, 1 thread; prints the medians (seconds).

    python benchmarks/kvzip_scoring_time.py
"""
import statistics
import time

import torch

import mmaccel
import mmaccel.kernels.column_scores as cs
import mmaccel.longctx.kvzip as kz
from mmaccel.data.haystack import make_niah_sample
from mmaccel.longctx import compress

torch.set_num_threads(1)
model, tok = mmaccel.load("smollm2-135m", device="cpu")
ids = make_niah_sample(tok, 2048, 0.5, seed=1, chat_template=True).input_ids
ids = torch.tensor([ids])
orig = cs.attention_column_scores_reference
def old(q, k, **kw):
    return orig(q, k, block_size=1024, **kw) if q.shape[2] > 1 else orig(q, k, **kw)
times = {"tiles": [], "key_blocks": []}
for rep in range(3):
    for name in ("tiles", "key_blocks"):
        kz.attention_column_scores = (lambda q, k, **kw: orig(q, k, **kw)) if name == "tiles" else old
        t = time.perf_counter(); r = compress("kvzip:ratio=0.25", model, ids); times[name].append(time.perf_counter() - t)
        print(name, rep, round(times[name][-1], 1), flush=True)
print({k: round(statistics.median(v), 1) for k, v in times.items()})
