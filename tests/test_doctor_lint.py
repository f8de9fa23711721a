"""doctor.lint: per-layer costs against analytic FLOPs, and each rule firing (or staying quiet)."""
import json
import os

import pytest
import torch
from torch import nn

from helpers import another_process_spinning

import torchspeed as ts
from torchspeed.measure import OthersLoad


@pytest.fixture(autouse=True)
def one_thread():
    """Per-op times at one thread: on a loaded machine a 2-thread op can stall for a whole time slice."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rules(report):
    return [f.rule for f in report.findings]


class Head(nn.Module):
    def __init__(self, final):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        self.final = final

    def forward(self, x):
        return self.final(self.body(x))


X = torch.randn(2, 3, 16, 16)


def test_softmax_into_cross_entropy_is_double_softmax():
    r = ts.doctor.lint(Head(nn.Softmax(dim=1)), X, loss_fn=nn.CrossEntropyLoss())
    assert rules(r)[0] == "double-softmax" and r.findings[0].severity == "bug"
    assert r.findings[0].where == ["final"]


def test_softmax_into_nll_and_log_softmax_pairing():
    r = ts.doctor.lint(Head(nn.Softmax(dim=1)), X, loss_fn=nn.NLLLoss())
    assert "softmax-nll" in rules(r)
    r = ts.doctor.lint(Head(nn.Softmax(dim=1)), X, loss_fn=lambda o, t: nn.functional.nll_loss(torch.log(o), t))
    assert "softmax-nll" in rules(r)
    ok = ts.doctor.lint(Head(nn.LogSoftmax(dim=1)), X, loss_fn=nn.NLLLoss())
    assert not {"softmax-nll", "double-softmax"} & set(rules(ok))
    ok = ts.doctor.lint(Head(nn.Identity()), X, loss_fn=nn.CrossEntropyLoss())
    assert not {"softmax-nll", "double-softmax"} & set(rules(ok))


def test_1_to_12_pointwise_block_breaks_g1():
    m = nn.Sequential(nn.Conv2d(32, 384, 1), nn.Conv2d(384, 32, 1))
    r = ts.doctor.lint(m, torch.randn(1, 32, 28, 28))
    g1 = [f for f in r.findings if f.rule == "g1-channel-ratio"]
    assert g1 and g1[0].where == ["0 (32->384, 1:12)", "1 (384->32, 1:12)"]
    assert 0 < g1[0].expected_gain < 1


def test_clean_model_is_quiet():
    m = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    r = ts.doctor.lint(m, torch.randn(1, 3, 32, 32), loss_fn=nn.CrossEntropyLoss())
    assert r.findings == [], [(f.rule, f.message) for f in r.findings]


def test_flops_and_memory_match_analytic_values():
    m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False))
    r = ts.doctor.lint(m, torch.randn(2, 8, 10, 10))
    assert r.totals["flops"] == 2 * 2 * 16 * 8 * 9 * 10 * 10
    # memory access: read input and weight, write output (fp32)
    assert r.totals["memory_bytes"] == 4 * (2 * 8 * 100 + 16 * 8 * 9 + 2 * 16 * 100)
    assert r.layers[0]["layer"] == "0" and r.layers[0]["in"] == (2, 8, 10, 10)


def test_groups_fragmentation_unfused_bn_and_channel_alignment_rules_fire():
    class Inception(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.ModuleList(nn.Conv2d(32, 8, 1) for _ in range(4))

        def forward(self, x):
            return torch.cat([b(x) for b in self.b], 1)

    r = ts.doctor.lint(Inception(), torch.randn(1, 32, 16, 16))
    assert "g3-fragmentation" in rules(r)
    r = ts.doctor.lint(nn.Sequential(nn.Conv2d(64, 64, 1, groups=8)), torch.randn(1, 64, 8, 8))
    assert "g2-groups" in rules(r)
    r = ts.doctor.lint(nn.Sequential(nn.Conv2d(64, 64, 3, groups=64)), torch.randn(1, 64, 8, 8))
    assert "g2-groups" not in rules(r)  # depthwise is not the G2 case
    m = nn.Sequential(nn.Conv2d(3, 36, 3), nn.BatchNorm2d(36))
    m.train()
    r = ts.doctor.lint(m, torch.randn(1, 3, 16, 16))
    assert {"unfused-bn", "channels-not-multiple-of-8"} <= set(rules(r))
    assert m.training  # lint restores the mode it found


def test_lint_result_round_trips_through_json_and_prints(tmp_path):
    r = ts.doctor.lint(Head(nn.Softmax(dim=1)), X, loss_fn=nn.CrossEntropyLoss())
    from torchspeed.atomic import write_json

    write_json(tmp_path / "l.json", r.to_dict())
    d = json.loads((tmp_path / "l.json").read_text())
    assert d["findings"][0]["rule"] == "double-softmax"
    assert {"rule", "message", "fix", "expected_gain", "command"} <= set(d["findings"][0])
    assert "double-softmax" in str(r)


def test_lint_refuses_non_modules():
    with pytest.raises(ValueError, match="needs an nn.Module"):
        ts.doctor.lint(lambda x: x, X)


def test_elementwise_heavy_model_breaks_g4():
    class Swishy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 1)

        def forward(self, x):
            x = self.conv(x)
            for _ in range(5):
                x = torch.sigmoid(x) * x + x
            return x

    r = ts.doctor.lint(Swishy(), torch.randn(1, 8, 64, 64))
    g4 = [f for f in r.findings if f.rule == "g4-elementwise"]
    assert g4 and 0 < g4[0].expected_gain <= 0.5
    assert r.by_kind["elementwise"]["ops"] == 15


def _timed_lint():
    """A lint whose timed forward passes last long enough for the load to be sampled."""
    m = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1))
    return ts.doctor.lint(m, torch.randn(4, 3, 64, 64), repeats=10)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
@pytest.mark.real_load
def test_lint_names_a_busy_machine_beside_its_timed_forward():
    with another_process_spinning():
        r = _timed_lint()
    assert r.others_cores > 0.5 and r.to_dict()["others_cores"] == r.others_cores
    assert r.busy.startswith("the machine was busy") and "the machine was busy" in str(r)


def test_lint_on_a_quiet_machine_says_nothing_of_load(monkeypatch):
    monkeypatch.setattr(OthersLoad, "cores", lambda self: 0.0)
    r = _timed_lint()
    assert r.others_cores == 0.0 and r.busy is None and r.to_dict()["busy"] is None
    assert "busy" not in str(r)


def test_lint_waits_for_a_quiet_machine_before_timing(monkeypatch):
    """At most `quiet_wait_s`: a machine that stays busy is timed anyway, and the result says so."""
    import torchspeed.doctor.linting as linting
    from torchspeed.measure import Quiet

    asked = []
    monkeypatch.setattr(linting, "wait_for_quiet_machine", lambda max_s: asked.append(max_s) or Quiet(1.5, 1.0))
    r = ts.doctor.lint(nn.Sequential(nn.Conv2d(3, 8, 3)), X, quiet_wait_s=1.5)
    assert asked == [1.5] and r.waited_s == 1.5 and r.to_dict()["waited_s"] == 1.5
    ts.doctor.lint(nn.Sequential(nn.Conv2d(3, 8, 3)), X, quiet_wait_s=0)
    assert asked == [1.5]  # 0: no wait
