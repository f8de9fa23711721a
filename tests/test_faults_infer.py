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
    # a warning that the machine was busy while something was timed is not part of the error
    lines = [line for line in err.strip().splitlines() if "the machine was busy" not in line]
    assert "torchspeed: error:" in err and len(lines) == 1, err
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


# ----------------------------------------------------------------------------------------- ONNX models and --out
def _matmul_onnx(path, seed=0, external_data=None):
    """A one-MatMul ONNX model `y = x @ w` (x: batch x 4); its weights in the file `external_data` beside it
    when given. Returns w."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if external_data:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=external_data, size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    import torch

    return torch.from_numpy(w)


def _optimize_args(src):
    return ["optimize", str(src), "--runtimes", "onnxruntime", "--precisions", "fp32", "--batch-sizes", "1"]


def _temporaries(d):
    return [n for n in os.listdir(d) if n.startswith(".torchspeed-save.")]


@pytest.mark.parametrize("limit", [None, 16], ids=["inline", "over-the-protobuf-limit"])
def test_onnx_with_external_data_optimized_with_out_gives_an_artifact_that_runs(tmp_path, monkeypatch, capsys, limit):
    import shutil

    import torch

    from torchspeed.infer import export, load

    src_dir = tmp_path / "src"
    src_dir.mkdir()
    w = _matmul_onnx(src_dir / "net.onnx", external_data="data.bin")
    if limit is not None:  # a model too big for one protobuf keeps its weights in a file beside model.onnx
        monkeypatch.setattr(export, "_PROTOBUF_LIMIT", limit)
    out = tmp_path / "best"
    assert main([*_optimize_args(src_dir / "net.onnx"), "--out", str(out)]) == 0
    shutil.rmtree(src_dir)  # the artifact needs nothing from where the model came from
    x = torch.randn(5, 4)
    assert torch.allclose(load(out)(x), x @ w, atol=1e-5)
    files = sorted(n for n in os.listdir(out) if not n.startswith(".torchspeed-output"))
    assert files == (["manifest.json", "model.onnx"] if limit is None else ["manifest.json", "model.onnx", "model.onnx.data"])
    assert json.loads((out / "manifest.json").read_text())["files"] == [f for f in files if f != "manifest.json"]


def test_optimize_out_is_checked_before_measuring_and_never_replaces_a_users_file(tmp_path, monkeypatch, capsys):
    import torch

    import torchspeed.infer.search as search
    from torchspeed.infer import load

    w = _matmul_onnx(tmp_path / "net.onnx")
    args = _optimize_args(tmp_path / "net.onnx")
    real_optimize = search.optimize
    monkeypatch.setattr(search, "optimize", lambda *a, **k: pytest.fail("measured before --out/--json were checked"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.onnx").write_bytes(b"the user's own model")
    for extra in ([], ["--overwrite"]):
        assert main([*args, "--out", str(mine), *extra]) == 2
        _one_line_error(capsys, "model.onnx", "never replaced")
    assert os.listdir(mine) == ["model.onnx"] and (mine / "model.onnx").read_bytes() == b"the user's own model"
    blocked = tmp_path / "file.txt"
    blocked.write_text("not a folder")
    assert main([*args, "--out", str(blocked / "out")]) == 2
    _one_line_error(capsys, "--out", "cannot be written")
    assert main([*args, "--json", str(blocked / "result.json")]) == 2
    _one_line_error(capsys, "--json", "cannot be written")

    monkeypatch.setattr(search, "optimize", real_optimize)
    out = tmp_path / "best"
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 2  # an earlier artifact is replaced only on request
    _one_line_error(capsys, "--overwrite")
    assert main([*args, "--out", str(out), "--overwrite"]) == 0
    x = torch.randn(2, 4)
    assert torch.allclose(load(out)(x), x @ w, atol=1e-5)


def test_disk_full_while_saving_optimize_out_is_one_line_and_the_old_artifact_stays(tmp_path, monkeypatch, capsys):
    import shutil

    import torch

    from torchspeed.infer import load

    w_old = _matmul_onnx(tmp_path / "old.onnx", seed=0)
    _matmul_onnx(tmp_path / "new.onnx", seed=1)
    out = tmp_path / "best"
    assert main([*_optimize_args(tmp_path / "old.onnx"), "--out", str(out)]) == 0
    capsys.readouterr()
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}

    def disk_full(src, dst, **kw):
        with open(dst, "wb") as f:
            f.write(b"half a model")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", disk_full)
    assert main(["-q", *_optimize_args(tmp_path / "new.onnx"), "--out", str(out), "--overwrite"]) == 2
    _one_line_error(capsys, "No space left on device", str(out))
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before  # nothing left over, nothing lost
    x = torch.randn(2, 4)
    assert torch.allclose(load(out)(x), x @ w_old, atol=1e-5)


# ----------------------------------------------------------------------------------------- kwargs name no files
@pytest.mark.parametrize("arch, named", [
    ({"source": "timm", "name": "resnet18", "kwargs": {"checkpoint_path": "OUTSIDE"}}, "checkpoint_path"),
    ({"source": "timm", "name": "resnet18", "kwargs": {"pretrained_cfg_overlay": {"file": "../outside.pt"}}},
     "pretrained_cfg_overlay.file"),
    ({"source": "torchvision", "name": "resnet18", "kwargs": {"norm_layer": "outside.pt"}}, "norm_layer"),
    ({"source": "timm", "name": "hf-hub:someone/net", "kwargs": {}}, "hf-hub:someone/net"),
], ids=["absolute-checkpoint", "nested-relative", "existing-file", "hub-name"])
def test_artifact_kwargs_naming_a_file_outside_it_are_refused(tmp_path, monkeypatch, capsys, arch, named):
    import torchspeed.models
    from torchspeed.infer import load

    d = _torch_artifact(tmp_path)
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"a file the artifact must not make anyone read")
    monkeypatch.chdir(tmp_path)  # so 'outside.pt' names that file
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["arch"] = json.loads(json.dumps(arch).replace("OUTSIDE", str(outside)))
    (d / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(torchspeed.models, "create", lambda *a, **k: pytest.fail("the model was built"))
    for trust_code in (False, True):
        with pytest.raises(ValueError, match=named.replace(".", r"\.")) as e:
            load(d, trust_code=trust_code)
        assert "model=" in str(e.value) and repr(str(d)) in str(e.value)
    assert main(["optimize", str(d)]) == 2
    _one_line_error(capsys, named, "art")


# ----------------------------------------------------------------------------------------- interrupted saves
class _Killed(BaseException):
    """Stands for SIGKILL: once raised, no later file operation runs (not even clean-up code)."""


def _kill_at(monkeypatch, step):
    """From the `step`-th file operation (rename, link, unlink, rmdir) on, every one raises _Killed."""
    state = {"calls": 0, "dead": False}
    for name in ("replace", "rename", "link", "unlink", "rmdir"):
        real = getattr(os, name)

        def op(*a, _real=real, **k):
            state["calls"] += 1
            if state["dead"] or state["calls"] == step:
                state["dead"] = True
                raise _Killed
            return _real(*a, **k)

        monkeypatch.setattr(os, name, op)
    return state


def _as_if_from_a_dead_process(d):
    """Rename this process's save temporaries in `d` as a dead process's, as a real kill leaves them."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    for name in _temporaries(d):
        os.rename(d / name, d / name.replace(f"-{os.getpid()}-", f"-{proc.pid}-", 1))


