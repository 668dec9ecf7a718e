"""Speculative decoding on smollm2-135m timed in CPU time (process time, 1 torch thread) as well as wall time.

On a shared CPU the wall time of a run depends on what else runs; the process time of a one-thread run is the work
it did, so ratios of process times are steadier (spec-bench's wall-time ratios need a quiet machine). Same prompts as
``mmaccel spec-bench --n-prompts N`` (free and copy sets, chat template, seed 0), same runners (the engine's
``SpeculativeMethod.timed_generate`` and transformers' peers), plain ``generate`` as the baseline; per prompt every
method runs in turn, ``repeats`` rounds, median per method; outputs are checked token for token against the baseline.

Usage: python cputime_bench.py OUT.json N_PROMPTS REPEATS SPEC [SPEC ...]
"""
import json
import os
import statistics
import sys
import time

import torch

import mmaccel
from mmaccel.eval.specbench import build_prompt_set
from mmaccel.pipeline import resolve_methods


def main(out_path, n_prompts, repeats, specs):
    torch.set_num_threads(1)
    model, tok = mmaccel.load("smollm2-135m", device="cpu")
    gc = model.generation_config
    gen_kwargs = {"do_sample": False, "eos_token_id": gc.eos_token_id, "pad_token_id": gc.pad_token_id}
    methods = resolve_methods(specs)
    for obj, _ in methods:
        if hasattr(obj, "prepare"):
            obj.prepare(model, tok)

    def run(obj, ids):
        c0, t0 = time.process_time(), time.perf_counter()
        with torch.inference_mode():
            if obj is None:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, **gen_kwargs)
                res = {"new_ids": out[0, ids.shape[1]:].tolist(), "telemetry": {}}
            else:
                res = obj.timed_generate(model, ids, max_new_tokens=64, gen_kwargs=gen_kwargs)
        return time.process_time() - c0, time.perf_counter() - t0, res

    prompts = [p for s in ("free", "copy") for p in build_prompt_set(tok, s, n=n_prompts, chat_template=True)]
    run(None, prompts[0].input_ids)  # warm-up
    for obj, _ in methods:
        run(obj, prompts[0].input_ids)
    rows = []
    for p in prompts:
        times = {label: [] for label in ["full"] + [label for _, label in methods]}
        results = {}
        for _ in range(repeats):
            for obj, label in [(None, "full")] + methods:
                cpu, wall, res = run(obj, p.input_ids)
                times[label].append((cpu, wall))
                results[label] = res
        base = results["full"]["new_ids"]
        for label, ts in times.items():
            tel = results[label]["telemetry"]
            rows.append({"prompt_set": p.prompt_set, "prompt_id": p.prompt_id, "method": label,
                         "cpu_s": statistics.median(t[0] for t in ts), "wall_s": statistics.median(t[1] for t in ts),
                         "new_tokens": len(results[label]["new_ids"]),
                         "identical": results[label]["new_ids"] == base,
                         "target_forwards": tel.get("target_forwards", len(base)),
                         "drafter_telemetry": tel.get("drafter_telemetry"), "load_avg_1m": os.getloadavg()[0]})
        print(p.prompt_set, p.prompt_id, {label: round(statistics.median(t[0] for t in ts), 2)
                                          for label, ts in times.items()}, flush=True)
    summary = {}
    for s in ("free", "copy"):
        base = [r for r in rows if r["prompt_set"] == s and r["method"] == "full"]
        for label in ["full"] + [label for _, label in methods]:
            rs = [r for r in rows if r["prompt_set"] == s and r["method"] == label]
            summary.setdefault(s, {})[label] = {
                "cpu_speedup": sum(r["cpu_s"] for r in base) / sum(r["cpu_s"] for r in rs),
                "wall_speedup": sum(r["wall_s"] for r in base) / sum(r["wall_s"] for r in rs),
                "tokens_per_forward": sum(r["new_tokens"] for r in rs) / sum(r["target_forwards"] for r in rs),
                "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}",
                "cpu_s": sum(r["cpu_s"] for r in rs), "wall_s": sum(r["wall_s"] for r in rs)}
    with open(out_path, "w") as f:
        json.dump({"config": {"n_prompts": n_prompts, "repeats": repeats, "threads": 1, "max_new_tokens": 64,
                              "specs": specs}, "summary": summary, "rows": rows}, f, indent=1)
    for s, by in summary.items():
        print(f"### {s}\n| method | identical | tokens / forward | CPU-time speedup | wall speedup |\n|---|---|---|---|---|")
        for label, x in by.items():
            print(f"| {label} | {x['identical']} | {x['tokens_per_forward']:.2f} | {x['cpu_speedup']:.2f}x | "
                  f"{x['wall_speedup']:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
