"""doctor's data fix: a DataLoader reading image files through the standard transforms is recognised
(crop, flip, normalisation read from its Compose), swapped for fast_loader on the same files under
`--try fast_loader`, and judged on the same files and labels with image statistics within tolerance;
a loader of tensors does not get the fix. Also: the ranking after --try and a busy machine named."""
import ast
import json
import os
import shutil
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from torchspeed.doctor import datafix
from torchspeed.doctor import fixes as fx
from torchspeed.doctor.recorder import Recorder, image_stats
from torchspeed.doctor.trying import apply_measured, note_load

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRAIN = T.Compose([T.RandomResizedCrop(32, scale=(0.25, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(),
                   T.Normalize(MEAN, STD)])
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "docs", "examples", "train_small_cnn.py")


def _described(folder, transform, **loader_kw):
    return datafix.describe(DataLoader(ImageFolder(folder, transform), batch_size=4, **loader_kw))


def test_the_compose_is_read_into_fast_loader_settings(photo_folder):
    d = _described(photo_folder, TRAIN, shuffle=True)
    assert d["supported"] and d["dataset"] == "ImageFolder" and d["root"] == os.path.abspath(photo_folder)
    assert (d["train"], d["crop"], d["scale"], d["samples"]) == (True, 32, [0.25, 1.0], 24)
    assert d["mean"] == list(MEAN) and d["std"] == list(STD)
    evaluation = _described(photo_folder, T.Compose([T.Resize(73), T.CenterCrop(64), T.ToTensor()]))
    assert evaluation["supported"] and (evaluation["train"], evaluation["crop"], evaluation["mean"]) == (False, 64, None)
    from torchvision.transforms import v2

    new_api = _described(photo_folder, v2.Compose([v2.ToImage(), v2.RandomResizedCrop(48), v2.RandomHorizontalFlip(),
                                                   v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]))
    assert new_api["supported"] and new_api["crop"] == 48


@pytest.mark.parametrize("transform, why", [
    (T.Compose([T.RandomResizedCrop(32), T.ColorJitter(0.2), T.RandomHorizontalFlip(), T.ToTensor()]), "ColorJitter"),
    (T.Compose([T.RandomResizedCrop(32), T.ToTensor()]), "always flips"),
    (T.Compose([T.Resize(64), T.CenterCrop(64), T.ToTensor()]), "keeps 1.000 of the short side"),
    (T.Compose([T.RandomResizedCrop((32, 48)), T.RandomHorizontalFlip(), T.ToTensor()]), "not square"),
    (T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()]), "ToTensor"),
    (None, "no transform"),
])
def test_what_fast_loader_would_do_differently_is_named(photo_folder, transform, why):
    d = _described(photo_folder, transform)
    assert d["supported"] is False and why in d["reason"], d


def test_tensors_subsets_and_changed_labels_get_no_fix(photo_folder):
    assert datafix.describe(DataLoader(TensorDataset(torch.randn(8, 3, 4, 4), torch.zeros(8)), batch_size=2)) is None
    sub = datafix.describe(DataLoader(Subset(ImageFolder(photo_folder, TRAIN), [0, 1, 2]), batch_size=2))
    assert not sub["supported"] and "subset" in sub["reason"]
    relabelled = datafix.describe(DataLoader(ImageFolder(photo_folder, TRAIN, target_transform=lambda y: y + 1)))
    assert not relabelled["supported"] and "target_transform" in relabelled["reason"]


def _loader_record(folder, **images):
    d = {"dataset": "ImageFolder", "root": os.path.abspath(folder), "samples": 24, "supported": True, "train": True,
         "crop": 32, "scale": [0.25, 1.0], "mean": list(MEAN), "std": list(STD), **images}
    return {"name": "DataLoader #1", "num_workers": 0, "batch_size": 4, "batches": 9, "training": True, "images": d}


def _payload(loader, cores=2):
    s = {"device": "cpu", "cores": cores, "torch_threads": 2, "loaders": [loader], "model": {"convs": 0},
         "mixed_precision": {"name": "fp32", "reason": "x"}, "optimizers": []}
    return {"settings": s, "findings": [], "steady": {"phases": {"eval": 0.0}}}


