"""Where a step's memory goes: parameters, gradients and optimizer state counted against numel x element
size, activations against the tensors autograd saves, the parts adding up to the peak read from the
allocator, the step measured apart from the timed ones, and CUDA's one host sync per step."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn

from torchspeed.doctor import profiling
from torchspeed.doctor.launch import build_payload
from torchspeed.doctor.memory_breakdown import PARTS, StepMemory, state_bytes
from torchspeed.doctor.output import format_profile, markdown
from torchspeed.doctor.recorder import Recorder
from torchspeed.memory import CPU_ALLOCATOR

B, IN, HID, OUT = 64, 96, 160, 8


def _stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _step(model, opt, x, y, acct=None):
    mark = acct.boundary if acct is not None else (lambda phase: None)
    mark("forward")
    loss = nn.functional.cross_entropy(model(x), y)
    mark("backward")
    loss.backward()
    mark("optimizer")
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark(None)


def test_state_bytes_are_numel_times_element_size_and_adam_keeps_two_per_parameter():
    model = _stack()
    opt = torch.optim.Adam(model.parameters())
    params = list(model.parameters())
    before = state_bytes(model, [opt])
    assert before == {"parameters": _nbytes(params), "gradients": 0, "optimizer_state": 0}
    x, y = torch.randn(B, IN), torch.randint(0, OUT, (B,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    after = state_bytes(model, [opt])
    steps = [s["step"] for s in opt.state.values()]  # Adam's step counters: one scalar per parameter
    assert after["gradients"] == _nbytes(params)
    assert after["optimizer_state"] == 2 * _nbytes(params) + _nbytes(steps)
    assert state_bytes(model, [opt], device="meta")["parameters"] == 0  # only the device asked for


def test_activations_are_the_tensors_autograd_saves_named_by_module():
    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(B, IN)
    acct = StepMemory(model, [opt], "cpu", step=1)
    acct.start()
    acct.boundary("forward")
    out = model(x).sum()  # sum saves no tensor: what is saved is the two Linears' inputs (ReLU's output, once)
    acct.boundary("backward")
    out.backward()
    acct.boundary("optimizer")
    opt.step()
    r = acct.finish()
    assert r.activations_bytes == B * IN * 4 + B * HID * 4
    by_module = {p["module"]: p for p in r.producers}
    assert by_module["0"]["bytes"] == B * IN * 4 and by_module["0"]["type"] == "Linear"  # x, saved by the Linear
    assert by_module["1"]["bytes"] == B * HID * 4 and by_module["1"]["type"] == "ReLU"  # its output, saved once
    assert "2" not in by_module  # the second Linear saved ReLU's output again (the same storage) and a weight


PARTS_ADD_UP = """
import json, sys
import pytest
import torch
sys.path.insert(0, {tests!r})
from test_doctor_memory import _stack, _step, B, IN, OUT
from torchspeed.doctor.memory_breakdown import StepMemory
from torchspeed.memory import peak_of
model = _stack()
opt = torch.optim.Adam(model.parameters())
x, y = torch.randn(B, IN), torch.randint(0, OUT, (B,))
_step(model, opt, x, y)  # Adam's state exists from here on
_, reference = peak_of(_step, model, opt, x, y, held=(model, opt))  # the same step, read on its own
acct = StepMemory(model, [opt], "cpu", step=2)
acct.start()
_step(model, opt, x, y, acct)
breakdown = acct.finish().to_dict()
nn_loss = torch.nn.functional.cross_entropy(model(x), y)  # gradients held when the next accounting starts
nn_loss.backward()
del nn_loss
held = StepMemory(model, [opt], "cpu", step=3)
held.start()
opt.zero_grad(set_to_none=True)  # frees gradients allocated before the profiler started
held.boundary("data")  # nothing allocated in this phase
print(json.dumps({{"reference": reference.to_dict(), "breakdown": breakdown, "held": held.finish().to_dict(),
                  "params": sum(p.numel() * 4 for p in model.parameters())}}))
