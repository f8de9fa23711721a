"""A loader whose counts were measured alone (a FastLoader on "auto") is re-chosen by accelerate() and the
Trainer with real training steps in the loop: the less parallel setting wins when the loader's threads
compete with the step, the model, optimizer and RNG are exactly as before, the choice is remembered (a
second call times nothing) and counts the user fixed are left alone; under torchrun rank 0's choice is
every rank's. Also: the fp16 step guard is removed when its preparation is let go, and a container
model keeps len() and iteration. Fake loaders: each batch waits as long as its counts say, on a fake clock
(the steps are timed by what the loaders wait, not by how busy the machine running the tests is)."""
import logging

import pytest
import torch
from helpers import fake_clock
from torch import nn

import torchspeed.train.loader_choice as loader_choice
from torchspeed import remembered
from torchspeed.train import Trainer, accelerate
from torchspeed.train.acceleration import Accelerated, AccelerateResult, forget_prepared, release_step_guard

FIXED = dict(precision="fp32", channels_last=False, compile=False, device="cpu")
SLOW_WHEN_PARALLEL = {(0, 1): 0.001, (0, 2): 0.03}  # seconds per batch: more threads, slower (they compete)


class Settings:
    """What a FastLoader's `settings` say (the counts it measured alone)."""

    def __init__(self, num_workers, threads):
        self.num_workers, self.threads = num_workers, threads


class FakeLoader:
    """Six (images, labels) batches of a fixed set; each batch takes as long as `delays[counts]` (on the clock
    loader_choice times with: the real one, or the `quiet` fixture's fake); rebuilt
    with other counts by `with_counts` (the calls logged in `log`); keeps its position like a FastLoader."""

    def __init__(self, num_workers=0, threads=2, delays=None, settings="measured", log=None, batches=6):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches * 4, 3, 8, 8, generator=g)
        self.y = torch.randint(0, 3, (batches * 4,), generator=g)
        self.num_workers, self.threads = num_workers, threads
        self.delays = delays or SLOW_WHEN_PARALLEL
        self.settings = Settings(num_workers, threads) if settings == "measured" else settings
        self.log = log if log is not None else {"with_counts": [], "passes": 0}
        self.batches, self.done = batches, 0

    def with_counts(self, num_workers, threads=1):
        self.log["with_counts"].append((num_workers, threads))
        other = FakeLoader(num_workers, threads, self.delays, self.settings, self.log, self.batches)
        other.done = self.done
        return other

    def __len__(self):
        return self.batches

    def __iter__(self):
        self.log["passes"] += 1
        start, self.done = self.done, 0
        for i in range(start, self.batches):
            loader_choice.time.sleep(self.delays[(self.num_workers, self.threads)])
            yield self.x[4 * i:4 * i + 4], self.y[4 * i:4 * i + 4]

    def identity(self):
        return {"batches": self.batches}

    def set_epoch(self, epoch):
        pass

    def state_dict(self):
        return {"batches_done": self.done}

    def load_state_dict(self, state):
        self.done = state["batches_done"]


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Dropout(0.5), nn.Linear(4, 3))  # dropout: the steps draw from the RNG


def sgd(model=None):
    """(a model, its plain SGD): accelerate()'s positional pair."""
    model = model if model is not None else net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def counted(model):
    """The model with a count of its forward calls (training steps run)."""
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    return model, calls


