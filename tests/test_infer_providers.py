"""GPU inference decisions that can be checked without a GPU: ONNX Runtime provider options, the row's
label when ONNX Runtime falls back to another provider, the CUDA-version check between onnxruntime and
torch, candidates placed on the model's device, and the fp16 ONNX conversion."""
import types

import numpy as np
import pytest
import torch
from torch import nn

from torchspeed.infer import providers, runners, search, variants
from torchspeed.infer.result import VariantRow
from torchspeed.infer.providers import ort_cuda_problem, ort_providers, provider_label

pytest.importorskip("onnxruntime")


# ----------------------------------------------------------------------------------------- provider options
def test_tensorrt_options_enable_fp16_and_the_engine_cache(tmp_path):
    opts = ort_providers("tensorrt", "fp16", device_id=1, cache_dir=str(tmp_path / "engines"))
    assert [name for name, _ in opts] == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    trt = opts[0][1]
    assert trt["trt_fp16_enable"] is True and trt["device_id"] == 1
    assert trt["trt_engine_cache_enable"] is True and trt["trt_engine_cache_path"] == str(tmp_path / "engines")
    assert trt["trt_timing_cache_enable"] is True
    assert opts[1][1] == {"device_id": 1}
    assert ort_providers("tensorrt", "fp32", cache_dir=str(tmp_path))[0][1]["trt_fp16_enable"] is False


def test_tensorrt_engine_cache_defaults_to_torchspeeds_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CACHE", str(tmp_path))
    path = ort_providers("tensorrt", "fp16")[0][1]["trt_engine_cache_path"]
    assert path == str(tmp_path / "tensorrt")


def test_cuda_and_cpu_provider_lists_and_the_shared_stream():
    assert ort_providers("cpu") == [("CPUExecutionProvider", {})]
    cuda = ort_providers("cuda", device_id=0, stream=1234)
    assert cuda[0] == ("CUDAExecutionProvider", {"device_id": 0, "has_user_compute_stream": True,
                                                 "user_compute_stream": "1234"})
    assert cuda[1][0] == "CPUExecutionProvider"
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'tensorrt'"):
        ort_providers("rocm")


