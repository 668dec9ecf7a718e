"""Frames vs exact peak and K/V held, from results.jsonl.xz: ``python plot.py`` -> curve.png."""
import json
import lzma
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
with lzma.open(HERE / "results.jsonl.xz", "rt") as f:
    rows = sorted((json.loads(line) for line in f), key=lambda r: r["extra"]["frames"])
frames = [r["extra"]["frames"] for r in rows]
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(frames, [r["peak_memory_bytes"] / 2**20 for r in rows], "o-", label="exact peak (allocator)")
ax.plot(frames, [r["kv_cache_bytes_final"] / 2**20 for r in rows], "s--", label="K/V held")
ax.set_xscale("log")
ax.set_ylim(0, None)
ax.set_xlabel("frames (streamed, pooled to 9 tokens each)")
ax.set_ylabel("MiB")
ax.set_title("smol-llava, StreamingLLM window 2,048: flat from 1k to 10k frames", fontsize=9)
ax.legend(loc="lower right")
fig.tight_layout()
fig.savefig(HERE / "curve.png", dpi=110)