@pytest.mark.parametrize("old_kind", ["onnxruntime", "openvino"])
def test_a_save_killed_at_any_step_leaves_an_artifact_that_loads(tmp_path, monkeypatch, old_kind):
    import torch

    from torchspeed.infer import load
    from torchspeed.infer.runners import OpenVINORunner, OrtRunner, recover_artifact

    if old_kind == "openvino":
        pytest.importorskip("openvino")
    w_old = _matmul_onnx(tmp_path / "old.onnx", seed=0)
    w_new = _matmul_onnx(tmp_path / "new.onnx", seed=1)
    old = (OrtRunner if old_kind == "onnxruntime" else OpenVINORunner)(str(tmp_path / "old.onnx"), "fp32", 1)
    new = OrtRunner(str(tmp_path / "new.onnx"), "fp32", 1)
    x = torch.randn(2, 4)

    def which(d):
        y = load(d)(x)
        return "old" if torch.allclose(y, x @ w_old, atol=1e-4) else "new" if torch.allclose(y, x @ w_new, atol=1e-4) else "?"

    seen = []
    for step in range(1, 100):
        d = tmp_path / f"art{step}"
        old.save(d)
        with monkeypatch.context() as m:
            state = _kill_at(m, step)
            try:
                new.save(d)
            except _Killed:
                pass
        seen.append(which(d))  # right after the kill: the old artifact or the new one, whole
        _as_if_from_a_dead_process(d)
        recover_artifact(d)  # the next run tidies up
        assert _temporaries(d) == [] and which(d) == seen[-1], (step, os.listdir(d))
        if not state["dead"]:
            break
    assert seen[0] == "old" and seen[-1] == "new" and "?" not in seen, seen
    assert seen == sorted(seen, key=["old", "new"].index), seen  # once the new one loads, it stays
    assert sorted(os.listdir(d)) == ["manifest.json", "model.onnx"]  # the previous artifact's other files are gone


