"""Can ``smollm2-135m`` with LoRA learn the scene questions when the scene is given as text, not as visual tokens?

Every trained ``smol-llava`` answers "What color is the <shape>?" at or near chance among the colours present. This
control removes the vision side: each question's scene is written out as text ("The image shows: a small red square
in row 1, column 3; ..."; objects in a random order), and the same LM gets the same LoRA (rank 8, alpha 16, every
linear layer, lr 1e-3 with 20 warm-up steps and cosine decay to 10%, bf16 autocast) on the same questions
(``mmaccel.data.scenes.make_scene_qa``, train split, 5 per scene), batch 16, loss on the answer and EOS. Held-out:
the first 200 questions of the test split (the ones the trainer scores), greedy, first word exact.

    python studies/smol_llava_binding/scene_text_binding.py --steps 100 --threads 2 --out benchmarks/results/vision/smol_llava_caption_turn/text_binding.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from mmaccel.data.scenes import make_scene_qa
from mmaccel.models import load
from mmaccel.zoo.train.smol_llava import INSTRUCTION, LORA_TARGETS, first_word


def prompt(qa, rng: random.Random) -> str:
    """The ChatML prompt of one question, its scene described in text (objects shuffled by ``rng``)."""
    objs = list(qa.objects)
    rng.shuffle(objs)
    scene = "; ".join(f"a {o.size} {o.colour} {o.shape} in row {o.cell[0] + 1}, column {o.cell[1] + 1}" for o in objs)
    return (f"<|im_start|>user\nThe image shows: {scene}.\n{qa.question} {INSTRUCTION}<|im_end|>\n"
            f"<|im_start|>assistant\n")


@torch.no_grad()
def evaluate(model, tok, test) -> dict:
    """Held-out accuracy (first word exact), overall and by question kind."""
    model.eval()
    hits: dict[str, list[bool]] = {}
    for i in range(0, len(test), 25):
        qs = test[i:i + 25]
        enc = tok([prompt(q, random.Random(q.seed)) for q in qs], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=3, do_sample=False)
        for q, o in zip(qs, out[:, enc.input_ids.shape[1]:]):
            hits.setdefault(q.kind, []).append(first_word(tok.decode(o, skip_special_tokens=True)) == q.answer)
    model.train()
    every = [h for v in hits.values() for h in v]
    return {"accuracy": sum(every) / len(every), "n": len(every),
            "by_kind": {k: sum(v) / len(v) for k, v in hits.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load("smollm2-135m", device="cpu", dtype=torch.float32)
    tok.padding_side = "left"
    model.requires_grad_(False)
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                                       bias="none"), model)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    train = make_scene_qa(args.steps * args.batch_size, seed=0, split="train", per_scene=5)
    random.Random(1).shuffle(train)
    test = make_scene_qa(200, seed=0, split="test")
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    rng = random.Random(0)
    rows, t0 = [{"step": 0, **evaluate(model, tok, test)}], time.perf_counter()
    print(rows[-1], flush=True)
    for step in range(args.steps):
        lr = 1e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        qs = train[step * args.batch_size:(step + 1) * args.batch_size]
        enc = tok([prompt(q, rng) + q.answer + "<|im_end|>" for q in qs], return_tensors="pt", padding=True)
        labels = torch.full_like(enc.input_ids, -100)
        for i, q in enumerate(qs):
            n = len(tok(q.answer + "<|im_end|>").input_ids)
            labels[i, -n:] = enc.input_ids[i, -n:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**enc, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rows.append({"step": step + 1, "loss": loss.item(), "train_s": time.perf_counter() - t0,
                         **evaluate(model, tok, test)})
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"threads": args.threads, "batch_size": args.batch_size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