def test_plan_tries_fast_loader_beside_workers_and_prints_runnable_code(photo_folder):
    payload = _payload(_loader_record(photo_folder), cores=8)
    run, _ = fx.plan(payload)
    values = [v for n, v in run if n == "fast_loader"]
    assert [v["threads"] for v in values] == [1, 4] and ("workers", 4) in run  # both measured, in the loop
    assert fx.label("fast_loader", values[0]) == "fast_loader(threads=1)"
    code = fx.code_for("fast_loader", values[0], payload)
    ast.parse(code)
    assert f"ts.data.fast_loader({os.path.abspath(photo_folder)!r}, batch_size=4, train=True, crop=32" in code
    assert "scale=(0.25, 1.0)" in code and f"mean={MEAN!r}" in code and "threads=1" in code
    (_, skipped) = fx.plan(_payload(_loader_record(photo_folder, supported=False, reason="its transforms include X")),
                           ["fast_loader"])
    assert "its transforms include X" in skipped[0]["reason"]


def test_the_swap_feeds_the_loop_from_fast_loader_and_is_undone(photo_folder, small_photo_folder):
    before = DataLoader.__iter__
    value = {"threads": 1, "device": "cpu", "root": os.path.abspath(photo_folder), "train": True, "crop": 32}
    rec = Recorder()
    rec.install()
    rec.inject({"fast_loader": value})
    try:
        swapped = DataLoader(ImageFolder(photo_folder, TRAIN), batch_size=4, shuffle=True)
        other = DataLoader(ImageFolder(small_photo_folder, TRAIN), batch_size=4)  # another folder: left alone
        x, y = next(iter(swapped))
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert next(iter(other))[0].shape == (4, 3, 32, 32)
        assert len(list(swapped)) == 6  # a second pass: the next epoch of the same fast_loader
    finally:
        rec.uninstall()
    notes = rec.fix.notes["fast_loader"]
    assert notes["same_samples"] is True and notes["samples"] == notes["fast_samples"] == 24
    kinds = sorted(ld["name"].split(" ")[0] for ld in rec.loaders.values())
    assert kinds == ["DataLoader", "FastLoader"]  # the other loader measured as a DataLoader, the swapped one as fast
    assert DataLoader.__iter__ is before


