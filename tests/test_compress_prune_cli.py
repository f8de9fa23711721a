"""`torchspeed prune` on the user's own model, and pruned models saved and rebuilt without pickle."""
import json
import textwrap

import pytest
import torch

import torchspeed as ts
from torchspeed.cli import main
from torchspeed.compress.pruning import load_pruned, save_pruned

pytest.importorskip("torch_pruning")

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    def make(width=16, num_classes=5):
        return nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width * 2, 3, padding=1, groups=1), nn.BatchNorm2d(width * 2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width * 2, num_classes))
""")


def test_pruned_model_round_trips_through_save_and_load(tmp_path):
    path = tmp_path / "mynet.py"
    path.write_text(MODEL_FILE)
    original = ts.models.create(f"{path}:make", width=16)
    example = torch.randn(2, 3, 16, 16)
    result = ts.compress.prune(original, example, 0.5, round_to=None, measure=False)
    pruned = result.model
    assert result.params_after < result.params_before
    save_pruned(pruned, str(tmp_path / "out"), ts.models.spec_of(original), result)
    from_spec = load_pruned(str(tmp_path / "out"), spec=f"{path}:make")
    from_model = load_pruned(str(tmp_path / "out"), model=ts.models.create(f"{path}:make", width=16))
    for rebuilt in (from_spec, from_model):
        assert rebuilt[0].out_channels == pruned[0].out_channels < 16
        with torch.no_grad():
            torch.testing.assert_close(rebuilt(example), pruned.eval()(example))
    saved = json.loads((tmp_path / "out" / "pruned.json").read_text())
    assert saved["report"] == json.loads(json.dumps(result.to_dict()))


def test_prune_command_on_a_file_factory_writes_a_loadable_model(tmp_path, capsys):
    path = tmp_path / "mynet.py"
    path.write_text(MODEL_FILE)
    out, js = tmp_path / "pruned", tmp_path / "prune.json"
    code = main(["prune", f"{path}:make", "--model-kwargs", '{"width": 16}', "--ratio", "0.5",
                 "--input-shape", "1,3,16,16", "--out", str(out), "--json", str(js)])
    assert code == 0
    report = json.loads(js.read_text())
    model = load_pruned(str(out), spec=f"{path}:make")  # the folder's {"width": 16} applies to the same spec
    assert sum(p.numel() for p in model.parameters()) == report["params_after"] < report["params_before"]
    assert model(torch.randn(1, 3, 16, 16)).shape == (1, 5)


def test_prune_command_names_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["prune", "resnet18", "--ratio", "1.5"])
    assert "in (0, 1)" in capsys.readouterr().err
    assert main(["prune", "resnet18", "--ratio", "0.3", "--importance", "magic"]) == 2
    assert "--importance 'magic'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a pruned model written by torchspeed"):
        load_pruned(str(tmp_path))
