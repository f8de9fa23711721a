"""Faults around `torchspeed doctor` and `lint`: `--json -` stays JSON whatever the script prints, a
killed doctor stops its script and its leftovers are cleaned, the suggested commands paste into a
shell, `--out` never replaces a user's file and a bad `--out`/`--json` costs no run, and an input
shape too large for memory is one line naming it."""
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from torchspeed.cli import main
from torchspeed.doctor.launch import build_payload

PRINTING = textwrap.dedent("""
    import os, sys, time, torch
    from torch import nn
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(str(os.getpid()))
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10**9):
        print(f"printed by the script at step {step}", flush=True)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if len(sys.argv) > 2:
            time.sleep(float(sys.argv[2]))
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "my train.py"  # a space: commands built from it must be quoted
    path.write_text(PRINTING)
    return str(path)


@pytest.mark.timeout(120)
def test_json_dash_keeps_stdout_pure_json_when_the_script_prints(script):
    run = subprocess.run([sys.executable, "-m", "torchspeed", "doctor", "--steps", "3", "--json", "-", "--",
                          sys.executable, script], capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)  # the script's prints would make this fail
    assert report["steps"] == 3
    assert "printed by the script at step 0" in run.stderr


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child is tied to doctor on Linux")
@pytest.mark.timeout(180)
def test_a_sigkilled_doctor_stops_its_script_and_the_next_run_cleans_its_leftovers(script, tmp_path):
    pid_file = tmp_path / "child.pid"
    doctor = subprocess.Popen([sys.executable, "-m", "torchspeed", "doctor", "--", sys.executable, script,
                               str(pid_file), "0.05"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 90
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert _alive(child)
        leftovers = glob.glob(os.path.join(tempfile.gettempdir(), f"torchspeed-doctor-{doctor.pid}-*"))
        assert leftovers
        doctor.send_signal(signal.SIGKILL)
        doctor.wait(timeout=30)
        deadline = time.monotonic() + 30  # generous: a busy machine delivers the signal and reaps late
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the script kept running after doctor was killed"
    finally:
        if doctor.poll() is None:
            doctor.kill()
            doctor.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    assert main(["doctor", "--steps", "2", "--json", str(tmp_path / "d.json"), "--", sys.executable, script]) == 0
    assert not any(os.path.exists(p) for p in leftovers)


def test_suggested_measure_commands_are_shell_quoted():
    command = [sys.executable, "/data/my project/train.py", "--name", "a b; rm -rf x", "--lr", "0.1"]
    window = {"wall": 1.0, "phases": {"data": 0.8, "copy": 0.0, "forward": 0.1, "backward": 0.05,
                                      "optimizer": 0.05, "other": 0.0, "eval": 0.0}, "samples": 8}
    raw = {"status": "stopped", "windows": [window] * 4,
           "settings": {"device": "cpu", "loaders": [{"name": "DataLoader", "num_workers": 0, "batches": 4,
                                                       "training": True, "data_s": 3.2, "batch_size": 8}]}}
    findings = build_payload(raw, command, 0)["findings"]
    measured = [f["command"] for f in findings if " -- " in f["command"]]
    assert measured
    for text in measured:
        assert shlex.split(text)[-len(command):] == command  # pasted into a shell, the script gets its arguments


def test_doctor_out_never_replaces_a_users_file_and_a_bad_target_costs_no_run(script, tmp_path, capsys):
    ran = tmp_path / "ran"
    report = tmp_path / "report"
    report.mkdir()
    (report / "doctor.md").write_text("my own notes")
    assert main(["doctor", "--out", str(report), "--", sys.executable, script, str(ran)]) == 2
    err = capsys.readouterr().err
    assert "'doctor.md'" in err and "never replaced" in err and "Traceback" not in err
    assert (report / "doctor.md").read_text() == "my own notes"
    (tmp_path / "blocker").write_text("a file")
    for flags in (["--out", str(tmp_path / "blocker" / "rep")], ["--json", str(tmp_path / "blocker" / "d.json")]):
        assert main(["doctor", *flags, "--", sys.executable, script, str(ran)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "cannot be written" in err and "Traceback" not in err
    assert not ran.exists()  # nothing ran


@pytest.mark.timeout(120)
def test_doctor_replaces_its_own_earlier_report(script, tmp_path):
    out = tmp_path / "rep"
    for steps in ("2", "3"):
        assert main(["doctor", "--steps", steps, "--out", str(out), "--", sys.executable, script]) == 0
    assert json.loads((out / "doctor.json").read_text())["steps"] == 3


def test_lint_input_shape_too_large_is_one_line_naming_it(capsys, monkeypatch):
    assert main(["lint", "resnet18", "--input-shape", "100000,3,1000,1000"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--input-shape 100000,3,1000,1000" in err and "GiB" in err and "Traceback" not in err

    import torch

    from torchspeed import batches

    def refuse(*shape, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4800000000 bytes")

    monkeypatch.setattr(batches, "free_memory", lambda device: None)  # the size check passes: allocation fails
    monkeypatch.setattr(torch, "randn", refuse)
    assert main(["lint", "resnet18", "--input-shape", "1000,3,400,1000"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--input-shape 1000,3,400,1000" in err and "cannot allocate" in err and "Traceback" not in err


def test_trace_without_out_is_refused_before_the_script_runs(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--trace", "--", sys.executable, str(script)]) == 2
    err = capsys.readouterr().err
    assert "--trace needs --out" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "doctor-trace.json").exists()
