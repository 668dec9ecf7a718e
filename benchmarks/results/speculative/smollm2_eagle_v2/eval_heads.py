"""Evaluate EAGLE heads on one held-out split (the 86 answers of /tmp/eagle/data.pt), chain of 5."""
import json
import random
import sys

import torch

from mmaccel.models import load
from mmaccel.speculative.eagle import load_head
from mmaccel.zoo.train.eagle import evaluate

torch.set_num_threads(2)
model, tok = load("smollm2-135m"); model.eval()
ex = torch.load("/tmp/eagle/data.pt", weights_only=True)["examples"]
random.Random(2).shuffle(ex)
n_eval = max(1, int(0.05 * len(ex)))
ev, tr = ex[:n_eval], ex[n_eval:]
scale = float(torch.cat([e["features"] for e in tr[:64]]).std())
embed = model.get_input_embeddings()
V = model.config.vocab_size
out = {}
for path in sys.argv[1:]:
    head = load_head(path)
    ids = head.vocab_ids
    vi = torch.full((V,), -100, dtype=torch.long); vi[ids] = torch.arange(len(ids))
    lm = model.get_output_embeddings().weight.detach()[ids].float().contiguous()
    r = evaluate(head, embed, lm, ev, vi, steps=5, scale=scale)
    out[path] = r
    print(path, [round(a, 3) for a in r["acc"]], [round(a, 3) for a in r["acc_chain"]], round(r["mean_accepted_length"], 3), flush=True)
json.dump(out, open("/tmp/eagle/eval_heads.json", "w"), indent=1)
