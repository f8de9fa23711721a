"""The CUDA and distributed paths of training, tested on the CPU where their logic lives on the host:
host reads per step, evaluation without autograd under FSDP, FSDP2's mixed-precision policy, the
measured TF32 / cudnn.benchmark switches, and CUBLAS_WORKSPACE_CONFIG under deterministic mode.
(tests/test_train_gpu.py runs the same paths on a GPU.)"""
import warnings

import pytest
import torch
from helpers import separable_loader, tiny_convnet
from torch import nn

from torchspeed.train import Trainer, accelerate
from torchspeed.train import acceleration as A
from torchspeed.train import strategy, trials
from torchspeed.train.choices import AccelerateOptions

FIXED = dict(precision="fp32", channels_last=False, compile=False, progress=False)


class _Reads:
    """Counts the ways a tensor's value reaches the host (each is a device sync on a GPU)."""

    NAMES = ("item", "tolist", "__float__", "__bool__", "__int__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **k):
                self.n += 1
                return _orig(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)


def _fit_reads(monkeypatch, n_batches, scaler=False, accum=1):
    model = tiny_convnet(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = accelerate(model, opt, device="cpu", fused_optimizer=False, **{k: v for k, v in FIXED.items()
                                                                        if k != "progress"})
    if scaler:  # fp16's GradScaler logic, with a CPU scaler
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    tr = Trainer(acc, loss_fn=nn.functional.cross_entropy, progress=False, log_every_n_steps=10_000,
                 grad_accum_steps=accum)
    scale_reads = []
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: scale_reads.append(1) or 1.0)
    with monkeypatch.context() as m:
        reads = _Reads(m)
        res = tr.fit(separable_loader(n_batches * 8, 8), epochs=1)
    assert res["step"] == n_batches // accum and not scale_reads
    return reads.n


def test_no_host_read_per_step_outside_fp16(monkeypatch):
    # the loss is read at reading points (here: the epoch's end), never per micro-step
    assert _fit_reads(monkeypatch, 4) == _fit_reads(monkeypatch, 12)
    assert _fit_reads(monkeypatch, 4, accum=2) == _fit_reads(monkeypatch, 12, accum=2)


def test_fp16_scaler_reads_once_per_optimizer_step_and_never_the_scale(monkeypatch):
    few, many = _fit_reads(monkeypatch, 4, scaler=True), _fit_reads(monkeypatch, 12, scaler=True)
    assert many - few == 8  # one read per optimizer step (the inf/NaN finding), get_scale() never
    few, many = _fit_reads(monkeypatch, 4, scaler=True, accum=2), _fit_reads(monkeypatch, 12, scaler=True, accum=2)
    assert many - few == 4  # per optimizer step, not per micro-step


def test_evaluate_under_fsdp_uses_no_grad_and_training_follows(monkeypatch):
    model = tiny_convnet(width=4)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, **FIXED)
    tr.prepare(separable_loader(64, 8))
    modes = []
    model.register_forward_hook(lambda m, i, o: modes.append((torch.is_inference_mode_enabled(),
                                                              torch.is_grad_enabled())))
    tr.evaluate(separable_loader(64, 8))
    assert set(modes) == {(True, False)}  # inference_mode without FSDP
    modes.clear()
    tr.acc.report.strategy = "fsdp"  # FSDP2's unsharded parameters must not become inference tensors
    before = tr.evaluate(separable_loader(64, 8))["val_loss"]
    assert set(modes) == {(False, False)}
    tr.acc.report.strategy = None
    res = tr.fit(separable_loader(64, 8), separable_loader(64, 8), epochs=2)  # evaluate-before-fit, then training works
    assert res["val_loss"] < before


