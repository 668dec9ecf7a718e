"""Held-out scene QA of a built LLaVA from its float32 projector file and from the bfloat16 copy of it.

Both files are loaded by ``build_llava`` into float32 models (the stored dtype is cast at load), one after the other
in one process, and answer the same test questions greedily with the trainer's prompt and scoring (first word
exact, 4 new tokens, batches of 8). Prints and writes both accuracies, how many generated answers are identical, the
ones that differ, and every answer.

    python studies/half_precision_adapters/llava_scene_qa.py FP32.safetensors BF16.safetensors --n 200 --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

logger = logging.getLogger(__name__)


def _prompt_helpers():
    """``messages`` and ``first_word`` of the smol-llava trainer, wherever it lives in this checkout."""
    try:
        from mmaccel.zoo.train.smol_llava import first_word, messages
    except ImportError:  # the trainers move into mmaccel/zoo/
        from mmaccel.zoo.train.smol_llava import first_word, messages
    return messages, first_word


def answers(projector: str, qas, *, batch_size: int = 8, max_new_tokens: int = 4) -> list[str]:
    """Greedy answers of the built model of ``projector`` (float32, CPU) to ``qas``, as the trainer's
    ``evaluate_scene_qa`` generates them."""
    from mmaccel.models.loading import resolve_model_path
    from mmaccel.models.smol_llava import build_llava, read_projector_parts

    messages, _ = _prompt_helpers()
    parts = read_projector_parts(projector)
    vision, language = (resolve_model_path(parts[role]["name"]) for role in ("vision", "language"))
    model, processor = build_llava(vision, language, projector=projector, dtype=torch.float32)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError("the model is not float32 throughout")
    tok, out = processor.tokenizer, []
    with torch.no_grad():
        for i in range(0, len(qas), batch_size):
            chunk = qas[i:i + batch_size]
            texts = [processor.apply_chat_template(messages(q.question), add_generation_prompt=True, tokenize=False)
                     for q in chunk]
            inputs = processor(images=[q.image for q in chunk], text=texts, return_tensors="pt", padding=True)
            ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            out += [tok.decode(row, skip_special_tokens=True) for row in ids[:, inputs["input_ids"].shape[1]:]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fp32", help="the float32 projector file (e.g. from `git show COMMIT:PATH`)")
    ap.add_argument("bf16", help="its bfloat16 copy (to_bf16.py)")
    ap.add_argument("--n", type=int, default=200, help="test-split questions (the cards use 200)")
    ap.add_argument("--seed", type=int, default=0, help="make_scene_qa seed (the trainer's: 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="JSON record to write")
    args = ap.parse_args(argv)
    if args.n < 1 or args.threads < 1:
        ap.error("--n and --threads must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    from mmaccel.data.scenes import make_scene_qa

    _, first_word = _prompt_helpers()
    qas = make_scene_qa(args.n, seed=args.seed, split="test")
    texts, hits = {}, {}
    for key in ("fp32", "bf16"):
        t0 = time.perf_counter()
        texts[key] = answers(getattr(args, key), qas)
        hits[key] = [first_word(t) == q.answer for t, q in zip(texts[key], qas)]
        logger.info("%s (%s): %.1f%% of %d questions, %.0f s", key, getattr(args, key),
                    100 * sum(hits[key]) / len(qas), len(qas), time.perf_counter() - t0)
    pairs = list(zip(texts["fp32"], texts["bf16"]))
    record = {"n": args.n, "fp32": sum(hits["fp32"]) / args.n, "bf16": sum(hits["bf16"]) / args.n,
              "identical_answers": sum(a == b for a, b in pairs),
              "same_correctness": sum(a == b for a, b in zip(hits["fp32"], hits["bf16"])),
              "differ": [[i, a, b] for i, (a, b) in enumerate(pairs) if a != b],
              "texts_fp32": texts["fp32"], "texts_bf16": texts["bf16"]}
    logger.info("identical answers: %d of %d", record["identical_answers"], args.n)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
