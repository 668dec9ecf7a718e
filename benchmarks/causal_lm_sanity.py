"""Sanity checks of a causal LM for its model card: perplexity on held-out prose and a few greedy answers.

Perplexity is measured on the held-out split of the built-in prose (standard-library docstrings, digits removed;
:func:`mmaccel.data.haystack.stdlib_paragraphs`), cut into ``--windows`` non-overlapping windows of ``--tokens``
tokens, each scored on its own (no context carried over): ``exp(mean next-token negative log-likelihood)``.

Usage::

    python benchmarks/causal_lm_sanity.py --model smollm2-135m --out assets/models/smollm2-135m/sanity.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

PROMPTS = (
    "What is the capital of France?",
    "What is 12 plus 30?",
    "Name three primary colours.",
    "Translate 'good morning' into French.",
    "Write one sentence about the sea.",
)
# raw completions (no chat template): what a base model is checked with, and a second view of an instruct model
COMPLETIONS = (
    "The capital of France is",
    "def add(a, b):\n    return",
    "Water boils at a temperature of",
    "The opposite of hot is",
)


def perplexity(model, tokenizer, *, tokens: int, windows: int) -> dict:
    """Held-out prose perplexity over ``windows`` windows of ``tokens`` tokens (no BOS, no context carried over)."""
    from mmaccel.data.haystack import stdlib_paragraphs

    ids = tokenizer.encode(" ".join(stdlib_paragraphs("eval")), add_special_tokens=False)
    nll, count = 0.0, 0
    for w in range(windows):
        chunk = torch.tensor([ids[w * tokens:(w + 1) * tokens]])
        if chunk.shape[1] < 2:
            break
        with torch.inference_mode():
            logits = model(chunk).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return {"perplexity": math.exp(nll / count), "tokens_scored": count, "windows": windows,
            "window_tokens": tokens, "text": "held-out standard-library docstrings, digits removed"}


def greedy_answers(model, tokenizer, max_new_tokens: int = 40) -> list[dict]:
    """Greedy answers to :data:`PROMPTS`, through the chat template when the tokenizer has one."""
    out = []
    for prompt in PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append({"prompt": prompt, "answer": tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    return out


def greedy_completions(model, tokenizer, max_new_tokens: int = 12) -> list[dict]:
    """Greedy continuations of :data:`COMPLETIONS` as raw text (no chat template; the tokenizer's own BOS rule)."""
    out = []
    for prompt in COMPLETIONS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append({"prompt": prompt, "answer": tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    return out


def memory(model, rss_before: int, rss_after: int) -> dict:
    """Parameter bytes in fp32 and bf16 (unique tensors: tied weights count once) and the process's peak RSS (bytes)
    before and after the load (``ru_maxrss``; the load's own peak when nothing larger ran before it)."""
    n = sum(p.numel() for p in model.parameters())
    return {"parameters": n, "fp32_bytes": 4 * n, "bf16_bytes": 2 * n, "peak_rss_before_load_bytes": rss_before,
            "peak_rss_after_load_bytes": rss_after}


def _max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kibibytes on Linux


def main(argv=None) -> int:
    from mmaccel import load

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rss_before = _max_rss()
    model, tokenizer = load(args.model, device="cpu")
    rss_after = _max_rss()
    result = {
        "model": args.model,
        "device": f"cpu ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads",
        "dtype": str(next(model.parameters()).dtype),
        "perplexity": perplexity(model, tokenizer, tokens=args.tokens, windows=args.windows),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "greedy": greedy_answers(model, tokenizer),
        "completions": greedy_completions(model, tokenizer),
        "memory": memory(model, rss_before, rss_after),
    }
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
