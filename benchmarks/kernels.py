"""Kernel benchmarks (speed, not correctness): ``python benchmarks/kernels.py --cpu [--out FILE.json]``.

Same as ``mmaccel kernel-bench``; see :mod:`mmaccel.kernels.bench` for the flags.
"""
import sys

from mmaccel.kernels.bench import main

if __name__ == "__main__":
    sys.exit(main())
