"""The orchestration of `torchspeed bench`: run the suites, keep going when one fails, collect their
JSON under the suite names, and write the report.

Each suite runs in its own Python process, so a native crash in one suite is reported as that suite's
failure while the others still run, and one suite's runtime thread pools cannot share the cores with
the next suite's timings. The parent writes `results.json` after every suite and renders the report
from it, as `render_report(DIR)` (`torchspeed bench --report-only DIR`) does again.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from rich.console import Console

from torchspeed.atomic import write_json
from torchspeed.measure import OthersLoad, wait_for_quiet_machine
from torchspeed.bench import suites
from torchspeed.bench.ceilings import ABOVE_CEILING_NOTE, annotate, ceiling_cell
from torchspeed.bench.budget import seconds_for
from torchspeed.bench.rows import rows_of
from torchspeed.tables import print_table

RESULTS = "results.json"
QUIET_WAIT_S = 5.0  # before each suite, the most it waits for other processes to leave the cores
_MARK = "\x1etorchspeed-bench-progress:"  # a progress line on the child's stdout


def run_suites(names: Sequence[str], quick: bool = False, out: str = "torchspeed-report",
               json_path: str | None = None, console: Console | None = None,
               command: str = "torchspeed bench", refresh_ceilings: bool = False) -> dict[str, Any]:
    """Run each suite in turn, each in its own process (a suite given as an object that is not a module runs
    in this one); a failing or crashing suite is recorded with its error and the others still run. Writes
    `results.json` (after each suite; `json_path` at the end), `report.md` and the plots into `out`. The
    ceilings come first when suites judged against them run: from the cache in quick mode unless
    `refresh_ceilings`, measured again (keeping the best) otherwise."""
    from torchspeed.runtime import describe, describe_line

    console = console or Console()
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the report directory {out!r}: {e.strerror}") from None
    machine = describe()
    console.print(f"[bold]Machine:[/] {describe_line(machine)}")
    results: dict[str, Any] = {"machine": machine, "quick": quick, "command": command}
    todo = list(names)
    if any(n in suites.UNDER_CEILINGS for n in todo):  # measured (or read from the cache) before the suites
        todo.insert(0, "ceilings")
    modules = {n: suites.load(n) for n in todo}
    expected = {n: seconds_for(n, quick) for n in todo}
    start = time.perf_counter()
    results_path = os.path.join(out, RESULTS)
    try:
        for i, name in enumerate(todo, 1):
            mode = quick and not (name == "ceilings" and refresh_ceilings)  # the ceilings measure in full mode
            results[name], title = _run_suite(name, modules[name], mode, console, f"[{i}/{len(todo)}]",
                                              expected[name], sum(expected[n] for n in todo[i:]))
            if name == "ceilings":
                print_ceilings(results[name], console)
                continue
            annotate({name: results[name]}, results.get("ceilings"))
            print_suite(name, results[name], console, title)
            write_json(results_path, results)  # after each suite: a crash later keeps the rest
    except KeyboardInterrupt:
        results["interrupted"] = True
        write_json(results_path, results)
        console.print(f"[red]interrupted:[/] the finished suites are in {results_path}; "
                      f"the report of those: torchspeed bench --report-only {out}")
        raise
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_json(results_path, results)
    if json_path:
        write_json(json_path, results)
    render_report(out, console, command=command)  # from the file, as --report-only does
    return results


def _run_suite(name: str, module: Any, quick: bool, console: Console, step: str, budget_s: float,
               left_after: float) -> tuple[dict[str, Any], str]:
    """One suite (or the ceilings) under a live status line: (its JSON, with its seconds and budget, and its
    title). `step` is "[i/n]"; `left_after` the budget of the suites still to come, for the time-left estimate."""
    title = getattr(module, "TITLE", name)
    with console.status(f"{step} {name}: waiting for a quiet machine (a few seconds at most)"):
        quiet = wait_for_quiet_machine(max_s=QUIET_WAIT_S)  # the previous suite's processes, or others, leave the cores
    t0 = time.perf_counter()
    load = OthersLoad()  # other processes' use of the cores while the suite (and its process) runs
    with console.status(f"{step} {name}: starting") as status:
        def progress(text: str) -> None:
            elapsed = time.perf_counter() - t0
            left = max(budget_s - elapsed, 0) + left_after
            status.update(f"{step} {name}: {text}  ({elapsed:.0f} s in suite, ~{left / 60:.1f} min left)")

        if isinstance(module, ModuleType):
            result, title = run_in_child(name, module.__name__, quick, progress, console, title,
                                         timeout_s=hang_timeout(budget_s))
        else:
            result = _run_here(module, quick, progress)
    if "error" in result:
        console.print(f"[red]suite {name} failed:[/] {result['error']}", highlight=False)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["budget_s"] = budget_s
    others = load.cores()
    result["others_cores"] = round(others, 2) if others is not None else None
    result["quiet_wait"] = {"waited_s": round(quiet.waited_s, 1),
                            "others_cores": round(quiet.others_cores, 2) if quiet.others_cores is not None else None}
    return result, title


def _run_here(module: Any, quick: bool, progress: Callable[[str], None]) -> dict[str, Any]:
    try:
        return module.run(quick=quick, progress=progress)
    except Exception as e:  # noqa: BLE001 - one suite's failure must not lose the others
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _death(status: int) -> str:
    """Why a child process ended, in words."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return (f"the suite's process was killed by {name} (signal {-status}) before it reported: a native crash "
                "(the faulthandler trace above says where) or the system ran out of memory")
    return f"the suite's process exited with status {status} before it reported (its error output is above)"


