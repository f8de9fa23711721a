"""doctor on a CUDA script (marked gpu; the GPU suite fails without a usable CUDA device): host syncs
counted, phases within the wall time, GPU time charged to the phase that queued it (a stall queued in
forward is forward's, though the host only waits for it at the step's end), and `profile()`'s GPU busy
share taken without the profiler's start-up."""
import pytest
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn

from torchspeed.doctor.recorder import Recorder
from torchspeed.doctor.launch import build_payload

pytestmark = pytest.mark.gpu  # without a usable CUDA device the GPU suite fails (conftest.py), never skips
STALL = 50_000_000  # cycles of torch.cuda._sleep: tens of milliseconds


def _stall_seconds():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(STALL)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


class Stalling(nn.Module):
    """A model whose forward queues a long GPU stall: the host returns at once, the GPU is busy after."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        torch.cuda._sleep(STALL)
        return self.inner(x)


def _recorded_training(model, loader, after_step=None):
    """A plain CUDA training loop over `loader` run under doctor's Recorder; the recorder."""
    model = model.cuda()
    rec = Recorder()
    rec.install()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            x, y = x.cuda(), y.cuda()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if after_step is not None:
                after_step(loss)
    finally:
        rec.uninstall()
    return rec


def test_doctor_counts_host_syncs_and_phases_stay_within_the_wall_time_on_cuda():
    def read_loss(loss):
        loss.item()            # one sync per step
        float(loss)            # and another

    rec = _recorded_training(tiny_convnet(classes=10, width=16), separable_loader(64, 8, size=32), read_loss)
    assert rec.s["host_syncs"] >= 2 * 8
    d = build_payload(rec.results(), ["python", "t.py"], 0)
    assert d["steps"] == 8
    ph = d["steady"]["phases"]
    assert ph["forward"] > 0 and ph["backward"] > 0 and ph["copy"] > 0
    assert sum(v for k, v in ph.items() if k != "other") <= d["steady"]["wall_s"] * 1.001


def test_doctor_charges_a_gpu_stall_in_forward_to_forward():
    stall = _stall_seconds()
    rec = _recorded_training(Stalling(tiny_convnet(classes=10, width=16)), separable_loader(48, 8, size=32))
    d = build_payload(rec.results(), ["python", "t.py"], 0)
    ph, steps = d["steady"]["phases"], d["steady"]["steps"]
    assert ph["forward"] / steps > 0.8 * stall, (ph, stall)  # queued in forward, charged to forward
    assert ph["optimizer"] + ph["backward"] + ph["other"] < ph["forward"], ph  # not to where the host waited
    assert sum(v for k, v in ph.items() if k != "other") <= d["steady"]["wall_s"] * 1.001


def test_profile_busy_share_leaves_out_the_profilers_start_up():
    from torchspeed.doctor import profile

    model = tiny_convnet(classes=10, width=16).cuda()
    res = profile(Stalling(model), separable_loader(64, 8, size=32), torch.optim.SGD(model.parameters(), lr=0.1),
                  nn.functional.cross_entropy, steps=4, warmup=1)
    # every step is mostly the stall: the GPU is busy nearly all of it, and the verdict is not overhead
    assert res.gpu_busy_s is not None and res.gpu_busy_s / res.wall_s > 0.7, res.to_dict()
    assert res.verdict == "compute-bound", res.evidence
