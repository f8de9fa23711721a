"""Trainer, accelerate and EarlyStopping: behaviour on tiny CPU tasks (seconds, not minutes)."""
import json
import logging
import math

import pytest
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn

from torchspeed.runtime import default_precision
from torchspeed.train import Callback, EarlyStopping, Trainer, accelerate


FIXED = dict(precision="fp32", channels_last=False, compile=False, progress=False)


def _first_batch():
    return next(iter(separable_loader(shuffle=True)))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_training_reduces_loss_on_cpu(precision):
    model = tiny_convnet()
    dl = separable_loader(shuffle=True)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), nn.functional.cross_entropy,
                 precision=precision, channels_last=False, compile=False, progress=False)
    before = tr.evaluate(dl)["val_loss"]
    out = tr.fit(dl, dl, epochs=4)
    assert tr.report.precision == precision
    assert out["val_loss"] < before - 0.1, (before, out)
    assert out["val_acc"] > 0.75
    assert all(p.dtype == torch.float32 for p in model.parameters())  # mixed precision keeps fp32 weights


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GradScaler path needs CUDA")
def test_fp16_gradscaler_on_cuda():
    model = tiny_convnet()
    dl = separable_loader(shuffle=True)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.2), nn.functional.cross_entropy, precision="fp16",
                 channels_last=False, compile=False, progress=False, device="cuda")
    before = tr.evaluate(dl)["val_loss"]
    out = tr.fit(dl, dl, epochs=3)
    assert tr.acc.scaler is not None and out["val_loss"] < before
    assert out["skipped_steps"] <= 2  # the scaler's first steps may overflow; counted, not raised


def test_evaluate_matches_a_manual_computation_and_runs_without_autograd():
    model = tiny_convnet(seed=3)
    dl = separable_loader()
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append(torch.is_inference_mode_enabled()))
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED)
    got = tr.evaluate(dl)
    during = list(seen)
    x, y = dl.dataset.tensors
    with torch.no_grad():
        out = model(x)
    assert got["val_loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)
    assert got["val_acc"] == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert during and all(during)


def test_gradient_accumulation_equals_the_big_batch():
    big = tiny_convnet(seed=1)
    Trainer(big, torch.optim.SGD(big.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED).fit(
        separable_loader(64), epochs=1)
    acc = tiny_convnet(seed=1)
    Trainer(acc, torch.optim.SGD(acc.parameters(), lr=0.1), nn.functional.cross_entropy, grad_accum_steps=2,
            **FIXED).fit(separable_loader(64, 16), epochs=1)
    for a, b in zip(big.parameters(), acc.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clipping_scheduler_and_jsonl_log(tmp_path):
    model = tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    log = tmp_path / "m.jsonl"
    tr = Trainer(model, opt, nn.functional.cross_entropy, scheduler=sched, max_grad_norm=1e-3, log_path=log,
                 log_every_n_steps=2, **FIXED)
    tr.fit(separable_loader(shuffle=True), separable_loader(64, shuffle=True), epochs=1, max_steps=8)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)  # stepped every optimizer step: 8 steps, 2 halvings
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
    assert moved <= 8 * 1e-3 * 1.0 + 1e-6  # each step moved at most lr x max_grad_norm
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows if "train_loss" in r][:4] == [2, 4, 6, 8]
    assert {"train_loss", "lr", "samples_per_s"} <= set(rows[0])


class _Poison(nn.Module):
    def __init__(self, at):
        super().__init__()
        self.lin, self.calls, self.at = nn.Linear(3 * 8 * 8, 2), 0, at

    def forward(self, x):
        self.calls += 1
        out = self.lin(x.flatten(1))
        return out * float("nan") if self.calls == self.at else out


def test_nan_loss_is_a_clear_error_naming_the_step():
    model = _Poison(at=3)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 3 \(epoch 1, batch 3\)"):
        tr.fit(separable_loader(shuffle=True), epochs=1)


def test_early_stopping_lightning_semantics():
    class T:
        should_stop = False

    es, t = EarlyStopping(patience=3, min_delta=0.1), T()
    for i, v in enumerate([5.0, 4.0, 3.95, 3.5, 3.99, 3.45, 3.6, 1.0], 1):
        es.on_validation_end(t, {"val_loss": v})
        if t.should_stop:
            break
    # 3.95 and 3.45 are within min_delta of the best: they count against patience, as 3.99 and 3.6 do
    assert (i, es.stopped_at_check, es.best) == (7, 7, 3.5)
    es2, t2 = EarlyStopping("val_acc", mode="max", patience=1), T()
    es2.on_validation_end(t2, {"val_acc": 0.5})
    es2.on_validation_end(t2, {"val_acc": 0.6})
    assert not t2.should_stop
    es2.on_validation_end(t2, {"val_acc": 0.6})
    assert t2.should_stop
    with pytest.raises(ValueError, match="monitors 'val_loss' but validation logged only"):
        EarlyStopping().on_validation_end(T(), {"val_acc": 1.0})
    t3 = T()
    EarlyStopping().on_validation_end(t3, {"val_loss": math.nan})
    assert t3.should_stop


def test_early_stopping_stops_the_trainer_at_the_right_check():
    model = tiny_convnet()
    checks = []

    class Count(Callback):
        def on_validation_end(self, trainer, metrics):
            checks.append(metrics["val_loss"])

    # lr=0: validation loss is flat from the first check, so patience=2 stops at check 3
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.functional.cross_entropy,
                 callbacks=[Count(), EarlyStopping(patience=2)], **FIXED)
    # validation unshuffled: the same float sums every check
    out = tr.fit(separable_loader(64, shuffle=True), separable_loader(64), epochs=20)
    assert len(checks) == 3 and out["epochs"] == 3 and out["stopped_early"]


