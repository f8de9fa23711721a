"""The CUDA paths' mechanisms, tested on the CPU (the GPU suite, `make test-gpu`, runs them for real).

No GPU is needed here: the GPU suite's guard, the flags a test must put back, ONNX Runtime's stream
ordering (fake streams), its provider options and IO binding (on ONNX Runtime's CPU provider), the
TensorRT availability check, doctor's phases on the GPU timeline and profile()'s busy share (a fake
profiler), and GPU rows judged against GPU ceilings.
"""
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import two_stage_convnet

from torchspeed.bench import ceilings
from torchspeed.doctor.recorder import step_on_timeline
from torchspeed.infer import providers, runners

TESTS = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- the GPU suite's guard
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the suite's failure without CUDA")
def test_the_gpu_suite_fails_without_cuda_and_says_why(tmp_path):
    def pytest_run(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                               os.path.join(TESTS, "test_doctor_gpu.py")], capture_output=True, text=True,
                              cwd=os.path.dirname(TESTS), timeout=300)

    gpu = pytest_run("-m", "gpu")
    assert gpu.returncode == 3, gpu.stdout[-2000:]
    lines = [line for line in (gpu.stdout + gpu.stderr).splitlines() if "the GPU suite cannot run:" in line]
    assert len(lines) == 1 and ("CUDA" in lines[0] or "CPU build" in lines[0]), gpu.stdout[-2000:]
    plain = pytest_run()  # the default selection leaves gpu tests out: no failure, nothing run
    assert plain.returncode == 5 and "deselected" in plain.stdout, plain.stdout[-2000:]


def test_usable_cuda_problem_is_one_line_naming_the_reason():
    from gpu_suite import usable_cuda_problem

    problem = usable_cuda_problem()
    if torch.cuda.is_available():
        assert problem is None
    else:
        assert problem and "\n" not in problem and torch.__version__ in problem


@pytest.mark.parametrize("api", ["legacy", "new"])
def test_torch_backend_flags_are_put_back(api):
    from gpu_suite import torch_flags

    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
              torch.are_deterministic_algorithms_enabled())
    with torch_flags():
        torch.backends.cudnn.deterministic = not before[0]
        torch.backends.cudnn.benchmark = not before[1]
        torch.backends.cudnn.allow_tf32 = not before[2]
        torch.use_deterministic_algorithms(True, warn_only=True)
        if api == "legacy":
            torch.set_float32_matmul_precision("medium")
        else:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
            torch.are_deterministic_algorithms_enabled()) == before
    assert torch.get_float32_matmul_precision() == "highest"


# ---------------------------------------------------------------- ONNX Runtime on CUDA: streams, options
class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def test_ort_runs_after_the_callers_stream_and_the_caller_after_it():
    log = []
    own, current = FakeStream("ort", log), FakeStream("torch", log)
    with providers.ordered_with(own, current):
        log.append("run")
    assert log == ["ort waits for torch", "run", "torch waits for ort"]
    log.clear()
    with pytest.raises(RuntimeError), providers.ordered_with(own, current):
        raise RuntimeError("the run failed")
    assert log == ["ort waits for torch", "torch waits for ort"]  # ordered even when the run raises
    log.clear()
    with providers.ordered_with(None, None):  # a CPU run: nothing to order
        log.append("run")
    assert log == ["run"]


def test_ort_is_never_given_the_legacy_default_stream():
    with pytest.raises(ValueError, match="legacy default CUDA stream"):
        providers.ort_providers("cuda", stream=0)  # torch's default current_stream(): ONNX Runtime reads it as none
    (name, opts), _ = providers.ort_providers("cuda", stream=1234)
    assert name == "CUDAExecutionProvider" and opts["user_compute_stream"] == "1234" and opts["has_user_compute_stream"]


