"""The one model factory: every spec form, weights loading, and the errors a user sees."""
from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch
import torchvision
from torch import nn

from torchspeed.models import ModelSpec, create, default_input_shape, load_weights, parse_kwargs, spec_of

USER_MODEL = '''
import torch
from torch import nn

class TinyNet(nn.Module):
    def __init__(self, num_classes=3, width=4):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))

def make_tiny(num_classes=3):
    return TinyNet(num_classes)

def not_a_model():
    return 42
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(USER_MODEL)
    return path


def test_torchvision_and_timm_names():
    assert isinstance(create("resnet18"), torchvision.models.ResNet)
    assert create("torchvision:resnet18", num_classes=7).fc.out_features == 7
    assert create("tv:resnet18").training is False  # built in eval mode
    timm_model = create("timm:resnet10t", num_classes=4)
    assert type(timm_model).__module__.startswith("timm.")
    assert default_input_shape(timm_model) == (1, *timm_model.pretrained_cfg["input_size"])
    assert default_input_shape(create("resnet18")) is None


def test_user_file_factory(user_file):
    model = create(f"{user_file}:make_tiny", num_classes=5)
    assert type(model).__name__ == "TinyNet" and model.fc.out_features == 5
    assert spec_of(model) == ModelSpec("file", f"{user_file}:make_tiny", {"num_classes": 5})
    # a class works as a factory too, and the spec rebuilds the same architecture
    cls_model = create(f"{user_file}:TinyNet", width=6)
    assert create(spec_of(cls_model)).conv.out_channels == 6


def test_user_module_factory(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    assert ModelSpec.parse("my_models:make_tiny").source == "module"
    assert create("my_models:make_tiny").fc.out_features == 3


def test_weights_roundtrip_and_prefixes(tmp_path):
    ref = create("resnet18", num_classes=3)
    plain, wrapped = tmp_path / "plain.pt", tmp_path / "lightning.ckpt"
    torch.save(ref.state_dict(), plain)
    torch.save({"state_dict": {f"model.{k}": v for k, v in ref.state_dict().items()}, "epoch": 3}, wrapped)
    x = torch.randn(1, 3, 64, 64)
    for path in (plain, wrapped):
        model = create("resnet18", num_classes=3, weights=str(path))
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))


def test_weights_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        create("resnet18", weights=str(tmp_path / "missing.pt"))
    wrong = tmp_path / "wrong.pt"
    torch.save(create("resnet18", num_classes=3).state_dict(), wrong)
    with pytest.raises(ValueError, match=r"wrong\.pt.*do not fit ResNet"):
        create("resnet18", num_classes=10, weights=str(wrong))


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_weights_never_unpickle_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"fc.weight": _Boom()}, f)
    with pytest.raises(ValueError, match=r"evil\.pt"):
        load_weights(nn.Linear(2, 2), str(evil))
    assert not (tmp_path / "pwned").exists()


def test_spec_errors(user_file):
    with pytest.raises(ValueError, match="did you mean resnet18") as e:
        create("resnett18")
    hints = str(e.value).split("did you mean ")[1].rstrip("?").split(", ")
    assert len(hints) == len(set(hints)), "each suggestion once"
    with pytest.raises(ValueError, match="package.module:factory"):
        create("no_such_net_xyz")
    with pytest.raises(ValueError, match="is a file, not a model spec"):
        create("exported.pt2")  # never torch.export.load: it unpickles
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        create("nowhere.py:make")
    with pytest.raises(ValueError, match="did you mean make_tiny"):
        create(f"{user_file}:make_tin")
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        create(f"{user_file}:not_a_model")
    with pytest.raises(ValueError, match="cannot import module"):
        create("no_such_package.models:make")
    with pytest.raises(ValueError, match="unexpected keyword"):
        create(f"{user_file}:make_tiny", depth=3)


def test_parse_kwargs():
    assert parse_kwargs('{"num_classes": 10}') == {"num_classes": 10}
    assert parse_kwargs(None) == {}
    with pytest.raises(ValueError, match="JSON object"):
        parse_kwargs("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        parse_kwargs("num_classes=10")


def test_a_module_spec_imports_from_the_current_directory(tmp_path, monkeypatch):
    """The installed `torchspeed` script's sys.path lacks the current directory; specs still find it."""
    from torchspeed.models import load_callable

    (tmp_path / "my_project_nets.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 3)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert create("my_project_nets:make").out_features == 3
    assert load_callable("my_project_nets:make", what="dataset")().in_features == 2
    with pytest.raises(ValueError, match="for dataset 'no_such_mod_xyz:f'.*current directory"):
        load_callable("no_such_mod_xyz:f", what="dataset")
    with pytest.raises(ValueError, match="not a dataset factory"):
        load_callable("resnet18", what="dataset")


def test_model_spec_round_trips_through_json_and_rejects_malformed_entries():
    import json

    spec = ModelSpec.parse("resnet18", num_classes=4)
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert create(spec).fc.out_features == 4
    assert spec.from_library and not spec.runs_user_code
    for bad in (None, {"source": "pickle", "name": "x"}, {"source": "timm", "name": 3},
                {"source": "module", "name": "a:b", "kwargs": []}):
        with pytest.raises(ValueError, match="manifest.json names no architecture"):
            ModelSpec.from_dict(bad, where="manifest.json")


def test_spec_of_is_none_for_a_model_built_elsewhere():
    assert spec_of(nn.Linear(2, 2)) is None
