"""Greedy outputs of smollm2-135m on tuning (held-out) and eval prompt sets, for replaying drafters offline.

Usage: python collect.py 128 greedy_outputs.jsonl
"""
import json
import sys

import torch

torch.set_num_threads(1)
import mmaccel
from mmaccel.eval.specbench import _encode, build_prompt_set

model, tok = mmaccel.load("smollm2-135m", device="cpu")
TUNE_FREE = [
    "Write a poem about autumn leaves falling in a quiet park.",
    "Explain what photosynthesis is and why it matters for life on Earth.",
    "List five tips for saving money on groceries and explain each one.",
    "Describe your ideal weekend in a small mountain village.",
    "How do vaccines train the immune system? Keep it simple.",
    "Write a short dialogue between a cat and a dog arguing about dinner.",
    "What is the difference between a list and a tuple in Python?",
    "Give a recipe for a simple tomato pasta sauce.",
]
out = []
sets = [("tune_free", [(_encode(tok, p, "", True)[1], "chat") for p in TUNE_FREE]),
        ("tune_copy", [(p.input_ids, p.task) for p in build_prompt_set(tok, "copy", n=9, chat_template=True, seed=1)]),
        ("eval_free", [(p.input_ids, p.task) for p in build_prompt_set(tok, "free", n=8, chat_template=True)]),
        ("eval_copy", [(p.input_ids, p.task) for p in build_prompt_set(tok, "copy", n=9, chat_template=True, seed=0)])]
N = int(sys.argv[1])
with open(sys.argv[2], "w") as f:
    for name, prompts in sets:
        for i, (ids, task) in enumerate(prompts):
            with torch.inference_mode():
                g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)
            rec = {"set": name, "i": i, "task": task, "prompt": ids[0].tolist(), "output": g[0, ids.shape[1]:].tolist()}
            f.write(json.dumps(rec) + "\n"); f.flush()
            print(name, i, len(rec["output"]), repr(tok.decode(rec["output"])[:80]), flush=True)
