"""This machine and torch's set-up on it: RNG state round trips, seeding and determinism, the default
precision from CPU flags and GPU capability, and forks that wait for helper threads."""
import os
import random

import numpy as np
import pytest
import torch
from helpers import tiny_convnet

from torchspeed import runtime


def _draws():
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        np.random.rand(3).tolist() + [np.random.randn()],
        torch.rand(3).tolist() + torch.randn(2).tolist(),
    )


def test_rng_round_trip_repeats_every_generator(tmp_path):
    runtime.seed_everything(123)
    random.gauss(0, 1), np.random.randn()  # leave cached gaussians in both generators
    state = runtime.rng_state()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    first = _draws()
    runtime.seed_everything(999)  # disturb everything
    _draws()
    runtime.set_rng_state(torch.load(path, weights_only=True))
    assert _draws() == first


def test_set_rng_state_rejects_garbage():
    with pytest.raises(ValueError, match="RNG state"):
        runtime.set_rng_state({"python": 1})


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", True])
def test_seed_everything_validates(bad):
    with pytest.raises(ValueError, match="seed"):
        runtime.seed_everything(bad)


def _tiny_run(seed: int) -> torch.Tensor:
    runtime.seed_everything(seed)
    model = tiny_convnet(classes=4, seed=None)  # initialised from the seeded generator
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    for _ in range(5):
        idx = torch.randperm(16)[:8]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_seed_everything_reproduces_training_bit_for_bit():
    runtime.deterministic(True)
    try:
        a, b, c = _tiny_run(7), _tiny_run(7), _tiny_run(8)
    finally:
        runtime.deterministic(False)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_deterministic_toggles_torch_flags():
    runtime.deterministic(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    runtime.deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_describe_names_the_machine_its_isa_flags_and_gpus():
    info = runtime.describe()
    assert info["cores"] >= 1 and info["torch"] == torch.__version__
    assert {"avx2", "avx512f", "amx_bf16"} <= set(info["isa"])
    assert all(isinstance(v, bool) for v in info["isa"].values())
    assert isinstance(info["gpus"], list)
    assert info["cpu"] in runtime.describe_line(info)


def test_default_precision_follows_cpu_flags(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    choice = runtime.default_precision("cpu")
    assert choice.name == "bf16" and "amx_bf16" in choice.reason and choice.dtype is torch.bfloat16
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2"}))
    assert runtime.default_precision("cpu").name == "fp32"


def test_default_precision_honours_a_onednn_isa_cap_below_bf16(monkeypatch):
    """A process capped below oneDNN's bf16 kernels (ONEDNN_MAX_CPU_ISA=AVX2) emulates bf16 on a bf16 CPU."""
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    choice = runtime.default_precision("cpu")
    assert choice.name == "fp32" and "ONEDNN_MAX_CPU_ISA=AVX2" in choice.reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert runtime.default_precision("cpu").name == "bf16"


def test_default_precision_follows_gpu_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 5))
    assert runtime.default_precision("cuda:0").name == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert runtime.default_precision("cuda:0").name == "bf16"


def test_deterministic_sets_the_cublas_workspace_and_warns_when_cuda_started(monkeypatch):
    import warnings

    from torchspeed.runtime import deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            deterministic(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert any("in the environment before starting Python" in str(w.message) for w in caught)
    finally:
        deterministic(False)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_waits_for_helper_work_and_the_child_gate_is_free():
    """DataLoader workers start by fork: one forked while a helper thread decodes could inherit a lock
    held forever. The fork waits until the helper's unit of work ends; the child's gate is usable."""
    import threading
    import time

    from torchspeed.runtime import helper_work

    inside, left = threading.Event(), []

    def work():
        with helper_work:
            inside.set()
            time.sleep(0.3)
            left.append(time.perf_counter())

    t = threading.Thread(target=work)
    t.start()
    inside.wait()
    pid = os.fork()
    if pid == 0:  # the child: the gate must not be held
        with helper_work:
            pass
        os._exit(0)
    forked_at = time.perf_counter()
    t.join()
    deadline = time.time() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.time() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child's gate was held"
    assert left and forked_at >= left[0], "the fork landed inside a helper's work"


def test_an_isa_cap_is_named_and_keeps_its_measurements_apart(monkeypatch):
    """A process started under ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY measures what that cap allows: its
    description says so and its machine key (the cache of ceilings and decisions) is not the uncapped one."""
    for name in runtime.ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = runtime.describe()
    assert plain["isa_caps"] == {} and "capped" not in runtime.describe_line(plain)
    assert plain["torch_cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", " avx2 ")  # oneDNN ignores a value with spaces
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "AVX2")  # ATen reads lower case only
    assert runtime.isa_caps() == {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    capped = runtime.describe()
    assert capped["isa_caps"] == {"ATEN_CPU_CAPABILITY": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "capped: ATEN_CPU_CAPABILITY=AVX2, ONEDNN_MAX_CPU_ISA=AVX2" in runtime.describe_line(capped)
    assert runtime.machine_key(capped) != runtime.machine_key(plain)
    # no cap, no change: the keys of caches written before caps were recorded still match
    legacy = {k: plain[k] for k in ("cpu", "arch", "cores", "isa", "gpus", "torch")}
    assert runtime.machine_key(plain) == runtime.machine_key(legacy)


def test_the_old_onednn_cap_name_is_honoured_too(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    choice = runtime.default_precision("cpu")
    assert choice.name == "fp32" and "DNNL_MAX_CPU_ISA=AVX2" in choice.reason
