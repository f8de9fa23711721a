"""Inference on a CUDA GPU (run with `pytest -m gpu`): a CUDA model's candidates run and are timed on
CUDA with the GPU precisions, ONNX Runtime's CUDA / TensorRT providers are really active when asked
for (fp16 on, one engine for the batch range, engine cache reused), IO binding keeps tensors on the
device (no host trip: a torch copy through the host would sync), ONNX Runtime waits for the stream
that made its inputs, and onnxruntime-gpu's CUDA matches torch's. TensorRT is optional: its tests
skip, naming why, where its libraries do not load."""
import os

import pytest
import torch
from helpers import two_stage_convnet

import torchspeed as ts
from torchspeed.infer import providers, runners
from torchspeed.infer.search import optimize

pytestmark = pytest.mark.gpu  # without a usable CUDA device the GPU suite fails (conftest.py), never skips
STALL = 50_000_000  # cycles of torch.cuda._sleep: tens of milliseconds


def _gpu_ort(provider="CUDAExecutionProvider"):
    ort = pytest.importorskip("onnxruntime")
    if provider not in ort.get_available_providers():
        pytest.skip(f"onnxruntime here has no {provider} ({ort.get_available_providers()})")
    problem = providers.ort_cuda_problem()
    if problem:
        pytest.fail(problem)  # the GPU provider is installed but cannot run beside this torch
    if provider == "TensorrtExecutionProvider" and providers.tensorrt_problem():
        pytest.skip(providers.tensorrt_problem())  # compiled in, but libnvinfer does not load: TensorRT is optional


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "net.onnx"
    ts.infer.export_onnx(two_stage_convnet(), torch.randn(1, 3, 32, 32), path)
    return str(path)


def test_cuda_model_candidates_run_and_are_timed_on_cuda():
    model = two_stage_convnet().cuda()
    r = optimize(model, torch.randn(1, 3, 32, 32, device="cuda"), runtimes="torch", batch_sizes=(1, 4),
                 repeats=2, min_time_s=0.0)
    assert r["eager fp32"].status == "ok" and r["eager fp32"].runner.device.type == "cuda"
    fp16 = r["fp16 + channels_last"]
    assert fp16.status != "skipped" and "emulated" not in fp16.reason, fp16.reason  # fp16 competes on a GPU
    assert fp16.rel_l2_error is not None and fp16.rel_l2_error < 0.01
    assert r.best is not None and r.best.p50_ms(4) > 0
    assert next(model.parameters()).device.type == "cuda"  # the caller's model is where it was


def test_cpu_model_asked_to_run_on_cuda_and_cpu_runtimes_step_aside():
    r = optimize(two_stage_convnet(), torch.randn(1, 3, 32, 32), device="cuda", batch_sizes=(2,), measure=False)
    assert r["eager fp32"].runner.device.type == "cuda"
    for name in ("onnxruntime fp32", "openvino fp32"):
        assert r[name].status == "skipped" and "the model is on cuda" in r[name].reason


def test_ort_cuda_provider_active_with_io_binding(onnx_file):
    _gpu_ort()
    run = runners.OrtRunner(onnx_file, "fp32", providers="cuda", device="cuda")
    assert run.active[0] == "CUDAExecutionProvider" and run.runtime == "onnxruntime-cuda" and run.fallback is None
    x = torch.randn(5, 3, 32, 32, device="cuda")
    out = run(x)
    assert out.device.type == "cuda" and out.shape == (5, 4)  # stayed on the device (IO binding, DLPack)
    with torch.inference_mode():
        ref = two_stage_convnet().cuda()(x)
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2)  # TF32 on either side
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a trip through the host (a torch copy from it) would sync
    try:
        again = run(x)  # the output's shape is known now: written into a torch tensor bound by pointer
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert again.is_cuda and torch.allclose(again, out, rtol=1e-4, atol=1e-5)
    assert torch.allclose(run(x.cpu()), ref, rtol=1e-2, atol=1e-2)  # host inputs are moved, not refused