"""


def test_the_parts_add_up_to_the_peak_the_allocator_reads():
    """In a fresh process: torch's CPU allocator remembers the sizes of blocks a profiler saw allocated, and
    a block freed after that profiler stopped, its address reused, reads as a free in the next one."""
    code = PARTS_ADD_UP.format(tests=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    r, reference = got["breakdown"], got["reference"]
    assert r["source"] == reference["source"] == CPU_ALLOCATOR
    assert set(r["parts"]) == set(PARTS) and sum(r["parts"].values()) == r["peak_bytes"]
    assert abs(r["peak_bytes"] - reference["peak_bytes"]) <= 0.01 * reference["peak_bytes"]
    assert r["parts"]["parameters"] == got["params"] and r["parts"]["optimizer_state"] >= 2 * got["params"]
    assert max(r["phases"].values()) == r["peak_bytes"] and r["peak_phase"] in r["phases"]
    assert set(r["phases"]) >= {"forward", "backward", "optimizer"}
    held = got["held"]  # gradients freed after the profiler started are no longer counted
    assert held["phases"]["data"] == held["parts"]["parameters"] + held["parts"]["optimizer_state"]
    assert held["phases"]["other"] == held["phases"]["data"] + got["params"]  # before zero_grad: with them


def test_the_accounting_changes_no_result_and_leaves_no_hook():
    x, y = torch.randn(B, IN), torch.randint(0, OUT, (B,))
    plain, counted = _stack(), _stack()
    for model, count in ((plain, False), (counted, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _step(model, opt, x, y)
        if count:
            acct = StepMemory(model, [opt], "cpu", step=2)
            acct.start()
            _step(model, opt, x, y, acct)
            acct.finish()
        else:
            _step(model, opt, x, y)
    for a, b in zip(plain.parameters(), counted.parameters()):
        assert torch.equal(a, b)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not nn.modules.module._global_forward_pre_hooks and not nn.modules.module._global_forward_hooks


def test_a_scripts_own_saved_tensor_hooks_are_left_in_charge():
    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(B, IN), torch.randint(0, OUT, (B,))
    with torch.autograd.graph.save_on_cpu():
        theirs = torch._C._autograd._top_saved_tensors_default_hooks(False)
        acct = StepMemory(model, [opt], "cpu", step=1)
        acct.start()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) == theirs  # not replaced by ours
        _step(model, opt, x, y, acct)
        r = acct.finish()
    assert r.activations_bytes == 0 and r.parts["activations"] == 0
    assert any("saved-tensor hooks of its own" in n for n in r.notes)


def _loop(model, opt, loader, epochs=3):
    def run():
        for _ in range(epochs):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return run


def _recorded(model, opt, loader, max_steps):
    """What doctor's recorder (memory on) keeps of `_loop` stopped after `max_steps` steps."""
    rec = Recorder(max_steps=max_steps, memory=True)
    rec.install()
    try:
        _loop(model, opt, loader)()
    except SystemExit:  # the recorder ends the script after max_steps
        pass
    finally:
        rec.uninstall()
    return rec.results()


