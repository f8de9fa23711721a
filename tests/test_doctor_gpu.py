"""doctor on a CUDA script (marked gpu; skipped without CUDA): host syncs counted, phases within the wall
time, and the `--try` CUDA fixes (pin_memory, cudnn_benchmark, fp16) planned where the script calls for
them."""
import pytest
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn

from torchspeed.doctor.instrument import Recorder
from torchspeed.doctor.launch import build_payload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_doctor_counts_host_syncs_and_phases_stay_within_the_wall_time_on_cuda():
    loader = separable_loader(64, 8, size=32)
    model = tiny_convnet(classes=10, width=16).cuda()
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