# ----------------------------------------------------------------------------------------- labels
def test_label_names_the_provider_really_running():
    assert provider_label(["TensorrtExecutionProvider"], ["TensorrtExecutionProvider", "CPUExecutionProvider"]) == \
        ("onnxruntime-tensorrt", None)
    runtime, why = provider_label(["TensorrtExecutionProvider", "CUDAExecutionProvider"],
                                  ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert runtime == "onnxruntime-cuda" and "asked for TensorrtExecutionProvider" in why and "CUDAExecutionProvider" in why
    assert provider_label(["CUDAExecutionProvider"], ["CPUExecutionProvider"])[0] == "onnxruntime"


class _FakeSession:
    """Stands in for onnxruntime.InferenceSession: records what it was given; TensorRT 'fails to load'."""

    created: list = []

    def __init__(self, path, opts, providers):
        self.requested = providers
        _FakeSession.created.append(self)

    def get_providers(self):
        names = [p[0] if isinstance(p, tuple) else p for p in self.requested]
        return [n for n in names if n != "TensorrtExecutionProvider"]

    def get_inputs(self):
        return [types.SimpleNamespace(name="input", type="tensor(float)", shape=["batch", 3])]

    def get_outputs(self):
        return [types.SimpleNamespace(name="output")]


@pytest.fixture()
def fake_ort(monkeypatch):
    import onnxruntime

    _FakeSession.created.clear()
    monkeypatch.setattr(onnxruntime, "InferenceSession", _FakeSession)
    monkeypatch.setattr(runners, "check_ort_cuda", lambda **_: None)
    return _FakeSession


def test_runner_that_fell_back_from_tensorrt_says_so(fake_ort, tmp_path):
    r = runners.OrtRunner("model.onnx", "fp16", providers="tensorrt", cache_dir=str(tmp_path))
    requested = fake_ort.created[0].requested
    assert requested[0][0] == "TensorrtExecutionProvider" and requested[0][1]["trt_fp16_enable"] is True
    assert r.runtime == "onnxruntime-cuda" and r.active[0] == "CUDAExecutionProvider"
    assert "asked for TensorrtExecutionProvider" in r.fallback


def test_a_fallen_back_row_is_dropped_with_the_reason(fake_ort, tmp_path):
    variant = variants.Variant("onnxruntime-tensorrt fp16", "onnxruntime-tensorrt", "fp16", "TensorRT",
                             lambda c: runners.OrtRunner("m.onnx", "fp16", providers="tensorrt", cache_dir=str(tmp_path)))
    row, out = search.build_variant(variant, types.SimpleNamespace(example=torch.zeros(1, 3)), torch.zeros(2, 3))
    assert row.status == "failed" and row.runner is None and out is None
    assert "asked for TensorrtExecutionProvider but ONNX Runtime runs CUDAExecutionProvider" in row.reason
    assert row.extra["providers"][0] == "CUDAExecutionProvider"


def test_gpu_provider_checks_the_cuda_versions_first(monkeypatch):
    monkeypatch.setattr(providers, "ort_cuda_problem", lambda **_: "onnxruntime-gpu 1.0 is built for CUDA 11.8 ...")
    with pytest.raises(RuntimeError, match="built for CUDA 11.8"):
        runners.OrtRunner("model.onnx", "fp32", providers="cuda")


# ----------------------------------------------------------------------------------------- CUDA versions
@pytest.mark.parametrize(("ort_cuda", "torch_cuda", "says"), [
    ("12.8", "12.6", None),
    ("13.0", "13.0", None),
    ("12.8", "13.0", "onnxruntime-gpu 1.31.0 is built for CUDA 12.8 but torch 2.14.1 uses CUDA 13.0"),
    ("", "13.0", "onnxruntime 1.31.0 is a CPU build"),
    ("12.8", "", "torch 2.14.1 is a CPU build"),
])
def test_cuda_version_check_names_both_versions(ort_cuda, torch_cuda, says):
    problem = ort_cuda_problem(ort_cuda=ort_cuda, torch_cuda=torch_cuda, ort_version="1.31.0", torch_version="2.14.1")
    if says is None:
        assert problem is None
    else:
        assert says in problem
    if says and "uses CUDA 13.0" in says:
        assert "onnxruntime-gpu build for CUDA 13" in problem
    if ort_cuda == "":
        assert "torchspeed[infer-gpu]" in problem and "CUDA 13" in problem


def test_check_ort_cuda_raises_with_the_message():
    with pytest.raises(RuntimeError, match="built for CUDA 11.8 but torch 2.14.1 uses CUDA 12.4"):
        runners.check_ort_cuda(ort_cuda="11.8", torch_cuda="12.4", ort_version="1.18.0", torch_version="2.14.1")


# ----------------------------------------------------------------------------------------- device placement
def _variant(name):
    return next(v for v in variants.VARIANTS if v.name == name)


def _machine(device):
    usable = dict.fromkeys(runners.RUNTIMES)
    return variants.Machine(usable, native_bf16=True, device=device)


FACTS = variants.ModelFacts(linear_heavy=False, calibrated=True, calibration="minmax")


def test_on_cuda_fp16_competes_and_cpu_runtimes_step_aside():
    cuda, cpu = _machine("cuda:0"), _machine("cpu")
    assert variants.skip_reason(_variant("fp16 + channels_last"), cuda, FACTS) is None
    assert "emulated on CPU" in variants.skip_reason(_variant("fp16 + channels_last"), cpu, FACTS)
    for name in ("onnxruntime fp32", "onnxruntime int8", "openvino fp32", "openvino int8"):
        assert "the model is on cuda:0" in variants.skip_reason(_variant(name), cuda, FACTS)
        assert variants.skip_reason(_variant(name), cpu, FACTS) is None
    for name in ("onnxruntime-cuda fp32", "onnxruntime-cuda fp16", "onnxruntime-tensorrt fp16"):
        assert variants.skip_reason(_variant(name), cuda, FACTS) is None, name
        assert variants.skip_reason(_variant(name), cpu, FACTS)  # a CPU model is not moved to the GPU
    # a CPU runtime not installed says it does not apply to a model on the GPU, not how to install it
    missing = {**dict.fromkeys(runners.RUNTIMES), "openvino": "openvino needs openvino: pip install ..."}
    on_gpu, on_cpu = (variants.Machine(missing, native_bf16=True, device=d) for d in ("cuda:0", "cpu"))
    assert "the model is on cuda:0" in variants.skip_reason(_variant("openvino fp32"), on_gpu, FACTS)
    assert "pip install" in variants.skip_reason(_variant("openvino fp32"), on_cpu, FACTS)
    uncalibrated = variants.ModelFacts(linear_heavy=False, calibrated=False, calibration="minmax")
    assert "pip install" in variants.skip_reason(_variant("openvino int8"), on_cpu, uncalibrated)  # first things first
    no_bf16 = variants.Machine(dict.fromkeys(runners.RUNTIMES), native_bf16=False, device="cuda:0")
    assert "no native bf16 on this GPU" in variants.skip_reason(_variant("bf16 + channels_last"), no_bf16, FACTS)


def test_gpu_rows_skipped_with_the_install_hint_when_onnxruntime_has_no_cuda():
    usable = dict.fromkeys(runners.RUNTIMES)
    usable["onnxruntime-cuda"] = usable["tensorrt"] = ort_cuda_problem(
        ort_cuda="", torch_cuda="13.0", ort_version="1.31.0", torch_version="2.14.1")
    machine = variants.Machine(usable, native_bf16=True, device="cuda:0")
    reason = variants.skip_reason(_variant("onnxruntime-tensorrt fp16"), machine, FACTS)
    assert "CPU build" in reason and "torchspeed[infer-gpu]" in reason


def test_timing_synchronises_on_the_models_device(monkeypatch):
    import torchspeed.measure

    seen = {}

    def fake_compare(contenders, **kw):
        seen.update(kw)
        for fn in contenders.values():
            fn()
        timings = [torchspeed.measure.Timing(name, [0.001], [2.0]) for name in contenders]
        return torchspeed.measure.Comparison(timings, baseline=kw["baseline"], others_cores=0.0)

    monkeypatch.setattr(search, "compare", fake_compare)
    row = VariantRow("onnxruntime fp32", "onnxruntime", "fp32", True, runner=lambda x: x)
    search.time_variants([row], torch.zeros(1, 3), (2,), torch.Generator(), 1, 0.0, lambda _: None, device="cuda:0")
    assert seen["device"] == "cuda:0" and seen["baseline"] == "onnxruntime fp32"
    assert row.latency_ms[2]["p50_ms"] == pytest.approx(1.0)


def test_torch_runner_runs_where_the_model_is():
    model = nn.Linear(3, 2)
    r = runners.TorchRunner(model, {})
    assert r.device == torch.device("cpu") and r(np.zeros((2, 3), np.float32)).shape == (2, 2)
    assert runners.module_device(model.to("meta")) == torch.device("meta")


def test_asking_for_cuda_without_one_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device"):
        search.optimize(nn.Linear(3, 2), torch.zeros(1, 3), device="cuda")


# ----------------------------------------------------------------------------------------- fp16 ONNX
def test_fp16_conversion_keeps_float32_inputs_and_outputs(tmp_path):
    onnx = pytest.importorskip("onnx")
    from torchspeed.infer.export import convert_onnx_fp16, export_onnx, fp16_converter

    if fp16_converter() is None:
        pytest.skip("no fp16 converter installed")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    export_onnx(model, torch.randn(1, 8), tmp_path / "m.onnx", exporter="torchscript")
    convert_onnx_fp16(tmp_path / "m.onnx", tmp_path / "h.onnx")
    m = onnx.load(str(tmp_path / "h.onnx"))
    assert {i.data_type for i in m.graph.initializer if i.dims} == {onnx.TensorProto.FLOAT16}
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    try:
        run = runners.OrtRunner(str(tmp_path / "h.onnx"), "fp16")
    except Exception as e:  # noqa: BLE001 - the CPU provider lacks fp16 kernels for some ops
        pytest.skip(f"the CPU provider cannot run this fp16 model: {e}")
    x = torch.randn(5, 8)
    with torch.inference_mode():
        ref = model(x)
    assert run(x).dtype == torch.float32 and torch.allclose(run(x), ref, rtol=1e-2, atol=1e-2)


def test_cli_device_cuda_without_one_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from torchspeed.cli import main

    assert main(["optimize", "resnet18", "--num-classes", "2", "--input-shape", "1,3,32,32", "--device", "cuda",
                 "--runtimes", "torch", "--precisions", "fp32"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no CUDA device" in err and "Traceback" not in err


def test_io_binding_path_matches_the_numpy_path(tmp_path):
    """The GPU path binds torch tensors by pointer and returns the output through DLPack; the same code
    runs on the CPU provider here, so its binding (names, dtypes, shapes, integer inputs) is checked."""
    from torchspeed.infer.export import export_onnx

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.fc = nn.Embedding(10, 4), nn.Linear(4, 3)

        def forward(self, ids, scale):
            return self.fc(self.embed(ids).mean(1) * scale)

    export_onnx(Mixed().eval(), {"ids": torch.randint(0, 10, (1, 5)), "scale": torch.rand(1, 1)}, tmp_path / "m.onnx",
                exporter="torchscript")
    run = runners.OrtRunner(str(tmp_path / "m.onnx"))
    feed = {"ids": torch.randint(0, 10, (3, 5)), "scale": torch.rand(3, 1)}
    bound = run.run_bound(feed)
    assert isinstance(bound, torch.Tensor) and bound.shape == (3, 3)
    assert torch.allclose(bound, run(feed), atol=1e-6)


def test_exact_tolerance_allows_for_tf32_on_a_gpu(monkeypatch):
    assert search.exact_tolerance(torch.device("cpu")) == 1e-3
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert search.exact_tolerance(torch.device("cuda:0")) == 1e-2
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert search.exact_tolerance(torch.device("cuda:0")) == 1e-3
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # TF32 matmuls
    assert search.exact_tolerance(torch.device("cuda:0")) == 1e-2
