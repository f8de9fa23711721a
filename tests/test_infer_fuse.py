"""Conv+BN folding and precision variants: numerics against the fp32 original."""
import pytest
import torch
import torchvision
from torch import nn

from torchspeed.infer.fuse import fuse_conv_bn, fuse_conv_bn_report
from torchspeed.infer.precision import output_error, to_precision


def _with_real_bn_stats(model: nn.Module) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine params, so folding has work to do."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


def _rel_max_error(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_fusion_numerics_on_torchvision_models(name):
    torch.manual_seed(0)
    model = _with_real_bn_stats(torchvision.models.get_model(name, num_classes=10))
    x = torch.randn(2, 3, 32, 32)
    fused, report = fuse_conv_bn_report(model)
    assert report.method == "fx" and report.fused >= 17
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules())
    with torch.no_grad():
        assert _rel_max_error(fused(x), model(x)) <= 1e-4
    # the original is untouched
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


class Branchy(nn.Module):
    """Data-dependent control flow: FX cannot trace it, so the module walk must fuse."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6))

    def forward(self, x):
        y = self.body(x).mean(-1)
        if y.sum() > 0:
            y = y * 2
        return self.head(y)


def test_module_walk_fallback_fuses_conv1d_and_linear():
    model = _with_real_bn_stats(Branchy())
    fused, report = fuse_conv_bn_report(model)
    assert report.method.startswith("module-walk") and report.fused == 2
    x = torch.randn(5, 4, 16)
    with torch.no_grad():
        assert _rel_max_error(fused(x), model(x)) <= 1e-4


def test_fuse_rejects_non_modules():
    with pytest.raises(ValueError, match="nn.Module"):
        fuse_conv_bn(lambda x: x)


@pytest.mark.parametrize("precision,mode,tol", [("bf16", "autocast", 0.05), ("bf16", "weights", 0.05),
                                                ("fp16", "weights", 0.01), ("fp32", "autocast", 1e-5)])
def test_precision_variants_close_to_fp32(precision, mode, tol):
    torch.manual_seed(0)
    model = _with_real_bn_stats(nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)))
    x = torch.randn(4, 3, 32, 32)
    variant = to_precision(model, precision, mode, channels_last=True)
    with torch.no_grad():
        out, ref = variant(x), model(x)
    assert out.dtype == torch.float32
    err = output_error(out, ref)["rel_l2"]
    assert err <= tol
    if precision != "fp32":
        assert err > 0  # it really ran in reduced precision
    assert next(model.parameters()).dtype == torch.float32  # original untouched


def test_precision_rejects_unknown():
    with pytest.raises(ValueError, match="precision must be one of"):
        to_precision(nn.Linear(2, 2), "int4")
