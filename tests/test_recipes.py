"""train_classifier from Python: one call trains an image classifier on a folder and writes the weights
and summary.json that `torchspeed train` writes; a spec gets one output per class; bad input is
refused before any data is read."""
import json
import os

import pytest
import torch
from helpers import tiny_convnet

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
    for bad, match in (({"lr": 0.0}, "--lr must be > 0"), ({"precision": "fp8"}, "precision must be"),
                       ({"epochs": 0}, "epochs must be a positive integer")):
        with pytest.raises(ValueError, match=match):
            ClassifierOptions(**{"epochs": 1, **bad})
