"""Faults in pruned folders and `prune --out`: a pruned folder is data (the architecture it names is
built on its word only from a library; its arguments name no file outside it), and `--out` never
replaces a user's file and fails before any work when it cannot be used."""
import json
import os
import textwrap

import pytest
import torch

import torchspeed as ts
from torchspeed.cli import main
from torchspeed.compress import pruning
from torchspeed.compress.pruning import load_pruned, save_pruned

pytest.importorskip("torch_pruning")

NET = textwrap.dedent("""
    from torch import nn

    def make(width=8, num_classes=3):
        return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                             nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
""")


@pytest.fixture
def pruned_dir(tmp_path, monkeypatch):
    """A pruned folder of the user's own `net.py:make`; the working directory is tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET)
    original = ts.models.create("net.py:make", width=8)
    result = ts.compress.prune(original, torch.randn(1, 3, 8, 8), 0.5, round_to=None, measure=False)
    save_pruned(result.model, str(tmp_path / "pr"), ts.models.spec_of(original), result)
    return tmp_path / "pr"


def _edit_spec(folder, spec):
    meta = json.loads((folder / "pruned.json").read_text())
    meta["spec"] = spec
    (folder / "pruned.json").write_text(json.dumps(meta))


def test_a_pruned_folder_naming_code_runs_nothing_and_names_the_remedy(pruned_dir, tmp_path):
    evil = tmp_path / "evil.py"
    evil.write_text("open('PWNED_AT_IMPORT', 'w').close()\ndef make():\n    open('PWNED', 'w').close()\n")
    for spec in ({"source": "module", "name": "subprocess:run", "kwargs": {"args": "touch PWNED", "shell": True}},
                 {"source": "file", "name": f"{evil}:make", "kwargs": {}}):
        _edit_spec(pruned_dir, spec)
        with pytest.raises(ValueError) as info:
            load_pruned(str(pruned_dir))
        message = str(info.value)
        assert str(pruned_dir / "pruned.json") in message
        assert "spec=" in message and "model=" in message and "trust_code=True" in message
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED_AT_IMPORT").exists()


def test_the_callers_own_spec_or_model_loads_the_folder(pruned_dir):
    _edit_spec(pruned_dir, {"source": "module", "name": "subprocess:run", "kwargs": {}})
    example = torch.randn(2, 3, 8, 8)
    by_spec = load_pruned(str(pruned_dir), spec="net.py:make")
    by_model = load_pruned(str(pruned_dir), model=ts.models.create("net.py:make"))
    with torch.no_grad():
        torch.testing.assert_close(by_spec(example), by_model(example))
    assert by_spec[0].out_channels == 4
    assert not os.path.exists("PWNED")


def test_folder_arguments_naming_a_file_outside_it_are_refused(pruned_dir, tmp_path):
    outside = tmp_path / "weights.pt"
    torch.save({}, outside)
    for value in (str(outside), "../weights.pt", "weights.pt", "~/.ssh/id_rsa", "https://example.com/w.pt"):
        _edit_spec(pruned_dir, {"source": "file", "name": f"{tmp_path / 'net.py'}:make",
                                "kwargs": {"width": 8, "config": {"checkpoint": value}}})
        with pytest.raises(ValueError, match=r"passes config\.checkpoint=.*naming a file"):
            load_pruned(str(pruned_dir), spec="net.py:make")  # the same spec: the folder's kwargs would apply
    _edit_spec(pruned_dir, {"source": "torchvision", "name": "resnet18", "kwargs": {"weights": str(outside)}})
    with pytest.raises(ValueError, match=r"passes weights=.*naming a file"):
        load_pruned(str(pruned_dir))


def test_a_library_name_that_would_fetch_or_read_elsewhere_is_refused(pruned_dir):
    for name in ("hf-hub:timm/resnet18.a1_in1k", "local-dir:/etc", "not_a_model_xyz"):
        _edit_spec(pruned_dir, {"source": "timm", "name": name, "kwargs": {}})
        with pytest.raises(ValueError, match="pruned.json"):
            load_pruned(str(pruned_dir))


def test_layer_sizes_may_set_only_size_attributes(pruned_dir):
    meta = json.loads((pruned_dir / "pruned.json").read_text())
    for sizes in ({"0": {"forward": 3}}, {"0": {"out_channels": "4"}}, ["0"]):
        meta["sizes"] = sizes
        (pruned_dir / "pruned.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match="pruned.json"):
            load_pruned(str(pruned_dir), spec="net.py:make")


PRUNE = ["prune", "net.py:make", "--ratio", "0.5", "--input-shape", "1,3,8,8", "--round-to", "1"]


def test_prune_out_never_replaces_a_users_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.pt").write_bytes(b"the user's own weights")
    monkeypatch.setattr(pruning, "prune", lambda *a, **k: pytest.fail("pruned before --out was checked"))
    for extra in ([], ["--overwrite"]):
        assert main([*PRUNE, "--out", str(mine), *extra]) == 2
        err = capsys.readouterr().err
        assert "'model.pt'" in err and "never replaced" in err and "Traceback" not in err
    assert (mine / "model.pt").read_bytes() == b"the user's own weights"


def test_prune_out_replaces_its_own_output_only_with_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET)
    assert main([*PRUNE, "--out", "pr"]) == 0
    first = (tmp_path / "pr" / "model.pt").read_bytes()
    capsys.readouterr()
    assert main([*PRUNE, "--out", "pr", "--ratio", "0.25"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "pr" / "model.pt").read_bytes() == first
    assert load_pruned("pr", spec="net.py:make")[0].out_channels == 4  # the previous output still loads
    assert main([*PRUNE, "--out", "pr", "--ratio", "0.25", "--overwrite"]) == 0
    assert load_pruned("pr", spec="net.py:make")[0].out_channels == 6
    assert sorted(n for n in os.listdir("pr") if not n.startswith(".")) == ["model.pt", "pruned.json"]


def test_an_unwritable_prune_out_fails_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET)
    import torchspeed.cli.compress as cli_compress

    monkeypatch.setattr(cli_compress, "build_model", lambda *a, **k: pytest.fail("built before --out was checked"))
    (tmp_path / "blocker").write_text("a file")
    targets = [tmp_path / "blocker" / "pr"]
    if os.geteuid() != 0:  # root writes into read-only folders
        (tmp_path / "ro").mkdir(mode=0o555)
        targets.append(tmp_path / "ro")
    for target in targets:
        assert main([*PRUNE, "--out", str(target)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert repr(str(target)) in err and "cannot be written" in err and "Traceback" not in err


def test_save_pruned_refuses_a_folder_with_a_users_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    model = ts.models.create("resnet18", num_classes=2)
    with pytest.raises(ValueError, match="'notes.txt'"):
        save_pruned(model, str(tmp_path), ts.models.spec_of(model))
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("command", [["prune", "resnet18", "--ratio", "0.3"], ["select", "--candidates", "resnet18,mobilenet_v3_small"]])
def test_prune_and_select_input_shape_too_large_is_one_line_naming_it(command, capsys):
    from torchspeed.cli import main

    assert main([*command, "--input-shape", "100000,3,1000,1000"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "100000,3,1000,1000" in err and "GiB" in err and "Traceback" not in err, err
