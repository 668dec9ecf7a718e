"""Per-step overhead of the speculative engine, and its tokens/s against plain and transformers' assisted decoding.

``python benchmarks/spec_overhead.py [--before DIR] [--out FILE.json]``

Greedy :func:`mmaccel.speculative.speculative_generate` with the ``draft`` drafter on ``micro-lm`` + ``micro-draft``
(one torch thread, 64 new tokens, the free and copy-heavy prompts of :mod:`mmaccel.eval.specbench`). Three parts:

1. **Counts** (load-independent, the primary evidence), per verification step, each from a separate untimed run:
   ``py_calls`` -- Python function calls outside the two models' forwards (``sys.setprofile``); ``c_calls`` --
   calls of builtins/C functions outside the forwards; ``aten_out`` / ``aten_in`` -- ATen ops (each allocates its
   outputs, or views them) dispatched outside / inside the forwards (a ``TorchDispatchMode``); ``forwards`` --
   target + draft forwards; ``cprofile_calls`` -- every function call cProfile sees, forwards included.
2. **Engine overhead** per step, ms: the wall time of the call minus the time spent inside the target's and the
   draft's forwards (forward pre/post hooks; the prefill forward is a forward too), divided by the verification
   steps. The forwards' own time per step is reported beside it.
3. **End to end**, through the one measured path :func:`mmaccel.eval.generation.generate_measured`: plain
   autoregressive decoding (``full``), the engine's ``draft`` method (each variant) and transformers' assisted
   generation (``hf_assisted``), interleaved per prompt and round (A, B, C, A, B, C, ...) after a warm-up of every
   method. Reported: tokens/s (new tokens over TTFT + decode seconds) as the median over rounds, and ratios vs
   ``full`` and ``hf_assisted`` as the median of the per-(prompt, round) paired ratios, plus whether every output is
   token-identical to ``full``.

``--before DIR`` names a copy of an older ``mmaccel/speculative`` package kept *outside* the repository (e.g. saved
before a change); it is imported as ``mmaccel._spec_before`` and measured as variant ``before``, interleaved with the
current package (``after``) in the same process. Without it only the current package is measured.

The load average (``os.getloadavg``) is recorded at the start and the end of each part: on a shared machine the
counts are the trustworthy numbers, time ratios come second.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmaccel.eval.generation import generate_measured
from mmaccel.eval.specbench import build_prompt_set
from mmaccel.models import load


def load_variant(directory: str | None):
    """The current ``mmaccel.speculative``, or a copy of an older one at ``directory`` imported as
    ``mmaccel._spec_before`` (its relative imports resolve against the installed ``mmaccel``)."""
    if directory is None:
        import mmaccel.speculative as pkg

        return pkg
    init = Path(directory) / "__init__.py"
    spec = importlib.util.spec_from_file_location("mmaccel._spec_before", init,
                                                  submodule_search_locations=[str(Path(directory))])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["mmaccel._spec_before"] = pkg
    spec.loader.exec_module(pkg)
    return pkg


class ForwardClock:
    """Forward pre/post hooks on several modules: seconds spent inside their forwards, number of forwards, and a
    depth counter (``inside``) that the counters below read. Removed on exit."""

    def __init__(self, *modules):
        self.modules = modules
        self.seconds = 0.0
        self.per_module = [0.0] * len(modules)
        self.count = 0
        self.inside = 0
        self._t0 = 0.0
        self._handles = []

    def _pre(self, module, args):
        if self.inside == 0:
            self._t0 = time.perf_counter()
        self.inside += 1

    def _post_of(self, i):
        def post(module, args, output):
            self.inside -= 1
            if self.inside == 0:
                dt = time.perf_counter() - self._t0
                self.seconds += dt
                self.per_module[i] += dt
                self.count += 1
        return post

    def __enter__(self):
        for i, m in enumerate(self.modules):
            self._handles += [m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post_of(i))]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


class AtenCounter(TorchDispatchMode):
    """Counts ATen ops dispatched inside / outside the forwards of a :class:`ForwardClock`."""

    def __init__(self, clock: ForwardClock):
        super().__init__()
        self.clock = clock
        self.inside = 0
        self.outside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.clock.inside:
            self.inside += 1
        else:
            self.outside += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def call_counter(clock: ForwardClock):
    """``sys.setprofile`` counter of Python and C calls made while ``clock`` is outside every forward."""
    counts = {"py": 0, "c": 0}

    def prof(frame, event, arg):
        if clock.inside:
            return
        if event == "call":
            counts["py"] += 1
        elif event == "c_call":
            counts["c"] += 1

    sys.setprofile(prof)
    try:
        yield counts
    finally:
        sys.setprofile(None)


def run_engine(pkg, model, draft_model, ids, new_tokens):
    """One greedy ``speculative_generate`` of ``pkg`` with its ``DraftModel`` (k = 4, no early stop at EOS)."""
    return pkg.speculative_generate(model, ids, pkg.DraftModel(draft_model), max_new_tokens=new_tokens,
                                    num_draft_tokens=4, eos_token_id=None)


def counts_per_step(pkg, model, draft_model, prompts, new_tokens) -> dict:
    """Load-independent counts per verification step (see the module docstring), summed over ``prompts``."""
    steps = py = c = a_in = a_out = fwd = 0
    for p in prompts:
        with ForwardClock(model, draft_model) as clock, call_counter(clock) as calls:
            out = run_engine(pkg, model, draft_model, p.input_ids, new_tokens)
        with ForwardClock(model, draft_model) as clock, AtenCounter(clock) as aten:
            run_engine(pkg, model, draft_model, p.input_ids, new_tokens)
        steps += out.steps
        py, c, fwd = py + calls["py"], c + calls["c"], fwd + clock.count
        a_in, a_out = a_in + aten.inside, a_out + aten.outside
    prof = cProfile.Profile()
    prof.enable()
    for p in prompts:
        run_engine(pkg, model, draft_model, p.input_ids, new_tokens)
    prof.disable()
    stats = pstats.Stats(prof)
    own = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})", v[1]) for k, v in stats.stats.items()
                  if "speculative" in k[0]), reverse=True)[:8]
    return {"steps": steps, "py_calls": py / steps, "c_calls": c / steps, "aten_out": a_out / steps,
            "aten_in": a_in / steps, "forwards": fwd / steps, "cprofile_calls": stats.total_calls / steps,
            "top_engine_tottime_ms_per_step": [(name, round(t * 1e3 / steps, 4), n) for t, name, n in own]}


def overhead(variants, model, draft_model, prompts, new_tokens, rounds) -> dict:
    """Per variant: medians over prompts and rounds of (wall - forward time) / steps, of the forward time / steps
    (both models, and each: the target's includes its prefill) and of the wall time / steps, ms."""
    per = {name: {"overhead_ms": [], "forward_ms": [], "target_forward_ms": [], "draft_forward_ms": [],
                  "wall_ms": []} for name in variants}
    for _ in range(rounds):
        for p in prompts:
            for name, pkg in variants.items():
                with ForwardClock(model, draft_model) as clock:
                    t0 = time.perf_counter()
                    out = run_engine(pkg, model, draft_model, p.input_ids, new_tokens)
                    wall = time.perf_counter() - t0
                per[name]["overhead_ms"].append((wall - clock.seconds) * 1e3 / out.steps)
                per[name]["forward_ms"].append(clock.seconds * 1e3 / out.steps)
                per[name]["target_forward_ms"].append(clock.per_module[0] * 1e3 / out.steps)
                per[name]["draft_forward_ms"].append(clock.per_module[1] * 1e3 / out.steps)
                per[name]["wall_ms"].append(wall * 1e3 / out.steps)
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in per.items()}


