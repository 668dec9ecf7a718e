"""Why H2O and KNorm answer 0/N on smollm2-135m NIAH: what each keeps, and the needle's fate.

One 4k NIAH document per depth (chat template, built-in haystack), greedy answer through each method's cache; after
the answer, every layer's held positions (``layer.positions`` [1, Hkv, S]) are read back and summarised per method:
the fraction of (layer, KV head) pairs that hold the needle's digits, the first 4 tokens (sinks), the question
(the prompt's tail after the haystack) and the answer prefix (the last 8 tokens); the share of kept slots in each
fifth of the prompt; and, for H2O, how its prefill score (attention summed over every causal query) depends on
position. Control: SnapKV at the same ratio.

Not run yet (written this session; its run never got CPU time on the loaded machine).

Usage::

    python benchmarks/results/longctx/calib_h2o_knorm/diagnose.py --methods h2o:ratio=0.25 knorm:ratio=0.25 \
        snapkv:ratio=0.25 --depths 0.25 0.5 --out benchmarks/results/longctx/calib_h2o_knorm/diagnosis.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import mmaccel
from mmaccel.data.haystack import make_niah_sample
from mmaccel.longctx import build_method


def digit_positions(tokenizer, sample, ids: torch.Tensor) -> list[int]:
    """Positions in ``ids`` [1, L] of the digit tokens of ``sample``'s needle."""
    needle = tokenizer.encode(" " + sample.needles[0].text(), add_special_tokens=False)
    span = range(sample.needle_position, sample.needle_position + len(needle))
    return [p for p in span if tokenizer.decode([ids[0, p]]).strip().isdigit()]


def held_fraction(layers, positions: list[int]) -> float:
    """Mean over (layer, KV head) of the fraction of ``positions`` held."""
    want = torch.tensor(positions)
    fr = [torch.isin(want, layer.positions[0, h]).float().mean() for layer in layers
          for h in range(layer.positions.shape[1])]
    return round(float(torch.stack(fr).mean()), 3)


def run(model, tok, spec: str, ids: torch.Tensor, parts: dict) -> dict:
    method = build_method(spec)
    L = ids.shape[1]
    with method.make_cache(model) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
        layers = list(cache.layers)
        kept = {name: held_fraction(layers, pos) for name, pos in parts.items()}
        allpos = torch.cat([layer.positions[0].flatten() for layer in layers])
        allpos = allpos[allpos < L]
        fifths = torch.bincount((allpos * 5 // L).clamp(max=4), minlength=5).float()
        kept["slots_per_fifth_of_prompt"] = [round(x, 3) for x in (fifths / fifths.sum()).tolist()]
    return {"output": tok.decode(out[0, L:]), "held": kept}


def h2o_prefill_profile(model, ids: torch.Tensor, layer_idx: int = 15) -> list[float]:
    """H2O's prefill score (attention received, summed over every causal query, mean over heads) of layer
    ``layer_idx``, averaged over each tenth of the prompt (the sink excluded), normalised to the last tenth."""
    from mmaccel.longctx.h2o import H2O

    method = H2O(ratio=1.0)
    with method.make_cache(model) as cache:
        model(ids, past_key_values=cache, use_cache=True)
        score = cache.layers[layer_idx].slot_state["attention"][0].mean(0)  # [S]
    L = score.shape[0]
    tenths = [float(score[max(4, i * L // 10):(i + 1) * L // 10].mean()) for i in range(10)]
    return [round(t / tenths[-1], 2) for t in tenths]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = mmaccel.load(args.model, device="cpu")
    docs = []
    for depth in args.depths:
        sample = make_niah_sample(tok, args.length, depth, seed=args.seed, chat_template=True)
        ids = torch.tensor([sample.input_ids])
        L = ids.shape[1]
        q_start = sample.needle_position + 1
        # the question: from the end of the last haystack sentence to the end; found as the last "?" span's start
        text = [tok.decode([t]) for t in sample.input_ids]
        user_end = max(i for i, t in enumerate(text) if "<|im_end|>" in t)
        q_start = max(i for i in range(user_end) if "." in text[i]) + 1  # after the haystack's last sentence
        parts = {"needle_digits": digit_positions(tok, sample, ids), "sinks": list(range(4)),
                 "question": list(range(q_start, user_end)), "answer_prefix": list(range(L - 8, L))}
        doc = {"depth": depth, "answer": sample.answer, "length": L,
               "question_tokens": "".join(text[q_start:user_end]), "answer_prefix": "".join(text[L - 8:]),
               "h2o_prefill_score_by_tenth": h2o_prefill_profile(model, ids),
               "methods": {spec: run(model, tok, spec, ids, parts) for spec in args.methods}}
        print(json.dumps(doc, indent=1), flush=True)
        docs.append(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "seed": args.seed, "documents": docs}, indent=1),
                        encoding="utf-8")


if __name__ == "__main__":
    main()