def test_callback_can_stop_after_a_step():
    class StopAt(Callback):
        def on_step_end(self, trainer, step, metrics):
            assert set(metrics) == {"train_loss", "lr", "samples_per_s"}
            if step == 5:
                trainer.should_stop = True

    model = tiny_convnet()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                 callbacks=[StopAt()], **FIXED)
    assert tr.fit(separable_loader(shuffle=True), epochs=3)["step"] == 5


def test_loss_fn_with_inputs_for_distillation():
    teacher = tiny_convnet(seed=7).eval()

    class KD:
        needs_inputs = True

        def __call__(self, out, y, x):
            with torch.no_grad():
                t = teacher(x)
            return nn.functional.mse_loss(out, t)

    student = tiny_convnet(seed=8)
    tr = Trainer(student, torch.optim.SGD(student.parameters(), lr=0.3, momentum=0.9), KD(), **FIXED)
    dl = separable_loader(shuffle=True)
    before = tr.evaluate(dl)["val_loss"]
    tr.fit(dl, epochs=3)
    assert tr.evaluate(dl)["val_loss"] < before / 2


def test_accelerate_reports_every_candidate_and_restores_weights():
    model = tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _first_batch()
    acc = accelerate(model, opt, example_batch=batch, loss_fn=nn.functional.cross_entropy, trial_steps=2,
                     untried={"compile": "quick mode budget"})
    m, o = acc
    assert m.module is model and acc.module is model and o is opt  # the model wraps the user's own
    rep = acc.report
    settings = {(c.setting, c.value): c for c in rep.candidates}
    precs = ["fp32", default_precision("cpu").name] if default_precision("cpu").name != "fp32" else ["fp32"]
    joint = "precision+channels_last" if len(precs) > 1 else "channels_last"
    combos = [f"{p}+{l}" for p in precs for l in ("NCHW", "NHWC")] if len(precs) > 1 else ["NCHW", "NHWC"]
    tried = [c for c in rep.candidates if c.setting == joint]
    assert [c.value for c in tried] == combos  # every combination measured, interleaved
    assert all(c.step_s > 0 for c in tried)
    assert sum(c.decision == "kept" for c in tried) == 1 and tried[0].decision in ("kept", "baseline")
    kept = [c for c in tried if c.decision == "kept"][0]
    assert kept.value.startswith(rep.precision) or len(precs) == 1
    assert kept.value.endswith("NHWC") == rep.channels_last
    assert settings[("compile", "True")].decision == "not tried: quick mode budget"
    assert rep.to_dict()["candidates"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k])  # trials changed nothing
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["fused"] is True and rep.optimizer == "fused"


