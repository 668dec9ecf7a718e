"""Kernel benchmarks: every figure is a ratio to dense SDPA measured in the same process.

``python -m mmaccel.kernels.bench --cpu`` (or ``mmaccel kernel-bench --cpu``, ``python benchmarks/kernels.py --cpu``)
runs small CPU sizes so the scaling is visible: dense prefill grows ~quadratically in L, streaming ~linearly.
Without ``--cpu`` it runs the GPU sizes (prefill 8k..128k; decode budgets 1k/2k/4k of 32k..128k caches).

Each record holds the median time over ``--repeats`` (after ``--warmup`` calls), ``speedup`` = SDPA time / time
(flash-attn too when installed), the work actually done in TFLOP/s (computed tiles only) and GB/s (bytes that must be
read and written), and those as a percentage of the device peak where the peak is known.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .backends import available_backends, has_flash_attn
from .column_scores import attention_column_scores
from .decode import decode_attention
from .patterns import BlockSparse, Chunked, Dense, Streaming
from .roofline import memory_bandwidth
from .sparse_prefill import dense_plan_fraction, sparse_prefill_attention

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core TFLOP/s and HBM GB/s (vendor datasheets), matched by substring of the device name.
GPU_PEAKS = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L40S": (362.0, 864.0),
             "A10G": (125.0, 600.0), "L4": (121.0, 300.0), "4090": (165.0, 1008.0)}


@dataclass
class Record:
    """One measured configuration."""

    op: str
    method: str
    backend: str
    length: int
    ms: float
    speedup: float
    vs_flash: float | None = None
    density: float = 1.0
    tflops: float = 0.0
    gbps: float = 0.0
    pct_peak_flops: float | None = None
    pct_peak_bw: float | None = None
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in milliseconds, after ``warmup`` untimed calls."""
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        _sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_peaks(device: torch.device) -> tuple[float | None, float | None]:
    """(TFLOP/s, GB/s) peaks of a known GPU; (None, None) for the CPU or an unknown device."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks
    return None, None


def block_sparse_pattern(length: int, density: float, block: int, seed: int = 0) -> BlockSparse:
    """Random top-k-like block table keeping about ``density`` of the causal blocks (always the diagonal and sink)."""
    n = -(-length // block)
    g = torch.Generator().manual_seed(seed)
    table = (torch.rand(n, n, generator=g) < density).tril()
    table |= torch.eye(n, dtype=torch.bool)
    table[:, 0] = True
    return BlockSparse(table, block)


def _fill(rec: Record, flops: float, nbytes: float, peaks) -> Record:
    s = rec.ms / 1e3
    rec.tflops, rec.gbps = flops / s / 1e12, nbytes / s / 1e9
    if peaks[0]:
        rec.pct_peak_flops, rec.pct_peak_bw = 100 * rec.tflops / peaks[0], 100 * rec.gbps / peaks[1]
    return rec


def _prefill_at(args, device, dtype, peaks, L: int) -> list[Record]:
    B, Hq, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    records = []
    g = torch.Generator(device=device).manual_seed(L)
    q = torch.randn(B, Hq, L, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, L, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, L, D, device=device, dtype=dtype, generator=g)
    dense_flops = 4.0 * B * Hq * D * L * (L + 1) / 2
    io_bytes = (2 * q.numel() + 2 * k.numel()) * q.element_size()

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)

    t_sdpa = time_ms(sdpa, device, args.warmup, args.repeats)
    t_flash = None
    if has_flash_attn(device):
        from flash_attn import flash_attn_func

        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        t_flash = time_ms(lambda: flash_attn_func(qt, kt, vt, causal=True), device, args.warmup, args.repeats)
        records.append(_fill(Record("prefill", "flash-attn dense", "flash", L, t_flash, t_sdpa / t_flash, 1.0),
                             dense_flops, io_bytes, peaks))
    records.append(_fill(Record("prefill", "sdpa dense", "sdpa", L, t_sdpa, 1.0,
                                t_flash / t_sdpa if t_flash else None), dense_flops, io_bytes, peaks))
    patterns = {
        "dense": Dense(),
        f"streaming({args.sink},{args.window})": Streaming(args.sink, args.window),
        f"chunked({args.chunk},sink={args.sink})": Chunked(args.chunk, args.sink),
    }
    for density in args.densities:
        patterns[f"block_sparse({int(density * 100)}%)"] = block_sparse_pattern(L, density, args.block)
    for name, pattern in patterns.items():
        frac = dense_plan_fraction(pattern, Hq, L, L, 64)  # tiles the reference computes
        for backend in args.backends:
            def run(pattern=pattern, backend=backend):
                return sparse_prefill_attention(q, k, v, pattern, backend=backend)

            try:
                t = time_ms(run, device, args.warmup, args.repeats)
            except (RuntimeError, ValueError) as err:  # a backend unavailable here
                logger.warning("skipping %s/%s at L=%d: %s", name, backend, L, err)
                continue
            rec = Record("prefill", name, backend, L, t, t_sdpa / t, t_flash / t if t_flash else None, frac)
            records.append(_fill(rec, dense_flops * frac, io_bytes, peaks))
    if args.column_window:
        W = min(args.column_window, L)
        qw = q[:, :, -W:]
        t_win = time_ms(lambda: F.scaled_dot_product_attention(
            qw, k, v, attn_mask=torch.ones(W, L, dtype=torch.bool, device=device).tril(L - W),
            enable_gqa=Hq != Hkv), device, args.warmup, args.repeats)
        t_col = time_ms(lambda: attention_column_scores(qw, k), device, args.warmup, args.repeats)
        rec = Record("column_scores", f"column_scores(W={W})", "auto", L, t_col, t_win / t_col,
                     extra={"sdpa_window_ms": t_win, "vs_dense_prefill": t_sdpa / t_col})
        records.append(_fill(rec, 2 * 4.0 * B * Hq * D * W * L, (qw.numel() + k.numel()) * q.element_size(),
                             peaks))
    return records


def _streamed(rows: list[Record]) -> list[Record]:
    """Log one length's rows as soon as they are measured, so a run stopped at a time limit keeps its figures."""
    for r in rows:
        print(format_row(r), file=sys.stderr, flush=True)
    return rows


