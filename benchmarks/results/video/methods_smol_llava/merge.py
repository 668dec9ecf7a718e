"""Merge the video-method sweeps into one record folder: results.jsonl.xz, summary.json, table.md, methods.png.

``python merge.py OUT [SRC [TITLE]]``: every ``SRC/*/results.jsonl`` (default /work/runs/video2, one folder per frame
count). Peak memory: the median over the runs that measured it (with a shared vision encoding, only the first clip
of each frame count runs every method with its own encoding; the other records have ``peak_memory_bytes=None``).
"""
import json
import lzma
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
src = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/work/runs/video2")
title = sys.argv[3] if len(sys.argv) > 3 else "smol-llava video NIAH (number question), CPU"
out.mkdir(parents=True, exist_ok=True)
records = []
for folder in sorted(p for p in src.iterdir() if p.is_dir() and (p / "results.jsonl").exists() and p.name != "smoke"):
    for line in (folder / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        r["extra"]["sweep"] = folder.name
        records.append(r)
with lzma.open(out / "results.jsonl.xz", "wt", preset=9) as f:  # xz: the vision telemetry packs 15x smaller than gzip
    for r in records:
        f.write(json.dumps(r) + "\n")

def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

rows = {}
for r in records:
    key = (r["method"], r["extra"]["frames"], r["peak_memory_method"] if r["status"] == "ok" else None)
    rows.setdefault((r["method"], r["extra"]["frames"]), []).append(r)
summary = []
for (method, frames), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ok = [r for r in rs if r["status"] == "ok"]
    summary.append({
        "method": method, "frames": frames, "n": len(rs), "failed": len(rs) - len(ok),
        "correct": sum(bool(r["extra"].get("correct")) for r in ok),
        "visual_tokens": med([r["visual_tokens"] or r["extra"].get("visual_tokens_input") for r in ok]),
        "visual_tokens_kept": med([r["visual_tokens_kept"] if r["visual_tokens_kept"] is not None else r["extra"].get("visual_tokens_input") for r in ok]),
        "vision_encoder_s": med([r["vision_encoder_s"] for r in ok]), "prefill_s": med([r["prefill_s"] for r in ok]),
        "decode_s": med([r["decode_s"] for r in ok]),
        "peak_memory_bytes": med([r["peak_memory_bytes"] for r in ok]),
        "peak_memory_method": sorted({r["peak_memory_method"] for r in ok if r["peak_memory_bytes"] is not None}),
        "peak_memory_runs": sum(r["peak_memory_bytes"] is not None for r in ok),
        "shared_encoding_runs": sum("shared_vision_encoder_s" in (r.get("telemetry") or {}) for r in ok),
        "kv_cache_bytes_prefill": med([r["kv_cache_bytes_prefill"] for r in ok]),
        "kv_read_fraction": med([r["telemetry"].get("kv_read_fraction") for r in ok]),
        "sweeps": sorted({r["extra"]["sweep"] for r in rs}),
        "answers": [(r["extra"]["depth"], r["extra"]["trial"], r["extra"]["answer"], r["output_text"]) for r in ok],
    })
(out / "summary.json").write_text(json.dumps({"rows": summary, "runs": len(records)}, indent=1) + "\n")
fail = lambda s: f" ({s['failed']} failed)" if s["failed"] else ""
mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"
sec = lambda s: "-" if s is None else f"{s:.0f}"
lines = ["| method | frames | correct / clips | visual tokens kept | K/V read per step | vision enc. (s) | prefill (s) | decode (s) | peak (MiB) | meter (runs) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
for s in summary:
    kv = "-" if s["kv_read_fraction"] is None else f"{s['kv_read_fraction']:.2f}"
    meter = ", ".join("exact" if m == "cpu_allocator_profiled" else "RSS" for m in s["peak_memory_method"])
    meter += f" ({s['peak_memory_runs']} run{'s' if s['peak_memory_runs'] != 1 else ''})"
    lines.append(f"| `{s['method']}` | {s['frames']} | {s['correct']} / {s['n'] - s['failed']}"
                 f"{fail(s)} | {s['visual_tokens_kept']:.0f} / {s['visual_tokens']:.0f} | {kv} | "
                 f"{sec(s['vision_encoder_s'])} | {sec(s['prefill_s'])} | {s['decode_s']:.1f} | {mib(s['peak_memory_bytes'])} | {meter} |")
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(13, 1.6 + 0.32 * len(summary)), sharey=True)
labels = [f"{s['method'].replace(':positions=contiguous', '')} @{s['frames']}" for s in summary]
y = range(len(summary))
axes[0].barh(y, [s["visual_tokens_kept"] for s in summary], color="tab:blue")
axes[0].set_xlabel("visual tokens kept (median)")
axes[0].set_yticks(list(y), labels, fontsize=6)
for i, s in enumerate(summary):
    axes[0].text(s["visual_tokens_kept"], i, f" {s['correct']}/{s['n'] - s['failed']} correct", va="center", fontsize=6)
axes[1].barh(y, [(s["peak_memory_bytes"] or 0) / 2**20 for s in summary],
             color=["tab:green" if s["peak_memory_method"] == ["cpu_allocator_profiled"] else "tab:gray" for s in summary])
axes[1].set_xlabel("peak memory (MiB); green: exact allocator meter, grey: sampled RSS")
axes[0].invert_yaxis()
fig.suptitle(title, fontsize=9)
fig.tight_layout()
fig.savefig(out / "methods.png", dpi=110)
