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

  Windows (bounded memory for long runs). The profiler keeps every op's event until it stops, so one profile around
  a 10,000-frame video grows without bound (it was OOM-killed at 5,000 frames). The meter therefore runs the
  profiler in windows: :meth:`PeakMemory.checkpoint`, called by the measured code between pieces of work (or
  :meth:`PeakMemory.checkpointed` around the iterable that feeds it), stops the profile, folds its memory events
  into a running sum and its peak (two integers), drops the profile and starts a new one. Exactness across
  windows: torch's CPU memory reporter keeps the size of every block allocated while profiling in a table that
  outlives one profile, so a tensor allocated in one window and freed in a later one is reported as a free of its
  bytes there and leaves the running sum; a peak inside a window or one built across windows is the running sum's
  maximum either way, so the windowed peak equals the one-window peak (tested). The only blind spot is the gap
  between stop and start, in which the checkpoint runs no tensor code and holds the garbage collector off, so the
  measured thread frees nothing there. A checkpoint re-arms only once ``window_s`` seconds (default
  ``ALLOCATOR_WINDOW_S``) have passed since the window opened (``window_s=0``: at every call), so a fine-grained
  caller pays a re-arm (about 6 ms, and two lines of the profiler's log) at most once a second; what the meter holds
  is then one window's events, whatever the run's length. Measured on this CPU (64x64 matmuls): an event costs about
  100 bytes while recorded and about 2 KB while its window is folded (torch builds its trace at stop), and folding
  takes about three times as long as the profiled work -- so a one-second window holds tens of MB, where one
  profile around the whole run grows with it (the 5,000-frame run that was OOM-killed).
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
import time

import torch

RSS_SAMPLE_INTERVAL_S = 0.002
"""Sampling interval of the CPU RSS monitor, seconds."""

ALLOCATOR_WINDOW_S = 1.0
"""Shortest profiler window of the ``"allocator"`` meter between re-arms at :meth:`PeakMemory.checkpoint`, seconds."""

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
    window_s : float
        ``"allocator"`` only: seconds a profiler window stays open at least before :meth:`checkpoint` re-arms it
        (``0``: re-arm at every checkpoint). Default :data:`ALLOCATOR_WINDOW_S`.

    Attributes
    ----------
    method : str
        ``"cuda_max_memory_allocated"``, ``"rss_delta_sampled"``, ``"cpu_allocator_profiled"`` or ``"unavailable"``.
    peak : int or None
        After exit: peak bytes above the start (``None`` when unavailable).
    windows : int
        ``"allocator"``: profiler windows folded so far (1 + the checkpoints that re-armed); 0 otherwise.
    window_events_max : int
        ``"allocator"``: the most profiler events (ops and memory records) one window held: what the meter held
        at most, independent of the number of windows.

    Raises
    ------
    ValueError
        An unknown ``cpu_meter`` or a negative ``window_s``.

    Notes
    -----
    Not re-entrant on CUDA (it resets the device's peak statistics), nor under ``"allocator"`` (one profiler at a
    time).
    """

    def __init__(self, device: torch.device, cpu_meter: str = "rss", window_s: float = ALLOCATOR_WINDOW_S):
        check_cpu_meter(cpu_meter)
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0 seconds, got {window_s!r}")
        self.device = device
        self.window_s = window_s
        self.peak: int | None = None
        self.windows = self.window_events_max = 0
        self._profiler = None
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
            self._total = self._peak = 0
            self.windows = self.window_events_max = 0
            self._arm()
        return self

    def _arm(self) -> None:
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True)
        self._profiler.__enter__()
        self._opened = time.monotonic()

    def _fold(self, *exc) -> None:
        """Stop the open window and fold its memory events into the running sum and peak; drop its profile."""
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(*exc)
        events = _events(profiler)
        del profiler
        self._total, self._peak = running_peak(_memory_events(events), self._total, self._peak)
        self.windows += 1
        self.window_events_max = max(self.window_events_max, len(events))

    def checkpoint(self) -> None:
        """Under ``"allocator"``, close the profiler window and open a new one (once ``window_s`` has passed since
        it opened), so the meter's own memory stays one window's events on a run of any length; exact across the
        boundary (module docstring). Call it between pieces of work, outside any tensor code; elsewhere (CUDA, RSS,
        outside the ``with`` block) it does nothing."""
        if self._profiler is None or time.monotonic() - self._opened < self.window_s:
            return
        collecting = gc.isenabled()
        gc.disable()  # nothing of the measured thread may be freed while no profile is open
        try:
            self._fold(None, None, None)
            self._arm()
        finally:
            if collecting:
                gc.enable()

    def checkpointed(self, iterable):
        """Yield ``iterable``'s items, calling :meth:`checkpoint` before each: wraps the batches a long run
        consumes (e.g. video frames) so that the meter re-arms between them."""
        for item in iterable:
            self.checkpoint()
            yield item

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
            self._fold(*exc)
            self.peak = int(self._peak)


def _events(profiler) -> list:
    """All events of a finished ``torch.profiler.profile``; ``RuntimeError`` when it exposes none (see
    :func:`allocation_peak`)."""
    results = getattr(getattr(profiler, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError("no profiler memory records: run torch.profiler.profile(profile_memory=True), on a torch "
                           "whose profile exposes kineto_results")
    return results.events()


def _memory_events(events) -> list:
    """``(start_ns, nbytes)`` of the CPU memory records among profiler ``events``, in time order (frees negative)."""
    return sorted((e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)


def running_peak(events, total: int = 0, peak: int = 0) -> tuple[int, int]:
    """Fold time-ordered ``(start_ns, nbytes)`` allocation (+) and free (-) records, in bytes, into a running sum
    that stood at ``total`` with maximum ``peak`` so far; returns the new ``(total, peak)``."""
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return total, peak


def allocation_peak(profiler) -> int:
    """Peak of the running sum of a finished ``torch.profiler.profile``'s CPU allocations and frees, in bytes: the
    most memory the profiled block's own allocations held at once. Frees of memory allocated before any profile
    are not recorded by torch (it warns), so a block that frees earlier tensors is not credited for them.

    Raises
    ------
    RuntimeError
        The profile holds no memory records (it was not run with ``profile_memory=True``) or this torch does not
        expose them (``profiler.profiler.kineto_results``).
    """
    return int(running_peak(_memory_events(_events(profiler)))[1])
