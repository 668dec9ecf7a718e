"""The composed pipeline on ``smol-llava``: a visual-token method, a KV policy and speculative decoding, each alone
and all together, on the same prompts, through :func:`mmaccel.eval.compare_pieces` (one measured path).

Two settings:

- **lossless**: every piece at a lossless setting (``pooling:keep_ratio=1.0``, ``snapkv:ratio=1.0``, ``prompt_lookup``): each
  configuration's greedy output must equal the plain model's, token for token; the script records whether it does.
- **fast**: the pieces at their working settings (default ``pooling:keep_ratio=0.25``, ``snapkv:ratio=0.5``
  -- prefill-only eviction, whose cache the speculative engine can crop -- and ``prompt_lookup``): per configuration the vision-encoder, prefill and decode seconds and the ratios to the plain
  model in the same process, and whether the answer still equals the plain model's.

Prompts: held-out scene images (``mmaccel.data.scenes``) with a copy-heavy instruction ("repeat this sentence"), so
that decoding is long enough for speculative decoding to matter; the language model is SmolLM2-135M-Instruct as
fetched (only the projector is trained), so it follows text instructions.

Usage::

    python benchmarks/pipeline_smol_llava.py --threads 2 --n 6 --out benchmarks/results/pipeline/smol_llava.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

import mmaccel
from mmaccel.data.scenes import make_scene_qa
from mmaccel.eval import compare_pieces

SENTENCES = (
    "The red circle sits to the left of the blue square, and a small green triangle lies below them both.",
    "Every shape in this picture is drawn on a textured background, and each one has a colour and a size.",
    "A large yellow square is near the top of the image while two small purple circles are at the bottom.",
    "The scene shows a few simple objects: circles, squares and triangles in bright colours on a grey floor.",
    "Count the objects carefully, then name the colour of the largest one and the shape of the smallest one.",
    "Two triangles and one circle are visible; the circle is orange and both triangles are a light cyan.",
)


def prompts(n: int, seed: int = 0) -> list:
    """``n`` (image, question) pairs: held-out scenes with a sentence to repeat."""
    qas = make_scene_qa(n, seed=seed, split="test", per_scene=1)
    return [(qa.image, f"Repeat this sentence exactly: {SENTENCES[i % len(SENTENCES)]}") for i, qa in enumerate(qas)]


def run_setting(model, processor, pieces: dict, items: list, *, max_new_tokens: int, repeats: int) -> dict:
    """compare_pieces on every item; per configuration the median seconds and the ratios to ``plain``."""
    pipe = mmaccel.Pipeline(model, processor, **pieces)
    rows: dict = {}
    for image, question in items:
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            add_generation_prompt=True, tokenize=False)
        comparison = compare_pieces(pipe, text, images=image, max_new_tokens=max_new_tokens, repeats=repeats)
        plain = comparison.records[0]
        for record in comparison.records:
            row = rows.setdefault(record.method, {"same_as_plain": 0, "failed": 0, "n": 0, "vision_encoder_s": [],
                                                 "prefill_s": [], "decode_s": [], "total_s": [], "new_tokens": [],
                                                 "decode_s_per_token": [],
                                                 "mean_accepted_length": [], "kv_cache_bytes_final": []})
            row["n"] += 1
            if not record.ok:
                row["failed"] += 1
                row.setdefault("errors", []).append(record.error)
                continue
            row["same_as_plain"] += int(record.output_ids == plain.output_ids)
            total = (record.ttft_s or 0.0) + (record.decode_s or 0.0)  # TTFT includes the tower and the prefill
            for key, value in (("vision_encoder_s", record.vision_encoder_s), ("prefill_s", record.prefill_s),
                               ("decode_s", record.decode_s), ("total_s", total),
                               # decode seconds over all new tokens: answers differ in length between settings
                               ("decode_s_per_token", record.decode_s / max(record.new_tokens, 1)),
                               ("new_tokens", record.new_tokens),
                               ("kv_cache_bytes_final", record.kv_cache_bytes_final),
                               ("mean_accepted_length", record.telemetry.get("mean_accepted_length"))):
                if value is not None:
                    row[key].append(value)
    base = rows["plain"]
    for row in rows.values():
        for key in ("vision_encoder_s", "prefill_s", "decode_s", "total_s", "new_tokens", "mean_accepted_length",
                    "kv_cache_bytes_final", "decode_s_per_token"):
            values = row.pop(key)
            row[f"median_{key}"] = statistics.median(values) if values else None
        for key in ("prefill_s", "decode_s", "total_s", "decode_s_per_token"):
            a, b = base[f"median_{key}"], row[f"median_{key}"]
            row[f"speedup_{key}"] = a / b if a and b else None
        a, b = base["median_kv_cache_bytes_final"], row["median_kv_cache_bytes_final"]
        row["kv_bytes_vs_plain"] = b / a if a and b else None  # K/V held at the end, fraction of plain's
    return rows


def table(rows: dict) -> str:
    """Markdown table of one setting."""
    head = ("| configuration | same as plain | new tokens | vision s | prefill s | decode s | total s | prefill × "
            "| decode × per token | total × | K/V vs plain | accepted len |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    return head + "\n".join(
        f"| {label} | {r['same_as_plain']}/{r['n'] - r['failed']} | {f(r['median_new_tokens'], '.0f')} | "
        f"{f(r['median_vision_encoder_s'], '.3f')} | "
        f"{f(r['median_prefill_s'], '.3f')} | {f(r['median_decode_s'], '.3f')} | {f(r['median_total_s'], '.3f')} | "
        f"{f(r['speedup_prefill_s'], '.2f')} | {f(r['speedup_decode_s_per_token'], '.2f')} | "
        f"{f(r['speedup_total_s'], '.2f')} | "
        f"{f(r['kv_bytes_vs_plain'], '.2f')} | "
        f"{f(r['median_mean_accepted_length'], '.2f')} |" for label, r in rows.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smol-llava")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vision", default="pooling:keep_ratio=0.25")
    p.add_argument("--kv", default="snapkv:ratio=0.5")
    p.add_argument("--speculative", default="prompt_lookup")
    p.add_argument("--out", default="benchmarks/results/pipeline/smol_llava.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, processor = mmaccel.load(args.model)
    items = prompts(args.n)
    load_start = os.getloadavg()[0]
    lossless = run_setting(model, processor, {"vision": "pooling:keep_ratio=1.0", "kv": "snapkv:ratio=1.0",
                                              "speculative": args.speculative}, items,
                           max_new_tokens=args.max_new_tokens, repeats=1)
    fast = run_setting(model, processor, {"vision": args.vision, "kv": args.kv, "speculative": args.speculative},
                       items, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    result = {"model": args.model, "device": "cpu", "dtype": "float32", "threads": args.threads, "n": args.n,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "load_avg_1m": {"start": load_start, "end": os.getloadavg()[0]},
              "lossless": lossless, "fast": fast}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(f"## lossless settings\n\n{table(lossless)}\n\n## working settings\n\n"
                                      f"{table(fast)}\n")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
