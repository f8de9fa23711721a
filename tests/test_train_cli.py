"""`torchspeed train` end to end on a tiny ImageFolder, resume, and clear errors."""
import json

import pytest

from torchspeed.cli import main


@pytest.fixture
def folder(photo_folder):
    return photo_folder  # 24 images in 3 classes: 22 to train on, 2 held out


FAST = ["--model", "mobilenet_v3_small", "--crop", "32", "--batch-size", "8", "--num-workers", "0", "--threads", "2",
        "--precision", "fp32", "--channels-last", "off", "--compile", "off", "--no-progress"]


def test_train_then_resume(folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(folder), "--epochs", "2", "--out", str(out), "--json", str(tmp_path / "s.json"),
                 *FAST]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["epochs"] == 2 and s["step"] == 2 * (22 // 8)  # 22 training images (10% held out), drop_last
    assert s["classes"] == ["class_00", "class_01", "class_02"] and 0.0 <= s["val_acc"] <= 1.0
    assert s["checkpoint"].endswith(f"step-{s['step']:08d}.pt")
    assert (out / "metrics.csv").read_text().startswith("epoch,step,train_loss,val_loss,val_acc,lr,samples_per_s")
    assert {c["setting"] for c in s["accelerate"]["candidates"]} >= {"precision", "channels_last", "compile"}
    assert main(["train", "--data", str(folder), "--epochs", "3", "--out", str(out), "--resume", *FAST]) == 0
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["epochs"] == 3 and s2["step"] == 3 * (22 // 8)  # continued: one more epoch, not three
    assert len((out / "metrics.csv").read_text().strip().splitlines()) == 1 + 3


def test_resume_auto_starts_the_run_then_continues_it(folder, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--data", str(folder), "--epochs", "1", "--out", str(out), "--resume", "auto", *FAST]) == 0
    assert json.loads((out / "summary.json").read_text())["step"] == 22 // 8  # nothing to continue: a new run
    assert main(["train", "--data", str(folder), "--epochs", "2", "--out", str(out), "--resume", "auto", *FAST]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["epochs"] == 2 and s["step"] == 2 * (22 // 8)  # continued: one more epoch
    assert len((out / "metrics.csv").read_text().strip().splitlines()) == 1 + 2


def test_bad_inputs_are_one_line(tmp_path, folder, capsys):
    assert main(["train", "--data", str(tmp_path / "missing"), "--model", "resnet18", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in " ".join(err.split()) and "Traceback" not in err
    assert main(["train", "--data", str(folder), "--model", "no_such_net", "--epochs", "1", "--out",
                 str(tmp_path / "o"), "--num-workers", "0", "--no-progress", "--batch-size", "8"]) == 2
    assert "unknown model 'no_such_net'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--data", str(folder), "--model", "resnet18", "--epochs", "0"])
    with pytest.raises(SystemExit):  # counts are auto, a number or a comma list
        main(["train", "--data", str(folder), "--model", "resnet18", "--epochs", "1", "--num-workers", "many"])
    assert "--num-workers" in capsys.readouterr().err
    assert main(["train", "--data", str(folder), "--model", "resnet18", "--epochs", "1", "--val-fraction", "0.99",
                 "--num-workers", "0", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "too few to hold out" in capsys.readouterr().err


DATASET_MODULE = '''
import numpy as np
import torch


class Shapes(torch.utils.data.Dataset):
    """Bright or dark 40x40 images: two classes anyone can learn."""

    classes = ["dark", "bright"]

    def __init__(self, n=24):
        rng = np.random.default_rng(0)
        self.labels = [i % 2 for i in range(n)]
        self.images = [(rng.integers(0, 90, (40, 40, 3)) + 150 * y).astype(np.uint8) for y in self.labels]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def make_dataset():
    return Shapes()
'''


def test_train_on_a_dataset_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "ts_cli_shapes.py").write_text(DATASET_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["train", "--data", "ts_cli_shapes:make_dataset", "--epochs", "1", "--out", str(out), *FAST]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["data"] == "ts_cli_shapes:make_dataset" and s["classes"] == ["dark", "bright"]
    assert s["step"] == 22 // 8 and 0.0 <= s["val_acc"] <= 1.0  # 24 samples, 2 held out, drop_last
    assert main(["train", "--data", "ts_cli_shapes:no_such_factory", "--epochs", "1", "--out", str(tmp_path / "o"),
                 *FAST]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "ts_cli_shapes:no_such_factory" in err and "Traceback" not in err


def test_refresh_reaches_the_recipe(folder, tmp_path, monkeypatch):
    """--refresh measures again: it is the recipe's `refresh`, which goes to fast_loader and accelerate."""
    import torchspeed.recipes

    seen = {}

    def capture(data, model, options, progress):
        seen["options"] = options
        raise ValueError("stop here")

    monkeypatch.setattr(torchspeed.recipes, "prepare_classifier", capture)
    assert main(["train", "--data", str(folder), "--epochs", "1", "--out", str(tmp_path / "o"), "--refresh", *FAST]) == 2
    assert seen["options"].refresh is True
    assert main(["train", "--data", str(folder), "--epochs", "1", "--out", str(tmp_path / "o"), *FAST]) == 2
    assert seen["options"].refresh is False
