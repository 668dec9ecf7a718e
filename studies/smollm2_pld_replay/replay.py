"""Offline replay of prompt lookup on smollm2-135m's greedy outputs: exact for greedy decoding (a drafter's proposals
depend only on committed tokens, and the committed tokens are the greedy output), so drafting policies are compared
without running the model. Cost of a step = measured relative cost of verifying k draft tokens (1 for k = 0).

Usage: python replay.py [COSTS]   (COSTS: comma-separated cost of verifying 1, 2, ... draft tokens)
Inputs: greedy_outputs.jsonl.gz (collect.py's output, gzipped: prompts and 128 greedy tokens of
smollm2-135m-instruct, 1 thread;
"tune_*" = 8 chat requests not in spec-bench + spec-bench copy set seed 1, used to shape the policy; "eval_*" =
spec-bench's free prompts and copy set seed 0). Each generation is cut to 64 new tokens as in the spec-bench runs.
"""
import gzip
import json
import sys
from pathlib import Path

import torch

from mmaccel.speculative.prompt_lookup import PromptLookup

HERE = Path(__file__).parent
RECORDS = [json.loads(line) for line in gzip.decompress((HERE / "greedy_outputs.jsonl.gz").read_bytes()).splitlines()]
# smollm2-135m, 1 thread, process time, context 256 (mmaccel.speculative.schedule.measure_verify_costs, loaded CPU)
CPU_TABLE = [1.183, 1.318, 1.736, 1.786, 1.85, 2.158, 2.147, 2.222, 2.498, 2.462, 2.533, 2.79, 2.838, 3.001, 2.137,
             2.202, 2.329, 2.27, 2.501, 2.31]


def replay(drafter, full, prompt_len, k_max, cost, new=64):
    full = full[: prompt_len + new]
    seq = torch.tensor([full])
    drafter.begin(None, None, None, None)
    T, spent, steps = prompt_len, 0.0, 0
    while T < len(full):
        k = min(k_max, len(full) - T - 1)
        draft = drafter.propose(seq[:, :T], torch.ones(1, T, dtype=torch.long), k, None).tokens[0].tolist() if k else []
        accepted = 0
        while accepted < len(draft) and draft[accepted] == full[T + accepted]:
            accepted += 1
        spent += cost(len(draft))
        steps += 1
        T += accepted + 1
    return len(full) - prompt_len, spent, steps


def main():
    table = [float(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else CPU_TABLE
    cost = lambda k: 1.0 if k == 0 else table[min(k, len(table)) - 1]
    policies = [
        ("classic PLD (max_ngram=3, k=10)", lambda: PromptLookup(max_ngram=3, verify_cost=0, extend=False), 10),
        ("adaptive, linear 0.15, k=10", lambda: PromptLookup(), 10),
        ("adaptive, linear 0.15, k=16", lambda: PromptLookup(), 16),
        ("adaptive, measured table, k=16", lambda: PromptLookup(verify_costs=table), 16),
    ]
    sets = ["tune_free", "tune_copy", "eval_free", "eval_copy"]
    print("| policy | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for label, make, k in policies:
        cells = []
        for s in sets:
            n = spent = steps = 0
            for r in RECORDS:
                if r["set"] == s:
                    a, b, c = replay(make(), r["prompt"] + r["output"], len(r["prompt"]), k, cost)
                    n, spent, steps = n + a, spent + b, steps + c
            cells.append(f"{n / spent:.2f}x ({n / steps:.2f} tok/fwd)")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