def test_accelerate_compile_is_charged_against_the_run_length():
    model = tiny_convnet()
    acc = accelerate(model, None, precision="fp32", channels_last=False, example_batch=_first_batch(),
                     expected_steps=10, min_compile_cost_s=20.0)
    c = [c for c in acc.report.candidates if c.setting == "compile" and c.value == "True"][0]
    assert c.decision.startswith("not tried: expected run") and not acc.report.compile


def test_bad_arguments_are_clear():
    model = tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="precision must be"):
        accelerate(model, opt, precision="fp8")
    with pytest.raises(ValueError, match="needs a batch.*the training loader.*example_batch"):
        accelerate(model, opt)
    with pytest.raises(ValueError, match="fp16.*CUDA"):
        accelerate(model, opt, precision="fp16", channels_last=False, compile=False, device="cpu")
    with pytest.raises(ValueError, match="log_path"):
        Trainer(model, opt, nn.functional.cross_entropy, log_path="x.txt")
    with pytest.raises(ValueError, match="precision must be"):  # refused when the Trainer is made, not at fit
        Trainer(model, opt, nn.functional.cross_entropy, precision="fp8")
    with pytest.raises(ValueError, match="tf32 must be 'auto', True or False"):
        Trainer(model, opt, nn.functional.cross_entropy, accelerate_kwargs={"tf32": "yes"})
    with pytest.raises(ValueError, match="a batch must be"):
        Trainer(model, opt, nn.functional.cross_entropy, **FIXED).fit([torch.zeros(2, 3, 8, 8)], epochs=1)


@pytest.mark.slow
def test_accelerate_tries_compile_and_reports_its_cost():
    model = tiny_convnet()
    acc = accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", channels_last=False,
                     example_batch=_first_batch(), loss_fn=nn.functional.cross_entropy, expected_steps=10**6,
                     min_compile_cost_s=0.0)
    comp = {c.value: c for c in acc.report.candidates if c.setting == "compile"}
    assert comp["True"].step_s > 0 and comp["True"].one_off_s > 0  # measured, with its compile time
    assert comp["True"].decision.startswith(("kept", "rejected"))
    assert acc.report.compile == (comp["True"].decision == "kept")
    assert hasattr(acc.wrapped, "_orig_mod") == acc.report.compile and acc.module is model
    out = acc.model(_first_batch()[0])
    assert out.shape == (32, 2)