def test_a_killed_optimize_leaves_its_temporaries_where_the_next_run_removes_them(tmp_path, monkeypatch):
    import subprocess
    import sys

    import torchspeed as ts

    _matmul_onnx(tmp_path / "net.onnx")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHSPEED_CACHE", str(cache))
    script = (f"import os, signal, torchspeed as ts\n"
              f"ts.infer.optimize({str(tmp_path / 'net.onnx')!r}, runtimes='onnxruntime', precisions='fp32', "
              "measure=False, extra_candidates={'dies': lambda path: os.kill(os.getpid(), signal.SIGKILL)})\n")
    killed = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TORCHSPEED_CACHE": str(cache)})
    assert killed.wait(timeout=120) == -9
    assert [n.split("-")[:2] for n in os.listdir(cache / "tmp")] == [["optimize", str(killed.pid)]]
    result = ts.infer.optimize(str(tmp_path / "net.onnx"), runtimes="onnxruntime", precisions="fp32", measure=False)
    assert [n.split("-")[:2] for n in os.listdir(cache / "tmp")] == [["optimize", str(os.getpid())]]
    del result
    import gc

    gc.collect()
    assert os.listdir(cache / "tmp") == []


# ----------------------------------------------------------------------------------------- saved programs bounded
def _program_net():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))

    return Net().eval()


@pytest.fixture(scope="module")
def program_file(tmp_path_factory):
    import torch

    from torchspeed.infer.program import load_program, save_program

    path = tmp_path_factory.mktemp("program") / "program.pt2"
    save_program(_program_net(), torch.randn(2, 3, 8, 8), str(path))
    load_program(path)(torch.randn(3, 3, 8, 8))  # the program as saved loads and runs at another batch size
    return path.read_bytes()


def _crafted(tmp_path, program_file, change):
    """program.pt2 with its entries (names under the root folder) changed by `change`; a value may be
    (bytes, compression) for a member written compressed."""
    path = tmp_path / "program.pt2"
    path.write_bytes(program_file)
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    root = next(iter(entries)).split("/", 1)[0]
    changed = change({n.split("/", 1)[1]: v for n, v in entries.items()})
    with zipfile.ZipFile(path, "w") as z:
        for n, v in changed.items():
            data, compression = v if isinstance(v, tuple) else (v, zipfile.ZIP_STORED)
            z.writestr(zipfile.ZipInfo(f"{root}/{n}"), data, compress_type=compression)
    return str(path)


def _graph_edit(fn):
    def change(entries):
        graph = json.loads(entries["models/model.json"])
        fn(graph)
        entries["models/model.json"] = json.dumps(graph).encode()
        return entries
    return change


def _an_expression(expr):
    """Every shape expression of the graph (its dynamic batch size) replaced by `expr`."""
    def fn(graph):
        def walk(o):
            if isinstance(o, dict):
                for k, v in o.items():
                    if k == "expr_str":
                        o[k] = expr
                    else:
                        walk(v)
            elif isinstance(o, list):
                for v in o:
                    walk(v)
        walk(graph)
        graph["range_constraints"] = {expr: v for v in graph["range_constraints"].values()}
    return _graph_edit(fn)


@pytest.mark.parametrize("expr", [
    "Pow(Integer(9), Pow(Integer(9), Pow(Integer(9), Integer(9))))",
    "9**9**9**9",
    "Symbol('s0', integer=True, positive=True)**99999999",
    "Float('1.5', precision=999999999)",
    "Float('1.5', 999999999)",
    "LShift(Integer(1), Integer(99999999999))",
    "PowByNatural(Symbol('s0', positive=True), Integer(99999999))",
    "Mul(Integer(" + "9" * 40 + "), Symbol('s0', positive=True))",
    "Float('1e999999999')",
    "Add(" + ", ".join(["Integer(1)"] * 3000) + ")",
    "Pow(" * 5 + "Integer(9)" + ", Integer(64))" * 5,
    "Pow(Integer(9), Float('1e300'))",
], ids=["nested-pow", "star-star", "symbol-star-star", "precision-keyword", "precision-positional", "huge-shift",
        "huge-natural-pow", "huge-literal", "huge-float-exponent", "too-long", "small-powers-nested", "float-power"])
def test_a_program_whose_shape_expressions_would_not_end_is_refused(tmp_path, program_file, expr):
    """A crafted program with `**` or precision arguments in its expressions is refused before it can hang a load."""
    from torchspeed.infer.program import load_program
    from torchspeed.safeload import UnsafeFileError

    path = _crafted(tmp_path, program_file, _an_expression(expr))
    with pytest.raises(UnsafeFileError, match="program.pt2.*shape expression.*not plain arithmetic"):
        load_program(path)


@pytest.mark.parametrize("guard", ["L['x'].size()[0] ** 9 ** 9 ** 9 > 1", "L['x'].size()[0] < 9" + "9" * 40,
                                   "L['x'].size()[0] << 99999999 > 1"])
