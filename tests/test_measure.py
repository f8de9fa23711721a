"""The one timing tool: statistics, interleaving and ratios of medians on a controlled clock, epochs of
an iterable, peak memory, JSON output."""
import json
import time

import pytest

from torchspeed.atomic import write_json
from torchspeed import measure


class FakeClock:
    """A controllable clock: each call of the workload advances time by a known amount."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(measure.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(measure.time, "sleep", lambda s: None)

    def work(self, seconds):
        def fn():
            self.now += seconds
        return fn


def test_time_callable_statistics_on_fake_workload(monkeypatch):
    clock = FakeClock(monkeypatch)
    durations = iter([9.0, 9.0, 1.0, 3.0, 2.0, 5.0, 4.0])  # two warm-ups (excluded), then five repeats
    calls = []

    def fn():
        d = next(durations)
        calls.append(d)
        clock.now += d

    t = measure.time_callable(fn, name="fake", warmup=2, repeats=5, items=10)
    assert len(calls) == 7
    assert t.times_s == [1.0, 3.0, 2.0, 5.0, 4.0]
    assert (t.min_s, t.median_s, t.max_s) == (1.0, 3.0, 5.0)
    assert t.throughput == pytest.approx(10 / 3.0)
    assert t.p90_s == pytest.approx(4.6)


def test_time_callable_grows_inner_loop_for_short_calls(monkeypatch):
    clock = FakeClock(monkeypatch)
    t = measure.time_callable(clock.work(0.001), warmup=0, repeats=3, min_time_s=0.1)
    assert t.extra["inner"] >= 100
    assert t.median_s == pytest.approx(0.001)


def test_compare_interleaves_and_reports_ratio_of_medians(monkeypatch):
    clock = FakeClock(monkeypatch)
    order = []

    def make(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return fn

    cmp = measure.compare({"slow": make("slow", 4.0), "fast": make("fast", 1.0)}, warmup=1, repeats=3)
    assert cmp.speedup("fast") == pytest.approx(4.0)
    assert cmp.speedup("slow") == pytest.approx(1.0)
    timed = order[4:]  # after warm-up + calibration of each contender
    assert timed == ["slow", "fast"] * 3
    d = cmp.to_dict()
    assert d["baseline"] == "slow" and d["speedup"]["fast"] == pytest.approx(4.0)


def test_compare_rejects_unknown_baseline():
    with pytest.raises(ValueError, match="baseline"):
        measure.compare({"a": lambda: None}, baseline="b")


def test_time_iterable_restarts_epochs_and_counts_items(monkeypatch):
    clock = FakeClock(monkeypatch)
    epochs = []

    def make_iter():
        epochs.append(1)
        for _ in range(3):
            clock.now += 0.5
            yield [0] * 4  # a "batch" of 4 items

    t = measure.time_iterable(make_iter, count=len, warmup_items=1, passes=2, min_pass_s=2.0)
    assert t.throughput == pytest.approx(8.0)  # 4 items per 0.5 s
    assert len(epochs) >= 2


def test_time_iterable_rejects_empty():
    with pytest.raises(ValueError, match="empty"):
        measure.time_iterable(lambda: [], name="loader")


def test_peak_memory_resets_between_contenders():
    mem = measure.PeakMemory("cpu")
    mem.reset()
    big = bytearray(200 * 2**20)
    big[::4096] = b"x" * len(big[::4096])  # touch every page
    peak_with = mem.peak()
    del big
    mem.reset()
    peak_after = mem.peak()
    if peak_with is None:
        pytest.skip("no /proc peak RSS here")
    assert peak_with - peak_after > 150 * 2**20


def test_timing_serialises_to_json(tmp_path):
    t = measure.Timing(name="x", times_s=[0.1, 0.2, 0.3], items=[8, 8, 8], unit="img")
    write_json(tmp_path / "t.json", {"t": t, "nan": float("nan")})
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["t"]["median_s"] == pytest.approx(0.2) and data["nan"] is None
    assert data["t"]["throughput"] == pytest.approx(40.0)


def test_real_clock_smoke():
    t = measure.time_callable(lambda: time.sleep(0.002), warmup=1, repeats=3)
    assert 0.0015 < t.median_s < 0.5