def end_to_end(methods, model, tok, prompts, new_tokens, rounds) -> dict:
    """Interleaved ``generate_measured`` runs; tokens/s per method, paired ratios vs ``full``/``hf_assisted``, and
    for speculative methods the tokens per verification forward and the wall ms per step."""
    for m in methods.values():  # warm-up of every method (loads, first-call costs)
        generate_measured(model, tok, prompts[0].input_ids, method=m, max_new_tokens=new_tokens, repeats=1,
                          warmup=1, raise_errors=True)
    runs = {name: {} for name in methods}  # name -> prompt -> [(tokens, seconds, ids, steps)] over rounds
    for r in range(rounds):
        for i, p in enumerate(prompts):
            order = list(methods.items())
            order = order[r % len(order):] + order[: r % len(order)]  # rotate who goes first
            for name, m in order:
                rr = generate_measured(model, tok, p.input_ids, method=m, max_new_tokens=new_tokens, repeats=1,
                                       warmup=0, raise_errors=True)
                runs[name].setdefault(i, []).append((rr.new_tokens, rr.ttft_s + rr.decode_s, rr.output_ids,
                                                     (rr.telemetry or {}).get("steps")))
    out = {}
    for name, by_prompt in runs.items():
        flat = [run for rs in by_prompt.values() for run in rs]
        total_tokens = sum(rs[0][0] for rs in by_prompt.values())
        total_s = sum(statistics.median(run[1] for run in rs) for rs in by_prompt.values())
        entry = {"tokens_per_s": total_tokens / total_s,
                 "tokens_per_s_median_run": statistics.median(n / s for n, s, _, _ in flat),
                 "identical_to_full": all(rs[-1][2] == runs["full"][i][-1][2] for i, rs in by_prompt.items())}
        if all(run[3] for run in flat):
            entry["mean_accepted_length"] = sum(run[0] for run in flat) / sum(run[3] for run in flat)
            entry["ms_per_step"] = statistics.median(s * 1e3 / steps for _, s, _, steps in flat)
        for ref in ("full", "hf_assisted"):
            if ref in runs and ref != name:
                entry[f"vs_{ref}"] = statistics.median((n / s) / (rn / rs) for i, rs_ in by_prompt.items()
                                                       for (n, s, _, _), (rn, rs, _, _) in zip(rs_, runs[ref][i]))
        out[name] = entry
    return out


