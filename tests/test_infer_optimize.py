"""optimize(): INT8 accuracy on a trained task, the guard, failures reported, artifacts, clear errors,
the variant registry, logging, thread count, artifact safety, the command line."""
import json
import logging
import os

import pytest
import torch
from helpers import two_stage_convnet
from torch import nn

import torchspeed as ts
from torchspeed.infer.search import optimize

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")


def _task(n: int, seed: int):
    """A small learnable task: 16x16 noisy images whose mean colour (hue) gives one of 4 classes."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    palette = torch.tensor([[1.0, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, -1]])
    x = palette[y].view(n, 3, 1, 1) * 0.5 + torch.randn(n, 3, 16, 16, generator=g) * 3.0
    return x, y


@pytest.fixture(scope="module")
def trained():
    model = two_stage_convnet(seed=0).train()
    x, y = _task(1536, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        for i in range(0, len(x), 64):
            loss = nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    hx, hy = _task(1000, 1)

    def eval_fn(run):
        out = torch.as_tensor(run(hx))
        return float((out.argmax(1) == hy).float().mean())

    assert 0.7 < eval_fn(model) < 0.99, "the small task did not train (or is trivially easy)"
    return model, [x[i:i + 32] for i in range(0, 256, 32)], eval_fn


@pytest.fixture(scope="module")
def result(trained):
    model, calib, eval_fn = trained

    def broken(m):  # a deliberately broken variant: a lossy copy that zeroes the classifier's strongest weights
        import copy
        b = copy.deepcopy(m)
        with torch.no_grad():
            w = b[-1].weight
            w[w.abs() > w.abs().median()] = 0
        return b

    return optimize(model, torch.randn(1, 3, 16, 16), calib_data=calib, eval_fn=eval_fn, max_metric_drop=0.02,
                    runtimes=["torch", "onnxruntime", "openvino"], batch_sizes=(1, 4), exporter="torchscript",
                    repeats=2, min_time_s=0.0, extra_candidates={"broken": broken})


def test_int8_accuracy_within_bound_on_trained_task(result):
    for name in ("onnxruntime int8", "openvino int8"):
        c = result[name]
        assert c.status == "ok", (name, c.status, c.reason)
        assert c.metric_drop is not None and c.metric_drop <= 0.02
        assert c.rel_l2_error > 0  # it really is quantized
    assert result.baseline_metric > 0.7


def test_guard_rejects_broken_variant(result):
    c = result["broken"]
    assert c.status == "rejected" and "metric drop" in c.reason
    assert result.best is not None and result.best.name != "broken" and result.best.passed


def test_table_has_latency_and_exact_variants_verified(result):
    for name in ("eager fp32", "fused fp32", "onnxruntime fp32", "openvino fp32"):
        c = result[name]
        assert c.status == "ok" and c.max_rel_error <= 1e-3
        assert c.p50_ms(1) > 0 and c.p50_ms(4) > 0
    assert result.best is result.fastest_at(1)
    d = result.to_dict()
    assert d["best"] == result.best.name and len(d["candidates"]) == len(result.table)


@pytest.mark.parametrize("name", ["onnxruntime int8", "openvino int8", "openvino fp32"])
def test_saved_artifact_reproduces_outputs(result, tmp_path, name):
    c = result[name]
    c.save(tmp_path / "a")
    runner = ts.infer.load(tmp_path / "a")
    for b in (1, 5):  # any batch size
        x = torch.randn(b, 3, 16, 16)
        assert torch.allclose(runner(x), c(x), rtol=1e-5, atol=1e-5)
    assert runner.manifest_data["name"] == name and runner.manifest_data["precision"] == c.precision


def test_torch_artifact_by_name_round_trip(tmp_path):
    model = ts.models.create("resnet18", num_classes=3)
    from torchspeed.infer.runners import TorchRunner

    r = TorchRunner(model, {"fuse": True, "precision": "fp32"})
    r.save(tmp_path / "t")
    back = ts.infer.load(tmp_path / "t")
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(back(x), r(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="without pickle"):
        TorchRunner(two_stage_convnet(), {}).save(tmp_path / "u")


@torch.library.custom_op("torchspeed_test::scramble", mutates_args=())
def _scramble(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1) * 0.5


@_scramble.register_fake
def _(x):
    return torch.empty_like(x)


class CustomOpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return _scramble(self.conv(x)).mean((2, 3))


def test_unsupported_operator_marks_candidates_failed_not_raised():
    r = optimize(CustomOpNet().eval(), torch.randn(1, 3, 8, 8), runtimes=["torch", "onnxruntime", "openvino"],
                 precisions=["fp32"], batch_sizes=(1,), repeats=1, exporter="torchscript")
    for name in ("onnxruntime fp32", "openvino fp32"):
        assert r[name].status == "failed" and "scramble" in r[name].reason, r[name].reason
    assert r["eager fp32"].status == "ok" and r.best is not None and r.best.runtime == "torch"


def test_clear_errors(trained):
    model = trained[0]
    with pytest.raises(ValueError, match="did you mean resnet18"):
        ts.models.create("resnett18")
    with pytest.raises(ValueError, match=r"cannot run on inputs of shape \(1, 1, 16, 16\)"):
        optimize(model, torch.randn(1, 1, 16, 16), runtimes=["torch"], precisions=["fp32"])
    with pytest.raises(ValueError, match="calibration"):
        optimize(model, torch.randn(1, 3, 16, 16), precisions=["int8"])
    with pytest.raises(ValueError, match="unknown runtime 'tensorflow'"):
        optimize(model, torch.randn(1, 3, 16, 16), runtimes=["tensorflow"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ts.infer.load("/nonexistent/artifact")


def test_export_onnx_dynamic_batch_from_batch_one(tmp_path):
    """The dynamo exporter with a batch-1 example still gives a batch-dynamic model, checked in ORT."""
    model = two_stage_convnet()
    rep = ts.infer.export_onnx(model, torch.randn(1, 3, 16, 16), tmp_path / "m.onnx")
    assert rep.exporter in ("dynamo", "torchscript")
    assert not isinstance(rep.input_shape[0], int)  # symbolic batch dimension
    assert set(rep.max_error) == {1, 3} and max(rep.max_error.values()) < 1e-4
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    out = sess.run(None, {sess.get_inputs()[0].name: torch.randn(7, 3, 16, 16).numpy()})[0]
    assert out.shape == (7, 4)


def test_export_unsupported_op_names_it(tmp_path):
    with pytest.raises(ValueError, match="scramble"):
        ts.infer.export_onnx(CustomOpNet().eval(), torch.randn(1, 3, 8, 8), tmp_path / "c.onnx", exporter="torchscript")
    assert not os.path.exists(tmp_path / "c.onnx")


def test_cli_optimize_end_to_end(tmp_path, capsys):
    from torchspeed.cli import main

    out, js = tmp_path / "best", tmp_path / "r.json"
    code = main(["optimize", "resnet18", "--num-classes", "4", "--input-shape", "1,3,32,32", "--runtimes", "torch",
                 "--precisions", "fp32", "--batch-sizes", "1,2", "--out", str(out), "--json", str(js)])
    assert code == 0, capsys.readouterr()
    assert json.loads(js.read_text())["best"] in ("eager fp32", "fused fp32")
    runner = ts.infer.load(out)
    assert runner(torch.randn(3, 3, 32, 32)).shape == (3, 4)


def test_cli_errors_are_one_line(capsys):
    from torchspeed.cli import main

    assert main(["optimize", "resnett18"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnett18'" in err and "Traceback" not in err
    assert main(["optimize", "resnet18", "--input-shape", "1,3,32,32", "--precisions", "int8"]) == 2
    assert "calibration" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_calibration_methods_selectable(trained, tmp_path, method):
    model, calib, eval_fn = trained
    from torchspeed.infer.quantize import quantize_onnx_static
    from torchspeed.infer.runners import OrtRunner

    ts.infer.export_onnx(model, torch.randn(1, 3, 16, 16), tmp_path / "m.onnx", exporter="torchscript")
    quantize_onnx_static(str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), calib, method=method)
    run = OrtRunner(str(tmp_path / "q.onnx"), "int8")
    assert eval_fn(model) - eval_fn(run) <= 0.03
    with pytest.raises(ValueError, match="calibration method must be one of"):
        quantize_onnx_static(str(tmp_path / "m.onnx"), str(tmp_path / "r.onnx"), calib, method="mse")


def test_result_vocabulary(result):
    """`.table` is a list of VariantRow rows; `.best` a property; labels spell fp32/bf16/fp16/int8."""
    assert all(isinstance(r, ts.infer.VariantRow) for r in result.table)
    assert isinstance(type(result).best, property)
    assert not any("f32" in r.name.replace("fp32", "") for r in result.table)
    assert {r.precision for r in result.table} <= {"fp32", "bf16", "fp16", "int8", "int8-dynamic", "custom"}
    assert result["onnxruntime int8"].label and result["openvino int8"].label


def test_runtimes_and_precisions_take_a_comma_string(trained):
    model = trained[0]
    r = optimize(model, torch.randn(1, 3, 16, 16), runtimes="torch, onnxruntime", precisions="fp32",
                 batch_sizes=(1,), exporter="torchscript", measure=False)
    assert r["onnxruntime fp32"].status == "ok"
    assert r["openvino fp32"].status == "skipped" and r["openvino fp32"].reason == "runtime not requested"
    assert r["bf16 + channels_last"].reason == "precision not requested"
    with pytest.raises(ValueError, match="unknown runtime 'tensorflow'"):
        optimize(model, torch.randn(1, 3, 16, 16), runtimes="torch,tensorflow")


def test_a_variant_that_does_not_apply_is_skipped_with_its_reason(trained, monkeypatch):
    from torchspeed.infer import variants

    seen = []

    def applicable(machine, model):
        seen.append((machine, model))
        return "needs a quantum accelerator"

    extra = variants.Variant("quantum fp32", "torch", "fp32", "a variant for no machine",
                           build=lambda ctx: pytest.fail("a skipped variant must not be built"),
                           applicable=applicable)
    monkeypatch.setattr(variants, "VARIANTS", (*variants.VARIANTS, extra))
    r = optimize(trained[0], torch.randn(1, 3, 16, 16), runtimes="torch", precisions="fp32", batch_sizes=(1,),
                 measure=False)
    row = r["quantum fp32"]
    assert row.status == "skipped" and row.reason == "needs a quantum accelerator"
    assert isinstance(seen[0][0], variants.Machine) and isinstance(seen[0][1], variants.ModelFacts)
    assert seen[0][1].calibrated is False


def test_thread_count_restored_even_when_a_variant_raises(trained):
    model, calib, eval_fn = trained
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def explode(m):
            raise RuntimeError("this variant cannot be built")

        r = optimize(model, torch.randn(1, 3, 16, 16), runtimes="torch", precisions="fp32", batch_sizes=(1,),
                     repeats=1, min_time_s=0.0, threads=2, extra_candidates={"explodes": explode})
        assert r["explodes"].status == "failed" and "cannot be built" in r["explodes"].reason
        assert r.threads == 2 and torch.get_num_threads() == 1

        def broken_eval(run):
            raise RuntimeError("the evaluation itself is broken")

        with pytest.raises(RuntimeError, match="evaluation itself"):
            optimize(model, torch.randn(1, 3, 16, 16), eval_fn=broken_eval, runtimes="torch", precisions="fp32",
                     batch_sizes=(1,), threads=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_runner_call_uses_its_threads_and_gives_the_callers_back():
    from torchspeed.infer.runners import TorchRunner

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            return x.flatten(1)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = TorchRunner(Probe(), {}, threads=2)
        runner(torch.randn(1, 3, 4, 4))
        assert seen == [2] and torch.get_num_threads() == 1
        with pytest.raises(TypeError):
            runner("not a tensor")  # a call that fails gives the caller's count back too
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_one_info_line_per_variant_and_one_for_the_choice(trained, caplog):
    model, calib, eval_fn = trained
    with caplog.at_level(logging.INFO, logger="torchspeed"):
        r = optimize(model, torch.randn(1, 3, 16, 16), eval_fn=eval_fn, runtimes="torch", precisions="fp32,bf16",
                     batch_sizes=(1, 2), repeats=1, min_time_s=0.0)
    lines = [rec.getMessage() for rec in caplog.records
             if rec.name == "torchspeed.infer.search" and rec.levelno == logging.INFO]
    built = [row for row in r.table if row.status != "skipped"]
    for row in built:
        mine = [ln for ln in lines if ln.startswith(f"optimize: {row.name}: ")]
        assert len(mine) == 1, (row.name, lines)
        if row.latency_ms:
            assert "at batch 1" in mine[0] and "at batch 2" in mine[0]
        assert ("passed" in mine[0]) == row.passed
        if row.metric_drop is not None:
            assert "metric drop" in mine[0]
    chose = [ln for ln in lines if ln.startswith("optimize: chose ")]
    assert len(chose) == 1 and r.best.name in chose[0]
    assert len(lines) == len(built) + 1


def test_quantization_leaves_root_and_nncf_loggers_alone(trained, tmp_path):
    import nncf  # noqa: F401 - nncf sets up its own logger on import; compare after that

    from torchspeed.infer.quantize import quantize_onnx_static, quantize_openvino

    model, calib, _ = trained
    root, nncf_logger = logging.getLogger(), logging.getLogger("nncf")
    before = (root.level, list(root.handlers), list(root.filters), nncf_logger.level)
    ts.infer.export_onnx(model, torch.randn(1, 3, 16, 16), tmp_path / "m.onnx", exporter="torchscript")
    quantize_onnx_static(str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), calib)
    quantize_openvino(str(tmp_path / "m.onnx"), calib)
    assert (root.level, list(root.handlers), list(root.filters), nncf_logger.level) == before


def test_quiet_quantizer_logs_drops_only_onnxruntime_notices(caplog):
    from torchspeed.infer.quantize import quiet_quantizer_logs

    ours = logging.getLogger("torchspeed.test")
    with caplog.at_level(logging.INFO):
        with quiet_quantizer_logs():
            ort_record = logging.LogRecord("root", logging.WARNING, os.path.join("x", "onnxruntime", "q.py"), 1,
                                           "per-channel notice", None, None)
            logging.getLogger().handle(ort_record)
            ours.warning("our own warning")
            assert logging.getLogger("nncf").level == logging.ERROR
    messages = [r.getMessage() for r in caplog.records]
    assert "our own warning" in messages and "per-channel notice" not in messages


NETDEF = '''
from torch import nn


def make(width=8, num_classes=3):
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
'''


@pytest.fixture()
def netdef(tmp_path):
    path = tmp_path / "netdef.py"
    path.write_text(NETDEF)
    return f"{path}:make"


def test_torch_artifact_from_user_code_needs_the_callers_model(netdef, tmp_path):
    from torchspeed.infer.runners import TorchRunner

    model = ts.models.create(netdef, width=8)
    r = TorchRunner(model, {"fuse": True})
    r.save(tmp_path / "a")
    with pytest.raises(ValueError, match=r"built from your own code.*model=my_model.*trust_code=True"):
        ts.infer.load(tmp_path / "a")
    x = torch.randn(2, 3, 16, 16)
    fresh = ts.models.create(netdef, width=8)
    back = ts.infer.load(tmp_path / "a", model=fresh)
    assert torch.allclose(back(x), r(x), rtol=1e-5, atol=1e-5)
    trusted = ts.infer.load(tmp_path / "a", trust_code=True)
    assert torch.allclose(trusted(x), r(x), rtol=1e-5, atol=1e-5)


def test_cli_user_model_with_weights_and_image_folders(netdef, photo_folder, tmp_path, capsys):
    from torchspeed.cli import main

    model = ts.models.create(netdef, width=6)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    js = tmp_path / "r.json"
    code = main(["optimize", netdef, "--model-kwargs", '{"width": 6}', "--weights", str(tmp_path / "w.pt"),
                 "--input-shape", "1,3,32,32", "--calib", str(photo_folder), "--eval", str(photo_folder),
                 "--max-calib-samples", "8", "--max-eval-samples", "12", "--runtimes", "torch,onnxruntime",
                 "--precisions", "fp32,int8", "--batch-sizes", "1", "--max-metric-drop", "0.5", "--json", str(js)])
    assert code == 0, capsys.readouterr()
    d = json.loads(js.read_text())
    rows = {c["name"]: c for c in d["candidates"]}
    assert 0 <= d["baseline_metric"] <= 1
    assert rows["onnxruntime int8"]["status"] in ("ok", "rejected") and rows["onnxruntime int8"]["metric"] is not None
    with pytest.raises(SystemExit):
        main(["optimize", "resnet18", "--max-metric-drop", "1.5"])
    assert "expected a number in [0, 1)" in capsys.readouterr().err