def _child_env() -> dict[str, str]:
    # torch.profiler's Kineto logs every start/stop (and, on a CUDA build without a GPU, an ERROR line) to
    # the console; the report has its own progress lines. Level 6, above USDT (5): Kineto prints nothing; a
    # user's own setting wins. PYTHONFAULTHANDLER: a native crash in the child prints where it happened.
    return {"KINETO_LOG_LEVEL": "6", **os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}


def hang_timeout(budget_s: float) -> float:
    """Seconds after which a suite's process is taken for hung and ended: far beyond its budget (first runs
    build the demo photos and model too), so only a deadlock reaches it."""
    return 4 * budget_s + 600


def run_in_child(name: str, module_name: str, quick: bool, progress: Callable[[str], None], console: Console,
                 title: str = "", timeout_s: float | None = None) -> tuple[dict[str, Any], str]:
    """Run the suite module `module_name` in a fresh Python process: (its JSON, its title). Its progress
    lines drive `progress`, its other output is passed on; a child that dies (a signal, an exit without a
    report) gives a result whose "error" says how; one still running after `timeout_s` (hung: e.g. a
    deadlocked worker process) is killed with its process group and reported as such."""
    import threading

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tmp = tempfile.mkdtemp(prefix=f"torchspeed-bench-{name}-")
    result_path = os.path.join(tmp, "suite.json")
    code = (f"import sys; sys.path.append({root!r}); "
            "from torchspeed.bench.orchestration import child_main; child_main()")
    argv = [sys.executable, "-c", code, module_name, name, result_path, "quick" if quick else "full"]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, errors="replace", env=_child_env(),
                                start_new_session=True)
        timed_out = threading.Event()

        def kill_hung() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the suite and its loader workers
            except OSError:
                pass

        watchdog = threading.Timer(timeout_s, kill_hung) if timeout_s else None
        if watchdog:
            watchdog.daemon = True
            watchdog.start()
        try:
            status = _follow(proc, progress, console)
        except BaseException:  # Ctrl-C: pass it on to the child (its own session), give it a moment, then end it
            if watchdog:
                watchdog.cancel()
            _interrupt(proc)
            raise
        if watchdog:
            watchdog.cancel()
        if timed_out.is_set():
            return {"error": f"the suite's process was still running after {timeout_s:.0f} s (far beyond its "
                             "budget) and was ended as hung: a deadlocked worker process or runtime; its last "
                             "progress line above says where"}, title
        return _child_result(result_path, status, title)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _follow(proc: subprocess.Popen, progress: Callable[[str], None], console: Console) -> int:
    """The child's output until it exits (progress lines to `progress`, the rest printed); its exit status."""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(_MARK):
            progress(line[len(_MARK):])
        else:
            console.print(line, markup=False, highlight=False)
    return proc.wait()