# ------------------------------------------------------------------ the plain-loop API: backward / step
def _hand_and_accelerated(precision, seed=0):
    """Two identical nets and plain SGD optimizers: one for a hand-written loop, one through accelerate()."""
    hand, mine = tiny_convnet(seed=seed), tiny_convnet(seed=seed)
    ho = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9)
    mo = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    acc = accelerate(mine, mo, precision=precision, channels_last=False, compile=False, fused_optimizer=False)
    return hand, ho, acc


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_backward_and_step_give_the_hand_loops_losses_gradients_and_weights(precision):
    hand, ho, acc = _hand_and_accelerated(precision)
    model, opt = acc
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    for x, y in list(separable_loader(96)):
        with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
            ref = nn.functional.cross_entropy(hand(x), y)
        ref.backward()
        with acc.autocast():
            loss = nn.functional.cross_entropy(model(acc.prepare_input(x)), acc.prepare_input(y))
        acc.backward(loss)
        assert torch.equal(loss.detach(), ref.detach())
        for a, b in zip(hand.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
        ho.step()
        ho.zero_grad(set_to_none=True)
        assert acc.step(opt) is True  # taken (no GradScaler here)
        assert all(p.grad is None for p in model.parameters())  # step() clears the gradients
    for a, b in zip(hand.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_step_clips_the_gradient_norm_before_stepping():
    hand, ho, acc = _hand_and_accelerated("fp32", seed=4)
    model, opt = acc
    x, y = next(iter(separable_loader(32)))
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.cross_entropy(hand(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(hand.parameters(), 1e-3)
    assert total > 1e-2  # so the clipping below really changes the step
    ho.step()
    with acc.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    acc.backward(loss)
    assert acc.step(max_grad_norm=1e-3)  # the optimizer given to accelerate() is the default
    for a, b in zip(hand.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm()
    assert moved <= 0.1 * 1e-3 * (1 + 1e-5)  # lr x max_grad_norm


# ------------------------------------------------------------------ a model accelerate() prepared, given to the Trainer
def test_trainer_takes_a_prepared_model_without_measuring_again(monkeypatch):
    from torchspeed.train import acceleration, step_timer

    model = tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    acc = accelerate(model, opt, example_batch=_first_batch(), loss_fn=nn.functional.cross_entropy,
                     trial_steps=1, untried={"compile": "test budget"})
    timers = []
    real_init = step_timer.StepTimer.__init__
    monkeypatch.setattr(step_timer.StepTimer, "__init__",
                        lambda self, *a, **kw: (timers.append(1), real_init(self, *a, **kw))[1])
    m, o = acc
    tr = Trainer(m, o, nn.functional.cross_entropy, progress=False)
    before = tr.evaluate(separable_loader(shuffle=True))["val_loss"]
    out = tr.fit(separable_loader(shuffle=True), separable_loader(shuffle=True), epochs=2)
    assert timers == [] and tr.report is acc.report  # no trials: the same report, the same choices
    assert tr.model is m and tr.module is model and tr.optimizer is opt
    assert out["val_loss"] < before
    # the Accelerated itself, the optimizer taken from it
    tr2 = Trainer(acc, loss_fn=nn.functional.cross_entropy, progress=False)
    assert tr2.acc is acc and tr2.optimizer is opt
    tr2.fit(separable_loader(64, shuffle=True), epochs=1)
    assert timers == []
    # a setting that contradicts the preparation is an error, not silently ignored
    other = "fp32" if acc.report.precision != "fp32" else "bf16"
    with pytest.raises(ValueError, match=f"prepared by accelerate\\(\\) with precision={acc.report.precision}"):
        Trainer(m, o, nn.functional.cross_entropy, precision=other)
    # the Trainer's own preparation is not taken for a user's: a new Trainer prepares the model afresh
    plain = tiny_convnet()
    tr3 = Trainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED)
    tr3.fit(separable_loader(64, shuffle=True), epochs=1)
    assert acceleration.Accelerated.of(plain) is None


def test_trainer_takes_a_wrapped_model_that_accelerate_returned():
    model = tiny_convnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o = accelerate(model, opt, precision="fp32", channels_last=False, compile=True)
    assert hasattr(m.wrapped, "_orig_mod")  # torch.compile's wrapper (compiles lazily, on the first call)
    tr = Trainer(m, o, nn.functional.cross_entropy, progress=False)  # no "already wrapped" error
    assert tr.model is m and tr.module is model and tr.report.compile
    with pytest.raises(ValueError, match="already wrapped"):
        accelerate(m, o, precision="fp32", channels_last=False, compile=False)


# ------------------------------------------------------------------ the loss stays on the device
class _CountedLoss(torch.Tensor):
    """A loss tensor that counts every read to the host (and keeps doing so through detach/stack/...)."""

    reads: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "__float__", "tolist", "cpu", "numpy", "__bool__", "__int__",
                                             "__format__"):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_loss_is_read_at_logging_points_not_every_step(tmp_path):
    _CountedLoss.reads = []
    model = tiny_convnet()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: nn.functional.cross_entropy(
        out, y).as_subclass(_CountedLoss), log_every_n_steps=4, log_path=tmp_path / "m.jsonl", **FIXED)
    out = tr.fit(separable_loader(shuffle=True), epochs=2)  # 8 steps per epoch
    assert out["step"] == 16
    # reading points: steps 4, 8, 12 and 16, one transfer each (the epoch ends at 8 and 16 find nothing unread)
    assert len(_CountedLoss.reads) == 4, _CountedLoss.reads
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 8, 12, 16, 16]  # every 4 steps, and each epoch's row
    assert all(math.isfinite(r["train_loss"]) for r in rows)


def test_a_nan_loss_found_later_still_names_its_step():
    model = _Poison(at=2)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                 log_every_n_steps=4, **FIXED)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 2 \(epoch 1, batch 2\).*read every"):
        tr.fit(separable_loader(shuffle=True), epochs=1)
    assert tr.global_step == 4  # found at the reading point after step 4


