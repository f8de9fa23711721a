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
    monkeypatch.setattr(dm, "load_demo_model", lambda log=None: demo)
    for name, value in (("FINETUNE_STEPS", (2, 2)), ("KD_STEPS", (2, 2)), ("MAX_TRAIN_SIDE", 16), ("BN_RECALIB", 64)):
        monkeypatch.setattr(suite, name, value)
    steps = []
    result = suite.run(quick=True, step=steps.append)
    for key in ("prune_speedup", "prune_metric_drop", "kd_gain", "kd_gain_std"):
        assert isinstance(result[key], float) and math.isfinite(result[key]), key
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


def test_image_loader_is_deterministic_crops_and_normalises():
    from torchspeed.bench.suites.compress import ImageTensorLoader

    images = torch.randint(0, 256, (10, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(10)
    a = ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), crop=8, seed=1)
    b = ImageTensorLoader(images, labels, 4, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), crop=8, seed=1)
    assert len(a) == 2
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.shape == (4, 3, 8, 8)
    a.set_epoch(1)
    assert not torch.equal(next(iter(a))[1], next(iter(b))[1])
    whole = ImageTensorLoader(images, labels, 10, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    x, y = next(iter(whole))
    flipped = torch.stack([img if torch.allclose(x[i], (img.float() / 255 - 0.5) / 0.25, atol=1e-5)
                           else img.flip(2) for i, img in enumerate(images[[int(v) for v in y]])])
    torch.testing.assert_close(x, (flipped.float() / 255 - 0.5) / 0.25)
    shifted = ImageTensorLoader(images, labels, 10, (0.0,) * 3, (1 / 255,) * 3, pad=2, seed=3)
    xs, ys = next(iter(shifted))
    assert xs.shape == (10, 3, 16, 16)
    # every output is a (possibly flipped) translation of its source image by at most 2 pixels
    for img, out in zip(images[[int(v) for v in ys]].float(), xs):
        padded = torch.nn.functional.pad(img[None], (2, 2, 2, 2), mode="reflect")[0]
        windows = [padded[:, i:i + 16, j:j + 16] for i in range(5) for j in range(5)]
        assert any(torch.allclose(out, w, atol=1e-3) or torch.allclose(out, w.flip(2), atol=1e-3) for w in windows)
    with pytest.raises(ValueError, match="crop 32"):
        ImageTensorLoader(images, labels, 4, (0.5,) * 3, (0.25,) * 3, crop=32)


def test_recalibrate_bn_matches_whole_batch_statistics():
    from torch import nn

    from torchspeed.bench.suites.compress import recalibrate_bn

    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    xs = [torch.randn(8, 3, 5, 5) + 2 for _ in range(3)]
    recalibrate_bn(net, ((x, None) for x in xs))
    with torch.no_grad():
        feats = torch.cat([net[0](x) for x in xs])
    torch.testing.assert_close(net[1].running_mean, feats.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    assert not net.training and net[1].momentum == 0.1
