"""A library call leaves the caller's process as it found it.

Each public entry point runs as a user's first call, in a fresh interpreter (so one-time effects of
imports count): torch's thread count, default dtype, matmul precision, cudnn / TF32 / determinism
flags, grad mode, loggers, warning filters, the multiprocessing start method, signal handlers and
every environment variable are snapshotted before and after, and must be equal. The user has set
one torch thread (torch's default here is the core count), so a call that leaves its own count behind shows.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
MARK = "PROCESS-STATE:"

# What may legitimately differ after a call, and why (a key of `snapshot()` -> the reason). Not compared
# at all: torch.get_num_interop_threads() (the interop pool is sized once, on first use, and reading it is
# a first use, so the snapshot itself would decide it) and loggers created by the call (nobody's settings).
ALLOWED: dict[str, str] = {
    "logger 'torch.__trace'": "torch's placeholder handler for TORCH_TRACE removes itself on its first record "
                              "when TORCH_TRACE is unset (torch's own lazy set-up; it writes nothing either way)",
}
# Set by torch or cv2 on first use in this pytest process, so not part of the environment a user starts with.
NOT_INHERITED = ("TORCHINDUCTOR_CACHE_DIR",)
STARTING_LD_LIBRARY_PATH = os.environ.get("LD_LIBRARY_PATH")  # read at collection, before any test imports cv2


def snapshot() -> dict[str, str]:
    """Everything a library call could leave changed in the caller's process, as comparable strings."""
    import logging
    import multiprocessing
    import os
    import signal
    import sys
    import warnings

    import torch

    def logger_state(lg: logging.Logger) -> str:
        return repr((lg.level, lg.disabled, lg.propagate, [(type(h).__name__, h.level) for h in lg.handlers]))

    state = {
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "torch.get_default_device()": torch.get_default_device(),
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.backends.cudnn.enabled": torch.backends.cudnn.enabled,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.mkldnn.enabled": torch.backends.mkldnn.enabled,
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
        "torch.is_deterministic_algorithms_warn_only_enabled()": torch.is_deterministic_algorithms_warn_only_enabled(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
        "torch.is_autocast_enabled('cpu')": torch.is_autocast_enabled("cpu"),
        "multiprocessing.get_start_method(allow_none=True)": multiprocessing.get_start_method(allow_none=True),
        "warnings.filters": [(a, getattr(m, "pattern", m), c.__name__, getattr(mod, "pattern", mod), n)
                             for a, m, c, mod, n in warnings.filters],
        "logging root": logger_state(logging.getLogger()),
        "signal SIGINT": signal.getsignal(signal.SIGINT),
        "signal SIGTERM": signal.getsignal(signal.SIGTERM),
        "sys.stdout, sys.stderr": (id(sys.stdout), id(sys.stderr)),
        # setuptools appends its own _vendor folder when torch's inductor imports it to build C++ (after
        # everything installed, so nothing of the user's is shadowed): not ours to undo, and undoing it
        # would break setuptools' later imports
        "sys.path": [p for p in sys.path if not p.replace(os.sep, "/").endswith("setuptools/_vendor")],
        "os.getcwd()": os.getcwd(),
    }
    for name, lg in logging.root.manager.loggerDict.items():
        if isinstance(lg, logging.Logger):
            state[f"logger {name!r}"] = logger_state(lg)
    for key, value in os.environ.items():
        state[f"os.environ[{key!r}]"] = value
    return {k: repr(v) for k, v in state.items()}


# The user's script up to the call: torch imported, one thread set, tiny model and data built.
PRELUDE = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import torchspeed as ts
from torch import nn
from helpers import tiny_convnet, two_stage_convnet, separable_loader, separable_images
"""

# name -> (set-up, the call(s) under test). `STORE` is a packed photo store, `FOLDER` an ImageFolder.
CASES: dict[str, tuple[str, str]] = {
    "accelerate(compile=False)": (
        "m = tiny_convnet(2); opt = torch.optim.SGD(m.parameters(), lr=0.1); x, y = separable_images(16)",
        "acc = ts.train.accelerate(m, opt, example_batch=(x, y), loss_fn=nn.CrossEntropyLoss(), compile=False,"
        " trial_steps=2)",
    ),
    "accelerate(compile=True)": (
        "m = tiny_convnet(2); opt = torch.optim.SGD(m.parameters(), lr=0.1); x, y = separable_images(16)",
        "acc = ts.train.accelerate(m, opt, example_batch=(x, y), loss_fn=nn.CrossEntropyLoss(), compile=True,"
        " precision='fp32', channels_last=False, trial_steps=2)",
    ),
    "pack": (
        "import tempfile; out = os.path.join(tempfile.mkdtemp(), 'photos.store')",
        "ts.data.pack(FOLDER, out, short_side=32, num_workers=2)",
    ),
    "fast_loader and its iteration": (
        "",
        "loader = ts.data.fast_loader(STORE, batch_size=4, crop=32, device='cpu', num_workers='auto',"
        " tune_seconds=0.1)\n"
        "for images, labels in loader: pass",
    ),
    "fast_loader from a folder (OpenCV and friends)": (
        "",
        "loader = ts.data.fast_loader(FOLDER, batch_size=4, crop=32, device='cpu', num_workers=0)\n"
        "for images, labels in loader: pass",
    ),
    "tune_loader": (
        "",
        "ts.data.tune_loader(STORE, 4, num_workers='0,1', tune_seconds=0.1, device='cpu', crop=32)",
    ),
    "Trainer.fit and evaluate": (
        "m = tiny_convnet(2); opt = torch.optim.SGD(m.parameters(), lr=0.1); train = separable_loader(64, 16)",
        "trainer = ts.train.Trainer(m, opt, nn.CrossEntropyLoss())\n"
        "trainer.fit(train, train, epochs=1)\n"
        "trainer.evaluate(train)",
    ),
    "optimize(torch, onnxruntime) and its best runner": (
        "m = two_stage_convnet(2); x = torch.randn(1, 3, 16, 16)",
        "r = ts.infer.optimize(m, x, runtimes='torch,onnxruntime', precisions='fp32', batch_sizes=(1,), repeats=2,"
        " min_time_s=0.0)\n"
        "r.best.runner(torch.randn(2, 3, 16, 16))\n"
        "for row in r.table:\n"
        "    if row.runner is not None: row.runner(x)",
    ),
    "optimize(openvino) and its runners": (
        "m = two_stage_convnet(2); x = torch.randn(1, 3, 16, 16)",
        "r = ts.infer.optimize(m, x, runtimes='openvino', precisions='fp32', batch_sizes=(1,), repeats=2,"
        " min_time_s=0.0)\n"
        "for row in r.table:\n"
        "    if row.runner is not None: row.runner(x)",
    ),
    "TorchRunner(compile=True) and its calls": (
        "m = two_stage_convnet(2)",
        "r = ts.infer.TorchRunner(m, {'compile': True})\n"
        "r(torch.randn(1, 3, 16, 16)); r(torch.randn(2, 3, 16, 16))",
    ),
    "prune": (
        "m = two_stage_convnet(2); x = torch.randn(1, 3, 16, 16)",
        "ts.compress.prune(m, x, 0.5, repeats=2)",
    ),
    "select_backbone": (
        "",
        "ts.compress.select_backbone({'wide': tiny_convnet(width=8), 'narrow': tiny_convnet(width=4)}, (2, 3, 8, 8),"
        " repeats=2, warmup=1)",
    ),
    "doctor.profile": (
        "m = tiny_convnet(2); opt = torch.optim.SGD(m.parameters(), lr=0.1)",
        "ts.doctor.profile(m, separable_loader(64, 16), opt, nn.CrossEntropyLoss(), steps=3, warmup=1)",
    ),
    "doctor.lint": (
        "m = two_stage_convnet(2)",
        "ts.doctor.lint(m, torch.randn(1, 3, 16, 16), loss_fn=nn.CrossEntropyLoss(), repeats=1)",
    ),
}


def run_case(name: str, data: dict[str, str], timeout: float = 120) -> dict[str, tuple[str, str]]:
    """Run CASES[name] in a fresh interpreter: {what changed: (before, after)} (allowed changes left out)."""
    setup, call = CASES[name]
    script = "\n".join([
        PRELUDE.format(tests=TESTS),
        textwrap.dedent(inspect.getsource(snapshot)),
        f"STORE, FOLDER = {data['store']!r}, {data['folder']!r}",
        setup,
        "before = snapshot()",
        call,
        "after = snapshot()",
        "interop = torch.get_num_interop_threads()",
        "changed = {k: (before.get(k, '<absent>'), after.get(k, '<absent>')) for k in before.keys() | after.keys()",
        "           if before.get(k, '<absent>') != after.get(k, '<absent>') and not k.startswith('logger ') or",
        "           k.startswith('logger ') and k in before and before[k] != after.get(k)}",
        f"print({MARK!r} + json.dumps(changed))",
    ])
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED and k != "LD_LIBRARY_PATH"}
    if STARTING_LD_LIBRARY_PATH is not None:
        env["LD_LIBRARY_PATH"] = STARTING_LD_LIBRARY_PATH
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
    assert out.returncode == 0 and lines, f"{name} failed (exit {out.returncode}):\n{out.stderr[-4000:]}"
    changed = json.loads(lines[-1][len(MARK):])
    return {k: tuple(v) for k, v in changed.items() if k not in ALLOWED}


@pytest.fixture(scope="module")
def data(photo_store, photo_folder):
    return {"store": str(photo_store), "folder": str(photo_folder)}


@pytest.mark.parametrize("name", list(CASES))
def test_a_call_leaves_the_process_as_it_found_it(name, data):
    if name.startswith("optimize(openvino"):
        pytest.importorskip("openvino")
    changed = run_case(name, data)
    assert not changed, f"{name} changed the caller's process:\n" + "\n".join(
        f"  {k}: {_difference(before, after)}" for k, (before, after) in sorted(changed.items()))


def _difference(before: str, after: str) -> str:
    """'before -> after', or for lists (warning filters) the entries added and removed."""
    import ast

    try:
        old, new = ast.literal_eval(before), ast.literal_eval(after)
    except (ValueError, SyntaxError):
        return f"{before} -> {after}"
    if isinstance(old, list) and isinstance(new, list):
        return f"added {[x for x in new if x not in old]}, removed {[x for x in old if x not in new]}"
    return f"{before} -> {after}"


def test_openvino_sends_no_telemetry_and_the_users_settings_stay():
    """OpenVINO and NNCF start a process that sends usage telemetry on import unless told not to: the
    opt-out holds for our imports only, and the user's own CI / NNCF_CI values are as they were."""
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    script = textwrap.dedent(f"""
        import json, os
        import openvino_telemetry.main as telemetry
        sent = []
        telemetry.Telemetry.send_event = lambda self, *a, **k: sent.append((a, self.consent)) if self.consent else None
        os.environ["CI"] = "users-own"
        from torchspeed.infer.quantize import quantize_openvino  # imports nothing of openvino yet
        from torchspeed.infer.runners import available_runtimes
        from torchspeed.optional import optional
        assert available_runtimes()["openvino"] is None
        optional("nncf", "openvino", "INT8")
        import nncf.telemetry.wrapper as nncf_telemetry
        print({MARK!r} + json.dumps({{"sent": sent, "CI": os.environ.get("CI"), "NNCF_CI": os.environ.get("NNCF_CI"),
               "nncf": type(nncf_telemetry.telemetry).__name__}}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI")}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    got = json.loads(lines[-1][len(MARK):])
    assert got["sent"] == [], f"telemetry with consent: {got['sent']}"
    assert (got["CI"], got["NNCF_CI"]) == ("users-own", None)
    assert got["nncf"] != "NNCFTelemetry", "NNCF's telemetry is live, not its stub"


def test_process_as_found_puts_back_environment_filters_and_start_method(monkeypatch):
    import multiprocessing
    import warnings

    from torchspeed.runtime import default_mp_context, process_as_found

    monkeypatch.setenv("TS_KEPT", "mine")
    monkeypatch.delenv("TS_ADDED", raising=False)
    filters = list(warnings.filters)
    method = multiprocessing.get_start_method(allow_none=True)
    with process_as_found({"TS_INSIDE": "1"}):
        assert os.environ["TS_INSIDE"] == "1"
        os.environ["TS_KEPT"] = "changed"
        os.environ["TS_ADDED"] = "x"
        warnings.simplefilter("once", UserWarning)
        if method is None:
            multiprocessing.get_context().Queue()  # using the default context fixes the start method
    assert (os.environ["TS_KEPT"], "TS_ADDED" in os.environ, "TS_INSIDE" in os.environ) == ("mine", False, False)
    assert warnings.filters == filters
    assert multiprocessing.get_start_method(allow_none=True) == method
    ctx = default_mp_context()
    assert ctx.get_start_method() == (method or multiprocessing.get_all_start_methods()[0])
    assert multiprocessing.get_start_method(allow_none=True) == method
