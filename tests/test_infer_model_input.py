"""resolve_model: what a model name means (a spec, a saved torch artifact folder, an .onnx file), the
input shape each brings, the flags that do not apply named, and an .onnx file parsed once from the
command line to the end of the search."""
import pytest
import torch
from helpers import tiny_convnet

import torchspeed as ts
from torchspeed.infer import OnnxGraph, resolve_model

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "net.onnx"
    ts.infer.export_onnx(tiny_convnet(classes=3, batchnorm=True).eval(), torch.randn(1, 3, 16, 16), path,
                         exporter="torchscript")
    return str(path)


def test_a_spec_builds_the_model_with_its_default_or_the_given_shape():
    got = resolve_model("resnet18", num_classes=3)
    assert isinstance(got.model, torch.nn.Module) and got.model.fc.out_features == 3
    assert got.input_shape == (1, 3, 224, 224) and not got.from_artifact and not got.is_onnx
    assert resolve_model("resnet18", input_shape=(1, 3, 32, 32)).input_shape == (1, 3, 32, 32)
    assert resolve_model("resnet18", model_kwargs='{"num_classes": 5}', num_classes=3).model.fc.out_features == 5


def test_num_classes_does_not_reach_the_users_own_factory(tmp_path):
    (tmp_path / "netdef.py").write_text("from torch import nn\n\n\ndef make(width=4):\n"
                                        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * width, 2))\n")
    got = resolve_model(f"{tmp_path / 'netdef.py'}:make", model_kwargs={"width": 2}, num_classes=7)
    assert got.model[1].in_features == 6 and got.model[1].out_features == 2


def test_an_onnx_file_resolves_to_its_parsed_graph(onnx_file, tmp_path):
    got = resolve_model(onnx_file)
    assert isinstance(got.model, OnnxGraph) and got.is_onnx and got.input_shape == (1, 3, 16, 16)
    with pytest.raises(ValueError, match="--weights, --num-classes apply to a model built from a spec"):
        resolve_model(onnx_file, weights="w.pt", num_classes=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.onnx"))


def test_a_torch_artifact_folder_resolves_to_its_model(tmp_path):
    from torchspeed.infer.runners import OrtRunner, TorchRunner

    TorchRunner(ts.models.create("resnet18", num_classes=2), {}).save(tmp_path / "torch")
    got = resolve_model(str(tmp_path / "torch"))
    assert got.from_artifact and got.model.fc.out_features == 2 and got.input_shape == (1, 3, 224, 224)
    with pytest.raises(ValueError, match="--weights and --model-kwargs apply to a model built from a spec"):
        resolve_model(str(tmp_path / "torch"), weights="w.pt")
    ts.infer.export_onnx(tiny_convnet().eval(), torch.randn(1, 3, 8, 8), tmp_path / "m.onnx", exporter="torchscript")
    OrtRunner(str(tmp_path / "m.onnx")).save(tmp_path / "ort")
    with pytest.raises(ValueError, match="holds a onnxruntime artifact; optimize needs a PyTorch model"):
        resolve_model(str(tmp_path / "ort"))


def test_the_command_line_parses_an_onnx_file_once(onnx_file, monkeypatch, capsys):
    from torchspeed.cli import main
    from torchspeed.infer import export, model_input, search

    reads = []

    def counted(path):
        reads.append(path)
        return export.read_onnx(path)

    monkeypatch.setattr(model_input, "read_onnx", counted)
    monkeypatch.setattr(search, "read_onnx", counted)
    code = main(["optimize", onnx_file, "--runtimes", "onnxruntime", "--precisions", "fp32", "--batch-sizes", "1"])
    assert code == 0, capsys.readouterr()
    assert reads == [onnx_file]
