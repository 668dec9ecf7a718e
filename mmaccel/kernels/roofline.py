"""The memory roofline of decoding: how fast a decode step could be if it only had to read its bytes once.

A decode step of a causal LM at batch 1 is memory-bound: it reads every weight and every K/V byte it attends to, and
does ~2 FLOPs per weight. So its ceiling is ``bandwidth / (weight bytes + K/V bytes read per token)`` tokens per
second, and a KV method that holds a quarter of the K/V should approach the ceiling of the smaller cache. The
bandwidth is measured, not taken from a datasheet: a STREAM-style copy (McCalpin, 1995) of a buffer far larger than
the caches, counting the bytes read and written.

``mmaccel kernel-bench --ops bandwidth`` prints it; :func:`roofline_fraction` is what the decode tables report.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ._common import synchronize

#: default copy buffer: 256 MiB, far above the last-level cache of a CPU or a GPU's L2
DEFAULT_COPY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Bandwidth:
    """A measured memory bandwidth.

    Attributes
    ----------
    gbps : float
        Median copy bandwidth, 1e9 bytes per second (bytes read + bytes written per second).
    device : str
        Where it was measured (``"cpu"``, ``"cuda:0"``).
    nbytes : int
        Size of the copied buffer, bytes.
    threads : int
        ``torch.get_num_threads()`` during the measurement (CPU bandwidth depends on it).
    repeats : int
        Timed copies behind the median.
    """

    gbps: float
    device: str
    nbytes: int
    threads: int
    repeats: int


def memory_bandwidth(device: str | torch.device = "cpu", *, nbytes: int = DEFAULT_COPY_BYTES, repeats: int = 5,
                     warmup: int = 1) -> Bandwidth:
    """Measure memory bandwidth with a STREAM-style copy ``dst.copy_(src)`` of ``nbytes`` (float32).

    Each copy reads ``nbytes`` and writes ``nbytes``; the figure is ``2 * nbytes / seconds`` (median of ``repeats``
    after ``warmup`` untimed copies, synchronised on CUDA). Memory: two buffers of ``nbytes`` on ``device``.

    Raises
    ------
    ValueError
        ``nbytes`` below 1 MiB (the copy would fit in a cache and measure the cache) or ``repeats < 1``.
    """
    if nbytes < 2**20:
        raise ValueError(f"nbytes must be at least 1 MiB so the copy measures memory, not a cache; got {nbytes}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(device)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return Bandwidth(gbps=2 * n * 4 / seconds / 1e9, device=str(device), nbytes=n * 4,
                     threads=torch.get_num_threads(), repeats=repeats)


def roofline_tokens_per_s(bandwidth_gbps: float, weight_bytes: int, kv_bytes: int) -> float:
    """The decode ceiling at batch 1: ``bandwidth / (weight_bytes + kv_bytes)`` tokens per second.

    ``weight_bytes``: bytes of the parameters read per step (all of them for a dense model); ``kv_bytes``: K/V bytes
    read per step (what the method attends to, e.g. the cache it holds). Raises ``ValueError`` on a non-positive
    bandwidth or negative byte counts.
    """
    if not bandwidth_gbps > 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {bandwidth_gbps}")
    if weight_bytes < 0 or kv_bytes < 0 or weight_bytes + kv_bytes == 0:
        raise ValueError(f"byte counts must be >= 0 and not both 0, got weights {weight_bytes}, K/V {kv_bytes}")
    return bandwidth_gbps * 1e9 / (weight_bytes + kv_bytes)


def roofline_fraction(tokens_per_s: float | None, bandwidth_gbps: float, weight_bytes: int,
                      kv_bytes: int | None) -> float | None:
    """Measured decode speed as a fraction of :func:`roofline_tokens_per_s` (1.0 = at the memory roofline).

    ``None`` when the speed or the K/V bytes are unknown.
    """
    if tokens_per_s is None or kv_bytes is None:
        return None
    return tokens_per_s / roofline_tokens_per_s(bandwidth_gbps, weight_bytes, kv_bytes)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes one decode step reads: every parameter once (tied weights once), less the input embedding
    table when it is not also the LM head (a step reads one row of it, not the table)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        tied = head is not None and getattr(head, "weight", None) is not None \
            and head.weight.data_ptr() == emb.weight.data_ptr()
        if not tied:
            total -= emb.weight.numel() * emb.weight.element_size()
    return total
