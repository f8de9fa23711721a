"""prune: channels really cut out (rounded, output layers kept), the caller's model untouched, iterative
steps with fine-tuning, the measured figures in one result, clear errors for bad arguments."""
import pytest
import torch
import torchvision
from torch import nn

from torchspeed.compress import count_macs, count_params, prune


def _resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


@pytest.fixture(scope="module")
def pruned():
    model = _resnet()
    x = torch.randn(2, 3, 32, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = prune(model, x, 0.5, measure=False)
    return model, x, before, result


def test_pruned_model_is_smaller_and_keeps_shapes(pruned):
    model, x, before, result = pruned
    small, figures = result  # unpacks to (model, result)
    assert small is result.model and figures is result
    assert result.params_after < result.params_before / 2
    assert result.macs_after < result.macs_before / 2
    assert result.params_before == count_params(model) and result.params_after == count_params(small)
    assert result.macs_after == count_macs(small, x)
    with torch.no_grad():
        assert small(x).shape == model(x).shape == (2, 10)
        assert small(torch.randn(1, 3, 48, 48)).shape == (1, 10)  # still fully convolutional
    assert small.fc.out_features == 10 and result.ignored == ["fc"]


def test_channels_really_removed_and_rounded_to_8(pruned):
    _, _, _, result = pruned
    small = result.model
    assert small.conv1.out_channels == 32 and small.layer4[1].conv2.out_channels == 256
    for m in small.modules():
        if isinstance(m, nn.Conv2d) and m.in_channels != 3:
            assert m.in_channels % 8 == 0 and m.out_channels % 8 == 0
            assert m.weight.shape[:2] == (m.out_channels, m.in_channels)


def test_original_model_untouched(pruned):
    model, _, before, _ = pruned
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.conv1.out_channels == 64


def _dead_half_net():
    """conv-relu-conv-relu-pool-linear where channels 8..15 of both convs carry exactly nothing."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        net[0].weight[8:] = 0
        net[0].bias[8:] = 0
        net[2].weight[:, 8:] = 0
        net[2].weight[8:] = 0
        net[2].bias[8:] = 0
        net[6].weight[:, 8:] = 0
    return net


def test_pruning_dead_channels_keeps_outputs_exactly():
    net = _dead_half_net()
    x = torch.randn(4, 3, 12, 12)
    small, report = prune(net, x, 0.5, importance="l1", measure=False, round_to=None)
    assert small[0].out_channels == 8 and small[2].in_channels == 8 and small[6].in_features == 8
    with torch.no_grad():
        torch.testing.assert_close(small(x), net(x), rtol=1e-5, atol=1e-6)
    assert report.params_after < report.params_before


def test_iterative_steps_call_finetune_and_reach_ratio():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 5))
    widths = []
    result = prune(net, torch.randn(1, 3, 16, 16), 0.5, steps=2, measure=False,
                   finetune=lambda m, step: widths.append((step, m[0].out_channels, m.training)))
    assert widths == [(0, 24, False), (1, 16, False)]
    assert result.steps == 2 and result.model[3].out_channels == 16 and result.model[1].num_features == 16


def test_ignore_eval_fn_and_measured_latency_are_in_the_result():
    net = _dead_half_net()
    x = torch.randn(2, 3, 12, 12)
    calls = []

    def eval_fn(m):
        calls.append(m)
        return 0.75 if len(calls) == 1 else 0.5

    small, report = prune(net, x, 0.5, ignore=[net[0]], eval_fn=eval_fn, round_to=None, repeats=2)
    assert small[0].out_channels == 16 and small[2].out_channels == 8
    assert report.metric_before == 0.75 and report.metric_after == 0.5 and report.metric_drop == 0.25
    assert report.latency_before_ms > 0 and report.latency_after_ms > 0
    assert report.speedup == pytest.approx(report.latency_before_ms / report.latency_after_ms)
    figures = report.to_dict()
    assert "speedup" in figures and "model" not in figures and "->" in str(report)


@pytest.mark.parametrize("kwargs, message", [
    ({"ratio": 1.0}, "ratio"),
    ({"ratio": 0.5, "importance": "magic"}, "l1, l2"),
    ({"ratio": 0.5, "steps": 0}, "steps"),
    ({"ratio": 0.5, "ignore": [nn.Linear(2, 2)]}, "not a submodule"),
])
def test_bad_arguments_are_clear(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prune(_dead_half_net(), torch.randn(1, 3, 8, 8), measure=False, **kwargs)


def test_wrong_example_input_names_the_shape():
    with pytest.raises(ValueError, match=r"example_input of shape \(1, 5, 8, 8\)"):
        prune(_dead_half_net(), torch.randn(1, 5, 8, 8), 0.5, measure=False)
