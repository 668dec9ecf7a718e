"""The colour and motion questions at 64 frames: ``python kinds.py [SRC]`` reads ``SRC/f64_colour`` and
``SRC/f64_motion`` (default /work/runs/video2kinds; ``video-niah --kind colour|motion``, see README.md) and writes
``results_f64_kinds.jsonl.xz`` (every record) and ``kinds_table.md``: per method, correct / clips, and the most
frequent answers, beside the baseline of always giving the most frequent right answer."""
import collections
import json
import lzma
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work/runs/video2kinds")
records = []
for kind in ("colour", "motion"):
    for line in (src / f"f64_{kind}" / "results.jsonl").read_text().splitlines():
        records.append(json.loads(line))
with lzma.open(HERE / "results_f64_kinds.jsonl.xz", "wt", preset=9) as f:
    f.writelines(json.dumps(r) + "\n" for r in records)

lines = ["| question | method | correct / clips | most frequent outputs |", "|---|---|---|---|"]
for kind in ("colour", "motion"):
    rs = [r for r in records if r["extra"]["kind"] == kind]
    answers = collections.Counter(r["extra"]["answer"] for r in rs if r["method"] == rs[0]["method"])
    best, count = answers.most_common(1)[0]
    lines.append(f"| {kind} | always `{best}` (the most frequent right answer) | {count} / {sum(answers.values())} | - |")
    for method in dict.fromkeys(r["method"] for r in rs):
        mine = [r for r in rs if r["method"] == method]
        outs = collections.Counter(r["output_text"].strip().strip(".").lower()[:12] or "(empty)" for r in mine)
        top = ", ".join(f"`{o!r}` {n}" for o, n in outs.most_common(3))
        lines.append(f"| {kind} | `{method.replace(':positions=contiguous', '')}` | "
                     f"{sum(bool(r['extra']['correct']) for r in mine)} / {len(mine)} | {top} |")
(HERE / "kinds_table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
