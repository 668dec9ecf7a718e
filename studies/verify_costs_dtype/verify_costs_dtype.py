"""What one verification forward of n tokens costs against a one-token forward, fp32 vs bf16, on this machine.

``python studies/verify_costs_dtype/verify_costs_dtype.py`` prints, for ``smollm2-135m`` over a 256-token ``DynamicCache`` (random
ids, the cache cropped back after each forward), the median of 7 timed forwards after 2 warm-ups per n, in
milliseconds and as a ratio to n = 1, for fp32 on 2 and 1 threads and bf16 on 2 threads. Results:
``benchmarks/results/speculative/smollm2_eagle/verify_costs_dtype.md``. Run it on a quiet machine.
"""
import statistics
import time

import torch
from transformers import DynamicCache

from mmaccel.models import load


def measure(model, threads: int, dtype, sizes=(1, 2, 3, 5, 9), context: int = 256, repeats: int = 9) -> dict:
    """{n: (median ms, ratio to n = 1)} of forwards of n new tokens over a ``context``-token cache."""
    torch.set_num_threads(threads)
    m = model.to(dtype)
    out = {}
    with torch.inference_mode():
        cache = DynamicCache(config=m.config)
        m(torch.randint(0, m.config.vocab_size, (1, context)), past_key_values=cache, use_cache=True)
        for n in sizes:
            times = []
            for _ in range(repeats):
                ids = torch.randint(0, m.config.vocab_size, (1, n))
                t0 = time.perf_counter()
                m(ids, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                cache.crop(-n)
            out[n] = statistics.median(times[2:])
    return {n: (round(1000 * v, 1), round(v / out[sizes[0]], 2)) for n, v in out.items()}


def main() -> None:
    model, _ = load("smollm2-135m")
    model.eval()
    for label, threads, dtype in (("fp32, 2 threads", 2, torch.float32), ("fp32, 1 thread", 1, torch.float32),
                                  ("bf16, 2 threads", 2, torch.bfloat16)):
        print(label, measure(model, threads, dtype))


if __name__ == "__main__":
    main()
