import json
import threading
import types

import pytest
from helpers import another_process_spinning

from torchspeed.bench import budget, orchestration, suites


def _fake_suite(name, rows, keys):
    def run(quick, progress):
        progress("measuring")
        return {**keys, "rows": rows}
    return types.SimpleNamespace(TITLE=f"fake {name}", run=run)


def _broken_suite():
    def run(quick, progress):
        raise RuntimeError("the accelerator caught fire")
    return types.SimpleNamespace(TITLE="broken", run=run)


@pytest.fixture
def fake_suites(monkeypatch):
    fakes = {
        "data": _fake_suite("data", [
            {"technique": "baseline", "median": 100.0, "min": 90.0, "max": 110.0, "unit": "img/s", "ratio": 1.0,
             "cumulative": None, "metric_drop": None, "what": "torchvision ImageFolder"},
            {"technique": "torchspeed", "median": 600.0, "min": 580.0, "max": 610.0, "unit": "img/s", "ratio": 6.0,
             "cumulative": None, "metric_drop": None, "what": "packed store", "headline": True, "ceiling": "decode"},
            {"technique": "dali_cpu", "median": None, "min": None, "max": None, "unit": "img/s", "ratio": None,
             "cumulative": None, "metric_drop": None, "what": "skipped: dali not installed", "ceiling": "decode"},
        ], {"ratio_vs_tuned": 6.0, "limits": [
            {"goal": "data >= 60% of the decode-only ceiling", "measured": "600 img/s = 50% of 1,200", "met": False,
             "why": "decoding is 40% of each image's time"}]}),
        "train": _fake_suite("train", [
            {"technique": "plain", "median": 40.0, "min": 39.0, "max": 41.0, "unit": "samples/s", "ratio": 1.0,
             "cumulative": 1.0, "metric_drop": None, "what": "plain loop"},
            {"technique": "+ bf16", "median": 120.0, "min": 118.0, "max": 121.0, "unit": "samples/s", "ratio": 3.0,
             "cumulative": 3.0, "metric_drop": None, "what": "autocast", "ceiling": "bf16", "flops_per_item": 1e9},
        ], {"ratio": 3.0}),
        "infer": _fake_suite("infer", [
            {"technique": "eager fp32", "median": 140.0, "min": 135.0, "max": 150.0, "unit": "ms", "ratio": 1.0,
             "cumulative": None, "metric_drop": 0.0, "what": "baseline"},
            {"technique": "OpenVINO INT8", "median": 9.0, "min": 8.5, "max": 9.5, "unit": "ms", "ratio": 15.5,
             "cumulative": None, "metric_drop": 0.004, "what": "NNCF"},
        ], {"ratio": 15.5, "best_variant": "OpenVINO INT8"}),
        "compress": _broken_suite(),
        "ceilings": types.SimpleNamespace(TITLE="ceilings", run=lambda quick, progress: {
            "version": 1, "machine": {}, "measured_at": "2026-11-23 02:40 UTC", "load_avg_1min": 3.5,
            "source": "cache", "items": {
                "decode": {"value": 1200.0, "unit": "img/s", "route": "simplejpeg-fast", "what": "2 x 600"},
                "bf16": {"value": 240.0, "unit": "GFLOP/s", "route": "torch.mm", "what": "bf16 GEMM"}}}),
    }
    monkeypatch.setattr(suites, "load", lambda name: fakes[name])
    return fakes


