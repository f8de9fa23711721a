"""bench design: each experiment holds FLOPs fixed (the premise of the ShuffleNet V2 tables), and the
direction checks read the medians the right way round."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from torchspeed.bench.suites import design, load


def test_design_suite_is_registered():
    assert load("design") is design and design.TITLE


@pytest.mark.parametrize("name", ["g1", "g2", "g3", "g4"])
def test_each_experiment_holds_flops_fixed(name):
    exp = design._models(torch)[name]
    flops = []
    for (key, model), c in zip(exp["models"].items(), exp["input_channels"]):
        with torch.inference_mode(), FlopCounterMode(display=False) as fc:
            out = model(torch.randn(1, c, 8, 8))
        assert out.shape[1] == c, key  # blocks keep their width, so they stack
        flops.append(fc.get_total_flops())
    if name == "g4":  # ReLU and the shortcut add carry no conv FLOPs: the conv work is identical
        assert len(set(flops)) == 1
    else:
        assert max(flops) / min(flops) < 1.06, flops


def test_direction_checks_read_the_medians_the_right_way_round():
    assert design._holds("g1", [1.0, 1.2, 1.5, 2.0])
    assert not design._holds("g1", [1.3, 1.2, 1.5, 2.0])
    assert design._holds("g2", [1.0, 1.1, 1.2, 1.3]) and not design._holds("g2", [1.0, 0.9, 1.2, 1.3])
    assert design._holds("g3", [1.0, 1.1, 1.2, 1.3, 1.4])
    assert design._holds("g4", [1.0, 0.9, 0.95, 0.8]) and not design._holds("g4", [1.0, 0.9, 0.95, 1.1])


@pytest.mark.slow
def test_quick_run_gives_every_row_and_one_headline():
    res = design.run(quick=True, progress=lambda s: None)
    assert len(res["rows"]) == 17 and set(res["holds"]) == {"g1", "g2", "g3", "g4"}
    assert all(r["median"] > 0 and r["unit"] == "ms" for r in res["rows"])
    assert sum(bool(r.get("headline")) for r in res["rows"]) == 1
