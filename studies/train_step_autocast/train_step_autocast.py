"""Seconds per smol-llava training step, fp32 against bf16 autocast (the number behind ``--autocast bf16``).

``python studies/train_step_autocast/train_step_autocast.py``: builds smol-llava's parts with LoRA rank 8, takes 3 batches of 6
five-question conversations, and times 3 optimizer steps in each mode, twice, alternating (the first fp32 round is the
warm-up). Run it on a quiet machine. 2026-11-27, 2-core AVX-512-BF16 CPU, 2 threads, nothing else running: fp32
6.65-6.73 s, bf16 4.55-4.68 s per step of [6, 294] tokens (1.45x).
"""
import time

import torch

from mmaccel.zoo.train.smol_llava import (
    BuildRecipe,
    _parts,
    add_lora,
    build_llava,
    cache_features,
    collate,
    freeze_all_but_projector,
    train_step,
    training_conversations,
)


def main() -> None:
    torch.set_num_threads(2)
    parts = _parts("dinov2-small", "smollm2-135m", None)
    model, processor = build_llava(parts["vision"]["path"], parts["language"]["path"], recipe=BuildRecipe(seed=0))
    groups = [{"params": freeze_all_but_projector(model)}, {"params": add_lora(model, 8, 16.0)}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    examples, images, order = training_conversations(processor, steps=3, batch_size=6, turns=5, per_scene=5,
                                                     single_object_steps=0, seed=0)
    features = cache_features(model, processor, images)
    pad = processor.tokenizer.pad_token_id
    for autocast in ["none", "bf16", "none", "bf16"]:
        times = []
        for step in range(3):
            batch = collate([examples[i] for i in order[step * 6:(step + 1) * 6]], pad)
            t = time.perf_counter()
            train_step(model, optimizer, batch, features, autocast=autocast)
            times.append(time.perf_counter() - t)
        print(autocast, tuple(batch["input_ids"].shape), " ".join(f"{x:.2f}" for x in times), "s/step", flush=True)


if __name__ == "__main__":
    main()
