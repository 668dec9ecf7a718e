"""Held-out captions of a ``smol-llava`` projector trained with ``--caption``: does the model name each object right?

Asks :data:`mmaccel.zoo.train.smol_llava.CAPTION_PROMPT` about the test-split scenes of the trainer's evaluation
(``make_scene_qa(N, seed=0, split="test")``), greedy, and compares the answer with
:func:`mmaccel.data.scenes.describe_scene`: the whole caption (exact), and the share of the scene's objects whose
"a <size> <colour> <shape>" phrase appears among the answer's comma-separated items.

    python studies/smol_llava_binding/smol_llava_caption_eval.py --projector DIR/projector.safetensors --scenes 60 --out FILE.json
"""
from __future__ import annotations

import argparse
import json

import torch

from mmaccel.data.scenes import describe_scene, make_scene_qa
from mmaccel.models.smol_llava import build_llava
from mmaccel.zoo.train import smol_llava as tr


def items(caption: str) -> list[str]:
    """The comma-separated object phrases of a caption."""
    return [x.strip() for x in caption.strip().rstrip(".").split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--projector", required=True)
    p.add_argument("--scenes", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    parts = tr._parts("dinov2-small", "smollm2-135m", None)
    model, proc = build_llava(parts["vision"]["path"], parts["language"]["path"], projector=args.projector)
    model.eval()
    proc.tokenizer.padding_side = "left"
    qas = make_scene_qa(args.scenes, seed=0, split="test")
    exact = named = total = 0
    samples = []
    for i in range(0, len(qas), 10):
        batch = qas[i:i + 10]
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": tr.CAPTION_PROMPT}]}]
        text = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        enc = proc(images=[q.image for q in batch], text=[text] * len(batch), return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=40, do_sample=False)
        for q, o in zip(batch, out[:, enc["input_ids"].shape[1]:]):
            got, want = proc.tokenizer.decode(o, skip_special_tokens=True).strip(), describe_scene(q.objects)
            exact += got == want
            total += len(items(want))
            named += sum(x in items(got) for x in items(want))
            samples.append({"want": want, "got": got})
    result = {"projector": args.projector, "scenes": len(qas), "exact_caption": exact / len(qas),
              "objects_named_right": named / total, "samples": samples[:8]}
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