def test_a_program_whose_guard_would_not_end_is_refused(tmp_path, program_file, guard):
    from torchspeed.infer.program import load_program
    from torchspeed.safeload import UnsafeFileError

    path = _crafted(tmp_path, program_file, _graph_edit(lambda g: g.__setitem__("guards_code", [guard])))
    with pytest.raises(UnsafeFileError, match="program.pt2.*guard"):
        load_program(path)


def test_an_unreferenced_member_is_refused_before_it_is_read(tmp_path, program_file):
    """A weight member no tensor uses (zeros, tiny compressed) is refused without being read whole."""
    import tracemalloc

    from torchspeed.infer.program import load_program

    def bomb(entries):
        entries["data/weights/weight_999"] = (bytes(64 << 20), zipfile.ZIP_DEFLATED)  # 64 MiB in ~64 KiB
        return entries

    path = _crafted(tmp_path, program_file, bomb)
    assert os.path.getsize(path) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"program.pt2.*damaged.*data/weights/weight_999, which no tensor uses"):
            load_program(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def _first_weight(entries):
    config = json.loads(entries["data/weights/model_weights_config.json"])
    name, meta = next(iter(config["config"].items()))
    return config, name, meta


@pytest.mark.parametrize("how", ["empty-member-declaring-2**28-floats", "member-half-its-tensor", "member-missing"])
def test_declared_sizes_are_checked_against_the_members_before_any_allocation(tmp_path, program_file, how,
                                                                             monkeypatch):
    """An empty weight member declaring 2^28 floats is refused before anything is allocated."""
    import torch

    from torchspeed.infer.program import load_program

    def change(entries):
        config, name, meta = _first_weight(entries)
        member = f"data/weights/{meta['path_name']}"
        if how.startswith("empty"):
            meta["tensor_meta"]["sizes"] = [{"as_int": 1 << 28}]
            meta["tensor_meta"]["strides"] = [{"as_int": 1}]
            entries[member] = b""
        elif how.startswith("member-half"):
            entries[member] = entries[member][: len(entries[member]) // 2]
        else:
            meta["path_name"] = "weight_77"
        entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()
        return entries

    path = _crafted(tmp_path, program_file, change)
    monkeypatch.setattr(torch.export, "load", lambda *a, **k: pytest.fail("torch read the program"))
    said = "weight_77, which is missing" if how == "member-missing" else "declares .* bytes but .* holds"
    with pytest.raises(ValueError, match=f"program.pt2.*damaged.*{said}"):
        load_program(path)


def test_a_program_over_the_parse_time_limit_or_entry_limits_is_refused(tmp_path, program_file, monkeypatch):
    from torchspeed.infer import program

    path = _crafted(tmp_path, program_file, lambda entries: entries)
    monkeypatch.setattr(program, "PARSE_LIMIT_S", 1e-9)  # any program: over the limit
    with pytest.raises(ValueError, match="program.pt2.*would take torch over"):
        program.load_program(path)
    monkeypatch.undo()
    monkeypatch.setattr(program, "_JSON_LIMIT", 100)
    with pytest.raises(ValueError, match="program.pt2.*over the limit of 100"):
        program.load_program(path)
    monkeypatch.undo()
    (tmp_path / "deep").mkdir()
    deep = _crafted(tmp_path / "deep", program_file, _graph_edit(lambda g: g.__setitem__("x", "DEEP")))
    with zipfile.ZipFile(deep) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(deep, "w") as z:
        for n, v in entries.items():
            z.writestr(n, v.replace(b'"DEEP"', b"[" * 100_000 + b"]" * 100_000) if n.endswith("model.json") else v)
    with pytest.raises(ValueError, match="program.pt2.*damaged.*not valid JSON"):
        program.load_program(deep)
    assert program.load_program(path) is not None  # the program itself is sound


# ----------------------------------------------------------------------------------------- memory guard
def test_optimize_input_shape_too_large_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """`optimize --input-shape 1,3,100000,100000` is refused in one line before anything is allocated."""
    import torchspeed.runtime

    spec = os.path.join(os.path.dirname(__file__), "helpers.py") + ":tiny_convnet"
    assert main(["optimize", spec, "--input-shape", "1,3,100000,100000", "--out", str(tmp_path / "best")]) == 2
    _one_line_error(capsys, "--input-shape 1,3,100000,100000", "GiB")
    monkeypatch.setattr(torchspeed.runtime, "free_memory", lambda device: 64 << 20)  # 64 MiB free
    assert main(["optimize", spec, "--input-shape", "1,3,1024,1024"]) == 2  # 12 MiB, but 8 rows (96 MiB) verified
    _one_line_error(capsys, "--input-shape 1,3,1024,1024", "batches of 8")