def test_tensorrt_gets_one_profile_for_the_batch_range():
    prof = providers.tensorrt_profile([("x", ["batch", 3, 32, 32])], (1, 8))
    assert prof == {"trt_profile_min_shapes": "x:1x3x32x32", "trt_profile_opt_shapes": "x:8x3x32x32",
                    "trt_profile_max_shapes": "x:64x3x32x32"}
    assert providers.tensorrt_profile([("a", [None, 4]), ("b", [None, 2, 2])], (4, 128))["trt_profile_max_shapes"] \
        == "a:128x4,b:128x2x2"
    assert providers.tensorrt_profile([("x", [1, 3, 32, 32])]) == {}  # a fixed batch: one shape, one engine
    assert providers.tensorrt_profile([("x", ["batch", 3, "h", "w"])]) == {}  # no single range to give
    trt = dict(providers.ort_providers("tensorrt", "fp16", cache_dir="/tmp/e", stream=7, profile=prof))
    assert trt["TensorrtExecutionProvider"]["trt_profile_opt_shapes"] == "x:8x3x32x32"


def test_tensorrt_available_means_its_library_loads(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    import ctypes
    import glob

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        assert "no TensorRT execution provider" in providers.tensorrt_problem()
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["TensorrtExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/x/libonnxruntime_providers_tensorrt.so"])

    def cannot_load(path, *a, **k):
        raise OSError("libnvinfer.so.10: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", cannot_load)
    problem = providers.tensorrt_problem()  # compiled in, but its libraries are not here: not available
    assert "libnvinfer.so.10" in problem and "tensorrt" in problem.lower()
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **k: object())
    assert providers.tensorrt_problem() is None


def test_io_binding_writes_the_output_into_a_bound_tensor(tmp_path):
    pytest.importorskip("onnxruntime")
    import torchspeed as ts

    path = tmp_path / "net.onnx"
    ts.infer.export_onnx(two_stage_convnet(), torch.randn(1, 3, 32, 32), path)
    run = runners.OrtRunner(str(path), "fp32", threads=1)
    x = torch.randn(3, 3, 32, 32)
    expected = run(x)  # session.run through numpy
    first = run.run_bound({run.input_name: x})  # ONNX Runtime allocates it
    assert run._output_shapes == {((3, 3, 32, 32),): (3, 4)}
    second = run.run_bound({run.input_name: x})  # bound by pointer: a torch tensor ONNX Runtime writes into
    assert torch.allclose(first, expected, atol=1e-5) and torch.allclose(second, expected, atol=1e-5)
    assert second.data_ptr() != first.data_ptr()
    other = run.run_bound({run.input_name: torch.randn(5, 3, 32, 32)})  # a new shape: learnt again
    assert other.shape == (5, 4)


# ---------------------------------------------------------------- doctor on the GPU's timeline
def test_phases_are_read_on_the_device_timeline():
    # marks: (time on the device, phase running from it); the forward's kernels ran 0.3 s after the host
    # had left forward, while the host waited in "other"
    marks = [(0.0, "data"), (0.1, "forward"), (0.5, "backward"), (0.7, None), (0.9, "optimizer"), (1.0, None)]
    [ph] = step_on_timeline([(marks, 1.05)], lambda a, b: b - a)
    assert ph["data"] == pytest.approx(0.1) and ph["forward"] == pytest.approx(0.4)
    assert ph["backward"] == pytest.approx(0.2) and ph["optimizer"] == pytest.approx(0.1)
    assert ph["other"] == pytest.approx(0.25)  # the unmarked 0.2 s plus the host's 0.05 s after the device
    [squeezed] = step_on_timeline([(marks, 0.5)], lambda a, b: b - a)  # the device's clock read longer
    assert sum(v for k, v in squeezed.items() if k != "other") == pytest.approx(0.5) and squeezed["other"] == 0


