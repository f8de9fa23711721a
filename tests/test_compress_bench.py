import math
import types

import pytest
import torch
import torchvision


@pytest.mark.slow
def test_compress_suite_end_to_end_on_a_tiny_fake_demo(monkeypatch):
    """The suite's plumbing and JSON contract, on a tiny stand-in for the demo model (no speed claims)."""
    import torchspeed.bench.demo_model as dm
    import torchspeed.bench.suites.compress as suite

    torch.manual_seed(0)
    demo = types.SimpleNamespace(
        model=torchvision.models.resnet18(num_classes=10).eval(), input_size=32,
        train_images=torch.randint(0, 256, (128, 3, 32, 32), dtype=torch.uint8), train_labels=torch.arange(128) % 10,
        heldout_images=torch.randint(0, 256, (50, 3, 32, 32), dtype=torch.uint8), heldout_labels=torch.arange(50) % 10,
        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    monkeypatch.setattr(dm, "load_demo_model", lambda log=None: demo)
    monkeypatch.setattr(suite, "FINETUNE_STEPS", (2, 2))
    monkeypatch.setattr(suite, "KD_STEPS", (2, 2))
    monkeypatch.setattr(suite, "KD_SIZE", 32)
    steps = []
    result = suite.run(quick=True, step=steps.append)
    for key in ("prune_speedup", "prune_metric_drop", "kd_gain", "kd_gain_std"):
        assert isinstance(result[key], float) and math.isfinite(result[key]), key
    assert len(result["kd"]["runs"]) == 2 and result["kd"]["kd_gain_std"] >= 0
    assert result["prune"]["report"]["params_after"] < result["prune"]["report"]["params_before"] / 3
    assert result["prune_metric_drop"] == pytest.approx(result["prune"]["acc_before"] - result["prune"]["acc_after"])
    for row in result["rows"]:
        assert {"technique", "median", "min", "max", "unit", "ratio", "cumulative", "metric_drop", "what"} <= set(row)
    assert any("fine-tuning" in s for s in steps)


def test_half_width_student_has_half_the_channels():
    from torchspeed.bench.suites.compress import half_width_resnet18

    model = half_width_resnet18(10, torch.randn(1, 3, 32, 32))
    assert model.conv1.out_channels == 32 and model.layer4[0].conv1.out_channels == 256 and model.fc.in_features == 256
    assert model.fc.out_features == 10
    assert float(model.bn1.weight.min()) == 1.0 and float(model.bn1.running_var.min()) == 1.0  # re-initialised


def test_image_loader_is_deterministic_and_normalised():
    from torchspeed.bench.suites.compress import ImageTensorLoader

    images = torch.randint(0, 256, (10, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(10)
    a = ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), seed=1)
    b = ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), seed=1)
    assert len(a) == 2
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.shape == (4, 3, 16, 16)
    a.set_epoch(1)
    assert not torch.equal(next(iter(a))[1], next(iter(b))[1]) or not torch.equal(next(iter(a))[0], next(iter(b))[0])
    ev = ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), train=False)
    x, y = next(iter(ev))
    assert len(ev) == 3 and torch.equal(y, labels[:4])
    torch.testing.assert_close(x, (images[:4].float() / 255 - 0.5) / 0.25)
