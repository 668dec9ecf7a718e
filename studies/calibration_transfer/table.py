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

# Transfer: the three essay-haystack tasks on both sources (niah_single_1 is on the noise haystack, in eval_prose only)
SHARED = ("niah_multikey_1", "niah_multivalue", "niah_single_2")
FIT = {"shipped training-free": "eval_prose", "shipped gates": "eval_prose", "mix training-free": "train_prose",
       "mix gates": "train_prose"}
means = {}
for folder in ("train_prose", "eval_prose"):
    path = root / folder / "results.jsonl"
    if not path.exists():
        continue
    scores = collections.defaultdict(dict)
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["status"] == "ok":
            scores[r["cell_id"].split("|")[1]][label(r["method"])] = r["extra"]["score"]
    done = {s: v for s, v in scores.items() if len(v) == 5 and s.split("/")[0] in SHARED}
    for name in ["full", *NAMES.values()]:
        vals = [v[name] for v in done.values()]
        means[name, folder] = (100 * sum(vals) / max(len(vals), 1), len(vals))
if len({f for _, f in means}) == 2:
    print("\nTransfer on the three essay-haystack tasks (RULER score, percent; n samples per source):")
    print("| pattern | fitted on | score on its fitting source | held out | difference | vs full, fitting | "
          "vs full, held out |")
    print("|---|---|---|---|---|---|---|")
    for name, fit in FIT.items():
        held = "train_prose" if fit == "eval_prose" else "eval_prose"
        (a, n1), (b, n2) = means[name, fit], means[name, held]
        fa, fb = means["full", fit][0], means["full", held][0]
        print(f"| {name} | {fit} | {a:.0f} (n={n1}) | {b:.0f} (n={n2}) | {b - a:+.0f} | {a - fa:+.0f} | {b - fb:+.0f} |")
    print(f"| full | - | eval_prose {means['full', 'eval_prose'][0]:.0f} | train_prose "
          f"{means['full', 'train_prose'][0]:.0f} | | | |")
