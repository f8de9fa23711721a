"""The winner of `optimize` over your own nn.Module class (not built from a spec) saves and loads again
without pickle or your code: a torch.export program, checked before torch reads it."""
from __future__ import annotations

import json
import os
import pickle
import warnings
import zipfile

import pytest
import torch
from torch import nn

import torchspeed as ts
from torchspeed.infer.runners import TorchRunner
from torchspeed.safeload import UnsafeFileError


class UserNet(nn.Module):
    """A user's own architecture: convs with BatchNorm, pooling, a linear head."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class DictNet(nn.Module):
    """Hugging Face style: named inputs, a dict output holding the logits."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return {"logits": self.head(h.sum(1) / attention_mask.sum(1, keepdim=True))}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def _user_net() -> UserNet:
    torch.manual_seed(0)
    model = UserNet()
    for m in model.modules():  # running statistics that are not the identity, so folding them is tested
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _images(b: int) -> torch.Tensor:
    return torch.randn(b, 3, 16, 16, generator=torch.Generator().manual_seed(b))


def test_optimize_winner_of_a_users_own_class_saves_and_loads(tmp_path):
    model = _user_net()
    result = ts.infer.optimize(model, _images(1), runtimes="torch", precisions="fp32", batch_sizes=(1,),
                               repeats=1, min_time_s=0.0)
    best = result.best
    assert best is not None and best.runtime == "torch"
    saved = best.save(tmp_path / "best")
    assert "program.pt2" in os.listdir(saved) and "weights.pt" not in os.listdir(saved)
    back = ts.infer.load(saved)
    assert back.manifest_data["program"]["batch"] is None  # any batch size
    with torch.no_grad():
        for b in (1, 8):
            x = _images(b)
            torch.testing.assert_close(back(x), model(x), rtol=1e-4, atol=1e-5)