def test_report_writes_every_file_and_survives_a_failing_suite(tmp_path, fake_suites):
    out = tmp_path / "report"
    results = orchestration.run_suites(["data", "train", "infer", "compress"], quick=True, out=str(out),
                                       json_path=str(tmp_path / "r.json"))
    data = json.loads((out / "results.json").read_text())
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert data["data"]["ratio_vs_tuned"] == 6.0 and data["train"]["ratio"] == 3.0
    assert data["infer"]["best_variant"] == "OpenVINO INT8"
    assert "accelerator caught fire" in data["compress"]["error"]
    report = (out / "report.md").read_text()
    assert "## Summary" in report and "This suite failed" in report and "accelerator caught fire" in report
    assert "| data | torchspeed | 600 img/s | 6.00x |" in report
    for png in ("data.png", "train_speedup.png", "infer_latency.png", "infer_accuracy_vs_latency.png"):
        blob = (out / png).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in report
    assert results["compress"]["error"].startswith("RuntimeError")
    # ceilings: measured first, every row that names one gets its % (a skipped peer row none), one plot per suite
    assert data["ceilings"]["items"]["decode"]["value"] == 1200.0
    rows = {r["technique"]: r for r in data["data"]["rows"]}
    assert rows["torchspeed"]["pct_of_ceiling"] == pytest.approx(50.0) and rows["torchspeed"]["achieved"] == 600.0
    assert rows["dali_cpu"]["pct_of_ceiling"] is None and "pct_of_ceiling" not in rows["baseline"]
    assert data["train"]["rows"][1]["pct_of_ceiling"] == pytest.approx(50.0)  # 120 samples/s x 1 GFLOP of 240
    assert "## Ceilings of this machine" in report and "| decode | 1,200 img/s | simplejpeg-fast |" in report
    assert "load average 3.5" in report and "read from this machine's cache" in report
    # each row against the ceiling of its own precision, achieved first
    assert "decode: 600 of 1,200 img/s (50%)" in report and "bf16: 120 of 240 GFLOP/s (50%)" in report
    assert "above 100%" not in report  # no footnote without a row above its ceiling
    assert all("others_cores" in data[n] for n in ("ceilings", "data", "train", "infer", "compress"))
    assert "## How close to the limits" in report and "decoding is 40% of each image's time" in report
    assert "skipped: dali not installed" in report
    for png in ("data_ceiling.png", "train_ceiling.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in report
    assert not (out / "infer_ceiling.png").exists()  # no infer row names a ceiling


def test_headline_defaults_to_largest_speedup():
    from torchspeed.bench.report import headline

    rows = [{"technique": "a", "ratio": 1.0}, {"technique": "b", "cumulative": 2.5}, {"technique": "c", "ratio": 2.0}]
    assert headline({"rows": rows}).technique == "b"
    rows[2]["headline"] = True
    assert headline({"rows": rows}).technique == "c"


def test_unknown_suite_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown benchmark suite 'gpu'"):
        suites.load("gpu")


def test_every_suite_and_the_ceilings_load_by_name():
    for name in (*suites.SUITE_NAMES, "ceilings"):
        module = suites.load(name)
        assert module.TITLE and callable(module.run), name


def test_the_published_report_renders_again_from_its_results(tmp_path):
    """docs/report/results.json, written by an earlier version (no `others_cores`), renders through the typed
    rows: every suite's section and every row, design kept out of the Summary, no busy line without a load."""
    import shutil
    from pathlib import Path

    from rich.console import Console

    docs = Path(__file__).resolve().parents[1] / "docs" / "report"
    shutil.copy(docs / "results.json", tmp_path / "results.json")
    results = orchestration.render_report(str(tmp_path), Console(quiet=True))
    report = (tmp_path / "report.md").read_text()
    summary = report.split("## Summary", 1)[1].split("## Ceilings", 1)[0]
    assert "| design |" not in summary and "Not in the summary (design)" in summary
    assert "busy machine" not in report
    for name in [n for n in suites.SUITE_NAMES if n in results]:  # a suite added since is not in it
        assert f"## {name}:" in report
        for row in results[name]["rows"]:
            assert f"| {row['technique'].strip()} |" in report or row["technique"].strip() in report


class _WatchdogFromTheFirstLine(types.ModuleType):
    """`threading` for orchestration, whose watchdog Timer counts its interval from the suite's first
    progress line (`said`) instead of from the child's start: how long a busy machine takes to start Python
    and import the suite is not what is tested; that a suite hung after it started is ended, is."""

    def __init__(self, said):
        super().__init__("threading")
        self.said = said

    def __getattr__(self, name):
        return getattr(threading, name)

    def Timer(self, interval, function):  # noqa: N802 - threading's name
        said, cancelled = self.said, threading.Event()

        def run():
            if said.wait(120) and not cancelled.wait(interval):
                function()

        return types.SimpleNamespace(daemon=True, start=lambda: threading.Thread(target=run, daemon=True).start(),
                                     cancel=cancelled.set)


def test_a_hung_suite_is_ended_and_reported(tmp_path, monkeypatch):
    """A suite whose process hangs (a deadlocked loader worker) is killed with its workers after the timeout."""
    import os
    import time

    from rich.console import Console

    pkg = tmp_path / "hungsuites"
    pkg.mkdir()
    (pkg / "ts_fake_hung_suite.py").write_text(
        "import os, time\nTITLE = 'hangs'\n\ndef run(quick, progress):\n    progress('about to hang')\n"
        "    if os.fork() == 0:\n        time.sleep(600)\n    time.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pkg), os.environ.get("PYTHONPATH")])))
    seen, said = [], threading.Event()
    monkeypatch.setattr(orchestration, "threading", _WatchdogFromTheFirstLine(said))
    t0 = time.perf_counter()
    result, _ = orchestration.run_in_child("data", "ts_fake_hung_suite", True,
                                           lambda line: (seen.append(line), said.set()), Console(quiet=True),
                                           timeout_s=3)
    assert time.perf_counter() - t0 < 120  # a generous bound: a busy machine starts the child slowly
    assert "still running after 3 s" in result["error"] and "hung" in result["error"]
    assert seen == ["about to hang"]
    assert orchestration.hang_timeout(60) > 60


def test_a_suite_ends_with_the_bench_that_started_it(tmp_path):
    """A `torchspeed bench` killed outright (SIGKILL: no handler runs) leaves no suite process behind holding the
    cores: the suite, in its own session, ends its process group once its parent is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pkg = tmp_path / "orphans"
    pkg.mkdir()
    pid_file = tmp_path / "suite.pid"
    (pkg / "ts_fake_long_suite.py").write_text(
        "import os, time\nTITLE = 'long'\n\ndef run(quick, progress):\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    time.sleep(600)\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rich.console import Console; "
         "from torchspeed.bench import orchestration as o; "
         "o.run_in_child('data', 'ts_fake_long_suite', True, print, Console(quiet=True))"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pkg), os.environ.get("PYTHONPATH")]))})
    try:
        deadline = time.monotonic() + 120  # a generous bound: a busy machine starts both processes slowly
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the suite never started"
            time.sleep(0.2)
        suite_pid = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(suite_pid, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{suite_pid}/stat") as f:  # a zombie left for init to reap has ended too
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.2)
        else:
            os.kill(suite_pid, signal.SIGKILL)
            raise AssertionError("the suite kept running after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_ceilings_are_read_from_the_cache_in_quick_mode_unless_refreshed(tmp_path, monkeypatch):
    seen = {}

    def ceilings_run(quick, progress):
        seen["ceilings_quick"] = quick
        return {"version": 1, "machine": {}, "items": {"decode": {"value": 100.0, "unit": "img/s"}}}

    def data_run(quick, progress):
        seen["data_quick"] = quick
        return {"rows": [{"technique": "torchspeed", "median": 50.0, "unit": "img/s", "ceiling": "decode"}]}

    fakes = {"ceilings": types.SimpleNamespace(TITLE="c", run=ceilings_run), "data": types.SimpleNamespace(TITLE="d", run=data_run),
             "design": types.SimpleNamespace(TITLE="g", run=lambda quick, progress: {"rows": []})}
    monkeypatch.setattr(suites, "load", lambda name: fakes[name])
    orchestration.run_suites(["data"], quick=True, out=str(tmp_path / "a"))
    assert seen == {"ceilings_quick": True, "data_quick": True}
    results = orchestration.run_suites(["data"], quick=True, out=str(tmp_path / "b"), refresh_ceilings=True)
    assert seen == {"ceilings_quick": False, "data_quick": True}
    assert results["data"]["rows"][0]["pct_of_ceiling"] == 50.0
    orchestration.run_suites(["design"], quick=True, out=str(tmp_path / "c"))  # no suite judged against a ceiling
    assert "ceilings" not in json.loads((tmp_path / "c" / "results.json").read_text())


def test_rows_above_their_ceiling_carry_one_footnote_and_accuracy_stays_out_of_the_median():
    from torchspeed.bench.ceilings import ABOVE_CEILING_NOTE
    from torchspeed.bench.report import suite_table, summary_rows

    rows = [
        {"technique": "fast", "median": 10.0, "unit": "ms", "batch": 8, "ceiling": "bf16", "achieved": 330.0,
         "pct_of_ceiling": 137.5, "what": "a"},
        {"technique": "faster", "median": 9.0, "unit": "ms", "batch": 8, "ceiling": "bf16", "achieved": 360.0,
         "pct_of_ceiling": 150.0, "what": "b"},
        {"technique": "student", "median": 0.579, "min": 0.566, "max": 0.598, "unit": "top-1", "metric_drop": 0.074,
         "what": "distilled"},
    ]
    table = suite_table({"rows": rows})
    assert "bf16: 330 of 240 GFLOP/s (138%*)" in table and "bf16: 360 of 240 GFLOP/s (150%*)" in table
    assert table.count(ABOVE_CEILING_NOTE) == 1
    student = next(line for line in table.splitlines() if line.startswith("| student |"))
    assert student.startswith("| student |  |  |") and "top-1 0.579 (0.566-0.598); drop 0.074" in student
    results = {"design": {"rows": [{"technique": "G4", "median": 7.0, "unit": "ms", "ratio": 1.1, "headline": True}]},
               "data": {"error": ""}, "compress": {"rows": rows[2:]}}
    summary = summary_rows(results)
    assert [r[0] for r in summary] == ["data"]  # design left out; a suite with no speed-up row has no line
    assert summary[0][:3] == ("data", "failed", "(no message)")  # an empty error message still reports


@pytest.mark.skipif(not __import__("os").path.exists("/proc/stat"), reason="needs Linux /proc")
@pytest.mark.real_load
def test_a_suite_measured_beside_a_busy_process_is_named(tmp_path, monkeypatch):
    import time

    from rich.console import Console

    def run(quick, progress):
        time.sleep(1.0)
        return {"rows": [{"technique": "torchspeed", "median": 50.0, "unit": "img/s", "ratio": 2.0}]}

    monkeypatch.setattr(suites, "load", lambda name: types.SimpleNamespace(TITLE="d", run=run))
    with another_process_spinning():
        results = orchestration.run_suites(["compress"], quick=True, out=str(tmp_path), console=Console(quiet=True))
    assert results["compress"]["others_cores"] > 0.5  # the loop alone uses about one core
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["compress"]["others_cores"] == results["compress"]["others_cores"]
    report = (tmp_path / "report.md").read_text()
    assert "Measured on a busy machine" in report and "- compress: the machine was busy" in report
    assert "**Note:** the machine was busy" in report.split("## compress:", 1)[1]


def _console(width=80):
    import io

    from rich.console import Console

    return Console(width=width, record=True, file=io.StringIO(), color_system=None)


def test_the_console_reads_at_80_columns_with_the_summary_first(tmp_path, fake_suites):
    """The plan first (every part with its budget), a line per phase, then the summary (a line per suite: its
    figure, speed-up, share of the ceiling, the machine quiet or not) and where the report is; the suites'
    tables stay in the report unless asked for. No line is wider than the console."""
    con = _console(80)
    orchestration.run_suites(["data", "train", "infer", "compress"], quick=True, out=str(tmp_path / "r"), console=con)
    text = con.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert lines[0].startswith("torchspeed bench --quick: 5 parts, about")
    assert [line.split()[0] for line in lines[1:6]] == ["ceilings", "data", "train", "infer", "compress"]
    summary = next(i for i, line in enumerate(lines) if line.startswith("Summary"))
    report = next(i for i, line in enumerate(lines) if line.startswith("Full report:"))
    assert summary < report and str(tmp_path / "r" / "report.md") in "".join(lines[report:])
    assert "data done in" in text and "train done in" in text and "suite compress failed" in text
    data_line = next(line for line in lines[summary:] if "600 img/s" in line)
    assert "6.00x" in data_line and "50% decode" in data_line and ("quiet" in data_line or "busy:" in data_line)
    assert not any(line.strip() == "baseline" for line in lines)  # the tables are the report's
    assert "measuring" in text  # the suites' progress, as lines where the output is not a terminal

    con = _console(80)
    orchestration.render_report(str(tmp_path / "r"), con, verbose=True)
    lines = con.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    summary = next(i for i, line in enumerate(lines) if line.startswith("Summary"))
    tables = next(i for i, line in enumerate(lines) if line.strip() == "baseline")  # the data table, a row a block
    assert summary < tables and lines[tables + 2].strip() == "torchspeed"  # with --verbose: after the summary


def test_the_plan_is_printed_before_torch_is_imported(tmp_path):
    """Progress from the first second: `torchspeed bench` prints its plan before loading torch (seconds)."""
    import subprocess
    import sys

    code = ("import sys, io\nfrom rich.console import Console\nfrom torchspeed.bench import budget, orchestration\n"
            "con = Console(width=80, file=io.StringIO(), record=True)\n"
            "todo = ['ceilings', 'data', 'train']\n"
            "orchestration.print_plan(todo, {n: budget.seconds_for(n, True) for n in todo}, True, con)\n"
            "assert 'torch' not in sys.modules, 'torch imported before the plan'\n"
            "print(con.export_text())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "data" in out.stdout and f"{budget.seconds_for('train', True):.0f} s" in out.stdout


def test_a_first_run_prepares_the_shared_data_before_the_suites(tmp_path, monkeypatch):
    """What the suites share (here the demo photos of a fake preparation module) is built once, before the
    suites, in its own process, and named in the report; a step that fails leaves the suites to build it."""
    import os

    pkg = tmp_path / "prep"
    pkg.mkdir()
    (pkg / "ts_fake_prepare.py").write_text(
        "def ready():\n    return {'demo photos': False, 'demo model': False}\n\n"
        "def prepare_photos(quick, progress):\n    progress('generating photos')\n    return {'images': 3}\n\n"
        "def prepare_model(quick, progress):\n    raise RuntimeError('no model today')\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pkg), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(orchestration, "PREPARE_MODULE", "ts_fake_prepare")
    seen = []

    def run(quick, progress):
        seen.append("compress")
        return {"rows": [{"technique": "pruned", "median": 5.0, "unit": "ms", "ratio": 2.0, "headline": True}]}

    # a suite that needs the photos and the model (judged by its module name) and one that needs neither
    compress = types.SimpleNamespace(__name__="torchspeed.bench.suites.compress", TITLE="c", run=run)
    design = types.SimpleNamespace(TITLE="d", run=lambda quick, progress: {"rows": [], "holds": {"G1": True}})
    monkeypatch.setattr(suites, "load", lambda name: {"compress": compress, "design": design}[name])
    con = _console(80)
    results = orchestration.run_suites(["compress", "design"], quick=True, out=str(tmp_path / "r"), console=con)
    text = con.export_text()
    assert results["prepared"]["demo photos"]["images"] == 3 and "no model today" in results["prepared"]["demo model"]["error"]
    assert seen == ["compress"] and results["compress"]["rows"][0]["ratio"] == 2.0
    assert text.index("demo photos ready in") < text.index("compress done in")
    assert "generating photos" in text and "demo model failed" in text
    assert "1 of 1 rules hold" in text  # the design suite's summary line
    assert "First run on this machine" in (tmp_path / "r" / "report.md").read_text()
    assert orchestration.preparations(["design"], {"design": design}, False) == []  # nothing to build for it


def test_busy_ceilings_are_named_on_the_console_and_judge_no_goal(tmp_path, fake_suites):
    fake_suites["ceilings"] = types.SimpleNamespace(TITLE="ceilings", run=lambda quick, progress: {
        "version": 2, "machine": {}, "measured_at": "now", "source": "measured", "busy_cores": 1.5,
        "items": {"decode": {"value": 1200.0, "unit": "img/s"}}})
    con = _console(80)
    orchestration.run_suites(["data"], quick=True, out=str(tmp_path), console=con)
    text = con.export_text()
    assert "other processes used 1.5 cores" in text and "50% decode (busy)" in text
    report = (tmp_path / "report.md").read_text()
    assert "**Busy ceilings:**" in report and "decode: 600 of 1,200 img/s (50%, busy ceiling)" in report
    assert "not judged: busy ceiling" in report.split("## How close to the limits", 1)[1]


def test_a_part_over_its_budget_is_named_under_the_summary():
    from torchspeed.bench.report import over_budget

    assert over_budget({"seconds": 100.0, "budget_s": 40}) and not over_budget({"seconds": 45.0, "budget_s": 40})
    assert not over_budget({"seconds": 100.0})  # an earlier results.json without budgets
    results = {"train": {"rows": [{"technique": "auto", "median": 90.0, "unit": "samples/s", "cumulative": 2.2}],
                         "seconds": 100.0, "budget_s": 40, "others_cores": 1.5},
               "data": {"rows": [], "seconds": 30.0, "budget_s": 40, "others_cores": 0.0}}
    con = _console(80)
    orchestration.print_summary(results, con)
    text = con.export_text()
    assert "Over their time budget: train 100 s of 40" in text and "data 30 s" not in text
    train = next(line for line in text.splitlines() if line.startswith("│ train"))
    assert "90 samples/s" in train and "2.20x" in train and "busy: 1.5 cores" in train


def test_cut_share_keeps_the_quick_report_to_its_target():
    assert budget.cut_share(300, fixed_s=100, spent_s=50, target_s=540) == 1.0  # time enough
    assert budget.cut_share(300, fixed_s=100, spent_s=290, target_s=540) == 0.5  # 150 s left for 300 s of budgets
    assert budget.cut_share(300, fixed_s=100, spent_s=200, target_s=540) == pytest.approx(0.8)
    assert budget.cut_share(300, fixed_s=100, spent_s=500, target_s=540) == budget.QUICK_FLOOR  # never below it
    assert budget.cut_share(0, fixed_s=100, spent_s=500, target_s=540) == 1.0


def test_a_slow_first_run_cuts_the_suites_budgets_so_the_quick_report_ends_in_time(tmp_path, monkeypatch):
    """Where preparing took so long that the suites' shares would end the report after its target, the
    suites that take a budget are given a cut one (in a child process, through the variable that overrides
    a budget), said once on the console; the others run as they are; with time enough nothing is cut."""
    given = {}

    def data_run(quick, progress, budget_s=None):
        given["data"] = budget_s
        return {"rows": []}

    def infer_run(quick, progress):  # fixed work: takes no budget
        given["infer"] = "ran"
        return {"rows": []}

    fakes = {"data": types.SimpleNamespace(TITLE="d", run=data_run),
             "infer": types.SimpleNamespace(TITLE="i", run=infer_run),
             "ceilings": types.SimpleNamespace(TITLE="c", run=lambda quick, progress: {"source": "cache", "items": {}})}
    monkeypatch.setattr(suites, "load", lambda name: fakes[name])
    monkeypatch.delenv(budget.ENV, raising=False)
    con = _console(80)
    orchestration.run_suites(["data", "infer"], quick=True, out=str(tmp_path / "a"), console=con)
    assert given == {"data": None, "infer": "ran"} and "budgets cut to" not in con.export_text()
    monkeypatch.setattr(budget, "QUICK_TARGET_S", 0.0)  # the preparation took all the time there was
    con = _console(80)
    results = orchestration.run_suites(["data", "infer"], quick=True, out=str(tmp_path / "b"), console=con)
    lines = con.export_text().splitlines()
    text = " ".join(" ".join(lines).split())
    assert given["data"] == budget.seconds_for("data", True) * budget.QUICK_FLOOR
    assert results["data"]["budget_s"] == given["data"] and results["infer"]["budget_s"] == budget.seconds_for("infer", True)
    assert text.count(f"budgets cut to {budget.QUICK_FLOOR:.0%}") == 1
    assert max(len(line) for line in lines) <= 80
    assert orchestration._child_env(12.5)[budget.ENV] == "12.5" and budget.ENV not in orchestration._child_env()
