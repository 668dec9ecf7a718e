"""Does the model repeat its context when KVzip asks it to? Greedy next-token accuracy over a repeated 2k NIAH prompt,
fed as context + KVzip's instruction (+ chat suffix) + context in one forward.

    python studies/kvzip_gemma3/copy_accuracy.py gemma3-270m 2048
"""
import sys

import torch

from mmaccel.data.haystack import resolve_chat_template
from mmaccel.eval.niah import build_samples
from mmaccel.longctx.kvzip import _encode_prompts
from mmaccel.models import load

torch.set_num_threads(1)
name, length = sys.argv[1], int(sys.argv[2])
model, tok = load(name, device="cpu")
tok = getattr(tok, "tokenizer", tok)
(_, sample), = build_samples(tok, [length], [0.5], 1, chat_template=resolve_chat_template(tok, "auto"))
ctx = sample.input_ids
first, _, suffix = _encode_prompts(tok)
ids = torch.tensor([ctx + list(first) + list(suffix) + ctx])
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits[0]
start = len(ctx) + len(first) + len(suffix)
right = (logits[start - 1:start + len(ctx) - 1].argmax(-1) == ids[0, start:]).float()
print(f"{name}: chat suffix {tok.decode(list(suffix))!r}; copy accuracy {float(right.mean()):.4f} "
      f"(first 200 tokens {float(right[:200].mean()):.2f}, last 200 {float(right[-200:].mean()):.2f})")
