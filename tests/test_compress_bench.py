import math

import pytest
import torch
import torchvision


@pytest.mark.slow
def test_compress_suite_end_to_end_on_a_tiny_fake_demo(monkeypatch):
    """The suite's plumbing and JSON contract, on a tiny stand-in for the demo model (no speed claims)."""
    import torchspeed.bench.demo_model as dm
    import torchspeed.bench.suites.compress as suite

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    images = torch.randint(0, 256, (180, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(180) % 10
    demo = dm.DemoModel(model, images[:128], labels[:128], images[128:], labels[128:], 32, dm.IMAGENET_MEAN,
                        dm.IMAGENET_STD, accuracy=0.1)
    monkeypatch.setattr(dm, "load_demo_model", lambda progress=False: demo)
    for name, value in (("FINETUNE_STEPS", (2, 2)), ("KD_STEPS", (2, 2)), ("MAX_TRAIN_SIDE", 16), ("BN_RECALIB", 64)):
        monkeypatch.setattr(suite, name, value)
    steps = []
    result = suite.run(quick=True, progress=steps.append)
    for key in ("prune_speedup", "prune_metric_drop") + (("kd_gain", "kd_gain_std") if result["kd"]["learned"] else ()):
        assert isinstance(result[key], float) and math.isfinite(result[key]), key
    if not result["kd"]["learned"]:  # students at chance on random images: no gain is reported as a figure
        assert result["kd_gain"] is None and any("no figure" in n for n in result["notes"])
    runs = result["kd"]["runs"]
    assert len(runs) == 2 and all(r["gain"] == pytest.approx(r["distilled"] - r["alone"]) for r in runs)
    assert result["kd"]["setup"]["precision"] in ("fp32", "bf16")
    assert result["prune"]["report"]["params_after"] < result["prune"]["report"]["params_before"] / 3
    assert result["prune_metric_drop"] == pytest.approx(0.1 - result["prune"]["acc_after"])
    for row in result["rows"]:
        assert {"technique", "median", "min", "max", "unit", "ratio", "cumulative", "metric_drop", "what"} <= set(row)
    assert any("fine-tuning" in s for s in steps)


def test_half_width_student_has_half_the_channels():
    from torchspeed.bench.suites.compress import half_width_resnet18

    model = half_width_resnet18(10, torch.randn(1, 3, 32, 32))
    assert model.conv1.out_channels == 32 and model.layer4[0].conv1.out_channels == 256 and model.fc.in_features == 256
    assert model.fc.out_features == 10
    assert float(model.bn1.weight.detach().min()) == 1.0 and float(model.bn1.running_var.min()) == 1.0  # re-initialised


def test_a_distillation_gain_between_students_at_chance_is_not_a_figure():
    from torchspeed.bench.suites.compress import students_learned

    at_chance = [{"alone": 0.1015, "distilled": 0.109}, {"alone": 0.098, "distilled": 0.12}]
    assert not students_learned(at_chance, 10)
    assert students_learned(at_chance + [{"alone": 0.11, "distilled": 0.31}], 10)
    assert students_learned([{"alone": 0.3, "distilled": 0.3}], 2) is False  # 2 classes: chance is 0.5
