"""Frames vs exact peak memory of the streamed video path (mmaccel.eval.video_niah.streamed_generate) on a tiny
random-weight LLaVA (CLIP tower 56 px, 16 visual tokens per frame; Llama 4 layers, hidden 128): the structure of the
streamed path at 1k-10k frames, where smol-llava's tower costs ~0.75 s a frame on this loaded 2-core CPU.

    python benchmarks/results/video/long_memory_curve_tiny/curve_tiny.py --frames 1000 2000 5000 10000 --out DIR
    python benchmarks/results/video/long_memory_curve_tiny/curve_tiny.py --summarize DIR --record RECORD_DIR

Each run: frames made a batch at a time (random pixels, seeded), pooled to 4 tokens per frame with contiguous
positions interpolated into 4,096 positions, prefilled in 256-token pieces, with the KV method given; peak = exact
torch CPU allocator bytes (PeakMemory(cpu_meter="allocator"), its profiler re-armed between frame batches through
PeakMemory.checkpointed, so the meter's own memory does not grow with the frames). Each run writes
DIR/run_<kv>_<frames>.json (one JSON row; a run already there is skipped, so several processes can share DIR and a
killed sweep resumes); process_max_rss_bytes is the process's maximum RSS when the run ended (ru_maxrss: run one
frame count per process to read it per run). --summarize gathers DIR's rows into RECORD_DIR/records.jsonl.gz,
summary.json and peak_vs_frames.png.
"""
import argparse
import gzip
import json
import resource
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


def run_name(kv, n):
    """The record file of one (KV method, frames) run."""
    return f"run_{kv.replace(':', '_').replace('=', '')}_{n}.json"


def summarize(runs: Path, record: Path):
    """Gather the run rows into ``record``: records.jsonl.gz, summary.json and peak_vs_frames.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((json.loads(f.read_text()) for f in runs.glob("run_*.json")), key=lambda r: (r["kv"], r["frames"]))
    record.mkdir(parents=True, exist_ok=True)
    with gzip.open(record / "records.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = {}
    for kv in dict.fromkeys(r["kv"] for r in rows):
        mine = [r for r in rows if r["kv"] == kv]
        summary[kv] = {"frames": [r["frames"] for r in mine], "peak_bytes": [r["peak_bytes"] for r in mine],
                       "peak_ratio_to_fewest_frames": [round(r["peak_bytes"] / mine[0]["peak_bytes"], 4)
                                                       for r in mine],
                       "process_max_rss_bytes": [r.get("process_max_rss_bytes") for r in mine],
                       "meter_windows": [r.get("meter_windows") for r in mine],
                       "meter_window_events_max": [r.get("meter_window_events_max") for r in mine]}
    (record / "summary.json").write_text(json.dumps(summary, indent=1))
    fig, ax = plt.subplots(figsize=(6, 4))
    for kv, s in summary.items():
        ax.plot(s["frames"], [b / 2**20 for b in s["peak_bytes"]], "o-", label=f"{kv}: exact peak (tensor bytes)")
        ax.plot(s["frames"], [(b or 0) / 2**20 for b in s["process_max_rss_bytes"]], "x--", alpha=0.6,
                label=f"{kv}: process max RSS")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("frames")
    ax.set_ylabel("MiB")
    ax.set_title("Streamed video path, tiny random LLaVA (CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(record / "peak_vs_frames.png", dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    p.add_argument("--kv", nargs="+", default=["streaming:window=512:sink=4", "full"])
    p.add_argument("--full-up-to", type=int, default=2000, help="run the unbounded 'full' KV only up to this")
    p.add_argument("--out", type=Path, help="folder of the per-run rows")
    p.add_argument("--summarize", type=Path, help="folder of per-run rows to gather into --record")
    p.add_argument("--record", type=Path, help="record folder written by --summarize")
    args = p.parse_args()
    if args.summarize:
        if not args.record:
            p.error("--summarize needs --record")
        return summarize(args.summarize, args.record)
    if not args.out:
        p.error("--out is required")
    torch.set_num_threads(1)
    m = model()
    for kv in args.kv:
        for n in args.frames:
            path = args.out / run_name(kv, n)
            if (kv == "full" and n > args.full_up_to) or path.exists():
                continue
            t0 = time.time()
            with PeakMemory(torch.device("cpu"), cpu_meter="allocator") as mem:
                run = streamed_generate(m, PREFIX, SEP, SUFFIX, mem.checkpointed(batches(n)),
                                        vision="pooling:keep_ratio=0.25:positions=contiguous", kv=kv, chunk=256,
                                        max_new_tokens=4, frames=n, position_limit=4096)
            row = {"kv": kv, "frames": n, "peak_bytes": mem.peak, "meter": mem.method,
                   "meter_windows": mem.windows, "meter_window_events_max": mem.window_events_max,
                   "process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "prompt_tokens": run.prompt_tokens, "visual_tokens_kept": run.visual_tokens_kept,
                   "kv_cache_bytes_final": run.kv_cache_bytes_final, "output_ids": run.output_ids,
                   "position_scale": run.telemetry["position_scale"],
                   "last_position": run.telemetry["last_position"], "wall_s": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
