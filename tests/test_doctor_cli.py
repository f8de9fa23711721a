"""`torchspeed doctor` on small unchanged scripts (subprocesses: few, tiny, bounded) and `torchspeed lint`."""
import json
import sys
import textwrap

import pytest

from torchspeed.cli import main
from torchspeed.doctor.launch import build_payload, child_command

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    torch.set_num_threads(1)
    mode = sys.argv[1]

    class Slow(TensorDataset):       # a millisecond a sample: the loop waits for its loader
        def __getitem__(self, i):
            time.sleep(0.001)
            return super().__getitem__(i)

    loader = DataLoader(Slow(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=8, num_workers=0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    while True:                      # trains forever unless doctor stops it
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if mode == "raise" and steps == 2:
                raise RuntimeError("boom at step 2")
            if mode == "exit" and steps == 3:
                sys.exit(3)
""")


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return str(p)


@pytest.mark.timeout(120)
def test_doctor_stops_after_steps_and_flags_no_workers(script, tmp_path):
    out = tmp_path / "rep"
    code = main(["doctor", "--steps", "4", "--out", str(out), "--json", str(tmp_path / "d.json"), "--",
                 sys.executable, script, "forever"])
    assert code == 0
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["steps"] == 4 and d["status"] == "stopped" and d["exit_status"] == 0
    assert set(d["phases"]) >= {"data", "copy", "forward", "backward", "optimizer", "other"}
    assert d["verdict"] in ("data-bound", "compute-bound", "overhead-bound")
    assert d["settings"]["loaders"][0]["num_workers"] == 0 and d["settings"]["loaders"][0]["batch_size"] == 8
    assert d["settings"]["autocast"] is False
    assert "loader-no-workers" in [f["rule"] for f in d["findings"]]
    assert (out / "doctor.md").read_text().startswith("# torchspeed doctor report")
    assert json.loads((out / "doctor.json").read_text())["steps"] == 4


FAST_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import torchspeed as ts
    torch.set_num_threads(1)
    workers, threads = int(sys.argv[2]), int(sys.argv[3])
    loader = ts.data.fast_loader(sys.argv[1], 4, crop=16, device="cpu", num_workers=workers, threads=threads)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 3, 16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    while True:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y % 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers,threads", [(0, 2), (1, 1)])
def test_doctor_sees_a_fast_loader_and_its_threads_do_not_enter_the_loop_phases(tmp_path, photo_folder, workers,
                                                                                threads):
    from torchspeed.runtime import usable_cores

    (tmp_path / "fast.py").write_text(FAST_SCRIPT)
    code = main(["doctor", "--steps", "5", "--out", str(tmp_path / "rep"), "--json", str(tmp_path / "d.json"), "--",
                 sys.executable, str(tmp_path / "fast.py"), str(photo_folder), str(workers), str(threads)])
    assert code == 0
    d = json.loads((tmp_path / "d.json").read_text())
    # the FastLoader only: its inner DataLoader is iterated by the prefetch thread, which the loop's
    # phases (one stack, the loop's thread) must not see
    (ld,) = d["settings"]["loaders"]
    assert ld["name"].startswith("FastLoader") and ld["batches"] >= 5 and ld["training"]
    assert (ld["num_workers"], ld["threads"]) == (workers, threads)
    assert d["steps"] == 5
    # exclusive phases of the loop's thread only: they never add up to more than the wall time
    assert sum(v for k, v in d["phases"].items() if k != "other") <= d["wall_s"] * 1.01
    rules = [f["rule"] for f in d["findings"]]
    assert "loader-no-workers" not in rules  # its batches are made in the background
    # 1 intra-op thread + the loader's 2 threads or 1 worker: oversubscribed below that many cores
    assert ("cpu-oversubscribed" in rules) == (usable_cores() < 1 + max(workers, threads))


@pytest.mark.timeout(120)
def test_doctor_writes_report_when_script_raises(script, tmp_path, capfd):
    code = main(["doctor", "--json", str(tmp_path / "d.json"), "--", sys.executable, script, "raise"])
    assert code == 1
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["status"] == "error" and d["error"] == "RuntimeError: boom at step 2" and d["steps"] == 2
    err = capfd.readouterr().err
    assert "RuntimeError: boom at step 2" in err and "bootstrap.py" not in err  # the user's traceback only


@pytest.mark.timeout(120)
def test_doctor_propagates_exit_status(script, tmp_path):
    code = main(["doctor", "--json", str(tmp_path / "d.json"), "--", sys.executable, "-u", script, "exit"])
    assert code == 3
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["exit_status"] == 3 and d["steps"] == 3 and d["status"] == "exited"


def test_child_command_keeps_interpreter_options_and_script_arguments(script):
    cmd = child_command([sys.executable, "-u", "-W", "ignore", script, "--lr", "0.1"])
    assert cmd[:4] == [sys.executable, "-u", "-W", "ignore"] and cmd[4] == "-c"
    assert cmd[6:] == ["script", script, "--lr", "0.1"]
    assert child_command(["python3", "-m", "pkg.train", "x"])[-3:] == ["module", "pkg.train", "x"]
    assert child_command([script, "a"])[0] == sys.executable  # a bare .py runs with this interpreter
    with pytest.raises(ValueError, match="Python interpreter"):
        child_command(["bash", script])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        child_command(["python", "missing_train.py"])
    with pytest.raises(ValueError, match="no script"):
        child_command(["python", "-u"])


def test_doctor_needs_a_command(capsys):
    assert main(["doctor"]) == 2
    assert "after `--`" in capsys.readouterr().err


def test_build_payload_excludes_warmup_and_eval_loader_time():
    ph = lambda d, f: {"data": d, "copy": 0.0, "forward": f, "backward": 1.0, "optimizer": 0.1, "other": 0.0, "eval": 0.0}
    raw = {"status": "finished", "windows": [{"wall": 9.0, "phases": ph(7.0, 1.9), "samples": 8}] +
           [{"wall": 3.0, "phases": ph(0.8, 0.9), "samples": 8}] * 3,
           "settings": {"device": "cpu", "loaders": [
               {"name": "val", "num_workers": 2, "batches": 5, "training": False, "data_s": 0.6},
               {"name": "train", "num_workers": 2, "batches": 20, "training": True, "data_s": 2.4}]}}
    d = build_payload(raw, ["python", "t.py"], 0)
    assert d["steps"] == 4 and d["steady"]["steps"] == 3 and d["steady"]["wall_s"] == pytest.approx(9.0)
    assert d["steady"]["phases"]["data"] == pytest.approx(1.8) and d["steady"]["phases"]["eval"] == pytest.approx(0.6)
    assert d["throughput"] == pytest.approx(24 / 9.0)
    assert d["verdict"] == "compute-bound"


@pytest.mark.timeout(120)
def test_lint_command_on_resnet18(tmp_path, capsys):
    assert main(["lint", "resnet18", "--input-shape", "1,3,32,32", "--json", str(tmp_path / "l.json")]) == 0
    d = json.loads((tmp_path / "l.json").read_text())
    assert d["model"] == "ResNet" and d["totals"]["flops"] > 5e7
    assert "unfused-bn" in [f["rule"] for f in d["findings"]]
    assert "Top 12 layers" in capsys.readouterr().out
    assert main(["lint", "not_a_model_xyz"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_doctor_writes_a_profiler_trace_and_python_hot_spots(script, tmp_path):
    out = tmp_path / "rep"
    assert main(["doctor", "--steps", "6", "--trace", "--cprofile", "--out", str(out), "--",
                 sys.executable, script, "forever"]) == 0
    d = json.loads((out / "doctor.json").read_text())
    trace = json.loads((out / "doctor-trace.json").read_text())
    assert d["trace"] == str(out / "doctor-trace.json") and trace["traceEvents"]
    assert d["hotspots"] and all(h["calls"] >= 1 for h in d["hotspots"])


def test_doctor_parent_does_not_import_torch():
    """Only the instrumented child pays for torch; the parent parses, waits and judges."""
    import subprocess

    code = ("import sys; from torchspeed.doctor.launch import build_payload, child_command; "
            "from torchspeed.doctor.output import print_profile; "
            "d = build_payload({}, ['python', 't.py'], 0); print_profile(d); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(120)
def test_a_busy_machine_is_named_beside_the_step_times_of_a_plain_run(script, tmp_path, monkeypatch):
    from torchspeed.measure import OthersLoad

    monkeypatch.setattr(OthersLoad, "cores", lambda self: 1.5)  # other processes held 1.5 cores meanwhile
    assert main(["doctor", "--steps", "3", "--no-memory", "--json", str(tmp_path / "d.json"), "--",
                 sys.executable, script, "forever"]) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["others_cores"] == 1.5
    assert any(e.startswith("the machine was busy: other processes used 1.5") for e in d["evidence"])