def test_doctor_measures_memory_in_its_own_step_left_out_of_the_time_figures():
    model, loader = tiny_convnet(batchnorm=True), separable_loader(96, 16)
    opt = torch.optim.Adam(model.parameters())
    raw = json.loads(json.dumps(_recorded(model, opt, loader, 6)))  # the record crosses to the parent as JSON
    m = raw["memory"]
    assert m["step"] == 3 and m["source"] == CPU_ALLOCATOR  # CPU: the profiler runs from step 2
    assert sum(m["parts"].values()) == m["peak_bytes"] > 0
    assert m["parts"]["parameters"] == _nbytes(model.parameters())
    assert m["parts"]["optimizer_state"] >= 2 * _nbytes(model.parameters())
    assert m["producers"] and m["producers"][0]["module"] in {"0", "1", "2"}  # the conv, its norm, its ReLU
    assert [i for i, w in enumerate(raw["windows"]) if w.get("memory")] == [1, 2]
    d = build_payload(raw, ["python", "t.py"], 0)
    assert d["steps"] == 6 and d["steady"]["steps"] == 3  # steps 4-6: not the warm-up, not the memory steps
    assert any("left out of the time figures" in e for e in d["evidence"])
    text = format_profile({**d, "steps": d["steady"]["steps"], "wall_s": d["steady"]["wall_s"],
                           "phases": d["steady"]["phases"]})
    assert "Where the memory goes" in text and "optimizer state" in text and "Largest activation producers" in text
    assert "## Where the memory goes" in markdown(d, "r")


def test_a_script_shorter_than_the_memory_step_says_so():
    model, loader = tiny_convnet(), separable_loader(32, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    raw = _recorded(model, opt, loader, 1)
    assert "the script ran 1" in raw["memory"]["skipped"] and not any(w.get("memory") for w in raw["windows"])
    assert "not measured" in format_profile({**build_payload(raw, ["python", "t.py"], 0), "steps": 1})


def test_profile_reports_where_one_more_steps_memory_goes():
    model, loader = tiny_convnet(), separable_loader(64, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    r = profiling.profile(model, loader, opt, nn.CrossEntropyLoss(), steps=2, warmup=1)
    m = r.to_dict()["memory"]
    assert m["step"] == 4 and sum(m["parts"].values()) == m["peak_bytes"]
    assert m["parts"]["parameters"] == _nbytes(model.parameters())
    assert m["parts"]["optimizer_state"] == _nbytes(model.parameters())  # SGD's momentum: one per parameter
    assert "Where the memory goes" in str(r)
    assert profiling.profile(model, loader, opt, nn.CrossEntropyLoss(), steps=1, warmup=0, memory=False).memory is None


class _FakeEvent:
    """A CUDA event on a fake clock: what the recorder marks and reads, without a GPU."""
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e-3  # 1 us per tick, in ms


def test_doctor_syncs_the_device_once_per_step_on_cuda(monkeypatch):
    """With gradient accumulation (two backward calls per optimizer step): one torch.cuda.synchronize at
    each step's end, none at the backward that does not end it, and every segment read on the timeline."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    rec.optimizer_made(opt)
    rec._cuda_on()  # as when the loop's first CUDA tensor is seen
    x, y = torch.randn(B, IN), torch.randint(0, OUT, (B,))
    for step in range(3):
        for _ in range(2):
            rec.enter("forward")
            loss = nn.functional.cross_entropy(model(x), y)
            rec.exit()
            loss, depth = rec.backward_begin(loss)
            loss.backward()
            rec.unwind(depth)
            rec.backward_end()
        rec.optimizer_step_begin(opt)
        opt.step()
        rec.optimizer_step_end(opt)
        assert len(syncs) == step + 1
    assert rec.steps == 3 and not rec._unread
    for w in rec.windows[1:]:  # read on the fake timeline: whole ticks of 1 us
        assert w["phases"]["forward"] > 0 and w["phases"]["backward"] > 0
        assert all(round(v * 1e6, 6) == round(v * 1e6) for k, v in w["phases"].items() if k != "other")


def test_profile_syncs_the_device_once_per_step_on_cuda(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(profiling._Step, "cuda", property(lambda self: True))
    model = _stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = profiling._Step(model, opt, nn.CrossEntropyLoss(), torch.device("cpu"), profiling.BatchFormat.of(None), None)
    batches = profiling._Restarting([(torch.randn(B, IN), torch.randint(0, OUT, (B,)))])
    for n in range(1, 4):
        parts, wall, _, _ = profiling._timed_step(step, batches)
        assert len(syncs) == n and parts["forward"] > 0


def test_first_batches_and_the_loss_input_check_are_read_after_the_loop():
    """What doctor reads of the loop's tensors (labels, image statistics, a loss fed probabilities) stays
    on the tensors' device until the run ends: on CUDA a read in the loop would be a host sync."""
    loader, model = separable_loader(8, 4), tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    rec.install()
    try:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x).softmax(1), y)  # probabilities: the double-softmax bug
            opt.zero_grad()
            loss.backward()
            opt.step()
        kept = rec._prints[0][1]
        assert isinstance(kept, torch.Tensor) and not rec.s["loss_checks"]  # nothing read yet
    finally:
        rec.uninstall()
    raw = rec.results()
    assert raw["batch_prints"][0][1] == [int(v) for v in next(iter(loader))[1]]
    assert raw["batch_stats"][0]["means"] and len(raw["batch_stats"][0]["std"]) == 3
    assert [c["rule"] for c in raw["settings"]["loss_checks"]] == ["double-softmax"]