def _stats(mean, std=1.0, n=3, per_batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [image_stats((torch.randn(per_batch, 3, 16, 16, generator=g) * std + mean, torch.zeros(per_batch)))
            for _ in range(n)]


def test_numerics_judge_files_labels_and_image_statistics():
    base = {"batch_stats": _stats(0.0)}
    same = {"batch_stats": _stats(0.0, seed=1), "fix_notes": {"fast_loader": {"same_samples": True}}}
    check = fx.numerics("fast_loader", base, same)
    assert check["ok"] is True and check["kind"] == "images" and len(check["channels"]) == 3
    unnormalised = {**same, "batch_stats": _stats(2.0, seed=1)}  # Normalize left out: means 2 std units off
    assert fx.numerics("fast_loader", base, unnormalised)["ok"] is False
    scaled = {**same, "batch_stats": _stats(0.0, std=2.0, seed=1)}
    assert fx.numerics("fast_loader", base, scaled)["ok"] is False
    other_files = {**same, "fix_notes": {"fast_loader": {"same_samples": False}}}
    assert fx.numerics("fast_loader", base, other_files)["ok"] is False
    assert fx.numerics("fast_loader", base, {"batch_stats": _stats(0.0)})["ok"] is False  # the swap never happened


def test_a_measured_gain_outranks_a_guess_and_a_measured_loss_falls_below_it():
    def f(rule, gain):
        return {"rule": rule, "severity": "speed", "expected_gain": gain, "gain_basis": "a guess", "message": "m"}

    payload = {"findings": [f("no-autocast", 0.4), f("loader-no-workers", 0.1), f("no-channels-last", 0.3),
                            {**f("bf16-emulated", 0.0), "severity": "info"}]}
    rows = [{"name": "fast_loader", "fix": "fast_loader(threads=1)", "speedup": 1.12, "step_s": 0.1 / 1.12,
             "baseline_step_s": 0.1, "spread": 0.05, "kept": True, "verdict": "kept"},
            {"name": "channels_last", "fix": "channels_last", "speedup": 0.8, "step_s": 0.125, "baseline_step_s": 0.1,
             "spread": 0.05, "kept": False, "verdict": "slower"}]
    apply_measured(payload, rows, ["python", "t.py"])
    assert [x["rule"] for x in payload["findings"]] == ["loader-no-workers", "no-autocast", "no-channels-last",
                                                        "bf16-emulated"]
    first, demoted = payload["findings"][0], payload["findings"][2]
    assert first["measured"] == "kept" and first["expected_gain"] == pytest.approx(1 - 1 / 1.12, abs=1e-3)
    assert demoted["expected_gain"] == 0.0 and demoted["measured_gain"] < 0 and "fast_loader" in first["gain_basis"]


def test_a_busy_machine_names_the_figures_it_disturbed():
    from torchspeed.measure import Quiet

    t = {"spread": 0.3, "baseline_runs": [{"others_cores": 0.0}, {"others_cores": 1.2}],
         "tried": [{"fix": "fast_loader(threads=1)", "others_cores": 1.2, "verdict": "slower"},
                   {"fix": "workers=1", "others_cores": 0.1, "verdict": "within the spread"}]}
    note_load(t, 0.8, Quiet(5.0, 1.1))
    assert [b["figure"] for b in t["busy_figures"]] == ["baseline run 2", "fast_loader(threads=1)"]
    assert "busy during: baseline run 2 (1.2), fast_loader(threads=1) (1.2)" in t["busy"]
    assert t["quiet_wait"] == {"waited_s": 5.0, "others_cores": 1.1}
    assert [r["verdict"] for r in t["tried"]] == ["slower on a busy machine", "within the spread of a busy machine"]


TENSORS = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,))), batch_size=8)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
""")


@pytest.mark.timeout(300)
def test_doctor_recognises_an_image_folder_script_and_not_a_tensor_one(tmp_path, photo_folder):
    from torchspeed.doctor.launch import run_doctor

    script = tmp_path / "tensors.py"
    script.write_text(TENSORS)
    _, tensors = run_doctor([sys.executable, str(script)], steps=3, console=False)
    assert not any(ld.get("images") for ld in tensors["settings"]["loaders"])
    why = {s["fix"]: s["reason"] for s in fx.plan(tensors, ["fast_loader"]).skipped}
    assert "does not read image files" in why["fast_loader"]
    _, images = run_doctor([sys.executable, EXAMPLE, photo_folder, "--crop", "32", "--batch-size", "4"], steps=3,
                           console=False)
    (ld,) = images["settings"]["loaders"]
    assert ld["images"]["supported"] and ld["images"]["crop"] == 32 and ld["images"]["train"]
    found = {f["rule"]: f for f in images["findings"]}
    if "loader-no-workers" in found:  # the loop waits for PIL in the training process
        assert "--try fast_loader,workers" in found["loader-no-workers"]["command"]
        assert "ImageFolder (24 files, RandomResizedCrop 32)" in found["loader-no-workers"]["message"]
    assert [v["threads"] for n, v in fx.plan(images, ["fast_loader"]).run] == [1]  # 2 cores: one decoding thread


@pytest.mark.slow  # a baseline, the fix, a baseline (and 2 more if kept): each run starts torch
@pytest.mark.timeout(600)
def test_doctor_try_measures_the_fast_loader_fix_on_a_tutorial_script(tmp_path):
    """The tutorial case: an ImageFolder of full-size photos, PIL transforms, num_workers=0, a small CNN."""
    from torchspeed.cli import main
    from torchspeed.data import make_photo_folder

    photos = make_photo_folder(tmp_path / "photos", 96, n_classes=4, num_workers=1)  # 500x375 JPEGs
    code = main(["doctor", "--steps", "6", "--try", "fast_loader", "--json", str(tmp_path / "d.json"), "--",
                 sys.executable, EXAMPLE, photos, "--crop", "64", "--batch-size", "16"])
    assert code == 0
    d = json.loads((tmp_path / "d.json").read_text())
    (row,) = [r for r in d["tried"] if r["fix"] != "combined"]
    assert row["fix"] == "fast_loader(threads=1)" and row["speedup"] > 0  # a measured ratio, whichever way it went
    assert row["numerics_ok"] is True and row["numerics"]["same_samples"] is True
    assert f"ts.data.fast_loader({os.path.abspath(photos)!r}, batch_size=16, train=True, crop=64" in row["code"]
    assert "quiet_wait" in d["try"] and "busy_figures" in d["try"]
    measured = [f for f in d["findings"] if f.get("measured")]
    assert measured and "doctor --try fast_loader(threads=1)" in measured[0]["gain_basis"]
    shutil.rmtree(photos)
