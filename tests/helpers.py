"""Small models and data shared by the tests: seeded, generated, a few milliseconds a step.

Import as `from helpers import tiny_convnet, separable_loader` (pytest puts tests/ on the path).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def tiny_convnet(classes: int = 2, width: int = 8, *, batchnorm: bool = False, seed: int | None = 0) -> nn.Sequential:
    """conv3x3 (+ BatchNorm) + ReLU, global average pool, linear head: the smallest image classifier
    with every layer kind the library rewrites (conv, norm, activation, pooling, linear)."""
    if seed is not None:
        torch.manual_seed(seed)
    norm = [nn.BatchNorm2d(width)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), *norm, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, classes))


def two_stage_convnet(classes: int = 4, seed: int | None = 0) -> nn.Sequential:
    """Two conv + BatchNorm + ReLU stages (the second strided), pooled, linear head: enough depth for
    fusion, quantization and pruning to have something to do. In eval mode."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes)).eval()


def separable_images(n: int = 256, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 3, size, size) noise images and labels a small net can learn: 1 where channel 0's mean > 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    return x, (x[:, 0].mean((1, 2)) > 0).long()


def separable_loader(n: int = 256, batch: int = 32, *, size: int = 8, seed: int = 0, shuffle: bool = False,
                     device: str | torch.device = "cpu") -> DataLoader:
    """A DataLoader over `separable_images` (shuffled by its own seeded generator when asked)."""
    x, y = separable_images(n, size, seed)
    return DataLoader(TensorDataset(x.to(device), y.to(device)), batch_size=batch, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed) if shuffle else None)


@contextlib.contextmanager
def another_process_spinning() -> Iterator[None]:
    """A busy loop in a process that is not our descendant (its parent shell exits), for the length of the
    block: the load of "other processes" that torchspeed must notice and name. Started 0.2 s before."""
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    pid = int(out.stdout.strip())
    try:
        time.sleep(0.2)
        yield
    finally:
        os.kill(pid, signal.SIGKILL)


class FakeClock(types.ModuleType):
    """`time` for a module whose timing a test judges: `perf_counter()` and `monotonic()` read a clock that
    only `sleep(s)` moves on, at once, so a contender timed is exactly as slow as the fake it runs says,
    on a quiet or a busy machine alike, and no real time passes. Each reading also moves it on 1 us, so a
    loop that waits for time to pass always ends. Patched in with `fake_clock(monkeypatch, module, ...)`;
    the fakes call `clock.sleep`. Sleeps of several threads add up (as if one after the other)."""

    TICK_S = 1e-6

    def __init__(self) -> None:
        super().__init__("time")
        self.now = 0.0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.now += max(0.0, seconds)

    def perf_counter(self) -> float:
        with self._lock:
            self.now += self.TICK_S
            return self.now

    monotonic = perf_counter


def fake_clock(monkeypatch, *modules: types.ModuleType, clock: FakeClock | None = None) -> FakeClock:
    """A FakeClock (`clock`, or a new one) patched in as the `time` of each of `modules` (those that time what
    the test judges)."""
    clock = clock or FakeClock()
    for module in modules:
        monkeypatch.setattr(module, "time", clock)
    return clock


def cpu_torchrun(code: str, folder: Path, *args: object, name: str = "script.py", nproc: int = 2,
                 timeout: float = 240) -> subprocess.CompletedProcess:
    """`code` written to `folder/name` and run by torchrun as `nproc` CPU ranks (gloo, one thread each, no GPU
    seen) with `folder` and `args` as its arguments; a hang or a failing rank fails the test with its stderr."""
    script = Path(folder) / name
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           str(folder), *map(str, args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung (killed after {e.timeout} s): {e.stderr!r:.2000}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