def with_momentum(model):
    """SGD with momentum that has stepped once: state that the timing steps would change."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            torch.get_rng_state())


def assert_same(before, model, opt):
    params, state, rng = before
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys() and all(torch.equal(state[i][k], now[i][k]) for i in state for k in state[i])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture
def quiet(monkeypatch):
    """A quiet machine (the choice is remembered) without waiting for one, and a fake clock: a step takes
    exactly what its loader waits (tests/helpers.py FakeClock)."""
    monkeypatch.setattr(loader_choice.LoaderStepResult, "busy_warning", property(lambda self: None))
    monkeypatch.setattr(loader_choice, "wait_for_quiet_machine", lambda **k: None)
    fake_clock(monkeypatch, loader_choice)


def test_accelerate_picks_the_less_parallel_loader_and_leaves_no_trace(quiet, caplog):
    model = net()
    opt = with_momentum(model)
    before = snapshot(model, opt)
    loader = FakeLoader()
    lines = []
    with caplog.at_level(logging.INFO, logger="torchspeed"):
        acc = accelerate(model, opt, loader, progress=lines.append, **FIXED)
    assert_same(before, model, opt)
    chosen = acc.loader.loader
    assert (chosen.num_workers, chosen.threads) == (0, 1) and chosen is not loader
    assert loader.log["with_counts"] == [(0, 1)]  # the less parallel candidate; the loader given is the other
    result = acc.report.loader
    assert result.alone == (0, 2) and [r.setting for r in result.table] == ["num_workers=0, threads=1",
                                                                            "num_workers=0, threads=2"]
    rows = [r for r in acc.report.candidates if r.setting == "loader"]
    assert [r.decision.split(":")[0] for r in rows] == ["kept", "rejected"] and all(r.step_s for r in rows)
    assert acc.report.to_dict()["loader"]["setting"] == "num_workers=0, threads=1"
    assert lines[-1].startswith("loader with the step in the loop: num_workers=0, threads=1 (")
    assert any(r.name == "torchspeed.train.loader_choice" and "loader with the step in the loop" in r.getMessage()
               for r in caplog.records)


def test_a_remembered_choice_is_taken_at_once_and_refresh_measures_again(quiet):
    accelerate(*sgd(), FakeLoader(), **FIXED)
    model, steps = counted(net())
    loader = FakeLoader()
    acc = accelerate(*sgd(model), loader, **FIXED)
    assert not steps and loader.log["passes"] <= 1  # no step timed; at most the batch the key's shapes come from
    assert acc.report.loader.remembered.startswith("remembered from ") and not acc.report.loader.table
    assert (acc.loader.loader.num_workers, acc.loader.loader.threads) == (0, 1)
    assert [r.decision for r in acc.report.candidates if r.setting == "loader"] == [acc.report.loader.remembered]
    again = FakeLoader()
    fresh = accelerate(*sgd(), again, refresh=True, **FIXED)
    assert fresh.report.loader.remembered is None and len(fresh.report.loader.table) == 2


def test_a_choice_timed_on_a_busy_machine_is_not_remembered(monkeypatch):
    monkeypatch.setattr(loader_choice.LoaderStepResult, "busy_warning", property(lambda self: "the machine was busy"))
    monkeypatch.setattr(loader_choice, "wait_for_quiet_machine", lambda **k: None)
    accelerate(*sgd(), FakeLoader(), **FIXED)
    acc = accelerate(*sgd(), FakeLoader(), **FIXED)
    assert acc.report.loader.remembered is None and len(acc.report.loader.table) == 2


def test_counts_the_user_fixed_and_other_loaders_are_left_as_they_are(quiet):
    model, steps = counted(net())
    fixed = FakeLoader(settings=None)
    acc = accelerate(*sgd(model), fixed, **FIXED)
    assert acc.loader.loader is fixed and not fixed.log["with_counts"] and not steps and acc.report.loader is None
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,)))
    plain = torch.utils.data.DataLoader(data, batch_size=4)
    assert accelerate(*sgd(), plain, **FIXED).loader.loader is plain
    short = FakeLoader(batches=3)  # too short an epoch to time steps: the setting measured alone is kept
    acc = accelerate(*sgd(), short, **FIXED)
    assert acc.loader.loader is short and not short.log["with_counts"]


def test_the_trainer_chooses_before_its_first_epoch_once(quiet):
    model = net()
    opt = with_momentum(model)
    trainer = Trainer(model, opt, nn.functional.cross_entropy, progress=False, **FIXED)
    before = snapshot(model, opt)
    loader = FakeLoader()
    chosen = trainer.choose_loader(loader)
    assert_same(before, model, opt)
    assert (chosen.num_workers, chosen.threads) == (0, 1) and trainer.loader_choice.remembered is None
    assert [r.setting for r in trainer.report.candidates].count("loader") == 2
    made = list(loader.log["with_counts"])
    metrics = trainer.fit(loader, epochs=1, max_steps=2)  # the same loader given again: chosen once
    assert metrics["step"] == 2 and loader.log["with_counts"] == made
    assert trainer.fit(chosen, epochs=2, max_steps=3)["step"] == 3 and loader.log["with_counts"] == made
    model2, steps = counted(net())
    fitted = Trainer(model2, with_momentum(model2), nn.functional.cross_entropy, progress=False, **FIXED)
    steps.clear()
    fitted.fit(FakeLoader(), epochs=1, max_steps=1)  # fit alone: the choice remembered, no step timed
    assert fitted.loader_choice.remembered.startswith("remembered from ") and len(steps) == 1  # the one trained


def test_the_trainer_keeps_counts_the_user_fixed(quiet):
    trainer = Trainer(*sgd(), nn.functional.cross_entropy,
                      progress=False, **FIXED)
    fixed = FakeLoader(settings=None)
    trainer.fit(fixed, epochs=1, max_steps=1)
    assert trainer.loader_choice is None and not fixed.log["with_counts"]
    assert not any(r.setting == "loader" for r in trainer.report.candidates)


def test_under_torchrun_rank_0s_setting_and_choice_are_every_ranks(quiet, monkeypatch):
    """Rank 1 of two (the collectives faked): its candidates are rank 0's alone setting's, it times them
    (a DDP step needs every rank), takes rank 0's choice over its own and remembers nothing."""
    from torchspeed import ranks

    sent = []
    answers = iter([[0, 2], [1]])  # rank 0's alone setting; its choice: index 1 (it remembered nothing)

    def broadcast(values, src=0):
        sent.append(list(values))
        return next(answers)

    monkeypatch.setattr(ranks, "env", lambda: ranks.DistEnv(2, 1, 1))
    monkeypatch.setattr(ranks, "broadcast_ints", broadcast)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = FakeLoader(threads=4, delays={**SLOW_WHEN_PARALLEL, (0, 4): 0.05})  # this rank measured 4 threads

    def step(batch):
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()

    picked, result = loader_choice.choose_counts(loader, step, {"model": "m"}, model=model, optimizer=opt)
    assert sent[0] == [0, 4] and result.alone == (0, 2)
    assert [r.setting for r in result.table] == ["num_workers=0, threads=1", "num_workers=0, threads=2"]
    assert (picked.num_workers, picked.threads) == (0, 2)  # rank 0's, though (0, 1) was faster here
    assert sent[1] == [0]  # this rank's own finding, sent to be overruled
    assert not remembered.recall(loader_choice.KIND, {"model": "m", "alone": [0, 2],
                                                       "data": loader_choice.data_identity(loader)})