def test_fsdp_mixed_precision_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert strategy.fsdp_policy("fp32") is None
    for p, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert strategy.fsdp_policy(p) == MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def test_fsdp_wrap_all_gathers_in_the_chosen_precision(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        strategy.fsdp_wrap(model, "bf16")
        out = model(torch.randn(3, 4))
        assert out.dtype == torch.bfloat16  # computed with bf16 parameters
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the sharded master weights stay fp32
        out.float().sum().backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    finally:
        dist.destroy_process_group()


class _FakeTimer:
    """Stands in for StepTimer on a pretend CUDA device: fixed times per option."""

    def __init__(self, times):
        self.times, self.calls = times, []

    def step_fn(self, model, precision, channels_last):
        return lambda: None

    def compare(self, steps):
        for fn in steps.values():
            fn()  # sets the switch, as a real comparison would
        self.calls.append(sorted(steps))
        return dict(self.times)


@pytest.fixture
def pretend_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    monkeypatch.setattr(trials, "_SET_HERE", {})
    yield torch.device("cuda")
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.benchmark = saved[1]


def test_tf32_and_cudnn_benchmark_are_measured_and_recorded(pretend_cuda):
    report = A.AccelerateResult(device="cuda:0")
    trials._choose_cuda_flags(tiny_convnet(width=4), _FakeTimer({"False": 1.0, "True": 0.5}), AccelerateOptions(),
                              report, pretend_cuda)
    assert report.tf32 is True and torch.get_float32_matmul_precision() == "high"
    assert report.cudnn_benchmark is True and torch.backends.cudnn.benchmark is True
    rows = {(r.setting, r.value): r.decision for r in report.candidates}
    assert rows[("tf32", "True")] == "kept" and rows[("cudnn_benchmark", "True")] == "kept"
    assert "tf32=True cudnn_benchmark=True" in str(report)

    report = A.AccelerateResult(device="cuda:0")  # within the margin: both off
    trials._choose_cuda_flags(tiny_convnet(width=4), _FakeTimer({"False": 1.0, "True": 0.99}), AccelerateOptions(),
                              report, pretend_cuda)
    assert report.tf32 is False and torch.get_float32_matmul_precision() == "highest"
    assert report.cudnn_benchmark is False and torch.backends.cudnn.benchmark is False
    assert {(r.setting, r.decision) for r in report.candidates} >= {("tf32", "rejected: not 5% faster")}


def test_a_users_own_settings_are_kept(pretend_cuda):
    torch.set_float32_matmul_precision("high")  # set by the user before accelerate
    report = A.AccelerateResult(device="cuda:0")
    timer = _FakeTimer({"False": 1.0, "True": 0.5})
    trials._choose_cuda_flags(tiny_convnet(width=4), timer, AccelerateOptions(tf32="auto", cudnn_benchmark=False),
                              report, pretend_cuda)
    assert report.tf32 is True and torch.get_float32_matmul_precision() == "high"
    assert report.cudnn_benchmark is False and torch.backends.cudnn.benchmark is False
    assert timer.calls == []  # nothing measured: both were the user's
    decisions = {r.setting: r.decision for r in report.candidates}
    assert decisions["tf32"].startswith("given (matmul precision 'high'") and decisions["cudnn_benchmark"] == "given"

    torch.backends.cudnn.benchmark = True  # turned on by the user: kept, not measured
    report = A.AccelerateResult(device="cuda:0")
    trials._choose_cuda_flags(tiny_convnet(width=4), timer, AccelerateOptions(tf32=False, cudnn_benchmark="auto"),
                              report, pretend_cuda)
    assert report.cudnn_benchmark is True and torch.backends.cudnn.benchmark is True and timer.calls == []
    assert {r.setting: r.decision for r in report.candidates}["cudnn_benchmark"].startswith("given (turned on")

    torch.set_float32_matmul_precision("highest")
    report = A.AccelerateResult(device="cuda:0", precision="bf16")
    torch.use_deterministic_algorithms(True)
    try:
        torch.backends.cudnn.benchmark = False
        trials._choose_cuda_flags(tiny_convnet(width=4), timer, AccelerateOptions(), report, pretend_cuda)
    finally:
        torch.use_deterministic_algorithms(False)
    assert report.tf32 is None and report.cudnn_benchmark is None and timer.calls == []
    assert torch.backends.cudnn.benchmark is False  # left as it was under deterministic mode
    notes = " ".join(r.decision for r in report.candidates)
    assert "matmuls run in bf16" in notes and "deterministic mode" in notes


def test_cpu_has_no_cuda_switches():
    acc = accelerate(tiny_convnet(width=4), None, device="cpu", **{k: v for k, v in FIXED.items() if k != "progress"})
    assert acc.report.tf32 is None and acc.report.cudnn_benchmark is None
    assert not {r.setting for r in acc.report.candidates} & {"tf32", "cudnn_benchmark"}
    with pytest.raises(ValueError, match="tf32 must be 'auto', True or False"):
        accelerate(tiny_convnet(width=4), None, device="cpu", tf32="yes",
                   **{k: v for k, v in FIXED.items() if k != "progress"})


def test_cublas_workspace_is_set_for_deterministic_mode(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    A._cublas_workspace_for_determinism(cuda_initialized=False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in __import__("os").environ  # not asked for: untouched
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A._cublas_workspace_for_determinism(cuda_initialized=False)  # in time: set, no warning
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    with pytest.warns(RuntimeWarning, match="CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before"):
        A._cublas_workspace_for_determinism(cuda_initialized=True)  # too late to be sure: said so
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A._cublas_workspace_for_determinism(cuda_initialized=True)  # the user's own value: kept, no warning
    assert __import__("os").environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
