"""The command line when things go wrong: a bench suite that crashes natively still leaves the report, a
missing or damaged results file is named, Ctrl-C exits 130 keeping what finished, doctor's --timeout exits
124 with one clear line, and an interpreter without torch is named."""
from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import types

import pytest

from torchspeed.bench import orchestration, suites
from torchspeed.cli import main

OK_SUITE = '''
TITLE = "fake data suite"

def run(quick, progress):
    progress("measuring\\nthings")
    return {"ratio": 2.0, "rows": [
        {"technique": "baseline", "median": 100.0, "min": 90.0, "max": 110.0, "unit": "img/s", "ratio": 1.0},
        {"technique": "torchspeed", "median": 200.0, "min": 190.0, "max": 210.0, "unit": "img/s", "ratio": 2.0,
         "headline": True}]}
'''

SEGV_SUITE = '''
import os, signal
TITLE = "a suite whose runtime segfaults"

def run(quick, progress):
    progress("about to crash")
    os.kill(os.getpid(), signal.SIGSEGV)
'''


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")


@pytest.fixture
def crashing_suites(tmp_path, monkeypatch):
    """'design' kills its own process with SIGSEGV, every other suite is a fine one and the ceilings are
    an empty set. 'data' and 'design' are real modules, so each runs in its own process as the real suites
    do; the other fine suites run in this process (a fresh interpreter each would only cost seconds)."""
    pkg = tmp_path / "fakesuites"
    pkg.mkdir()
    (pkg / "ts_fake_ok_suite.py").write_text(OK_SUITE)
    (pkg / "ts_fake_segv_suite.py").write_text(SEGV_SUITE)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pkg), os.environ.get("PYTHONPATH")])))
    import importlib

    ok = importlib.import_module("ts_fake_ok_suite")
    fakes = {name: types.SimpleNamespace(TITLE=ok.TITLE, run=ok.run) for name in suites.SUITE_NAMES}
    fakes["data"] = ok
    fakes["design"] = importlib.import_module("ts_fake_segv_suite")
    fakes["ceilings"] = types.SimpleNamespace(TITLE="ceilings", run=lambda quick, progress: {"items": {}})
    monkeypatch.setattr(suites, "load", lambda name: fakes[name])
    return fakes


# bench: a crashed suite, a damaged results file


def test_a_suite_that_segfaults_still_leaves_the_report(tmp_path, crashing_suites, capfd):
    out = tmp_path / "report"
    assert main(["bench", "--quick", "--out", str(out)]) == 1
    captured = capfd.readouterr()
    assert "Fatal Python error: Segmentation fault" in captured.err  # faulthandler reached the child
    assert "design failed" in captured.out and "SIGSEGV" in captured.out
    data = json.loads((out / "results.json").read_text())
    assert data["data"]["ratio"] == 2.0 and data["data"]["rows"][1]["technique"] == "torchspeed"
    assert "SIGSEGV" in data["design"]["error"]
    report = (out / "report.md").read_text()
    assert "| data | torchspeed | 200 img/s | 2.00x |" in report
    assert "This suite failed" in report and "SIGSEGV" in report
    assert (out / "data.png").read_bytes()[:4] == b"\x89PNG"
    assert not [f for f in os.listdir(out) if f.startswith(".")]  # no temporaries

    # the report renders again from results.json alone, in a fresh command
    os.unlink(out / "report.md")
    os.unlink(out / "data.png")
    assert main(["bench", "--report-only", str(out)]) == 0
    assert (out / "report.md").read_text() == report
    assert (out / "data.png").exists()