@pytest.mark.gpu
def test_cuda_breakdown_reads_the_allocator_without_a_sync(monkeypatch):
    """On CUDA: the caching allocator's counters, read and reset with no device sync between start() and
    finish(); the activations those of the Linear stack; the parts adding up to the peak, which is no
    more than the allocator's own peak over the step."""
    dev = torch.device("cuda")
    model = _stack().to(dev)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(B, IN, device=dev), torch.randint(0, OUT, (B,), device=dev)
    _step(model, opt, x, y)
    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1) or real_sync(*a, **k))

    def step(acct=None):
        mark = acct.boundary if acct is not None else (lambda phase: None)
        mark("forward")
        out = model(x).sum()
        mark("backward")
        out.backward()
        mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark(None)

    acct = StepMemory(model, [opt], dev, step=2)
    acct.start()
    step(acct)
    r = acct.finish()
    assert not syncs
    real_sync()
    torch.cuda.reset_peak_memory_stats()
    step()  # the same step, its peak read on its own
    real_sync()
    reference = torch.cuda.max_memory_allocated()
    assert r.source == "cuda allocator" and r.device == "cuda"
    assert r.activations_bytes == B * IN * 4 + B * HID * 4
    assert sum(r.parts.values()) == r.peak_bytes and abs(r.peak_bytes - reference) <= 0.01 * reference
    assert r.parts["parameters"] == _nbytes(model.parameters())
    assert r.parts["optimizer_state"] == 2 * _nbytes(model.parameters())  # Adam's step counters stay on the CPU


UNCHANGED_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters())
x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
while True:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.timeout(180)
def test_doctor_command_reports_memory_in_console_and_json_and_no_memory_skips_it(tmp_path, capsys):
    from torchspeed.cli import main

    script = tmp_path / "train.py"
    script.write_text(UNCHANGED_SCRIPT)
    assert main(["doctor", "--steps", "5", "--json", str(tmp_path / "d.json"), "--", sys.executable, str(script)]) == 0
    printed = capsys.readouterr().out
    d = json.loads((tmp_path / "d.json").read_text())
    m = d["memory"]
    params = (32 * 64 + 64 + 64 * 4 + 4) * 4
    assert m["parts"]["parameters"] == params and m["parts"]["optimizer_state"] >= 2 * params
    assert m["producers"][0]["module"] in {"0", "1"} and sum(m["parts"].values()) == m["peak_bytes"]
    assert "Where the memory goes" in printed and "activations (saved for backward)" in printed
    assert d["steps"] == 5 and d["steady"]["steps"] == 2  # steps 2-3 measured memory, step 1 warmed up
    assert main(["doctor", "--steps", "3", "--no-memory", "--json", str(tmp_path / "n.json"), "--",
                 sys.executable, str(script)]) == 0
    n = json.loads((tmp_path / "n.json").read_text())
    assert n["memory"] is None and n["steady"]["steps"] == 2
    assert "Where the memory goes" not in capsys.readouterr().out
