"""train_classifier from Python: one call trains an image classifier on a folder and writes the weights
and summary.json that `torchspeed train` writes; a spec gets one output per class; bad input is
refused before any data is read."""
import json
import os

import pytest
import torch
from helpers import fake_clock, tiny_convnet

from torchspeed.recipes import ClassifierOptions, prepare_classifier, train_classifier

FAST = dict(crop=32, batch_size=4, num_workers=0, threads=1, precision="fp32", channels_last=False, compile=False)


def test_train_classifier_writes_the_weights_and_the_summary(small_photo_folder, tmp_path):
    out, lines = tmp_path / "run", []
    result = train_classifier(small_photo_folder, tiny_convnet(classes=2), epochs=1, max_steps=1, out=out,
                              progress=lines.append, **FAST)
    assert lines[0].startswith("training Sequential on 7 images (2 classes), validating on 1; 1 process(es)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.to_dict()))
    assert list(summary)[:6] == ["model", "data", "classes", "world_size", "lr", "batch_size"]
    assert {"epochs", "step", "val_loss", "early_stopping", "accelerate", "checkpoint", "run_id", "weights"} <= set(summary)
    assert summary["data"] == os.path.abspath(small_photo_folder) and summary["classes"] == ["class_00", "class_01"]
    assert result.metrics["step"] == 1 and result.report.precision == "fp32" and os.path.isfile(result.checkpoint)
    weights = torch.load(out / "model.pt", weights_only=True)
    assert weights.keys() == tiny_convnet(classes=2).state_dict().keys()


def test_a_model_spec_gets_one_output_per_class(small_photo_folder, tmp_path):
    run = prepare_classifier(small_photo_folder, "resnet18", ClassifierOptions(epochs=1, out=tmp_path / "run", **FAST),
                             progress=False)
    assert run.trainer.module.fc.out_features == 2 and run.classes == ["class_00", "class_01"]
    assert run.lr == pytest.approx(0.1 * 4 / 256)  # scaled to the global batch


def test_bad_input_is_refused_before_any_data_is_read(small_photo_folder, tmp_path, monkeypatch):
    import torchspeed.recipes

    def never(*a, **k):
        raise AssertionError("data was read")

    monkeypatch.setattr(torchspeed.recipes, "train_val_split", never)  # the name the recipe calls
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_classifier(tmp_path / "missing", "resnet18", epochs=1, out=tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="give one of them"):
        train_classifier(small_photo_folder, "resnet18", epochs=1, resume=True, overwrite=True, progress=False)
    blocked = tmp_path / "file.txt"
    blocked.write_text("not a directory")
    with pytest.raises(OSError, match="cannot be written"):
        train_classifier(small_photo_folder, "resnet18", epochs=1, out=blocked / "run", progress=False)
    for bad, match in (({"lr": 0.0}, "--lr = 0.0: it must be a positive"), ({"precision": "fp8"}, "precision must be"),
                       ({"epochs": 0}, "epochs must be a positive integer")):
        with pytest.raises(ValueError, match=match):
            ClassifierOptions(**{"epochs": 1, **bad})


def test_the_loader_is_chosen_with_the_training_step_in_the_loop(photo_folder, tmp_path, monkeypatch, caplog):
    """With num_workers and threads on auto, the training loader's setting is timed feeding real steps
    (here two candidates); the model and optimizer start training as they were; the choice is remembered,
    and refresh measures again."""
    import logging

    import torchspeed.train.loader_choice as loader_choice

    monkeypatch.setattr(loader_choice, "step_candidates", lambda w, t: [(0, 1), (0, 2)])
    monkeypatch.setattr(loader_choice.LoaderStepResult, "busy_warning", property(lambda self: None))  # quiet
    monkeypatch.setattr(loader_choice, "wait_for_quiet_machine", lambda **k: None)
    from torchspeed.data.tune import TuneResult  # the loader's own tuning kept too: the same setting alone next run

    monkeypatch.setattr(TuneResult, "busy_warning", property(lambda self: None))
    opts = dict(crop=32, batch_size=4, precision="fp32", channels_last=False, compile=False, epochs=1)
    model = tiny_convnet(classes=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = prepare_classifier(photo_folder, model, ClassifierOptions(out=tmp_path / "a", **opts), progress=False)
    choice = run.loader_choice
    assert [r.setting for r in choice.table] == ["num_workers=0, threads=1", "num_workers=0, threads=2"]
    assert all(r.step_s > 0 and len(r.rounds_s) == 2 for r in choice.table) and choice.remembered is None
    assert sum(r.decision == "chosen" for r in choice.table) == 1
    assert (run.train_loader.num_workers, run.train_loader.threads) == (choice.num_workers, choice.threads)
    after = run.trainer.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the trial steps left no trace
    assert not run.trainer.optimizer.state  # no momentum left by the trials
    with caplog.at_level(logging.INFO, logger="torchspeed"):
        again = prepare_classifier(photo_folder, tiny_convnet(classes=3), ClassifierOptions(out=tmp_path / "b", **opts),
                                   progress=False)
    assert again.loader_choice.remembered.startswith("remembered from ") and not again.loader_choice.table
    assert (again.loader_choice.num_workers, again.loader_choice.threads) == (choice.num_workers, choice.threads)
    assert any("loader with the step in the loop: remembered from" in r.getMessage() for r in caplog.records)
    fresh = prepare_classifier(photo_folder, tiny_convnet(classes=3),
                               ClassifierOptions(out=tmp_path / "c", refresh=True, **opts), progress=False)
    assert fresh.loader_choice.remembered is None and len(fresh.loader_choice.table) == 2
    assert fresh.trainer.options.refresh is True and not run.trainer.options.refresh  # accelerate measures again
    result = fresh.fit()
    assert result.to_dict()["loader"]["setting"] == fresh.loader_choice.setting
    assert [c["setting"] for c in result.to_dict()["accelerate"]["candidates"]].count("loader") == 2


def test_a_more_parallel_loader_is_kept_only_when_its_steps_are_faster_beyond_the_margin(monkeypatch):
    """Fake loaders: the step waits for the data as long as its loader says, on a fake clock (what is timed
    is exactly the waits, on a busy machine too); every pass is closed after its round (no loader runs
    while another is timed)."""
    from torchspeed.train import loader_choice
    from torchspeed.train.loader_choice import choose_loader_with_step, step_candidates, time_fed_steps

    clock = fake_clock(monkeypatch, loader_choice)

    assert step_candidates(0, 3) == [(0, 1), (0, 3)] and step_candidates(0, 1) == [(0, 1)]
    assert step_candidates(4, 1) == [(0, 1), (1, 1), (2, 1), (4, 1)]
    open_passes = []

    class Loader:
        def __init__(self, wait_s):
            self.wait_s = wait_s

        def __iter__(self):
            open_passes.append(self)
            try:
                while True:
                    yield self.wait_s
            finally:
                open_passes.remove(self)

    def step(wait_s):
        assert len(open_passes) == 1  # the contender timed is the only loader running
        clock.sleep(wait_s)

    times, _ = time_fed_steps({"a": (Loader(0.001), step), "b": (Loader(0.02), step)}, steps=2, rounds=3)
    assert [len(v) for v in times.values()] == [3, 3] and min(times["b"]) > max(times["a"])
    speeds = {(0, 1): 0.03, (0, 2): 0.005, (0, 4): 0.0049}  # 4 threads: not faster beyond the margin
    loader, result = choose_loader_with_step(lambda w, t: Loader(speeds[(w, t)]), step, list(speeds), rounds=2,
                                             margin=0.2)
    assert (result.num_workers, result.threads) == (0, 2) and loader.wait_s == 0.005
    decisions = [r.decision for r in result.table]
    assert decisions[0].endswith("x the chosen step time") and decisions[1] == "chosen"
    assert decisions[2].startswith("within 20% of a less parallel setting")
    assert not open_passes
