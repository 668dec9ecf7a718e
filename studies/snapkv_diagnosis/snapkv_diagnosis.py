"""Why does SnapKV miss a needle that full attention finds? A per-layer and oracle study on one model.

``python studies/snapkv_diagnosis/snapkv_diagnosis.py [--model micro-lm] [--length 4096] [--depth 0.5] [--seeds 8] [--out FILE]``

SnapKV (Li et al., 2024, arXiv 2404.14469) rests on one premise: the attention the last ``window`` prompt tokens pay
predicts the attention the generated tokens will pay. This script measures, on NIAH samples that full attention
answers, where that premise breaks. Every condition runs greedy generation on the same samples (exact match):

- ``full`` and ``snapkv`` (every layer compressed), the two ends;
- ``snapkv layer L only``: one layer compressed, the others full -- which layer's eviction costs the answer;
- ``snapkv layer L only, budget B``: how many slots that layer needs;
- ``+ needle``: SnapKV's selection plus the needle's tokens in every layer (a selection that "found the needle");
- ``+ decode top-n``: SnapKV's selection plus, per query head, the ``n`` prompt positions that the answer tokens
  attend to most under full attention (an oracle that knows the decode-time attention).

If ``+ needle`` fails and ``+ decode top-n`` succeeds, the window does not predict what the answer tokens attend to
besides the needle. This is a quality study, not a speed benchmark; it takes about 3 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmaccel.data.haystack import make_niah_sample, score_answer
from mmaccel.longctx import SnapKV
from mmaccel.longctx.base import LayerStep
from mmaccel.models import load


@dataclass
class _SnapKVStudy(SnapKV):
    """SnapKV on a subset of layers, optionally forcing given positions (per query head) into the kept set.

    Uses SnapKV's own pieces: layers outside ``layers`` get a budget as large as the context (kept whole), and the
    forced positions get the largest window score before SnapKV pools them and averages them per GQA group.
    """

    layers: tuple | None = None  # None = every layer
    forced: dict = field(default_factory=dict)  # layer -> LongTensor [Hq, n] or [n] prompt positions

    def layer_budget(self, step: LayerStep) -> int:
        if self.layers is not None and step.layer_idx not in self.layers:
            return step.layer.cumulative_length
        return super().layer_budget(step)

    def window_scores(self, step: LayerStep) -> torch.Tensor:
        scores = super().window_scores(step)
        pos = self.forced.get(step.layer_idx)
        if pos is not None:
            pos = pos.to(scores.device).expand(scores.shape[1], -1)
            scores[0].scatter_(-1, pos, torch.finfo(scores.dtype).max)
        return scores


def _answer(model, tok, ids: list[int], method) -> str:
    inp = torch.tensor([ids])
    cache = method.make_cache(model) if method is not None else None
    try:
        with torch.no_grad():
            out = model.generate(
                inp, attention_mask=torch.ones_like(inp), past_key_values=cache, max_new_tokens=8, do_sample=False
            )
    finally:
        if cache is not None:
            cache.close()
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def _decode_attention(model_eager, tok, sample) -> dict[int, torch.Tensor]:
    """Per layer, [Hq, S, P]: the attention each of the ``S`` answer steps (teacher-forced; step 0 is the last prompt
    token) pays each prompt position."""
    prompt = len(sample.input_ids)
    ids = sample.input_ids + tok.encode(" " + sample.answer, add_special_tokens=False)
    with torch.no_grad():
        out = model_eager(torch.tensor([ids]), output_attentions=True)
    return {i: a[0, :, prompt - 1:, :prompt] for i, a in enumerate(out.attentions)}


def _in_needle(positions: torch.Tensor, needle: torch.Tensor) -> torch.Tensor:
    """Bool mask: which prompt ``positions`` fall inside the needle's contiguous span ``needle``."""
    return (positions >= needle[0]) & (positions <= needle[-1])


