"""Score per pattern and source from the study's ruler folders, over the samples every configuration finished.

    python studies/calibration_transfer/table.py runs/calibration_transfer
"""
import collections
import json
import sys
from pathlib import Path

NAMES = {"pattern=smollm2-135m": "shipped training-free", "smollm2-135m-mix.json": "mix training-free",
         "pattern=smollm2-135m-gates": "shipped gates", "smollm2-135m-gates-mix.json": "mix gates"}


def label(method: str) -> str:
    if method == "full":
        return "full"
    return next(v for k, v in NAMES.items() if method.endswith(k))


root = Path(sys.argv[1])
for folder in ("train_prose", "eval_prose"):
    path = root / folder / "results.jsonl"
    if not path.exists():
        print(f"{folder}: not run yet")
        continue
    scores = collections.defaultdict(dict)  # sample -> label -> score
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["status"] == "ok":
            scores[r["cell_id"].split("|")[1]][label(r["method"])] = r["extra"]["score"]
    done = {s: v for s, v in scores.items() if len(v) == 5}
    tasks = sorted({s.split("/")[0] for s in done})
    print(f"\n{folder}: {len(done)} samples with all 5 configurations ({', '.join(tasks)})")
    print("| configuration | " + " | ".join(tasks) + " | mean |")
    print("|---" * (len(tasks) + 2) + "|")
    for name in ["full", *NAMES.values()]:
        cells = []
        for t in tasks:
            vals = [v[name] for s, v in done.items() if s.startswith(t + "/")]
            cells.append(f"{100 * sum(vals) / len(vals):.0f} (n={len(vals)})")
        allv = [v[name] for v in done.values()]
        print(f"| {name} | " + " | ".join(cells) + f" | {100 * sum(allv) / max(len(allv), 1):.0f} |")
