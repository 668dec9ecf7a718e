"""Peak memory of a piece of code: exact on CUDA; on the CPU an honest sampled estimate, or exact tensor bytes.

The measure is the peak memory *growth* while the block runs, above what was allocated when it started:

- CUDA (``peak_memory_method = "cuda_max_memory_allocated"``): ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus ``memory_allocated`` at the start. Exact for tensors from the caching allocator.
- CPU on Linux (``"rss_delta_sampled"``): the process's resident set size read from ``/proc/self/statm`` by a
  background thread every ``RSS_SAMPLE_INTERVAL_S`` seconds (and once at the end), minus the RSS at the start. Before
  each run the garbage collector runs and glibc's ``malloc_trim(0)`` returns freed heap pages, so memory a previous
  run freed is not silently reused unseen. Caveats, stated honestly: it is sampled (a peak shorter than the interval
  can be missed), it counts every allocation of the process (other threads included), and allocator reuse of pages
  that were never returned can still hide some growth -- read it as an approximate lower bound.
- CPU, exact (``"cpu_allocator_profiled"``, ``PeakMemory(device, cpu_meter="allocator")``): every allocation and
  free of torch's CPU allocator while the block runs, as recorded by ``torch.profiler`` with ``profile_memory=True``,
  summed in time order; the peak of that running sum. It is the CPU's counterpart of ``max_memory_allocated``: tensor
  bytes only (no allocator slack, no Python objects, no memory of other libraries), independent of what the process
  did before, so it compares across processes and library versions, which the RSS cannot. It includes the buffers
  kernels allocate internally through torch (e.g. attention's temporaries). Costs: the profiler records every op
  (a few microseconds each), so do not time a run under it; allocations made by threads the profiler does not
  follow (other Python threads; intra-op worker threads rarely allocate) are missed.
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

CPU_METERS = ("rss", "allocator")
"""What :class:`PeakMemory` measures off CUDA: the sampled process RSS, or torch's CPU allocations (exact)."""


def check_cpu_meter(value, name: str = "cpu_meter") -> None:
    """Raise ``ValueError`` (naming the argument ``name``) unless ``value`` is one of :data:`CPU_METERS`."""
    if value not in CPU_METERS:
        raise ValueError(f"{name} must be one of {CPU_METERS}, got {value!r}")


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
        CUDA devices use the caching allocator's statistics; anything else uses ``cpu_meter``.
    cpu_meter : {"rss", "allocator"}
        Off CUDA: ``"rss"`` (default) samples the process RSS, cheap enough to wrap a timed run; ``"allocator"``
        sums torch's CPU allocations under the profiler: exact tensor bytes, but not for timed runs (see the module
        docstring).

    Attributes
    ----------
    method : str
        ``"cuda_max_memory_allocated"``, ``"rss_delta_sampled"``, ``"cpu_allocator_profiled"`` or ``"unavailable"``.
    peak : int or None
        After exit: peak bytes above the start (``None`` when unavailable).

    Raises
    ------
    ValueError
        An unknown ``cpu_meter``.

    Notes
    -----
    Not re-entrant on CUDA (it resets the device's peak statistics), nor under ``"allocator"`` (one profiler at a
    time).
    """

    def __init__(self, device: torch.device, cpu_meter: str = "rss"):
        check_cpu_meter(cpu_meter)
        self.device = device
        self.peak: int | None = None
        if device.type == "cuda":
            self.method = "cuda_max_memory_allocated"
        elif cpu_meter == "allocator":
            self.method = "cpu_allocator_profiled"
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
        elif self.method == "cpu_allocator_profiled":
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True)
            self._profiler.__enter__()
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
        elif self.method == "cpu_allocator_profiled":
            self._profiler.__exit__(*exc)
            self.peak = allocation_peak(self._profiler)
            self._profiler = None


def allocation_peak(profiler) -> int:
    """Peak of the running sum of a finished ``torch.profiler.profile``'s CPU allocations and frees, in bytes: the
    most memory the profiled block's own allocations held at once. Frees of memory allocated before the profile are
    not recorded by torch (it warns), so a block that frees earlier tensors is not credited for them.

    Raises
    ------
    RuntimeError
        The profile holds no memory records (it was not run with ``profile_memory=True``) or this torch does not
        expose them (``profiler.profiler.kineto_results``).
    """
    results = getattr(getattr(profiler, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError("no profiler memory records: run torch.profiler.profile(profile_memory=True), on a torch "
                           "whose profile exposes kineto_results")
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return int(peak)
