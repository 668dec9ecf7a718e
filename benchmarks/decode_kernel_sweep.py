"""Sweep the split-K decode kernel's launch settings on a GPU, against SDPA and the PyTorch reference.

    python benchmarks/decode_kernel_sweep.py --out runs/decode_sweep.jsonl      # CUDA only

For each cache length (B=1, 32 query heads, 8 KV heads, D=128, bf16, the shapes of `mmaccel kernel-bench`) and each
case (the whole cache; 2,048 selected tokens per KV head; 2,048 tokens in 16-token pages), it times
`decode_attention(backend="triton", kernel_config=...)` for every `DecodeKernelConfig` in the grid (`tl.dot` or
broadcast products, keys per step, warps, stages, split scale), and the baselines in the same process: SDPA over the
whole cache, and the PyTorch reference (gather + softmax) for a selection. Times are the median wall time of
`--repeats` calls after `--warmup`, each synchronised, so a call's Python and launch costs count as they do in a
model. Every config's output is checked against the reference; a config off by more than 2e-2 is marked wrong and
never chosen. Rows stream to `--out` (JSON lines); the end prints the fastest correct config per case and the
one with the least mean slowdown against each case's fastest (the candidate for `DEFAULT_DECODE_CONFIG`).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from mmaccel.kernels import decode_attention
from mmaccel.kernels.bench import time_ms
from mmaccel.kernels.triton_kernels import DEFAULT_DECODE_CONFIG, DecodeKernelConfig


def grid(quick: bool) -> list[DecodeKernelConfig]:
    """The settings swept: every combination of the axes below (`quick`: a few, for a smoke run)."""
    if quick:
        return [DEFAULT_DECODE_CONFIG, DecodeKernelConfig(use_dot=True, block_n=64)]
    axes = itertools.product((False, True), (32, 64, 128), (4, 8), (1, 3), (1, 2, 4))
    return [DecodeKernelConfig(use_dot=d, block_n=n, num_warps=w, num_stages=s, splits_scale=k)
            for d, n, w, s, k in axes]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--budget", type=int, default=2048, help="selected tokens per KV head")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two configs only (smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, Hq, Hkv, D = 1, 32, 8, 128
    configs = grid(args.quick)
    rows: list[dict] = []
    with open(args.out, "w") as fh:
        def emit(row: dict) -> None:
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()

        for S in args.cache_lengths:
            g = torch.Generator(device=device).manual_seed(S)
            q, k, v = (torch.randn(B, h, n, D, device=device, dtype=dtype, generator=g)
                       for h, n in ((Hq, 1), (Hkv, S), (Hkv, S)))
            idx = torch.stack([torch.randperm(S, device=device)[:args.budget] for _ in range(B * Hkv)])
            idx = idx.reshape(B, Hkv, -1).sort(-1).values
            n_pages = args.budget // args.page_size
            pages = torch.stack([torch.randperm(S // args.page_size, device=device)[:n_pages]
                                 for _ in range(B * Hkv)]).reshape(B, Hkv, -1)
            cases = {"whole": {}, f"tokens {args.budget}": {"indices": idx},
                     f"pages {args.budget}": {"pages": pages, "page_size": args.page_size}}
            t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device,
                             args.warmup, args.repeats)
            emit({"S": S, "case": "whole", "impl": "sdpa", "ms": t_sdpa})
            for case, kw in cases.items():
                ref = decode_attention(q, k, v, backend="reference", **kw).float()
                if kw:
                    t_ref = time_ms(lambda kw=kw: decode_attention(q, k, v, backend="reference", check_indices=False,
                                                                   **kw), device, args.warmup, args.repeats)
                    emit({"S": S, "case": case, "impl": "reference", "ms": t_ref})
                for cfg in configs:
                    row = {"S": S, "case": case, "impl": "triton", "config": dataclasses.asdict(cfg),
                           "default": cfg == DEFAULT_DECODE_CONFIG}
                    try:
                        def run(cfg=cfg, kw=kw):
                            return decode_attention(q, k, v, backend="triton", check_indices=False,
                                                    kernel_config=cfg, **kw)

                        err = (run().float() - ref).abs().max().item()
                        row.update(ms=time_ms(run, device, args.warmup, args.repeats), max_abs_err=err,
                                   correct=err <= 2e-2)
                    except Exception as e:  # a setting that fails to compile is recorded, and the sweep goes on
                        row.update(ms=None, error=f"{type(e).__name__}: {e}"[:300], correct=False)
                    row["x_sdpa"] = t_sdpa / row["ms"] if row.get("ms") else None
                    emit(row)
                    print(f"S={S} {case:12s} {cfg} -> {row.get('ms')} ms, err {row.get('max_abs_err')}", flush=True)
    summarise(rows)
    return 0


def summarise(rows: list[dict]) -> None:
    """Print the fastest correct config per (S, case), the default's time, and the fastest config overall."""
    ok = [r for r in rows if r["impl"] == "triton" and r.get("correct")]
    base = {(r["S"], r["case"]): r["ms"] for r in rows if r["impl"] != "triton"}
    sdpa = {r["S"]: r["ms"] for r in rows if r["impl"] == "sdpa"}
    print("\n| S | case | sdpa ms | reference ms | default ms | best ms | x sdpa | best config |")
    print("|---|---|---|---|---|---|---|---|")
    for S, case in sorted({(r["S"], r["case"]) for r in ok}):
        here = [r for r in ok if r["S"] == S and r["case"] == case]
        best = min(here, key=lambda r: r["ms"])
        dflt = next((r["ms"] for r in here if r["default"]), None)
        ref = base.get((S, case)) if case != "whole" else None
        print(f"| {S} | {case} | {sdpa[S]:.3f} | {ref if ref is None else round(ref, 3)} | "
              f"{dflt if dflt is None else round(dflt, 3)} | {best['ms']:.3f} | {sdpa[S] / best['ms']:.2f} | "
              f"{best['config']} |")
    keys = {json.dumps(r["config"], sort_keys=True) for r in ok}
    cells = {(r["S"], r["case"]) for r in ok}
    fastest = {c: min(r["ms"] for r in ok if (r["S"], r["case"]) == c) for c in cells}
    total = {}
    for key in keys:
        here = [r for r in ok if json.dumps(r["config"], sort_keys=True) == key]
        if len(here) == len(cells):  # correct everywhere: mean slowdown against each cell's fastest
            total[key] = sum(r["ms"] / fastest[(r["S"], r["case"])] for r in here) / len(here)
    if total:
        best = min(total, key=total.get)
        print(f"\nfastest over all cases (mean {total[best]:.3f}x each case's fastest): {best}")


if __name__ == "__main__":
    sys.exit(main())
