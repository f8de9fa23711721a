"""recalibrate_bn: BatchNorm running statistics re-estimated on data, nothing else touched."""
import pytest
import torch
from helpers import two_stage_convnet
from torch import nn

from torchspeed.compress import prune, recalibrate_bn


def _conv_bn(momentum=0.1):
    """A 1x1 conv then a BatchNorm with the given momentum and nothing after it: the BatchNorm's
    inputs are the conv's outputs, so the expected statistics are computed from `net[0]` alone."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=momentum))


def _features(net, xs):
    with torch.no_grad():
        return torch.cat([net[0](x) for x in xs])


def test_running_stats_become_the_data_statistics():
    net = _conv_bn(momentum=0.3)
    conv_before = net[0].weight.detach().clone()
    xs = [torch.randn(8, 3, 5, 5) * 3 + 2 for _ in range(3)]
    feats = _features(net, xs)
    assert (net[1].running_mean - feats.mean((0, 2, 3))).abs().min() > 0.1  # fresh stats: far from the data's
    out = recalibrate_bn(net, ((x, torch.zeros(8)) for x in xs))
    assert out is net and not net.training
    torch.testing.assert_close(net[1].running_mean, feats.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    # the variance: the average over batches of each batch's (unbiased) variance, as BatchNorm accumulates it
    per_batch_var = torch.stack([_features(net, [x]).transpose(0, 1).flatten(1).var(1) for x in xs]).mean(0)
    torch.testing.assert_close(net[1].running_var, per_batch_var, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(net[1].running_var, feats.transpose(0, 1).flatten(1).var(1), rtol=0.05, atol=0.0)
    assert net[1].momentum == 0.3 and torch.equal(net[0].weight, conv_before)  # momentum restored, weights untouched
    assert all(p.grad is None for p in net.parameters())


def test_dict_and_tensor_batches_give_the_same_statistics_and_limit_caps_the_samples():
    xs = [torch.randn(8, 3, 5, 5) + 1 for _ in range(3)]
    a, b = _conv_bn(), _conv_bn()
    recalibrate_bn(a, [{"image": x, "label": torch.zeros(8)} for x in xs], limit=10)  # batches of 8 and 2
    recalibrate_bn(b, [torch.cat(xs)[:10]])  # input tensors alone, one batch
    first10 = _features(a, [torch.cat(xs)[:10]])
    torch.testing.assert_close(a[1].running_mean, first10.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a[1].running_mean, b[1].running_mean, rtol=1e-4, atol=1e-5)
    var8, var2 = (first10[s].transpose(0, 1).flatten(1).var(1) for s in (slice(0, 8), slice(8, 10)))
    torch.testing.assert_close(a[1].running_var, 0.8 * var8 + 0.2 * var2, rtol=1e-4, atol=1e-5)


def test_empty_batches_are_an_error_and_leave_the_statistics():
    net = _conv_bn()
    recalibrate_bn(net, [torch.randn(4, 3, 5, 5) + 5])
    before = {k: v.clone() for k, v in net[1].state_dict().items()}
    with pytest.raises(ValueError, match="empty"):
        recalibrate_bn(net, [])
    assert all(torch.equal(before[k], v) for k, v in net[1].state_dict().items())
    assert net[1].momentum == 0.1
    with pytest.raises(ValueError, match="limit"):
        recalibrate_bn(net, [torch.randn(4, 3, 5, 5)], limit=0)


def test_recalibration_after_pruning_matches_the_pruned_layers_inputs():
    small = prune(two_stage_convnet(), torch.randn(1, 3, 12, 12), 0.5, measure=False, round_to=None).model
    xs = [torch.randn(16, 3, 12, 12) * 2 - 1 for _ in range(2)]
    before = small[4].running_mean.clone()
    recalibrate_bn(small, xs)
    with torch.no_grad():
        h1 = torch.cat([small[0](x) for x in xs])
        h4 = torch.cat([small[3](small[2](small[1](small[0](x)))) for x in xs])
    torch.testing.assert_close(small[1].running_mean, h1.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    # the deeper layer saw inputs normalised by batch statistics during the pass: close, not identical
    torch.testing.assert_close(small[4].running_mean, h4.mean((0, 2, 3)), rtol=0.0, atol=1e-3)
    assert not torch.allclose(before, small[4].running_mean, atol=1e-3) and small[4].num_features == 16
