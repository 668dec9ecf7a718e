"""Frames vs exact peak memory of the streamed video path (mmaccel.eval.video_niah.streamed_generate) on a tiny
random-weight LLaVA (CLIP tower 56 px, 16 visual tokens per frame; Llama 4 layers, hidden 128): the structure of the
streamed path at 1k-10k frames, where smol-llava's tower costs ~0.75 s a frame on this loaded 2-core CPU.

    python benchmarks/results/video/long_memory_curve_tiny/curve_tiny.py --frames 1000 2000 5000 10000 --out DIR

Each run: frames made a batch at a time (random pixels, seeded), pooled to 4 tokens per frame with contiguous
positions interpolated into 4,096 positions, prefilled in 256-token pieces, with the KV method given; peak = exact
torch CPU allocator bytes (PeakMemory(cpu_meter="allocator")). Writes DIR/curve.json.
"""
import argparse
import json
import time
from pathlib import Path

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from mmaccel.eval.memory import PeakMemory
from mmaccel.eval.video_niah import streamed_generate

PREFIX, SEP, SUFFIX = torch.tensor([1, 7, 8]), torch.tensor([9]), torch.tensor([20, 21, 22])


def model():
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              image_size=56, patch_size=14, projection_dim=64)
    text = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=5,
                                                     attn_implementation="sdpa")).eval()


def batches(n, batch=16):
    for start in range(0, n, batch):
        yield torch.randn(min(batch, n - start), 3, 56, 56, generator=torch.Generator().manual_seed(start))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    p.add_argument("--kv", nargs="+", default=["streaming:window=512:sink=4", "full"])
    p.add_argument("--full-up-to", type=int, default=2000, help="run the unbounded 'full' KV only up to this")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    m = model()
    rows = []
    for kv in args.kv:
        for n in args.frames:
            if kv == "full" and n > args.full_up_to:
                continue
            t0 = time.time()
            with PeakMemory(torch.device("cpu"), cpu_meter="allocator") as mem:
                run = streamed_generate(m, PREFIX, SEP, SUFFIX, batches(n), vision="pooling:keep_ratio=0.25"
                                        ":positions=contiguous", kv=kv, chunk=256, max_new_tokens=4, frames=n,
                                        position_limit=4096)
            rows.append({"kv": kv, "frames": n, "peak_bytes": mem.peak, "meter": mem.method,
                         "prompt_tokens": run.prompt_tokens, "visual_tokens_kept": run.visual_tokens_kept,
                         "kv_cache_bytes_final": run.kv_cache_bytes_final,
                         "position_scale": run.telemetry["position_scale"],
                         "last_position": run.telemetry["last_position"], "wall_s": round(time.time() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "curve.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
