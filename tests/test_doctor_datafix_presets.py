"""doctor's data fix reads the transform pipelines people write: torchvision's reference preset classes (a
Compose held in `self.transforms`) in v1 (PILToTensor + ConvertImageDtype) and v2 (ToImage / PILToTensor +
ToDtype + ToPureTensor), nested containers and nn.Sequential; the first transform it cannot translate is
named with where it sits; the swap feeds a preset's loop; and `doctor --try fast_loader` measures the fix
on a training script written that way (v1 and v2)."""
import json
import os
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms as v1
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2
from torchvision_presets import MEAN, STD, ClassificationPresetEval, ClassificationPresetTrain

from torchspeed.doctor import datafix
from torchspeed.doctor.recorder import Recorder

TESTS = os.path.dirname(os.path.abspath(__file__))


def _described(folder, transform):
    return datafix.describe(DataLoader(ImageFolder(folder, transform), batch_size=4))


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("backend", ["pil", "tensor"])
def test_a_preset_class_holding_a_compose_is_read(photo_folder, use_v2, backend):
    train = _described(photo_folder, ClassificationPresetTrain(crop_size=32, backend=backend, use_v2=use_v2))
    assert train["supported"], train
    assert (train["train"], train["crop"], train["scale"]) == (True, 32, [0.08, 1.0])
    assert train["mean"] == list(MEAN) and train["std"] == list(STD)
    evaluation = _described(photo_folder, ClassificationPresetEval(crop_size=56, resize_size=64, backend=backend,
                                                                   use_v2=use_v2))
    assert evaluation["supported"], evaluation
    assert (evaluation["train"], evaluation["crop"], evaluation["scale"]) == (False, 56, None)


def test_nested_containers_and_sequential_are_opened(photo_folder):
    nested = v1.Compose([v1.Compose([v1.RandomResizedCrop(32), v1.RandomHorizontalFlip()]),
                         v1.Compose([v1.PILToTensor(), v1.ConvertImageDtype(torch.float32)])])
    assert _described(photo_folder, nested)["supported"]
    sequential = v2.Compose([v2.ToImage(), nn.Sequential(v2.Resize(64), v2.CenterCrop(56)),
                             v2.ToDtype({"others": torch.float32}, scale=True)])
    d = _described(photo_folder, sequential)
    assert d["supported"] and (d["train"], d["crop"]) == (False, 56), d


class Module(nn.Module):
    """A preset written as an nn.Module: its v2 Compose is one of its submodules."""

    def __init__(self):
        super().__init__()
        self.pipeline = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(),
                                    v2.ToDtype(torch.float32, scale=True)])

    def forward(self, img):
        return self.pipeline(img)


class Two:
    def __init__(self):
        self.train = v1.Compose([v1.RandomResizedCrop(32), v1.RandomHorizontalFlip(), v1.ToTensor()])
        self.eval = v1.Compose([v1.Resize(64), v1.CenterCrop(56), v1.ToTensor()])

    def __call__(self, img):
        return self.train(img)


def test_a_module_preset_is_read_and_one_holding_two_pipelines_is_named(photo_folder):
    assert _described(photo_folder, Module())["supported"]
    d = _described(photo_folder, Two())
    assert not d["supported"] and "Two holds several pipelines (train, eval)" in d["reason"], d


@pytest.mark.parametrize("transform, why", [
    (ClassificationPresetTrain(crop_size=32, extra=[v1.ColorJitter(0.2)]),
     "its transforms include ColorJitter (ClassificationPresetTrain.transforms[2])"),
    (ClassificationPresetTrain(crop_size=32, use_v2=True, extra=[v2.RandAugment()]),
     "its transforms include RandAugment (ClassificationPresetTrain.transforms[2])"),
    (v1.Compose([v1.RandomResizedCrop(32), v1.RandomHorizontalFlip(), v1.Lambda(lambda im: im), v1.ToTensor()]),
     "its transforms include Lambda (Compose[2])"),
    (v1.Compose([v1.RandomResizedCrop(32), v1.RandomHorizontalFlip(), lambda im: im, v1.ToTensor()]),
     "its transforms include <lambda> (Compose[2])"),
    (v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32)]),
     "ToDtype without scale=True"),
    (v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(),
                 v2.ToDtype(torch.float16, scale=True)]), "ToDtype(torch.float16)"),
    (v1.Compose([v1.RandomResizedCrop(32), v1.RandomHorizontalFlip(), v1.PILToTensor()]), "ConvertImageDtype"),
    (v2.Compose([v2.ToImage(), v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(), v2.Normalize(MEAN, STD)]),
     "Normalize (Compose[3]) is given a uint8 tensor"),
    (v2.Compose([v2.Resize(None, max_size=64), v2.CenterCrop(56), v2.ToImage()]), "Resize(max_size=64)"),
])
def test_the_first_transform_it_cannot_translate_is_named(photo_folder, transform, why):
    d = _described(photo_folder, transform)
    assert d["supported"] is False and why in d["reason"], d
    assert "could not be read" not in d["reason"]


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_the_swap_feeds_a_presets_loop(photo_folder, use_v2):
    value = {"threads": 1, "device": "cpu", "root": os.path.abspath(photo_folder), "train": True, "crop": 32}
    rec = Recorder()
    rec.install()
    rec.inject({"fast_loader": value})
    try:
        swapped = DataLoader(ImageFolder(photo_folder, ClassificationPresetTrain(crop_size=32, use_v2=use_v2)),
                             batch_size=4, shuffle=True)
        x, y = next(iter(swapped))
    finally:
        rec.uninstall()
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    notes = rec.fix.notes["fast_loader"]
    assert notes["same_samples"] is True and notes["samples"] == notes["fast_samples"] == 24


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from torch import nn
    from torchvision.datasets import ImageFolder
    from torchvision_presets import ClassificationPresetTrain

    data, crop, api = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dataset = ImageFolder(data, ClassificationPresetTrain(crop_size=crop, use_v2=api == "v2"))
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, len(dataset.classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(10):
        for images, labels in loader:
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
""")


@pytest.mark.slow  # a baseline, the fix, a baseline (and 2 more if kept): each run starts torch
@pytest.mark.timeout(600)
@pytest.mark.parametrize("api", ["v1", "v2"])
def test_doctor_try_measures_fast_loader_on_a_preset_script(tmp_path, api):
    from torchspeed.cli import main
    from torchspeed.data import make_photo_folder

    photos = make_photo_folder(tmp_path / "photos", 64, n_classes=4, num_workers=1)
    script = tmp_path / "train_with_presets.py"
    script.write_text(SCRIPT.format(tests=TESTS))
    code = main(["doctor", "--steps", "6", "--try", "fast_loader", "--json", str(tmp_path / "d.json"), "--",
                 sys.executable, str(script), photos, "64", api])
    assert code == 0
    d = json.loads((tmp_path / "d.json").read_text())
    (ld,) = d["settings"]["loaders"]
    assert ld["images"]["supported"] and ld["images"]["dataset"] == "ImageFolder", ld["images"]
    (row,) = [r for r in d["tried"] if r["fix"] != "combined"]
    assert row["fix"] == "fast_loader(threads=1)" and row["speedup"] > 0  # a measured ratio, whichever way it went
    assert row["numerics_ok"] is True and row["numerics"]["same_samples"] is True
    assert f"ts.data.fast_loader({os.path.abspath(photos)!r}, batch_size=16, train=True, crop=64" in row["code"]
