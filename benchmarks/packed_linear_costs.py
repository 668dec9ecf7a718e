"""What a forward of k tokens costs on this CPU, with PyTorch's default linear layers and with them prepacked for
oneDNN (:class:`mmaccel.kernels.PackedLinears`): per linear shape of ``smollm2-135m``, and per whole model step
(:func:`mmaccel.speculative.schedule.measure_verify_costs`, relative to a one-token step), and the prefill of
``smol-llava``'s LM-side prompt lengths (43 / 63 / 171 tokens: 10%, 25% and all of 144 visual tokens + 27 text).

    python benchmarks/packed_linear_costs.py --threads 2 --out benchmarks/results/speculative/smollm2_packed_linear/costs.json

Run it on a quiet machine: every figure is a median of repeats, default and packed measured in the same process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import mmaccel
from mmaccel.kernels import PackedLinear, PackedLinears
from mmaccel.speculative.schedule import measure_verify_costs

SHAPES = {"q/o projection": (576, 576), "MLP up/gate": (1536, 576), "LM head": (49152, 576)}
TOKENS = (1, 2, 3, 4, 5, 9, 17)
PREFILL = (43, 63, 171)


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    layers = {}
    with torch.no_grad():
        for label, (out_f, in_f) in SHAPES.items():
            linear = torch.nn.Linear(in_f, out_f, bias=False)
            packed = PackedLinear(linear)
            rows = []
            for k in TOKENS:
                x = torch.randn(1, k, in_f)
                rows.append({"tokens": k, "default_ms": _median_ms(lambda x=x, linear=linear: linear(x), args.repeats),
                             "packed_ms": _median_ms(lambda x=x, packed=packed: packed(x), args.repeats)})
            layers[label] = {"shape": [out_f, in_f], "rows": rows}
        model, _ = mmaccel.load(args.model, device="cpu")[:2]
        prompts = {n: torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(n)) for n in PREFILL}

        def prefill_ms():
            return {n: _median_ms(lambda ids=ids: model(ids, logits_to_keep=1), 9) for n, ids in prompts.items()}

        default = measure_verify_costs(model, max_draft=16, context=256, repeats=5)
        t_default = _median_ms(lambda: model(torch.randint(0, 1000, (1, 1))), 15)
        p_default = prefill_ms()
        with PackedLinears(model):
            packed = measure_verify_costs(model, max_draft=16, context=256, repeats=5)
            t_packed = _median_ms(lambda: model(torch.randint(0, 1000, (1, 1))), 15)
            p_packed = prefill_ms()
    result = {
        "model": args.model, "threads": args.threads, "device": "cpu", "dtype": "float32",
        "machine": platform.machine(), "torch": torch.__version__,
        "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0],
        "linear_layers_ms": layers,
        "verify_costs": {"note": "entry k-1: a forward of k+1 tokens over a 256-token cache / a one-token forward",
                         "default": default, "packed": packed},
        "one_token_forward_no_cache_ms": {"default": t_default, "packed": t_packed},
        "prefill_ms": {"note": "model(ids, logits_to_keep=1), no cache, median of 9",
                       "default": p_default, "packed": p_packed},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for label, entry in layers.items():
        print(label, entry["shape"], " ".join(f"k={r['tokens']}: {r['default_ms']:.3f}/{r['packed_ms']:.3f}"
                                             for r in entry["rows"]))
    print("verify costs default:", ", ".join(f"{c:.2f}" for c in default))
    print("verify costs packed: ", ", ".join(f"{c:.2f}" for c in packed))
    print(f"one-token forward: default {t_default:.1f} ms, packed {t_packed:.1f} ms")
    for label, row in (("default", p_default), ("packed", p_packed)):
        print(f"prefill {label}: " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in row.items())
              + f"; {PREFILL[-1]}/{PREFILL[1]} = {row[PREFILL[-1]] / row[PREFILL[1]]:.2f}")


if __name__ == "__main__":
    main()
