"""Every old public name in `torchspeed.deprecated` still works, warns once, and names the new one."""
import importlib
import warnings

import pytest
import torch

from torchspeed import deprecated
from torchspeed.cli import _renamed_flags, build_parser


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(deprecated, "_SAID", set())


def _warned(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("old", sorted(deprecated.NAMES))
def test_an_old_name_is_the_new_object_and_warns_once(old):
    package, name = old.rsplit(".", 1)
    new = deprecated.NAMES[old]
    module = importlib.import_module(package)
    value, said = _warned(lambda: getattr(module, name))
    assert value is getattr(module, new)
    assert len(said) == 1 and f"{package}.{new}" in said[0] and old in said[0]
    assert _warned(lambda: getattr(module, name))[1] == []  # once per process


def test_a_name_that_never_existed_is_still_an_attribute_error():
    import torchspeed.infer

    with pytest.raises(AttributeError, match="no attribute 'available_backendz'"):
        torchspeed.infer.available_backendz  # noqa: B018


def _row():
    from torchspeed.infer import VariantRow

    return VariantRow("onnxruntime-fp32", "onnxruntime", "fp32", True)


def _runner():
    from torchspeed.infer import TorchRunner

    return TorchRunner(torch.nn.Linear(2, 2), {})


@pytest.mark.parametrize("entry", sorted(deprecated.ATTRIBUTES))
def test_an_old_attribute_reads_the_new_one(entry):
    make = {"VariantRow.backend": _row, "Runner.backend": _runner}[entry]  # a KeyError: a new entry needs a case here
    obj = make()
    old = entry.split(".")[1]
    value, said = _warned(lambda: getattr(obj, old))
    assert value == getattr(obj, deprecated.ATTRIBUTES[entry]) and value
    assert len(said) == 1 and deprecated.ATTRIBUTES[entry] in said[0]


def test_the_old_optimize_keyword_restricts_the_runtimes_as_the_new_one_does():
    assert set(deprecated.KEYWORDS) == {"optimize(backends=)"}
    from torchspeed.infer import optimize

    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    result, said = _warned(lambda: optimize(model, torch.randn(1, 4), backends="torch", precisions="fp32",
                                            measure=False))
    new = optimize(model, torch.randn(1, 4), runtimes="torch", precisions="fp32", measure=False)
    assert [(r.name, r.status) for r in result.table] == [(r.name, r.status) for r in new.table]
    assert {r.runtime for r in result.table if r.status != "skipped"} == {"torch"}
    assert "optimize(runtimes=)" in said[0]


@pytest.mark.parametrize("entry", sorted(deprecated.FLAGS))
def test_an_old_flag_parses_as_the_new_one(entry, capsys):
    command, old = entry.split(" ")
    new = deprecated.FLAGS[entry]
    value = {"--backends": "torch", "--seconds": "0.5", "--workers": "3", "--image-size": "96"}[old]
    need = {"optimize": ["resnet18"], "tune-loader": ["folder"], "pack": ["folder", "out"],
            "train": ["--data", "folder", "--model", "resnet18", "--epochs", "1"]}[command]
    parser = build_parser()
    with_old = parser.parse_args(_renamed_flags([command, *need, old, value]))
    with_new = parser.parse_args([command, *need, new, value])
    assert vars(with_old) == vars(with_new)
    assert f"{old} is now {new}" in capsys.readouterr().err
    assert parser.parse_args(_renamed_flags([command, *need, f"{old}={value}"])) == with_new