def main(argv=None) -> int:
    """Run the three parts, print a table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="directory of an older mmaccel/speculative package (outside the repository)")
    ap.add_argument("--out", default="runs/spec-overhead.json")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set (free and copy)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load("micro-lm", device="cpu")
    draft_model, _ = load("micro-draft", device="cpu")
    prompts = build_prompt_set(tok, "free", n=args.prompts) + build_prompt_set(tok, "copy", n=args.prompts)
    variants = {"after": load_variant(None)}
    if args.before:
        variants = {"before": load_variant(args.before), **variants}
    result = {"model": "micro-lm", "draft": "micro-draft", "threads": 1, "new_tokens": args.new_tokens,
              "prompts": len(prompts), "rounds": args.rounds, "load_avg": {"start": os.getloadavg()}}
    for name, pkg in variants.items():  # warm-up
        run_engine(pkg, model, draft_model, prompts[0].input_ids, args.new_tokens)
    with torch.inference_mode():
        result["counts"] = {name: counts_per_step(pkg, model, draft_model, prompts, args.new_tokens)
                            for name, pkg in variants.items()}
    result["load_avg"]["counts_end"] = os.getloadavg()
    result["overhead"] = overhead(variants, model, draft_model, prompts, args.new_tokens, args.rounds)
    result["load_avg"]["overhead_end"] = os.getloadavg()
    if not args.skip_e2e:
        methods = {"full": None}
        for name, pkg in variants.items():
            methods[f"draft[{name}]"] = pkg.SpeculativeMethod(pkg.DraftModel(draft_model), 4)
        methods["hf_assisted"] = variants["after"].HFAssisted(draft_model)
        result["end_to_end"] = end_to_end(methods, model, tok, prompts, args.new_tokens, args.rounds)
        result["load_avg"]["e2e_end"] = os.getloadavg()

    print(f"load average (1/5/15 min): start {result['load_avg']['start']}, end "
          f"{result['load_avg'].get('e2e_end', result['load_avg']['overhead_end'])}")
    print("per verification step:")
    print(f"{'variant':8} {'py calls':>9} {'C calls':>8} {'aten out':>9} {'aten in':>8} {'fwd':>5} {'cProfile':>9} "
          f"{'overhead ms':>12} {'fwd ms':>7} {'(target':>8} {'draft)':>7} {'step ms':>8}")
    for name in variants:
        c, o = result["counts"][name], result["overhead"][name]
        print(f"{name:8} {c['py_calls']:9.0f} {c['c_calls']:8.0f} {c['aten_out']:9.1f} {c['aten_in']:8.1f} "
              f"{c['forwards']:5.2f} {c['cprofile_calls']:9.0f} {o['overhead_ms']:12.3f} {o['forward_ms']:7.3f} "
              f"{o['target_forward_ms']:8.3f} {o['draft_forward_ms']:7.3f} {o['wall_ms']:8.3f}")
    for name in variants:
        print(f"{name}: top engine functions by own time (cProfile, ms per step, calls): "
              + "; ".join(f"{f} {t} ({n})" for f, t, n in result["counts"][name]["top_engine_tottime_ms_per_step"][:5]))
    if "end_to_end" in result:
        print(f"\n{'method':16} {'tok/s':>8} {'vs full':>8} {'vs hf_assisted':>15} {'identical':>10} "
              f"{'tokens/step':>12} {'ms/step':>8}")
        for name, e in result["end_to_end"].items():
            print(f"{name:16} {e['tokens_per_s']:8.1f} {e.get('vs_full', 1.0):8.3f} "
                  f"{e.get('vs_hf_assisted', float('nan')):15.3f} {e['identical_to_full']!s:>10} "
                  f"{e.get('mean_accepted_length', float('nan')):12.2f} {e.get('ms_per_step', float('nan')):8.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
