"""Files a user hands in or keeps: nothing in them runs code, every damaged one is named in one line,
and an interrupted save leaves the previous files whole."""
from __future__ import annotations

import json
import os
import pickle
import zipfile

import pytest

from torchspeed.cli import main


class _Evil:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")  # one error line stays one line in the captured output


def _one_line_error(capsys, *names):
    err = capsys.readouterr().err
    assert "Traceback" not in err and "weights_only=False" not in err, err
    assert "torchspeed: error:" in err and len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name in err, err
    return err


# ----------------------------------------------------------------------------------------- nothing runs code
def test_lint_refuses_a_pt2_with_a_malicious_pickle(tmp_path, capsys):
    marker = tmp_path / "pwned"
    pt2 = tmp_path / "model.pt2"
    with zipfile.ZipFile(pt2, "w") as z:
        z.writestr("model/data.pkl", pickle.dumps(_Evil(marker)))
        z.writestr("model/version", "1")
    assert main(["lint", str(pt2)]) == 2
    _one_line_error(capsys, "model.pt2")
    assert not marker.exists()


def _torch_artifact(tmp_path):
    from torchspeed.infer.runners import TorchRunner
    from torchspeed.models import create

    model = create("resnet18", num_classes=2)
    d = tmp_path / "art"
    TorchRunner(model, {"fuse": False}).save(d)
    return d


def test_artifact_weights_with_a_malicious_pickle_are_refused(tmp_path, capsys):
    import torch

    from torchspeed.infer import load
    from torchspeed.safeload import UnsafeFileError

    d = _torch_artifact(tmp_path)
    assert sorted(os.listdir(d)) == ["manifest.json", "weights.pt"]  # no temporaries left
    load(d)  # the clean artifact loads
    marker = tmp_path / "pwned"
    torch.save({"conv1.weight": _Evil(marker)}, d / "weights.pt")
    with pytest.raises(UnsafeFileError, match="weights.pt") as e:
        load(d)
    assert "weights_only=False" not in str(e.value)
    assert main(["optimize", str(d)]) == 2
    _one_line_error(capsys, "weights.pt", "pickled")
    assert not marker.exists()


# ----------------------------------------------------------------------------------------- damaged files named
def test_truncated_artifact_weights_named(tmp_path, capsys):
    d = _torch_artifact(tmp_path)
    blob = (d / "weights.pt").read_bytes()
    (d / "weights.pt").write_bytes(blob[: len(blob) // 3])
    assert main(["optimize", str(d)]) == 2
    _one_line_error(capsys, "weights.pt")


def _manifest(d, runtime, file, **extra):
    """A manifest as saved artifacts write it (the runtime under the format's "backend" key)."""
    from torchspeed.infer.runners import FORMAT

    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_text(json.dumps({"format": FORMAT, "version": 1, "backend": runtime,
                                                 "precision": "fp32", "file": file, "threads": 1, **extra}))


def test_corrupt_onnx_model_is_one_line_naming_it(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from torchspeed.infer import load

    d = tmp_path / "ort"
    _manifest(d, "onnxruntime", "model.onnx", providers=["CPUExecutionProvider"])
    (d / "model.onnx").write_bytes(b"\x08\x07garbage, not a protobuf" * 10)
    with pytest.raises(ValueError, match="model.onnx"):
        load(d)
    assert main(["optimize", str(d)]) == 2
    _one_line_error(capsys, "model.onnx")


def test_corrupt_openvino_model_is_one_line_naming_it(tmp_path, capsys):
    pytest.importorskip("openvino")
    d = tmp_path / "ov"
    _manifest(d, "openvino", "model.xml")
    (d / "model.xml").write_text("<net name='x'><layers><layer id='0' type='Nope'")
    (d / "model.bin").write_bytes(b"\0" * 16)
    assert main(["optimize", str(d)]) == 2
    _one_line_error(capsys, "model.xml")


@pytest.mark.parametrize("content, says", [
    (None, "manifest.json is missing"),
    ("{\"format\": ", "damaged"),
    ("[1, 2]", "not a torchspeed inference manifest"),
    ("", "damaged"),
    ("{\"format\": \"torchspeed-inference-artifact\", \"backend\": \"torch\"}", "damaged"),
])
def test_missing_or_corrupt_manifest_is_one_line(tmp_path, capsys, content, says):
    d = tmp_path / "art"
    d.mkdir()
    (d / "weights.pt").write_bytes(b"x")
    if content is not None:
        (d / "manifest.json").write_text(content)
    assert main(["optimize", str(d)]) == 2
    _one_line_error(capsys, "art", says)


# ----------------------------------------------------------------------------------------- interrupted saves
def _tiny_openvino_model():
    ov = pytest.importorskip("openvino")
    import numpy as np

    try:
        import openvino.opset13 as ops
    except ImportError:
        import openvino.runtime.opset13 as ops
    x = ops.parameter([1, 4], np.float32, name="x")
    return ov, ov.Model([ops.relu(x)], [x], "tiny")


def test_openvino_save_is_atomic(tmp_path, monkeypatch):
    """An interrupted OpenVINO save leaves the previous artifact whole and loadable, and no temporaries."""
    import torch

    from torchspeed.infer import load
    from torchspeed.infer.runners import OpenVINORunner

    ov, model = _tiny_openvino_model()
    d = tmp_path / "ov"
    runner = OpenVINORunner(model, "fp32", threads=1)
    runner.save(d)
    assert sorted(os.listdir(d)) == ["manifest.json", "model.bin", "model.xml"]
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]])
    assert torch.equal(load(d)(x), torch.relu(x))

    real_save = ov.save_model

    def dies_halfway(m, path, **kw):
        real_save(m, path, **kw)
        with open(path, "w") as f:
            f.write("<half")
        raise KeyboardInterrupt  # the user pressed Ctrl-C while the files were being written

    monkeypatch.setattr(ov, "save_model", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        runner.save(d)
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before  # old artifact intact, nothing left over
    assert torch.equal(load(d)(x), torch.relu(x))


def test_publish_files_cleans_temporaries_of_dead_processes(tmp_path):
    from torchspeed.atomic import publish_files

    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("the user's own file")
    stale = d / ".torchspeed-save.partial-999999999-abc"  # no such pid
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"half")

    def write(tmp):
        with open(os.path.join(tmp, "model.onnx"), "wb") as f:
            f.write(b"new")
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            f.write("{}")

    publish_files(d, write, last="manifest.json")
    assert sorted(os.listdir(d)) == ["keep.txt", "manifest.json", "model.onnx"]
    assert (d / "keep.txt").read_text() == "the user's own file"


def test_report_png_written_atomically(tmp_path, monkeypatch):
    """A plot interrupted while being written leaves the previous PNG, not half a new one."""
    pytest.importorskip("matplotlib")
    from torchspeed.bench import report

    result = {"rows": [{"technique": "a", "median": 2.0, "unit": "ms"}, {"technique": "b", "median": 1.0, "unit": "ms"}]}
    assert report.plot_suite("design", result, str(tmp_path)) == ["design_latency.png"]
    old = (tmp_path / "design_latency.png").read_bytes()
    assert old[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.figure

    def torn(self, fname, **kw):
        fname.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", torn)
    with pytest.raises(OSError):
        report.plot_suite("design", result, str(tmp_path))
    assert (tmp_path / "design_latency.png").read_bytes() == old
    assert os.listdir(tmp_path) == ["design_latency.png"]
