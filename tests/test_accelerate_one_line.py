"""`model, optimizer, loader = ts.train.accelerate(model, optimizer, loader)`: the user's unchanged loop
runs at the chosen precision and memory format; the model keeps its names, attributes and checkpoints;
decisions are remembered; clear errors come before any trial; fp16 never steps unscaled gradients."""
import copy
import glob
import json
import logging
import os

import pytest
import torch
from helpers import separable_images, separable_loader, tiny_convnet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed import measure
from torchspeed.runtime import cache_dir
from torchspeed.train import Accelerated, accelerate
from torchspeed.train.acceleration import AccelerateResult
from torchspeed.train.mixed_precision import autocast_once
from torchspeed.train.step_timer import StepTimer
from torchspeed.train.wrapping import warn_if_unsharded

GIVEN = dict(precision="fp32", channels_last=False, compile=False)


class Recording(nn.Module):
    """A conv net whose forward records what its activations were: dtype and NHWC layout."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 2)
        self.seen = []

    def forward(self, x):
        h = self.conv(x)
        self.seen.append((h.dtype, x.is_contiguous(memory_format=torch.channels_last),
                          h.is_contiguous(memory_format=torch.channels_last)))
        return self.fc(torch.relu(h).mean((2, 3)))


def test_an_unchanged_loop_runs_at_the_chosen_precision_and_memory_format():
    model = Recording()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = separable_loader(128, 32)
    model, optimizer, loader = accelerate(model, optimizer, loader, precision="bf16", channels_last=True,
                                          compile=False)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(3):
        for x, y in loader:  # the user's loop, unchanged
            out = model(x)
            assert out.dtype == torch.float32  # outputs come back in fp32 for the loss
            loss = criterion(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    assert model.seen and all(s == (torch.bfloat16, True, True) for s in model.seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # mixed precision: fp32 weights
    assert sum(losses[-4:]) < sum(losses[:4])


def test_the_wrapped_model_keeps_the_users_names_attributes_and_checkpoints():
    plain = Recording()
    acc = accelerate(plain, torch.optim.SGD(plain.parameters(), lr=0.1), **GIVEN)
    model = acc.model
    assert model.fc is plain.fc and model.module is plain and Accelerated.of(model).module is plain
    assert list(model.state_dict()) == list(plain.state_dict()) == ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    other = Recording()
    nn.init.zeros_(other.fc.weight)
    model.load_state_dict(other.state_dict())  # loads into the plain model ...
    assert torch.equal(plain.fc.weight, other.fc.weight)
    other.load_state_dict(model.state_dict())  # ... and back
    model.eval()
    assert not plain.training and not model.training
    model.train()
    assert plain.training
    twin = copy.deepcopy(model)
    assert twin.module is not plain and torch.equal(twin.fc.weight, plain.fc.weight)
    assert twin(torch.randn(2, 3, 8, 8)).shape == (2, 2)
    model.fc = nn.Linear(8, 3)  # a layer replaced through the wrapper replaces the user's
    assert plain.fc.out_features == 3 and model(torch.randn(2, 3, 8, 8)).shape == (2, 3)


def test_no_prefix_leaks_from_torch_compile():
    plain = tiny_convnet()
    acc = accelerate(plain, None, precision="fp32", channels_last=False, compile=True)
    assert hasattr(acc.wrapped, "_orig_mod")
    assert list(acc.model.state_dict()) == list(tiny_convnet().state_dict())
    tiny_convnet().load_state_dict(acc.model.state_dict())


def test_the_explicit_style_does_not_enter_autocast_twice():
    plain = Recording()
    acc = accelerate(plain, None, precision="bf16", channels_last=False, compile=False)
    dev = torch.device("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert isinstance(autocast_once(dev, "bf16"), type(autocast_once(dev, "fp32")))  # nothing entered
        out = acc.model(acc.prepare_input(torch.randn(2, 3, 8, 8)))
    assert isinstance(autocast_once(dev, "bf16"), torch.autocast)
    assert plain.seen[-1][0] == torch.bfloat16 and out.dtype == torch.float32


def test_the_returned_loader_yields_device_batches_and_is_the_users_loader_otherwise():
    base = separable_loader(64, 16, shuffle=True)
    model = tiny_convnet()
    acc = accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), base, precision="fp32", channels_last=True,
                     compile=False)
    m, o, loader = acc
    assert (len(loader), loader.batch_size, loader.dataset, loader.sampler, loader.drop_last, loader.num_workers) == (
        4, 16, base.dataset, base.sampler, False, 0)
    assert loader.yields_device_batches and loader.generator is base.generator
    x, y = next(iter(loader))
    assert x.is_contiguous(memory_format=torch.channels_last) and x.device.type == "cpu" and y.dtype == torch.int64
    model2, opt2 = accelerate(tiny_convnet(), None, **GIVEN)  # no loader: two parts, as before
    assert opt2 is None


def test_the_example_batch_is_taken_from_the_loader_without_moving_rng_or_position():
    base, model = separable_loader(64, 16, shuffle=True), tiny_convnet()
    torch.manual_seed(5)
    gen_state, expected = base.generator.get_state(), torch.rand(3)
    torch.manual_seed(5)
    # channels_last "auto" is timed on every machine (precision "auto" only where the CPU has native bf16)
    acc = accelerate(model, None, base, precision="fp32", channels_last="auto", compile=False, trial_steps=1)
    assert torch.equal(torch.rand(3), expected) and torch.equal(base.generator.get_state(), gen_state)
    assert any(r.step_s for r in acc.report.candidates)  # measured on the loader's batch


def test_a_string_as_third_argument_says_to_pass_precision_by_keyword():
    model = tiny_convnet()
    with pytest.raises(TypeError, match="precision='bf16'"):
        accelerate(model, None, "bf16")


def test_a_second_accelerate_recalls_and_refresh_measures_again(caplog, capsys, monkeypatch):
    monkeypatch.setattr(AccelerateResult, "busy_warning", property(lambda self: None))  # a quiet machine
    x, y = separable_images(32)
    kw = dict(precision="fp32", channels_last="auto", compile=False, example_batch=(x, y), trial_steps=1)
    first = accelerate(tiny_convnet(), None, **kw).report
    assert any(r.step_s for r in first.candidates)  # measured
    lines = []
    with caplog.at_level(logging.INFO, logger="torchspeed"):
        second = accelerate(tiny_convnet(), None, progress=lines.append, **kw).report  # a fresh model, same kind
    assert not any(r.step_s for r in second.candidates)
    row = {r.setting: r for r in second.candidates}["channels_last"]
    assert row.decision.startswith("remembered from ") and "ms/step" in row.decision
    assert (second.precision, second.channels_last, second.compile) == (first.precision, first.channels_last, False)
    remembered_lines = [r.message for r in caplog.records if "remembered from" in r.message]
    assert len(remembered_lines) == 1 and lines == [f"accelerate: {row.decision}"]
    third = accelerate(tiny_convnet(), None, refresh=True, **kw).report
    assert any(r.step_s for r in third.candidates)
    assert capsys.readouterr().err == ""  # nothing printed without progress=
    other = accelerate(tiny_convnet(width=4), None, **kw).report  # another structure: measured
    assert any(r.step_s for r in other.candidates)


def test_a_remembered_decision_edited_into_nonsense_is_measured_again(monkeypatch):
    """A remembered decision holding a value accelerate() never chooses is unusable: measured again."""
    monkeypatch.setattr(AccelerateResult, "busy_warning", property(lambda self: None))  # a quiet machine
    kw = dict(precision="fp32", channels_last="auto", compile=False, example_batch=separable_images(32), trial_steps=1)
    accelerate(tiny_convnet(), None, **kw)
    for edit in ({"precision": "int4"}, {"logits_width": "wide"}, {"compile": "yes please"}, {"channels_last": [1]},
                 {"tf32": 1}, {"logits_width": True}):
        (path,) = glob.glob(os.path.join(cache_dir("decisions", "accelerate"), "*.json"))
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["decision"].update(edit)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
        again = accelerate(tiny_convnet(), None, **kw).report
        assert any(r.step_s for r in again.candidates), edit  # measured again, not used
        assert again.precision == "fp32" and type(again.channels_last) is bool and again.compile is False
    assert not any(r.step_s for r in accelerate(tiny_convnet(), None, **kw).report.candidates)  # sound: recalled


def test_a_choice_measured_on_a_busy_machine_is_not_remembered(monkeypatch):
    monkeypatch.setattr(AccelerateResult, "busy_warning", property(lambda self: "the machine was busy"))
    kw = dict(precision="fp32", channels_last="auto", compile=False, example_batch=separable_images(32),
              trial_steps=1)
    accelerate(tiny_convnet(), None, **kw)
    again = accelerate(tiny_convnet(), None, **kw).report
    assert any(r.step_s for r in again.candidates)  # measured again, not recalled


def test_progress_says_one_line_per_trial_and_waits_for_a_quiet_machine(monkeypatch):
    waits = []
    monkeypatch.setattr(measure, "wait_for_quiet_machine",
                        lambda **kw: waits.append(kw) or measure.Quiet(0.0, 0.0))
    lines = []
    rep = accelerate(tiny_convnet(), None, precision="fp32", compile=False, example_batch=separable_images(32),
                     trial_steps=1, progress=lines.append).report
    trials = [r for r in rep.candidates if r.step_s is not None]
    assert len(lines) == len(trials) == 2 and all(line.startswith("accelerate: channels_last ") for line in lines)
    assert len(waits) == 1 and waits[0]["max_s"] <= 5


def test_compile_without_expected_steps_is_weighed_against_the_default_horizon(monkeypatch):
    monkeypatch.setattr(StepTimer, "measure", lambda self, step: (0.002, 0.002))  # 2 ms a step: 2 s in 1000
    rep = accelerate(tiny_convnet(), None, precision="fp32", channels_last=False,
                     example_batch=separable_images(16)).report
    row = [r for r in rep.candidates if r.setting == "compile" and r.value == "True"][0]
    assert row.decision.startswith("not tried: expected run ~") and "1000 steps: the default horizon" in row.decision
    assert not rep.compile


class _Named(TensorDataset):
    classes = ["a", "b", "c", "d"]


def test_too_few_outputs_for_the_loaders_classes_fails_before_any_trial(monkeypatch):
    x, y = separable_images(32)  # labels 0/1 only; the dataset names 4 classes
    loader = DataLoader(_Named(x, y), batch_size=16)
    timed = []
    monkeypatch.setattr(measure, "compare", lambda *a, **k: timed.append(1))
    with pytest.raises(ValueError, match=r"gives 2 output\(s\).*the data has 4 classes"):
        accelerate(tiny_convnet(classes=2), None, loader, loss_fn=nn.CrossEntropyLoss(), compile=False)
    assert not timed


def test_a_batch_the_model_cannot_take_names_its_shapes():
    loader = DataLoader(TensorDataset(torch.randn(8, 5, 8, 8), torch.zeros(8, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match=r"cannot take the training batch \(inputs \(4, 5, 8, 8\) float32\).*"
                                         r"RuntimeError.*channels"):
        accelerate(tiny_convnet(), None, loader, compile=False)


def test_an_optimizer_that_does_not_hold_the_models_parameters_is_refused():
    model = tiny_convnet()
    with pytest.raises(ValueError, match="lacks 4 of the model's 4 trainable parameters"):
        accelerate(model, torch.optim.SGD(tiny_convnet().parameters(), lr=0.1), **GIVEN)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model[-1] = nn.Linear(8, 3)  # the head replaced after the optimizer was made
    with pytest.raises(ValueError, match="lacks 2 of the model's 4 .*holds 2 tensor\\(s\\) that are not"):
        accelerate(model, optimizer, **GIVEN)
    head_only = torch.optim.SGD(model[-1].parameters(), lr=0.1)  # fine-tuning a part: allowed
    accelerate(model, head_only, **GIVEN)


def _fp16_like(model, optimizer):
    """accelerate()'s fp16 set-up, built on the CPU: a GradScaler beside an fp32-prepared model."""
    acc = accelerate(model, optimizer, **GIVEN)
    return Accelerated(acc.model, optimizer, AccelerateResult(device="cpu", precision="fp16"), acc.device,
                       acc.module, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))


def test_fp16_refuses_a_plain_step_before_any_weight_changes():
    model = tiny_convnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = _fp16_like(model, optimizer)
    x, y = separable_images(16)
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.cross_entropy(acc.model(x), y).backward()
    with pytest.raises(RuntimeError, match="outside acc.step"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="no acc.backward"):
        acc.step(optimizer)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    optimizer.zero_grad()
    acc.backward(nn.functional.cross_entropy(acc.model(x), y))
    assert acc.step() is True
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(RuntimeError, match="no acc.backward"):  # one backward, one step
        acc.step()


def test_a_dataloader_without_a_distributed_sampler_is_named_under_torchrun(caplog):
    loader = separable_loader(32, 8)
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        warn_if_unsharded(loader, 1)
        assert not caplog.records
        warn_if_unsharded(loader, 2)
    assert "without a DistributedSampler" in caplog.text and "each rank would see all the data" in caplog.text