def test_report_only_names_a_missing_or_damaged_results_file(tmp_path, capsys):
    assert main(["bench", "--report-only", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "results.json" in err and str(tmp_path) in err and "Traceback" not in err
    (tmp_path / "results.json").write_text('{"machine": {"cpu": ')
    assert main(["bench", "--report-only", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "results.json" in err and "damaged" in err and "Traceback" not in err


# Ctrl-C


def test_ctrl_c_exits_130_and_keeps_finished_suites(tmp_path, monkeypatch, capsys):
    def done(quick, progress):
        return {"rows": [{"technique": "plain", "median": 1.0, "unit": "ms", "ratio": 1.0}]}

    def interrupted(quick, progress):
        raise KeyboardInterrupt

    fakes = {name: types.SimpleNamespace(TITLE=name, run=done) for name in suites.SUITE_NAMES}
    fakes["train"] = types.SimpleNamespace(TITLE="t", run=interrupted)
    fakes["ceilings"] = types.SimpleNamespace(TITLE="ceilings", run=lambda quick, progress: {"items": {}})
    monkeypatch.setattr(suites, "load", lambda name: fakes[name])
    out = tmp_path / "r"
    assert main(["bench", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    data = json.loads((out / "results.json").read_text())
    assert data["data"]["rows"][0]["technique"] == "plain" and data["interrupted"] is True
    assert main(["bench", "--report-only", str(out)]) == 0


def test_ctrl_c_before_any_suite_exits_130(monkeypatch):
    monkeypatch.setattr(orchestration, "run_suites", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert main(["bench", "--out", "x"]) == 130


# doctor: a script that never ends, an interpreter that cannot import torch


@pytest.mark.timeout(120)
def test_doctor_timeout_exits_124_with_one_clear_line(tmp_path, capfd):
    script = tmp_path / "forever.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    status = main(["doctor", "--timeout", "1", "--out", str(tmp_path / "rep"), "--", sys.executable, str(script)])
    captured = capfd.readouterr()
    assert status == 124
    assert "--timeout 1 s" in captured.out
    assert "Traceback" not in captured.err and "bootstrap.py" not in captured.err, captured.err
    assert json.loads((tmp_path / "rep" / "doctor.json").read_text())["status"] == "timeout"


def test_doctor_names_an_interpreter_without_torch(tmp_path, capsys):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"  # a Python that cannot see the site-packages holding torch
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        exec {sys.executable} -I -S "$@"
        """))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    assert main(["doctor", "--", str(fake), str(script)]) == 2
    err = capsys.readouterr().err
    assert "cannot import torch" in err and str(fake) in err
    assert "killed?" not in err and "ModuleNotFoundError" not in err and len(err.strip().splitlines()) == 1


# --json: checked before the command runs


def _placeholder(action):
    """A value the argument accepts: its first choice, else the first of a few that its type parses."""
    if action.choices:
        return str(list(action.choices)[0])
    for text in ("1", "0.5", "1,1"):
        try:
            (action.type or str)(text)
            return text
        except Exception:  # noqa: BLE001 - argparse types raise their own errors
            continue
    raise AssertionError(f"no placeholder for {action.dest}")


def _commands_with_json():
    """(command, argv with a placeholder for each required argument) of every subcommand that takes --json."""
    import argparse

    from torchspeed.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for name, p in sub.choices.items():
        if not any(a.dest == "json" for a in p._actions):
            continue
        argv = [name]
        for a in p._actions:
            if a.required and a.option_strings:
                argv += [a.option_strings[0], _placeholder(a)]
        argv += [_placeholder(a) for a in p._actions if not a.option_strings and a.nargs != argparse.REMAINDER]
        found.append((name, argv))
    return found


def test_an_unwritable_json_path_fails_before_any_command_runs(tmp_path, monkeypatch, capsys):
    import torchspeed.cli as cli

    real_build = cli.build_parser

    def parser_whose_commands_never_run():
        import argparse

        parser = real_build()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for p in sub.choices.values():
            p.set_defaults(func=lambda args: pytest.fail(f"{args.command} ran before --json was checked"))
        return parser

    monkeypatch.setattr(cli, "build_parser", parser_whose_commands_never_run)
    blocked = tmp_path / "file.txt"
    blocked.write_text("not a folder")
    commands = _commands_with_json()
    assert {"optimize", "train", "pack", "doctor", "lint", "bench", "info"} <= {name for name, _ in commands}
    for name, argv in commands:
        assert main([*argv, "--json", str(blocked / "result.json")]) == 2, name
        err = capsys.readouterr().err
        assert "--json" in err and "cannot be written" in err and len(err.strip().splitlines()) == 1, (name, err)
        assert main([*argv, "--json", str(tmp_path)]) == 2, name
        assert "is a folder" in capsys.readouterr().err, name
    assert blocked.read_text() == "not a folder" and sorted(os.listdir(tmp_path)) == ["file.txt"]


# ----------------------------------------------------------------------------------------- numbers, limits, one line
@pytest.mark.parametrize("argv", [
    ["tune-loader", "demo", "--tune-seconds", "{}"],
    ["train", "--data", "demo", "--model", "resnet18", "--epochs", "1", "--lr", "{}"],
    ["select", "--candidates", "resnet18", "--input-shape", "1,3,32,32", "--budget-ms", "{}"],
], ids=["tune-seconds", "lr", "budget-ms"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "NaN", "1e999"])
def test_numeric_options_are_finite_and_positive(argv, value, capsys):
    """A measuring budget of nan or inf (`tune-loader --tune-seconds nan`) would never end: refused in one line."""
    with pytest.raises(SystemExit) as e:
        main([a.replace("{}", value) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert repr(value) in err and ("a measuring budget must be a positive number of seconds" in err
                                   if "--tune-seconds" in argv else "positive, finite number" in err), err


def test_the_api_refuses_non_finite_budgets_with_the_rule():
    from torchspeed.args import SECONDS_RULE, positive_number

    for bad in (float("nan"), float("inf"), -float("inf"), 0, -1.5, True, "1", None):
        with pytest.raises(ValueError, match=f"tune_seconds = .*: {SECONDS_RULE}"):
            positive_number(bad, "tune_seconds")
    assert positive_number(0.5, "tune_seconds") == 0.5 and positive_number(0, "x", zero=True) == 0.0
    with pytest.raises(ValueError, match="lr = nan: it must be a positive, finite number$"):
        positive_number(float("nan"), "lr", None)
    import torch

    import torchspeed as ts

    for bad in (float("nan"), float("inf")):  # the API's budgets: refused before anything is timed or built
        with pytest.raises(ValueError, match=f"min_time_s = {bad}: {SECONDS_RULE}"):
            ts.infer.optimize(torch.nn.Linear(4, 2), torch.randn(1, 4), min_time_s=bad, runtimes="torch")
        with pytest.raises(ValueError, match=f"min_time_s = {bad}: {SECONDS_RULE}"):
            ts.measure.time_callable(lambda: pytest.fail("timed"), min_time_s=bad, warmup=0)
        with pytest.raises(ValueError, match=f"cooldown_s = {bad}: {SECONDS_RULE}"):
            ts.measure.compare({"a": lambda: pytest.fail("timed")}, cooldown_s=bad, warmup=0)


def test_an_error_is_one_line_when_stderr_is_piped_and_columns_unset(tmp_path, monkeypatch, capsys):
    """An error is one unwrapped line when stderr is not a terminal and COLUMNS is unset."""
    monkeypatch.delenv("COLUMNS", raising=False)
    missing = tmp_path / ("a-folder-with-a-long-name-" * 4)
    assert main(["tune-loader", str(missing)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and len(err) > 100 and str(missing) in err, err


@pytest.mark.parametrize("raised, says", [
    (MemoryError(), "out of memory"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 120000000000 bytes."),
     "out of memory (DefaultCPUAllocator: can't allocate memory"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore text"), "out of memory (CUDA out of memory"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3456 vs 3424\nframe #0: ..."),
     "a file could not be written (. unexpected pos 3456 vs 3424): the disk is full"),
])
def test_running_out_of_memory_or_disk_is_one_line(monkeypatch, capsys, raised, says):
    """Wherever the command line writes or allocates, torch's RuntimeError for a full disk or an
    allocation that failed is one line saying what to do; any other RuntimeError keeps its traceback."""
    import torchspeed.cli.data as data_cli

    def fails(args):
        raise raised

    monkeypatch.setattr(data_cli, "run_tune_loader", fails)
    assert main(["tune-loader", "demo"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err
    monkeypatch.setattr(data_cli, "run_tune_loader", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["tune-loader", "demo"])