def _wrong_digit_positions(generated: list[str], expected: list[str]) -> list[int]:
    """Per answer position (1-based digit index), how many generated answers have a wrong (or missing) digit there."""
    counts = [0] * max(len(e) for e in expected)
    for text, answer in zip(generated, expected):
        digits = re.search(r"\d*", text).group(0)
        for i, want in enumerate(answer):
            counts[i] += i >= len(digits) or digits[i] != want
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="micro-lm")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the per-condition results as JSON here")
    args = ap.parse_args(argv)

    model, tok = load(args.model, device="cpu")
    model_eager, _ = load(args.model, device="cpu", attn_implementation="eager")
    n_layers = model.config.num_hidden_layers
    samples = [make_niah_sample(tok, args.length, args.depth, seed=s) for s in range(args.seeds)]
    snap = {"budget": args.budget, "window": args.window}

    results: dict[str, list[bool]] = {}
    answers: dict[str, list[str]] = {}

    def record(name: str, sample, method) -> None:
        text = _answer(model, tok, sample.input_ids, method)
        answers.setdefault(name, []).append(text.strip())
        results.setdefault(name, []).append(score_answer(text, sample.answer))

    for sample in samples:
        record("full", sample, None)
        record("snapkv", sample, SnapKV(**snap))
        for layer in range(n_layers):
            record(f"snapkv layer {layer} only", sample, _SnapKVStudy(**snap, layers=(layer,)))
    worst = min(range(n_layers), key=lambda i: sum(results[f"snapkv layer {i} only"]))
    budgets = [b for b in (512, 1024, 2048) if b < args.length]
    targets = {"layer": worst, "in_needle": 0, "total": 0, "distance_from_end": [], "per_step_in_needle": {}}
    for sample in samples:
        for budget in budgets:
            record(f"snapkv layer {worst} only, budget {budget}", sample,
                   _SnapKVStudy(budget=budget, window=args.window, layers=(worst,)))
        needle_len = len(tok.encode(" " + sample.needles[0].text(), add_special_tokens=False))
        needle = torch.arange(sample.needle_position, sample.needle_position + needle_len)
        record("snapkv + needle", sample, _SnapKVStudy(**snap, forced=dict.fromkeys(range(n_layers), needle)))
        decode = _decode_attention(model_eager, tok, sample)
        per_step = decode[worst].topk(4, dim=-1).indices  # [Hq, S, 4]
        for step in range(per_step.shape[1]):
            idx = per_step[:, step].flatten()
            row = targets["per_step_in_needle"].setdefault(step, [0, 0])
            row[0] += int(_in_needle(idx, needle).sum())
            row[1] += idx.numel()
        decode = {i: a.amax(1) for i, a in decode.items()}  # [Hq, P]: the most any answer step pays
        top4 = decode[worst].topk(4, dim=-1).indices.flatten()
        in_needle = _in_needle(top4, needle)
        targets["in_needle"] += int(in_needle.sum())
        targets["total"] += top4.numel()
        targets["distance_from_end"] += (len(sample.input_ids) - top4[~in_needle]).tolist()
        for n in (1, 4):
            forced = {i: a.topk(n, dim=-1).indices for i, a in decode.items()}
            record(f"snapkv + decode top-{n}", sample, _SnapKVStudy(**snap, forced=forced))
            record(f"snapkv layer {worst} only + decode top-{n}", sample,
                   _SnapKVStudy(**snap, layers=(worst,), forced={worst: forced[worst]}))

    print(f"{args.model}, {args.length} tokens, depth {args.depth}, {args.seeds} seeds, "
          f"snapkv budget {args.budget} window {args.window}")
    print("| condition | correct |\n| --- | ---: |")
    for name, hits in results.items():
        print(f"| {name} | {sum(hits)}/{len(hits)} |")
    wrong_digits = _wrong_digit_positions(answers["snapkv"], [s.answer for s in samples])
    print(f"layer {worst}, share of the top-4 positions per head in the needle, by answer step: "
          + ", ".join(f"{k}: {a}/{b}" for k, a, b in ((k, *v) for k, v in targets["per_step_in_needle"].items())))
    print(f"snapkv answers: {answers['snapkv']} (wrong digits per answer position: {wrong_digits})")
    dist = sorted(targets["distance_from_end"])
    median = dist[len(dist) // 2] if dist else None
    print(f"layer {worst}: {targets['in_needle']}/{targets['total']} of the answer tokens' top-4 positions per head "
          f"are in the needle; the others lie a median {median} tokens before the end of the prompt")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"args": vars(args), "results": results, "snapkv_answers": answers["snapkv"],
             "expected_answers": [s.answer for s in samples], "snapkv_wrong_digit_positions": wrong_digits,
             "worst_layer_decode_targets": {**targets, "median_distance_from_end": median,
                                            "distance_from_end": None}},
            indent=1,
        ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