def test_a_stall_queued_in_one_segment_is_charged_there_though_the_host_waits_in_the_next():
    # forward queues 0.25 s of GPU work and returns; backward's segment ends after 0.03 s on the host; the
    # optimizer's segment waits 0.25 s at the step's sync. Read segment by segment, forward would be cut to
    # its segment's 0.03 s wall.
    first = [(0.0, "data"), (0.01, "forward"), (0.26, "backward"), (0.27, None)]
    second = [(0.27, "optimizer"), (0.28, None)]
    a, b = step_on_timeline([(first, 0.03), (second, 0.26)], lambda x, y: y - x)
    assert a["forward"] == pytest.approx(0.25) and a["backward"] == pytest.approx(0.01)
    assert b["optimizer"] == pytest.approx(0.01)
    total = sum(a.values()) + sum(b.values())
    assert total == pytest.approx(0.29) and a["other"] + b["other"] == pytest.approx(0.01)
    assert a["other"] == 0  # the host's wait was in the second segment
    [none] = step_on_timeline([(first, 0.0)], lambda x, y: y - x)  # a wall read as 0: no time to share out
    assert sum(none.values()) == 0


def test_profile_busy_share_is_not_diluted_by_the_profilers_start_up(monkeypatch):
    from torch import nn

    from torchspeed.batches import BatchFormat
    from torchspeed.doctor import profiling

    class Span:
        def __init__(self, a, b):
            self.time_range = type("R", (), {"start": a * 1e6, "end": b * 1e6})()
            self.device_type = torch.autograd.DeviceType.CUDA

    class SlowToStart:  # CUPTI's start-up: far longer than a step
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            time.sleep(0.3)
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [Span(0.0, 0.004), Span(0.003, 0.008)]  # 8 ms busy (overlap counted once)

    monkeypatch.setattr(torch.profiler, "profile", SlowToStart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    model = nn.Linear(4, 2)
    step = profiling._Step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                           torch.device("cpu"), BatchFormat(), None)
    batch = (torch.randn(2, 4), torch.tensor([0, 1]))
    share = profiling._gpu_busy_share(step, lambda: batch, step_s=0.010)
    assert share == pytest.approx(0.8)  # 8 ms of a 10 ms step, whatever the profiler took to start


# ---------------------------------------------------------------- GPU rows against GPU ceilings
def _results(device_key):
    rows = [{"technique": "torchspeed auto", "median": 2000.0, "unit": "img/s", "ceiling": "bf16",
             "flops_per_item": 1e9},
            {"technique": "int8", "median": 100.0, "unit": "img/s", "ceiling": "int8", "flops_per_item": 1e9}]
    return {"train": {"rows": rows, **device_key}}


CEILINGS = {"items": {"fp32": {"value": 100.0}, "bf16": {"value": 200.0}, "int8": {"value": 400.0}}}


def test_gpu_rows_are_never_judged_against_the_cpu_ceilings():
    res = _results({"accelerate": {"device": "cuda:0"}})
    ceilings.annotate(res, CEILINGS)  # no GPU ceiling measured (e.g. ceilings cached before)
    auto, int8 = res["train"]["rows"]
    assert auto["ceiling"] == "gpu_bf16" and auto["pct_of_ceiling"] is None  # not 1000% of the CPU's GEMM
    assert int8["ceiling"] == "gpu_int8" and int8["pct_of_ceiling"] is None
    from torchspeed.bench.rows import Row

    assert ceilings.ceiling_cell(Row.from_dict(auto)) == f"gpu_bf16: {ceilings.NO_GPU_CEILING}"
    res = _results({"device": "cuda"})
    ceilings.annotate(res, {"items": {**CEILINGS["items"], "gpu_bf16": {"value": 400_000.0}}})
    assert res["train"]["rows"][0]["pct_of_ceiling"] == pytest.approx(0.5)  # 2 TFLOP/s of 400
    res = _results({})
    ceilings.annotate(res, CEILINGS)  # a CPU suite: its own ceilings, as before
    assert res["train"]["rows"][0]["ceiling"] == "bf16" and res["train"]["rows"][0]["pct_of_ceiling"] == 1000.0
