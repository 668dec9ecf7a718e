"""KVzip's reconstruction scores on one 4k NIAH document: per layer and KV head, the rank of each needle-value token
among the held slots, the score quantiles, and which needle tokens a global ranking keeps at 25%, 50%, 75%.

    python studies/kvzip_gemma3/kvzip_scores.py gemma3-270m 4096 0.55
"""
import sys
import time

import torch

from mmaccel.data.haystack import resolve_chat_template
from mmaccel.eval.niah import build_samples
from mmaccel.longctx import build_method
from mmaccel.models import load

torch.set_num_threads(1)
name, length, depth = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
model, tok = load(name, device="cpu")
tok = getattr(tok, "tokenizer", tok)
(_, sample), = build_samples(tok, [length], [depth], 1, chat_template=resolve_chat_template(tok, "auto"))
seq = sample.input_ids
value = tok.encode(sample.answer, add_special_tokens=False)
at = next(p for p in range(sample.needle_position, len(seq)) if seq[p:p + len(value)] == value)
print(f"needle value {sample.answer!r} at tokens {at}..{at + len(value) - 1}")
cache = build_method("kvzip:ratio=1.0").make_cache(model, tokenizer=tok)  # scores every slot, evicts nothing
start = time.time()
with torch.no_grad():
    model(input_ids=torch.tensor([seq]), past_key_values=cache, use_cache=True, logits_to_keep=1)
print(f"prefill + reconstruction {time.time() - start:.0f} s")
layers = [(i, l) for i, l in enumerate(cache.layers) if "kvzip" in getattr(l, "slot_state", {})]
for i, layer in layers:
    for h, row in enumerate(layer.slot_state["kvzip"][0].float()):
        finite = row[~torch.isinf(row)]
        rank = torch.empty_like(row, dtype=torch.long)
        rank[row.masked_fill(torch.isinf(row), 1e9).argsort(descending=True)] = torch.arange(len(row))
        q = torch.quantile(finite, torch.tensor([0.1, 0.5, 0.9]))
        print(f"layer {i} KV head {h}: needle ranks {[int(rank[p]) for p in range(at, at + len(value))]} of "
              f"{len(row)}; scores 10/50/90% {[f'{float(x):.3g}' for x in q]}; >= 0.5: "
              f"{float((finite >= 0.5).float().mean()):.2f}")
flat = torch.cat([l.slot_state["kvzip"][0].float().flatten() for _, l in layers])
for ratio in (0.25, 0.5, 0.75):
    threshold = float(flat.topk(int(ratio * flat.numel())).values[-1])
    kept = {i: int((l.slot_state["kvzip"][0, :, at:at + len(value)] >= threshold).sum()) for i, l in layers}
    print(f"global ranking at {ratio}: threshold {threshold:.3g}; needle tokens kept per layer {kept} "
          f"(of {len(value)} x KV heads)")
cache.close()
