"""The exact CPU meter in windows (PeakMemory(cpu_meter="allocator").checkpoint): equal to one window, bounded."""
import math

import pytest
import torch
import torch.nn.functional as F

from mmaccel.eval.memory import PeakMemory, running_peak

CPU = torch.device("cpu")
MIB = 1 << 20


def _across_windows(mem):
    """16 MiB, then 8 more in the next window (a peak spanning windows: 24), then the 16 freed in a later window
    than the one that allocated it and 20 MiB allocated and freed inside one window (28, the peak; 44 if the free
    across the boundary were lost), then 4 MiB."""
    a = torch.ones(4 * MIB)
    mem.checkpoint()
    b = torch.ones(2 * MIB)
    mem.checkpoint()
    del a
    c = torch.ones(5 * MIB)
    del c
    mem.checkpoint()
    d = torch.ones(MIB)
    del b, d


@pytest.mark.parametrize("window_s, windows", [(0, 4), (3600, 1)])
def test_windowed_meter_equals_one_window_across_boundaries(window_s, windows):
    """window_s=0 re-arms at every checkpoint; 3600 s never within this test: one window."""
    with PeakMemory(CPU, cpu_meter="allocator", window_s=window_s) as mem:
        _across_windows(mem)
    assert mem.windows == windows
    assert mem.peak == 28 * MIB


def _model_steps(mem, steps):
    """Attention and a projection (kernels' own temporaries included) and a buffer that grows, then is released."""
    q = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    held = []
    for i in range(steps):
        out = (F.scaled_dot_product_attention(q, q, q) @ weight).sum()
        held.append(torch.empty(1024 * (i % 3 + 1)))
        if i % 3 == 2:
            held.clear()
        del out
        mem.checkpoint()


@pytest.fixture
def one_thread():
    """Tiny ops on one intra-op thread: two threads spin against a loaded CPU and take ~10 ms an op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_windowed_meter_equals_one_window_on_real_ops_and_holds_one_windows_events(one_thread):
    with PeakMemory(CPU, cpu_meter="allocator", window_s=math.inf) as one:
        _model_steps(one, 24)
    runs = {}
    for steps in (3, 24):
        with PeakMemory(CPU, cpu_meter="allocator", window_s=0) as runs[steps]:
            _model_steps(runs[steps], steps)
    assert (one.windows, runs[3].windows, runs[24].windows) == (1, 4, 25)
    assert runs[24].peak == runs[3].peak == one.peak > 0
    assert runs[24].window_events_max <= runs[3].window_events_max + 4  # flat in the number of windows
    assert one.window_events_max > 12 * runs[24].window_events_max  # one window keeps every event


def test_checkpoint_is_a_no_op_outside_a_profile_and_bad_windows_fail():
    rss, idle = PeakMemory(CPU, cpu_meter="rss"), PeakMemory(CPU, cpu_meter="allocator")
    assert list(rss.checkpointed(iter("ab"))) == ["a", "b"]
    idle.checkpoint()  # not entered: nothing to re-arm
    assert rss.windows == idle.windows == 0 and rss.peak is None
    with pytest.raises(ValueError, match="window_s must be >= 0"):
        PeakMemory(CPU, cpu_meter="allocator", window_s=-1)


def test_running_peak_continues_from_a_previous_window():
    assert running_peak([(0, 10), (1, -4), (2, 3)]) == (9, 10)
    assert running_peak([(5, -9), (6, 12)], 9, 10) == (12, 12)
