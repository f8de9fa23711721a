"""optimize() on an .onnx file: the ONNX-based variants compete against ONNX Runtime fp32 on the file
itself, the input shape comes from the graph (input_shape / --input-shape fills dynamic dimensions),
and the accuracy guard compares with the file's own fp32 outputs. API and command line."""
import json
import pathlib
import warnings

import pytest
import torch
from helpers import tiny_convnet

import torchspeed as ts
from torchspeed.infer.export import onnx_example, onnx_inputs
from torchspeed.infer.search import optimize

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "net.onnx"
    ts.infer.export_onnx(tiny_convnet(classes=3, batchnorm=True).eval(), torch.randn(1, 3, 16, 16), path, exporter="torchscript")
    return path


@pytest.fixture(scope="module")
def dynamic_hw_file(tmp_path_factory):
    """An ONNX file whose height and width are dynamic too (only --input-shape can say them)."""
    path = tmp_path_factory.mktemp("onnx") / "dyn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(tiny_convnet(classes=3, batchnorm=True).eval(), (torch.randn(2, 3, 16, 16),), str(path), dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}, "y": {0: "n"}})
    return path


def test_onnx_file_variants_compete_against_its_own_fp32(onnx_file):
    calib = [torch.randn(8, 3, 16, 16) for _ in range(2)]
    r = optimize(onnx_file, calib_data=calib, runtimes="onnxruntime,openvino", precisions="fp32,int8",
                 batch_sizes=(1, 2), repeats=1, min_time_s=0.0)
    assert r.table[0].name == "onnxruntime fp32" and r.table[0].status == "ok"
    assert r.table[0].input_shape == [1, 3, 16, 16]  # read from the graph
    assert r["openvino fp32"].status == "ok" and r["openvino fp32"].max_rel_error < 1e-3
    for name in ("onnxruntime int8", "openvino int8"):
        assert r[name].status in ("ok", "rejected") and r[name].rel_l2_error is not None, r[name].reason
    for name in ("eager fp32", "fused fp32"):
        assert name not in [row.name for row in r.table if row.status != "skipped"]
    assert r.best is not None and r.best.p50_ms(2) > 0
    assert r["onnxruntime fp32"].extra["export"]["exporter"] == "given"


def test_onnx_guard_compares_with_the_files_own_outputs(onnx_file, tmp_path):
    """A deliberately wrong candidate is rejected against ONNX Runtime fp32 on the file, and a saved
    artifact of the file reproduces its outputs at any batch size."""
    r = optimize(pathlib.Path(onnx_file), runtimes="onnxruntime", precisions="fp32", batch_sizes=(1,),
                 repeats=1, min_time_s=0.0, extra_candidates={"off by one": lambda path: (lambda x: _ref(path, x) + 1)})
    assert r["off by one"].status == "rejected" and "output error" in r["off by one"].reason
    r.best.save(tmp_path / "a")
    run = ts.infer.load(tmp_path / "a")
    x = torch.randn(5, 3, 16, 16)
    assert torch.allclose(run(x), _ref(str(onnx_file), x), atol=1e-5)


def _ref(path, x):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


def test_input_shape_fills_dynamic_dimensions(dynamic_hw_file):
    assert onnx_inputs(dynamic_hw_file)[0][1] == ["n", 3, "h", "w"]
    with pytest.raises(ValueError, match=r"dynamic dimensions \['n', 3, 'h', 'w'\].*--input-shape"):
        onnx_example(dynamic_hw_file)
    with pytest.raises(ValueError, match="does not fit the ONNX input 'x'"):
        onnx_example(dynamic_hw_file, (1, 4, 16, 16))
    r = optimize(dynamic_hw_file, input_shape=(1, 3, 20, 20), runtimes="onnxruntime", precisions="fp32",
                 batch_sizes=(1,), measure=False)
    assert r.table[0].status == "ok" and r.table[0].input_shape == [1, 3, 20, 20]


def test_onnx_path_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        optimize(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match="junk.onnx.*not a readable ONNX model"):
        optimize(tmp_path / "junk.onnx")
    with pytest.raises(ValueError, match="nn.Module or an .onnx file"):
        optimize(str(tmp_path / "weights.pt"))


def test_cli_optimize_an_onnx_file(onnx_file, tmp_path, capsys):
    from torchspeed.cli import main

    js, out = tmp_path / "r.json", tmp_path / "best"
    code = main(["optimize", str(onnx_file), "--runtimes", "onnxruntime,openvino", "--precisions", "fp32",
                 "--batch-sizes", "1", "--json", str(js), "--out", str(out)])
    assert code == 0, capsys.readouterr()
    d = json.loads(js.read_text())
    assert d["candidates"][0]["name"] == "onnxruntime fp32" and d["best"] in ("onnxruntime fp32", "openvino fp32")
    assert ts.infer.load(out)(torch.randn(2, 3, 16, 16)).shape == (2, 3)
    assert main(["optimize", str(onnx_file), "--weights", "w.pt"]) == 2
    assert "--weights apply to a model built from a spec" in " ".join(capsys.readouterr().err.split())
    assert main(["optimize", str(tmp_path / "nope.onnx")]) == 2
    assert "does not exist" in " ".join(capsys.readouterr().err.split())
