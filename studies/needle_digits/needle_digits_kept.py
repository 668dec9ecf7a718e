"""Which of the needle's digits a KV-cache method keeps: per digit, the fraction of (layer, KV head) pairs holding it.

A study script for the NIAH misses on smollm2-135m, where compressed caches drop or change the answer's later digits.
One document (4k tokens by default), greedy generation through each method's cache, then the held positions of every
layer are read back (``layer.positions``, [B, Hkv, S]) after the answer was generated (so decode-time eviction
counts).

Usage::

    python studies/needle_digits/needle_digits_kept.py --methods h2o:ratio=0.5 snapkv:ratio=0.5 --out FILE.json

Writes ``{"document": {...}, "methods": {spec: {"output", "digit_kept_fraction"}}}``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import mmaccel
from mmaccel.data.haystack import make_niah_sample
from mmaccel.longctx import build_method


def needle_digit_positions(tokenizer, sample, input_ids: torch.Tensor) -> list[int]:
    """Positions in ``input_ids`` [1, L] of the tokens of ``sample``'s first needle that are digits."""
    needle = tokenizer.encode(" " + sample.needles[0].text(), add_special_tokens=False)
    span = range(sample.needle_position, sample.needle_position + len(needle))
    return [p for p in span if tokenizer.decode([input_ids[0, p]]).strip().isdigit()]


def digits_kept(model, tokenizer, spec: str, input_ids: torch.Tensor, digit_positions: list[int],
                max_new_tokens: int = 8) -> dict:
    """Generate greedily through ``spec``'s cache; return the output text and, per digit position, the fraction of
    (layer, KV head) pairs whose held slots include it.

    Raises
    ------
    ValueError
        If the method's cache has no per-slot ``positions`` (e.g. ``full`` or the attention-owning methods).
    """
    method = build_method(spec)
    with method.make_cache(model) as cache:
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)
        if not all(hasattr(layer, "positions") for layer in cache.layers):
            raise ValueError(f"{spec}: its cache layers hold no per-slot positions; pick an evicting method")
        held = torch.stack([torch.stack([(layer.positions[0] == p).any(-1) for p in digit_positions], -1)
                            for layer in cache.layers]).float()  # [L, Hkv, digits]
    return {"output": tokenizer.decode(out[0, input_ids.shape[1]:]),
            "digit_kept_fraction": [round(x, 3) for x in held.mean((0, 1)).tolist()]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["h2o:ratio=0.5", "snapkv:ratio=0.5"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depth", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = mmaccel.load(args.model, device="cpu")
    sample = make_niah_sample(tok, args.length, args.depth, seed=args.seed, chat_template=True)
    ids = torch.tensor([sample.input_ids])
    digits = needle_digit_positions(tok, sample, ids)
    result = {"document": {"model": args.model, "length": args.length, "depth": args.depth, "seed": args.seed,
                           "answer": sample.answer, "digit_positions": digits},
              "methods": {spec: digits_kept(model, tok, spec, ids, digits) for spec in args.methods}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
