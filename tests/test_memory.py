"""torchspeed.memory: a call's peak read from the allocator, each reading naming its source."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchspeed.memory import SOURCES, MemoryWatch, device_capacity, format_bytes, held_bytes, peak_of


def test_cpu_peak_counts_a_temporary_exactly():
    """A 4 MB temporary freed inside the call is in its peak, not in what it holds at the end."""
    def call() -> float:
        t = torch.ones(1_000_000)
        return float(t.sum())

    _, r = peak_of(call)
    assert r.source == "cpu allocator (profiler)"
    assert 4_000_000 <= r.added_bytes < 4_100_000
    assert r.end_bytes - r.start_bytes < 1000


def test_start_level_is_the_tensors_held_and_phases_have_their_own_peaks():
    model = nn.Linear(100, 100)
    watch = MemoryWatch("cpu", held=(model,))
    with watch:
        with watch.phase("small"):
            a = torch.zeros(1000)
            del a
        with watch.phase("large"):
            b = torch.zeros(100_000)
            del b
    r = watch.reading
    assert r.start_bytes == held_bytes(model) == (100 * 100 + 100) * 4
    assert r.phases["large"] - r.start_bytes == 400_000
    assert r.phases["small"] - r.start_bytes == 4000
    assert r.peak_bytes == r.phases["large"]


def test_held_bytes_counts_each_storage_once_and_reads_optimizer_state():
    model = nn.Linear(10, 10, bias=False)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    opt.step()
    weight = 10 * 10 * 4
    assert held_bytes(model) == 2 * weight  # weight and its gradient
    step = opt.state[model.weight]["step"]
    assert held_bytes(model, opt, model.weight[:2]) == 4 * weight + step.nbytes  # + exp_avg, exp_avg_sq, step
    assert held_bytes(model, device="meta") == 0


def test_inside_another_profiler_the_process_rss_is_read_and_said():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _, r = peak_of(lambda: torch.ones(10).sum())
    assert r.source == "process RSS" and r.peak_bytes >= r.start_bytes > 0
    assert r.source in SOURCES


def test_rss_asked_for_and_bad_source_refused():
    _, r = peak_of(lambda: None, source="rss")
    assert r.source == "process RSS"
    with pytest.raises(ValueError, match="source must be 'auto' or 'rss'"):
        MemoryWatch(source="profiler")


def test_capacity_and_format():
    total, called = device_capacity("cpu")
    assert called == "RAM" and total > 1 << 20
    assert format_bytes(3 << 30) == "3.00 GiB" and format_bytes(1536 * 1024) == "1.5 MiB" and format_bytes(12) == "12 B"


@pytest.mark.gpu
def test_cuda_peak_from_the_allocator():
    dev = torch.device("cuda")
    _, r = peak_of(lambda: torch.ones(1 << 20, device=dev).sum(), device=dev)
    assert r.source == "cuda allocator" and r.added_bytes >= 4 << 20
