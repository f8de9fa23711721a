"""select_backbone and `torchspeed select`: parameters and MACs counted exactly, candidates ranked by
measured latency, the budget marked, names resolved with clear errors, the JSON the command writes."""
import json

import pytest
import torch
import torchvision
from helpers import tiny_convnet

from torchspeed.cli import main
from torchspeed.compress import count_macs, count_params, select_backbone
from torchspeed.models import create


def test_counts_match_hand_computation():
    x = torch.randn(1, 3, 16, 16)
    # conv: 8 out * 3 in * 3*3 kernel per output pixel * 16*16 pixels; linear: 8 * 10
    assert count_macs(tiny_convnet(10), x) == 8 * 3 * 9 * 16 * 16 + 8 * 10
    assert count_macs(tiny_convnet(10), torch.randn(2, 3, 16, 16)) == 2 * (8 * 3 * 9 * 16 * 16 + 8 * 10)
    assert count_params(tiny_convnet(10)) == 8 * 3 * 9 + 8 + 8 * 10 + 10


@pytest.fixture(scope="module")
def ranked():
    return select_backbone({"big": torchvision.models.resnet18(), "tiny": tiny_convnet(10)}, (1, 3, 64, 64),
                           budget_ms=1e6, repeats=3, warmup=1, precision="fp32")


def test_obviously_smaller_model_ranks_faster(ranked):
    from torchspeed.compress import BackboneRow

    assert [c.name for c in ranked.table] == ["tiny", "big"]
    assert all(isinstance(c, BackboneRow) for c in ranked.table)
    tiny, big = ranked.table
    assert tiny.latency_ms < big.latency_ms and tiny.macs < big.macs and tiny.params < big.params
    assert big.params == 11_689_512
    assert tiny.macs == 8 * 3 * 9 * 64 * 64 + 80  # per sample
    assert ranked.best is tiny and ranked.fastest is tiny  # properties, the same row
    assert tiny.precision == "fp32" and set(tiny.tried_ms) == {"fp32"}
    assert tiny.throughput == pytest.approx(1e3 / tiny.latency_ms, rel=0.5)


def test_budget_fit_is_marked_by_measured_latency(ranked):
    assert all(c.fits for c in ranked.table)  # a budget of 1e6 ms fits everything
    result = select_backbone({"tiny": tiny_convnet(10)}, (1, 3, 64, 64), budget_ms=1e-6, repeats=2, warmup=1, precision="fp32")
    assert result.table[0].fits is False and result.fitting == []
    d = ranked.to_dict()
    assert d["budget_ms"] == 1e6 and [c["name"] for c in d["table"]] == ["tiny", "big"] and d["best"] == "tiny"


def test_no_budget_means_fits_is_none_and_batch_size_overrides():
    result = select_backbone([tiny_convnet(10)], (1, 3, 8, 8), batch_size=4, repeats=2, warmup=1, precision="fp32")
    c = result.table[0]
    assert c.fits is None and result.fitting == [c] and result.batch_size == 4 and result.input_shape == (4, 3, 8, 8)
    assert c.name == "Sequential#0"


def test_auto_precision_tries_fp32_and_the_mixed_precision():
    from torchspeed.runtime import default_precision

    result = select_backbone([tiny_convnet(10)], (1, 3, 8, 8), repeats=2, warmup=1)
    tried = set(result.table[0].tried_ms)
    assert "fp32" in tried and default_precision("cpu").name in tried
    assert result.best.precision == min(result.best.tried_ms, key=result.best.tried_ms.get)


def test_candidates_as_a_comma_string_and_the_choice_logged(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="torchspeed"):
        result = select_backbone(" mobilenet_v3_small, resnet18 ,", (1, 3, 32, 32), repeats=2, warmup=1,
                                 precision="fp32")
    assert sorted(c.name for c in result.table) == ["mobilenet_v3_small", "resnet18"]
    records = [r for r in caplog.records if r.name == "torchspeed.compress.selection" and r.levelno == logging.INFO]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]  # other processes may share the cores
    assert len(records) == 1 and len(warned) == (1 if result.busy_warning else 0)
    line = records[0].getMessage()
    assert line.startswith(f"select_backbone: fastest {result.best.name} at fp32")
    assert f"{result.best.latency_ms:.2f} ms" in line and result.table[1].name in line
    with pytest.raises(ValueError, match="candidates is empty"):
        select_backbone(" , ", (1, 3, 32, 32))