def test_progress_callable_receives_short_lines():
    lines = []
    model = tiny_convnet()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                 precision="fp32", channels_last=False, compile=False, progress=lines.append, log_every_n_steps=4)
    tr.fit(separable_loader(shuffle=True), separable_loader(64, shuffle=True), epochs=1)
    assert lines[0].startswith("epoch 1 step 4 loss ") and lines[1].startswith("epoch 1 step 8 loss ")
    assert lines[2].startswith("epoch 1 step 8 train_loss ") and "val_loss" in lines[2]
    assert lines[-1].startswith("done: 8 steps")
    with pytest.raises(ValueError, match="progress must be"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, progress="yes")


# ------------------------------------------------------------------ logging
def test_accelerate_logs_one_info_line_per_setting(caplog):
    model = tiny_convnet()
    with caplog.at_level(logging.INFO, logger="torchspeed.train.acceleration"):
        acc = accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_first_batch(),
                         loss_fn=nn.functional.cross_entropy, trial_steps=1, untried={"compile": "test budget"})
    mine = [r for r in caplog.records if r.name == "torchspeed.train.acceleration"]
    busy = [r for r in mine if r.levelno == logging.WARNING and "the machine was busy" in r.getMessage()]
    assert len(busy) == (1 if acc.report.busy_warning else 0)  # other processes may share the cores
    lines = [r.getMessage() for r in mine if r not in busy]
    assert all(r.levelno == logging.INFO for r in mine if r not in busy)
    settings = list(dict.fromkeys(c.setting for c in acc.report.candidates))
    assert len(lines) == len(settings)
    for setting, line in zip(settings, lines):
        assert f", {setting}: " in line
    measured = [c for c in acc.report.candidates if c.step_s is not None]
    assert measured
    joint = next(line for line in lines if f", {measured[0].setting}: " in line)
    for c in measured:  # every option with its median and its decision
        assert f"{c.value} {c.step_s * 1e3:.1f} ms [{c.decision}]" in joint
    assert "compile: True [not tried: test budget]" in next(line for line in lines if ", compile: " in line)


@pytest.mark.parametrize("fused", [False, True])
def test_step_reports_a_step_the_grad_scaler_skipped(fused):
    # fp16 needs CUDA; the GradScaler logic is the same with a CPU scaler, so test it here
    model = tiny_convnet(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = accelerate(model, opt, precision="fp32", channels_last=False, compile=False, fused_optimizer=fused)
    assert (acc.report.optimizer == "fused") == fused
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    x, y = next(iter(separable_loader(32)))
    acc.backward(nn.functional.cross_entropy(model(x), y))
    grads = [p.grad.clone() / 16.0 for p in model.parameters()]  # the loss was scaled by 16
    before = [p.detach().clone() for p in model.parameters()]
    assert acc.step(opt) is True and acc.scaler.get_scale() == 16.0
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), b - 0.1 * g)  # stepped on the unscaled gradients
    acc.backward(nn.functional.cross_entropy(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    assert acc.step(opt, max_grad_norm=1.0) is False  # skipped: inf in the gradients
    assert acc.scaler.get_scale() == 8.0 and all(p.grad is None for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_trial_steps_leave_weights_statistics_momentum_and_rng_as_they_were():
    from torchspeed.train.step_timer import trial_state_kept

    torch.manual_seed(0)
    model = tiny_convnet(classes=4, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # momentum to keep
    opt.zero_grad(set_to_none=True)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    with trial_state_kept(model, opt):
        assert model.training
        for _ in range(2):
            nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), y).backward()
            opt.step()
        assert not torch.equal(next(model.parameters()), before[next(iter(before))])
    assert not model.training and all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_trial_snapshot_keeps_the_kind_of_dict_and_a_modules_metadata():
    import collections

    from torchspeed.train.step_timer import _host_copy

    state = collections.defaultdict(dict, {0: {"momentum_buffer": torch.ones(2)}})
    copied = _host_copy(state)
    assert type(copied) is collections.defaultdict and torch.equal(copied[0]["momentum_buffer"], torch.ones(2))
    assert copied[0]["momentum_buffer"].data_ptr() != state[0]["momentum_buffer"].data_ptr()
    sd = nn.BatchNorm2d(3).state_dict()
    assert _host_copy(sd)._metadata == sd._metadata and _host_copy(sd)._metadata is not sd._metadata
