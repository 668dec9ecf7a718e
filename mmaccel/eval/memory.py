"""Peak memory of a piece of code: exact on CUDA, an honest sampled estimate on the CPU.

The measure is the peak memory *growth* while the block runs, above what was allocated when it started:

- CUDA (``peak_memory_method = "cuda_max_memory_allocated"``): ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus ``memory_allocated`` at the start. Exact for tensors from the caching allocator.
- CPU on Linux (``"rss_delta_sampled"``): the process's resident set size read from ``/proc/self/statm`` by a
  background thread every ``RSS_SAMPLE_INTERVAL_S`` seconds (and once at the end), minus the RSS at the start. Before
  each run the garbage collector runs and glibc's ``malloc_trim(0)`` returns freed heap pages, so memory a previous
  run freed is not silently reused unseen. Caveats, stated honestly: it is sampled (a peak shorter than the interval
  can be missed), it counts every allocation of the process (other threads included), and allocator reuse of pages
  that were never returned can still hide some growth -- read it as an approximate lower bound.
- Elsewhere (``"unavailable"``): ``None``.

The sampler thread reads ``/proc/self/statm`` (about 15 microseconds) every ``RSS_SAMPLE_INTERVAL_S`` seconds: about 1%
of one core.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading

import torch

RSS_SAMPLE_INTERVAL_S = 0.002
"""Sampling interval of the CPU RSS monitor, seconds."""


def rss_bytes() -> int | None:
    """Resident set size of this process in bytes, from ``/proc/self/statm`` (``None`` where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _malloc_trim() -> None:
    """Ask glibc to return freed heap pages to the OS (no-op on other C libraries)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakMemory:
    """Context manager measuring the peak memory growth of the code inside it, in bytes.

    Parameters
    ----------
    device : torch.device
        CUDA devices use the caching allocator's statistics; anything else uses the process RSS.

    Attributes
    ----------
    method : str
        ``"cuda_max_memory_allocated"``, ``"rss_delta_sampled"`` or ``"unavailable"``.
    peak : int or None
        After exit: peak bytes above the start (``None`` when unavailable).

    Notes
    -----
    Not re-entrant on CUDA (it resets the device's peak statistics).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None
        if device.type == "cuda":
            self.method = "cuda_max_memory_allocated"
        elif rss_bytes() is not None:
            self.method = "rss_delta_sampled"
        else:
            self.method = "unavailable"

    def __enter__(self):
        gc.collect()
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.method == "rss_delta_sampled":
            _malloc_trim()
            self._start = self._max = rss_bytes()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_INTERVAL_S):
            self._max = max(self._max, rss_bytes() or 0)

    def __exit__(self, *exc) -> None:
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device) - self._start)
        elif self.method == "rss_delta_sampled":
            self._stop.set()
            self._thread.join()
            self.peak = int(max(self._max, rss_bytes() or 0) - self._start)