def test_progress_true_prints_and_a_callable_receives_messages(capsys):
    seen = []
    select_backbone([tiny_convnet(10)], (1, 3, 8, 8), repeats=2, warmup=1, precision="fp32", progress=seen.append)
    assert seen and any("timing" in m for m in seen)
    select_backbone([tiny_convnet(10)], (1, 3, 8, 8), repeats=2, warmup=1, precision="fp32", progress=True)
    assert "timing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="progress must be"):
        select_backbone([tiny_convnet(10)], (1, 3, 8, 8), progress="yes")


def test_names_resolve_to_torchvision_and_timm():
    assert isinstance(create("resnet18"), torchvision.models.ResNet)
    assert type(create("timm:resnet10t")).__module__.startswith("timm.")
    assert create("tv:resnet18", num_classes=7).fc.out_features == 7


HOW = ("torchvision", "timm:NAME", "file.py:factory", "nn.Module")


@pytest.mark.parametrize("name, expected", [
    ("resnet-18", HOW + ("did you mean resnet18",)), ("resnet_does_not_exist", HOW),
    ("timm:nonet", HOW), ("foo:resnet18", ("cannot import module 'foo'", "nn.Module")),
])
def test_unknown_name_says_how_to_name_models(name, expected):
    with pytest.raises(ValueError) as e:
        select_backbone([name], (1, 3, 32, 32))
    msg = str(e.value)
    assert repr(name) in msg and all(part in msg for part in expected), msg


@pytest.mark.parametrize("shape, message", [((3,), "input_shape"), ((1, 3, 0, 4), "input_shape"), ("abc", "input_shape")])
def test_bad_shapes_are_clear(shape, message):
    with pytest.raises(ValueError, match=message):
        select_backbone([tiny_convnet(10)], shape)


def test_model_failing_at_shape_is_named():
    with pytest.raises(ValueError, match=r"candidate 'Sequential#0' fails on input shape \(1, 5, 8, 8\)"):
        select_backbone([tiny_convnet(10)], (1, 5, 8, 8))


def test_cli_select_writes_json(tmp_path, capsys):
    path = tmp_path / "sel.json"
    code = main(["select", "--candidates", "mobilenet_v3_small", "--input-shape", "1,3,32,32", "--budget-ms", "1e5",
                 "--repeats", "2", "--precision", "fp32", "--json", str(path)])
    assert code == 0
    d = json.loads(path.read_text())
    assert d["table"][0]["name"] == "mobilenet_v3_small" and d["table"][0]["fits"] is True
    assert "within 100000 ms: mobilenet_v3_small" in capsys.readouterr().out


def test_cli_unknown_candidate_is_one_line_exit_2(capsys):
    code = main(["select", "--candidates", "resnet18,frobnet", "--input-shape", "1,3,32,32"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown model 'frobnet'" in err and "Traceback" not in err


def test_cli_unknown_precision_names_the_choices_exit_2(capsys):
    code = main(["select", "--candidates", "resnet18", "--input-shape", "1,3,32,32", "--precision", "int8"])
    err = capsys.readouterr().err
    assert code == 2 and "'fp32', 'bf16', 'fp16', got 'int8'" in err and "Traceback" not in err


def test_select_waits_for_a_quiet_machine_before_timing(monkeypatch):
    from torchspeed import measure
    from torchspeed.compress import selection

    calls = []
    monkeypatch.setattr(selection, "wait_for_quiet_machine", lambda **kw: calls.append(kw) or measure.Quiet(0.0, 0.0))
    selection.select_backbone({"a": torch.nn.Conv2d(3, 4, 3)}, input_shape=(1, 3, 16, 16), repeats=1, warmup=0)
    assert len(calls) == 1 and calls[0]["max_s"] <= 5