def _interrupt(proc: subprocess.Popen) -> None:
    """SIGINT to the child's process group, up to 10 s to finish, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()


def _child_result(result_path: str, status: int, title: str) -> tuple[dict[str, Any], str]:
    """What the child wrote (its JSON and title), or an error saying how it died without writing it."""
    try:
        with open(result_path, encoding="utf-8") as f:
            payload = json.load(f)
    except (FileNotFoundError, ValueError):
        payload = None
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), dict):
        return {"error": _death(status)}, title
    result = payload["result"]
    if status != 0 and "error" not in result:
        note = f"the suite reported its results, then its process ended badly: {_death(status)}"
        result["notes"] = [*result.get("notes", []), note]
    return result, payload.get("title") or title


def child_main(argv: Sequence[str] | None = None) -> None:
    """The child side of `run_in_child`: argv is MODULE NAME RESULT_PATH quick|full."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()
    module_name, name, result_path, mode = list(argv if argv is not None else sys.argv[1:])

    def progress(text: str) -> None:
        sys.stdout.write(_MARK + " ".join(str(text).split("\n")) + "\n")
        sys.stdout.flush()

    title = name
    try:
        module = importlib.import_module(module_name)
        title = getattr(module, "TITLE", name)
        result = module.run(quick=mode == "quick", progress=progress)
        if not isinstance(result, dict):
            raise TypeError(f"suite {name} returned {type(result).__name__}, not a dict")
    except Exception as e:  # noqa: BLE001 - recorded as the suite's failure
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    write_json(result_path, {"title": title, "result": result})


def read_results(out: str) -> dict[str, Any]:
    """`out/results.json` as written by `run_suites`; one clear error naming the file otherwise."""
    path = os.path.join(out, RESULTS)
    if not os.path.isdir(out):
        raise FileNotFoundError(f"report directory {out!r} does not exist")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{out!r} holds no {RESULTS}: run `torchspeed bench --out {out}` first")
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"{path!r} is damaged (not valid JSON: {str(e).splitlines()[0][:160]})") from None
    if not isinstance(results, dict) or not isinstance(results.get("machine"), dict):
        raise ValueError(f"{path!r} is not a torchspeed bench results file (no 'machine' record)")
    return results


def render_report(out: str, console: Console | None = None, command: str | None = None) -> dict[str, Any]:
    """Write `out/report.md` and the plots from `out/results.json` and print the summary; returns the results."""
    from torchspeed.bench.report import busy_lines, summary_rows, write_report

    console = console or Console()
    results = read_results(out)
    summary = summary_rows(results)
    report = write_report(results, out, command=command or results.get("command") or "torchspeed bench")
    print_table("Summary: speed-up of each technique over plain PyTorch on this machine",
                ["suite", "technique", "measured", "speed-up", "accuracy", "achieved of ceiling"], summary, console)
    if any("%*)" in row[-1] for row in summary):
        console.print(ABOVE_CEILING_NOTE, highlight=False, markup=False)
    for line in busy_lines(results):
        console.print(f"[yellow]busy machine:[/] {line}", highlight=False)
    took = f" ({results['seconds'] / 60:.1f} min)" if results.get("seconds") is not None else ""
    console.print(f"report: {report}{took}")
    return results


def print_suite(name: str, result: dict[str, Any], console: Console, title: str | None = None) -> None:
    """A suite's table on the console, as it finishes."""
    if "error" in result:
        return
    rows = [(r.technique, r.median, r.unit, r.ratio, r.cumulative, r.metric_drop, ceiling_cell(r))
            for r in rows_of(result)]
    if title is None:
        title = getattr(suites.load(name), "TITLE", name)
    print_table(title, ["technique", "median", "unit", "ratio", "cumulative", "metric drop", "achieved of ceiling"], rows,
                console)


def print_ceilings(result: dict[str, Any], console: Console) -> None:
    """The machine's ceilings on the console, before the suites judged against them."""
    if "error" in result:
        return
    from torchspeed.bench.ceilings import ceiling_rows

    print_table(f"Ceilings of this machine ({result.get('source', '')}, measured {result.get('measured_at', '?')})",
                ["ceiling", "value", "route", "what"], ceiling_rows(result), console)
