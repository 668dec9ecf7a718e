"""Speed-up over autoregressive decoding per prompt set and method, from a spec-bench folder: the aggregate
(total tokens / total seconds, spec-bench's `speedup`) as bars, each prompt's own ratio as dots; the dashed line is
transformers' best path on that set (its rows as shipped: the assistant the user gave it, no `quantize=`). Also
prints the ratio of each mmaccel method to that best path, aggregate and median over prompts, and, when the run has
`hf_assisted:...:quantize=int8` rows, to the best transformers row handed mmaccel's int8 draft (equal drafts).

    python benchmarks/results/speculative/qwen_coder_pair/plot.py benchmarks/results/speculative/qwen_coder_pair/run
"""
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

run = Path(sys.argv[1])
raw = run / "results.jsonl"
text = raw.read_text() if raw.exists() else gzip.decompress((run / "results.jsonl.gz").read_bytes()).decode()
recs = [json.loads(line) for line in text.splitlines()]
per = collections.defaultdict(dict)  # (set, prompt) -> method -> seconds
for r in recs:
    if r["status"] == "ok":
        per[(r["extra"]["prompt_set"], r["extra"]["prompt_id"])][r["method"]] = r["extra"]["total_s"]
sets = list(dict.fromkeys(s for s, _ in per))
methods = list(dict.fromkeys(r["method"] for r in recs if r["method"] != "full"))
fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
for ax, s in zip(axes[0], sets):
    prompts = [p for (t, p), m in per.items() if t == s and "full" in m and all(x in m for x in methods)]
    if not prompts:  # a set whose first prompt is still running
        continue
    agg = {m: sum(per[(s, p)]["full"] for p in prompts) / sum(per[(s, p)][m] for p in prompts) for m in methods}
    dots = {m: [per[(s, p)]["full"] / per[(s, p)][m] for p in prompts] for m in methods}
    hf = [m for m in methods if m.startswith("hf_")]
    shipped = [m for m in hf if "quantize=" not in m]
    best = max(shipped, key=agg.get)
    best_q = max(hf, key=agg.get)
    print(f"{s}: {len(prompts)} prompts; transformers' best path {best} {agg[best]:.2f}x; with the int8 draft too: "
          f"{best_q} {agg[best_q]:.2f}x")
    for m in methods:
        print(f"  {m}: {agg[m]:.2f}x over AR", end="")
        if m not in hf:
            for b in dict.fromkeys((best, best_q)):
                ratio = [per[(s, p)][b] / per[(s, p)][m] for p in prompts]
                print(f"; vs {b}: aggregate {agg[m] / agg[b]:.2f}x, median per prompt {statistics.median(ratio):.2f}x "
                      f"(min {min(ratio):.2f}, max {max(ratio):.2f})", end="")
        print()
    xs = range(len(methods))
    ax.bar(xs, [agg[m] for m in methods], color=["#999" if m in hf else "#3a7" for m in methods])
    for x, m in zip(xs, methods):
        ax.plot([x] * len(dots[m]), dots[m], "k.", ms=4)
    ax.axhline(agg[best], ls="--", c="#555", lw=1)
    if best_q != best:  # transformers handed the int8 draft: dotted
        ax.axhline(agg[best_q], ls=":", c="#555", lw=1)
    ax.axhline(1.0, c="k", lw=0.8)
    ax.set_xticks(list(xs), [m.replace(":", "\n", 1) for m in methods], fontsize=7, rotation=30, ha="right")
    ax.set_title(f"{s} ({len(prompts)} prompts)")
    ax.set_ylabel("speed-up over autoregressive decoding")
fig.suptitle("qwen2.5-coder-1.5b target, 0.5b draft, fp32 CPU, 2 threads, greedy, 64 new tokens")
fig.tight_layout()
fig.savefig(run / "speedup.png", dpi=110)