def test_ort_waits_for_the_stream_that_made_its_inputs(onnx_file):
    """The input is written by the caller's stream after a stall: ONNX Runtime, on its own stream, must
    wait for it (ordered_with), not read the memory before it is written."""
    _gpu_ort()
    run = runners.OrtRunner(onnx_file, "fp32", providers="cuda", device="cuda")
    assert run.stream is not None and run.stream.cuda_stream != 0  # never the legacy default stream
    base = torch.randn(6, 3, 32, 32, device="cuda")
    with torch.inference_mode():
        ref = two_stage_convnet().cuda()(base)
    for _ in range(3):
        x = torch.empty_like(base)
        torch.cuda._sleep(STALL)
        x.copy_(base)  # queued behind the stall on the current stream
        out = run(x)
        assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2)


def test_ort_cuda_fp16_model(onnx_file, tmp_path):
    _gpu_ort()
    from torchspeed.infer.export import convert_onnx_fp16, fp16_converter

    if fp16_converter() is None:
        pytest.skip("no fp16 ONNX converter")
    half = convert_onnx_fp16(onnx_file, tmp_path / "h.onnx")
    run = runners.OrtRunner(half, "fp16", providers="cuda", device="cuda")
    x = torch.randn(3, 3, 32, 32, device="cuda")
    with torch.inference_mode():
        ref = two_stage_convnet().cuda()(x)
    out = run(x)
    assert out.dtype == torch.float32 and ts.infer.output_error(out, ref)["rel_l2"] < 0.01


def test_tensorrt_active_fp16_on_and_engine_cache_reused(onnx_file, tmp_path):
    _gpu_ort("TensorrtExecutionProvider")
    cache = tmp_path / "engines"
    run = runners.OrtRunner(onnx_file, "fp16", providers="tensorrt", device="cuda", cache_dir=str(cache))
    assert run.active[0] == "TensorrtExecutionProvider" and run.fallback is None
    options = run.session.get_provider_options()["TensorrtExecutionProvider"]
    assert options["trt_fp16_enable"] in ("1", "True", "true")
    assert options["trt_engine_cache_enable"] in ("1", "True", "true") and options["trt_engine_cache_path"] == str(cache)
    x = torch.randn(2, 3, 32, 32, device="cuda")
    first = run(x)
    engines = {f: os.path.getmtime(cache / f) for f in os.listdir(cache) if f.endswith(".engine")}
    assert engines, os.listdir(cache)
    again = runners.OrtRunner(onnx_file, "fp16", providers="tensorrt", device="cuda", cache_dir=str(cache))
    assert torch.allclose(again(x), first, rtol=1e-2, atol=1e-2)
    assert {f: os.path.getmtime(cache / f) for f in engines} == engines  # loaded, not rebuilt
    for b in (1, 3, 8):  # within the optimisation profile: the same engine, none built per batch size
        assert again(torch.randn(b, 3, 32, 32, device="cuda")).shape == (b, 4)
    assert {f for f in os.listdir(cache) if f.endswith(".engine")} == set(engines)


def test_optimize_cuda_model_with_onnx_runtime_gpu_rows():
    _gpu_ort()
    model = two_stage_convnet().cuda()
    r = optimize(model, torch.randn(1, 3, 32, 32, device="cuda"), runtimes="torch,onnxruntime-cuda,tensorrt",
                 batch_sizes=(1, 4), repeats=2, min_time_s=0.0)
    row = r["onnxruntime-cuda fp32"]
    assert row.status == "ok" and row.extra["providers"][0] == "CUDAExecutionProvider", row.reason
    assert row.max_rel_error < 1e-2 and row.p50_ms(4) > 0
    trt = r["onnxruntime-tensorrt fp16"]
    if trt.status == "failed":  # a TensorRT that did not load is named, never mislabelled
        assert "TensorrtExecutionProvider" in trt.reason or "TensorRT" in trt.reason
    elif trt.status != "skipped":
        assert trt.extra["providers"][0] == "TensorrtExecutionProvider"


def test_onnx_runtime_cuda_matches_torch_cuda():
    ort = pytest.importorskip("onnxruntime")
    if not getattr(ort, "cuda_version", ""):
        pytest.skip("onnxruntime here is a CPU build")
    assert providers.ort_cuda_problem() is None