RECIPES = {
    "eager fp32": ({}, 1e-5),
    "fused fp32": ({"fuse": True}, 1e-4),
    "bf16 + channels_last": ({"fuse": True, "precision": "bf16", "channels_last": True}, 0.1),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_torch_variant_round_trips_at_batch_1_and_8(tmp_path, name):
    recipe, tol = RECIPES[name]
    model = _user_net()
    runner = TorchRunner(model, recipe, example=_images(1))
    runner.save(tmp_path / "art")
    back = ts.infer.load(tmp_path / "art")
    manifest = back.manifest_data
    assert manifest["recipe"] == recipe and manifest["program"]["fused"] == bool(recipe.get("fuse"))
    assert back.precision == runner.precision
    for b in (1, 8):
        x = _images(b)
        out = back(x)
        assert out.dtype == torch.float32 and out.shape == (b, 5)
        torch.testing.assert_close(out, runner(x), rtol=tol, atol=tol)  # the same variant as before saving
        with torch.no_grad():
            ref = model(x)
        assert (out - ref).abs().max() <= tol * ref.abs().max()  # and the original model's outputs
    assert model.training is False and not any(isinstance(m, nn.Identity) for m in model.modules())  # untouched


@pytest.mark.slow
def test_a_compiled_variant_round_trips(tmp_path):
    model = _user_net()
    runner = TorchRunner(model, {"fuse": True, "compile": True}, example=_images(1))
    runner.save(tmp_path / "art")
    back = ts.infer.load(tmp_path / "art")
    assert back.runtime == "torch.compile"
    x = _images(8)
    torch.testing.assert_close(back(x), model(x).detach(), rtol=1e-3, atol=1e-4)


def test_named_inputs_and_dict_outputs_round_trip(tmp_path):
    torch.manual_seed(0)
    model = DictNet().eval()

    def batch(b):
        return {"input_ids": torch.randint(0, 20, (b, 6)), "attention_mask": torch.ones(b, 6)}

    runner = TorchRunner(model, {}, example=batch(1))
    runner.save(tmp_path / "art")
    back = ts.infer.load(tmp_path / "art")
    assert back.manifest_data["program"]["inputs"] == ["input_ids", "attention_mask"]
    for b in (1, 8):
        x = batch(b)
        torch.testing.assert_close(back(x), model(**x)["logits"].detach(), rtol=1e-5, atol=1e-6)


def test_a_loaded_program_saves_again(tmp_path):
    model = _user_net()
    TorchRunner(model, {"fuse": True}, example=_images(1)).save(tmp_path / "a")
    ts.infer.load(tmp_path / "a").save(tmp_path / "b")
    x = _images(8)
    torch.testing.assert_close(ts.infer.load(tmp_path / "b")(x), model(x).detach(), rtol=1e-4, atol=1e-5)


def test_a_model_that_fixes_its_batch_size_is_saved_at_that_size(tmp_path):
    class Flatten1(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(12, 2)

        def forward(self, x):
            return self.fc(x.reshape(1, -1))

    model = Flatten1().eval()
    x = torch.randn(1, 3, 4)
    TorchRunner(model, {}, example=x).save(tmp_path / "art")
    back = ts.infer.load(tmp_path / "art")
    assert back.manifest_data["program"]["batch"] == 1
    torch.testing.assert_close(back(x), model(x).detach())


def test_data_dependent_control_flow_is_one_clear_error_and_saves_nothing(tmp_path):
    runner = TorchRunner(DataDependent().eval(), {}, example=torch.randn(1, 4))
    with pytest.raises(ValueError, match="control flow depends on the values") as e:
        runner.save(tmp_path / "art")
    assert "torchspeed.models.create" in str(e.value) and "ONNX Runtime" in str(e.value)
    assert not (tmp_path / "art" / "manifest.json").exists()


def test_save_and_load_leave_the_process_as_found(tmp_path):
    env, filters = dict(os.environ), list(warnings.filters)
    TorchRunner(_user_net(), {"fuse": True}, example=_images(1)).save(tmp_path / "art")
    ts.infer.load(tmp_path / "art")(_images(2))
    assert dict(os.environ) == env and warnings.filters == filters


# ----------------------------------------------------------------------------------------- untrusted programs
class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(tmp_path) -> str:
    d = tmp_path / "art"
    TorchRunner(_user_net(), {}, example=_images(1)).save(d)
    ts.infer.load(d)  # the clean artifact loads
    return str(d / "program.pt2")


def _rewrite(path: str, change) -> None:
    """Rewrite the archive at `path`, entries by name (relative to its root folder) through `change`."""
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    root = next(iter(entries)).split("/", 1)[0]
    rel = change({n.split("/", 1)[1]: v for n, v in entries.items()})
    with zipfile.ZipFile(path, "w") as z:
        for n, v in rel.items():
            z.writestr(f"{root}/{n}", v)


def _edit_graph(fn):
    def change(entries):
        graph = json.loads(entries["models/model.json"])
        fn(graph)
        entries["models/model.json"] = json.dumps(graph).encode()
        return entries
    return change


def _pickled_weight(marker):
    def change(entries):
        config = json.loads(entries["data/weights/model_weights_config.json"])
        name, meta = next(iter(config["config"].items()))
        meta["use_pickle"] = True
        entries[f"data/weights/{meta['path_name']}"] = pickle.dumps(_Evil(marker))
        entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()
        return entries
    return change


def _pickled_sample_inputs(marker):
    def change(entries):
        entries["data/sample_inputs/model.pt"] = pickle.dumps(_Evil(marker))
        return entries
    return change


def _node_target(target):
    def fn(graph):
        graph["graph_module"]["graph"]["nodes"][0]["target"] = target
    return _edit_graph(fn)


def _expression(marker):
    def fn(graph):
        key = next(iter(graph["range_constraints"]))
        graph["range_constraints"][f"__import__('os').system('touch {marker}')"] = graph["range_constraints"].pop(key)
    return _edit_graph(fn)


def _guard(marker):
    def fn(graph):
        graph["guards_code"] = [f"__import__('os').system('touch {marker}') == 0"]
    return _edit_graph(fn)


def _packed_library(marker):
    def change(entries):
        entries["data/aotinductor/model/model.so"] = b"\x7fELF"
        return entries
    return change


@pytest.mark.parametrize("attack,named", [
    (_pickled_weight, "pickled object"),
    (_pickled_sample_inputs, "sample inputs"),
    (lambda m: _node_target("torch.hub.load"), "torch.hub.load"),
    (lambda m: _node_target("torch.ops.aten.__class__.__init__.__globals__"), "not one of torch's own operators"),
    (_expression, "shape expression"),
    (_guard, "guard"),
    (_packed_library, "aotinductor"),
])
def test_a_program_that_could_run_code_is_refused_and_nothing_runs(tmp_path, attack, named):
    marker = tmp_path / "pwned"
    path = _saved(tmp_path)
    _rewrite(path, attack(marker))
    with pytest.raises(UnsafeFileError, match="program.pt2") as e:
        ts.infer.load(tmp_path / "art")
    assert named in str(e.value) and "weights_only=False" not in str(e.value)
    assert not marker.exists()


def test_a_truncated_program_is_named_in_one_line(tmp_path):
    path = _saved(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="program.pt2.*damaged"):
        ts.infer.load(tmp_path / "art")