def bench_prefill(args, device, dtype, peaks) -> list[Record]:
    return [r for L in args.lengths for r in _streamed(_prefill_at(args, device, dtype, peaks, L))]


def _decode_at(args, device, dtype, peaks, S: int) -> list[Record]:
    B, Hq, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    records = []
    g = torch.Generator(device=device).manual_seed(S)
    q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, S, D, device=device, dtype=dtype, generator=g)
    el = q.element_size()

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)

    t_sdpa = time_ms(sdpa, device, args.warmup, args.repeats)
    full_bytes = 2 * k.numel() * el
    records.append(_fill(Record("decode", "sdpa full cache", "sdpa", S, t_sdpa, 1.0),
                         4.0 * B * Hq * D * S, full_bytes, peaks))
    t = time_ms(lambda: decode_attention(q, k, v), device, args.warmup, args.repeats)
    records.append(_fill(Record("decode", "decode full cache", "auto", S, t, t_sdpa / t),
                         4.0 * B * Hq * D * S, full_bytes, peaks))
    for budget in args.budgets:
        if budget > S:
            continue
        idx = torch.stack([torch.randperm(S, device=device)[:budget] for _ in range(B * Hkv)]).reshape(B, Hkv, -1)
        idx = idx.sort(-1).values
        n_pages = budget // args.page_size
        pages = torch.stack([torch.randperm(S // args.page_size, device=device)[:n_pages]
                             for _ in range(B * Hkv)]).reshape(B, Hkv, -1)
        sel_bytes = 2 * B * Hkv * budget * D * el
        for label, kw in ((f"tokens {budget}", {"indices": idx}), (f"pages {budget}", {"pages": pages})):
            t = time_ms(lambda kw=kw: decode_attention(q, k, v, page_size=args.page_size, **kw), device,
                        args.warmup, args.repeats)
            rec = Record("decode", label, "auto", S, t, t_sdpa / t, density=budget / S)
            records.append(_fill(rec, 4.0 * B * Hq * D * budget, sel_bytes, peaks))
    return records


def bench_decode(args, device, dtype, peaks) -> list[Record]:
    return [r for S in args.cache_lengths for r in _streamed(_decode_at(args, device, dtype, peaks, S))]


def scaling_summary(records: list[Record]) -> dict[str, dict]:
    """Per prefill method and backend: time ratio and growth exponent from the shortest to the longest length."""
    out = {}
    keys = {(r.method, r.backend) for r in records if r.op == "prefill"}
    for method, backend in sorted(keys):
        rows = sorted((r for r in records if r.op == "prefill" and r.method == method and r.backend == backend),
                      key=lambda r: r.length)
        if len(rows) < 2:
            continue
        lo, hi = rows[0], rows[-1]
        ratio = hi.ms / lo.ms
        out[f"{method} [{backend}]"] = {
            "from_length": lo.length, "to_length": hi.length, "time_ratio": ratio,
            "exponent": math.log(ratio) / math.log(hi.length / lo.length),
        }
    return out


def format_row(r: Record) -> str:
    """One record as a fixed-width line of :func:`format_table`."""
    def opt(x, fmt):
        return format(x, fmt) if x is not None else "-"
    return (f"{r.op:<14}{r.method:<28}{r.backend:<10}{r.length:>8}{r.ms:>11.2f}{r.speedup:>9.2f}"
            f"{opt(r.vs_flash, '.2f'):>9}{r.density:>6.2f}{r.tflops:>9.3f}{r.gbps:>8.1f}"
            f"{opt(r.pct_peak_flops, '.1f'):>8}{opt(r.pct_peak_bw, '.1f'):>8}")


def format_table(records: list[Record], scaling: dict[str, dict]) -> str:
    """Fixed-width text table of the records, then the scaling summary."""
    head = f"{'op':<14}{'method':<28}{'backend':<10}{'L':>8}{'ms':>11}{'x sdpa':>9}{'x flash':>9}{'dens':>6}" \
           f"{'TFLOP/s':>9}{'GB/s':>8}{'%peakF':>8}{'%peakB':>8}"
    lines = [head, "-" * len(head)] + [format_row(r) for r in records]
    if scaling:
        lines += ["", "prefill scaling (time ratio, exponent: 1 = linear, 2 = quadratic)"]
        for name, s in scaling.items():
            lines.append(f"  {name:<46} {s['from_length']:>6} -> {s['to_length']:<6} x{s['time_ratio']:>7.2f}  "
                         f"exponent {s['exponent']:.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmaccel kernel-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="small CPU sizes (2k..8k prefill), CI-sized")
    p.add_argument("--out", type=Path, help="write the records and the scaling summary as JSON")
    p.add_argument("--lengths", type=int, nargs="+", help="prefill lengths")
    p.add_argument("--cache-lengths", type=int, nargs="+", help="decode cache lengths")
    p.add_argument("--budgets", type=int, nargs="+", help="decode token budgets")
    p.add_argument("--densities", type=float, nargs="+", help="block-sparse densities (fractions)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--sink", type=int, help="streaming / chunked sink tokens")
    p.add_argument("--window", type=int, help="streaming window")
    p.add_argument("--chunk", type=int, help="chunked pattern chunk size")
    p.add_argument("--block", type=int, default=128, help="block-sparse table granularity")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--column-window", type=int, help="query window of the column-score benchmark (0 = skip)")
    p.add_argument("--backends", nargs="+", help="sparse-prefill backends (default: auto; on CUDA also triton)")
    p.add_argument("--ops", nargs="+", choices=("bandwidth", "prefill", "decode"),
                   default=("bandwidth", "prefill", "decode"),
                   help="bandwidth: a STREAM-style copy (the memory roofline of decoding); prefill; decode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, help="timed calls per figure (median)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    return p


def _defaults(args, device: torch.device) -> None:
    cpu = device.type != "cuda"
    preset = {
        "lengths": [2048, 4096, 8192] if cpu else [8192, 16384, 32768, 65536, 131072],
        "cache_lengths": [8192, 32768] if cpu else [32768, 65536, 131072],
        "budgets": [256, 1024] if cpu else [1024, 2048, 4096],
        "densities": [0.5, 0.1], "heads": 8 if cpu else 32, "kv_heads": 2 if cpu else 8, "head_dim": 64 if cpu else 128,
        "sink": 64 if cpu else 128, "window": 512 if cpu else 4096, "chunk": 512 if cpu else 4096, "column_window": 64,
        "backends": ["auto"] if cpu else ["auto", "triton"], "repeats": 3 if cpu else 5,
        "dtype": "float32" if cpu else "bfloat16",
    }
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``mmaccel kernel-bench``): run, print the table, optionally write JSON; returns the exit code."""
    args = build_parser().parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    _defaults(args, device)
    dtype = getattr(torch, args.dtype)
    peaks = device_peaks(device)
    records: list[Record] = []
    bandwidth = memory_bandwidth(device) if "bandwidth" in args.ops else None
    if "prefill" in args.ops:
        records += bench_prefill(args, device, dtype, peaks)
    if "decode" in args.ops:
        records += bench_decode(args, device, dtype, peaks)
    scaling = scaling_summary(records)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sys.stdout.write(f"mmaccel kernel-bench on {dev_name} ({args.dtype}, B={args.batch}, Hq={args.heads}, "
                     f"Hkv={args.kv_heads}, D={args.head_dim}, threads={torch.get_num_threads()}, "
                     f"backends available: {available_backends(device)})\n")
    if bandwidth is not None:
        sys.stdout.write(f"memory bandwidth (STREAM-style copy of {bandwidth.nbytes / 2**20:.0f} MiB, read + write, "
                         f"median of {bandwidth.repeats}): {bandwidth.gbps:.1f} GB/s"
                         + (f" ({100 * bandwidth.gbps / peaks[1]:.0f}% of the datasheet's {peaks[1]:.0f})"
                            if peaks[1] else "") + "\n")
    sys.stdout.write(format_table(records, scaling) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"device": dev_name, "dtype": args.dtype, "peaks": {"tflops": peaks[0], "gbps": peaks[1]},
                       "bandwidth": asdict(bandwidth) if bandwidth is not None else None,
                       "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                       "records": [asdict(r) for r in records], "scaling": scaling}
        args.out.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