def test_the_fp16_step_guard_goes_with_its_preparation():
    """Under fp16 a plain optimizer.step() is refused while the preparation holds the optimizer; once it is
    forgotten (or the guard released) the optimizer steps plainly again."""
    from torchspeed.train import prepared

    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accelerated(model=model, optimizer=opt, report=AccelerateResult("cpu", precision="fp16"),
                      device=torch.device("cpu"), module=model, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="outside acc.step"):
        opt.step()
    release_step_guard(opt)
    opt.step()
    prepared._StepGuard.on(opt)  # guarded again, as acc.step does; and held as accelerate() holds it
    acc.hold()
    with pytest.raises(RuntimeError, match="outside acc.step"):
        opt.step()
    forget_prepared(model)
    opt.step()
    assert not opt._optimizer_step_pre_hooks


def test_a_container_model_keeps_len_and_iteration():
    seq = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.ReLU(), nn.Linear(4, 2))
    acc = accelerate(seq, None, **FIXED)
    assert len(acc.model) == 4 and list(acc.model) == list(seq) and acc.model[1] is seq[1]
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert [m for m in accelerate(layers, None, **FIXED).model] == list(layers)
    plain = accelerate(nn.Linear(3, 2), None, **FIXED).model
    with pytest.raises(TypeError):
        len(plain)
    assert plain(torch.randn(1, 3)).shape == (1, 2) and bool(plain)
