"""The orchestration of `torchspeed bench`: run the suites, keep going when one fails, collect their
JSON under the suite names, and write the report.

Each suite runs in its own Python process, so a native crash in one suite is reported as that suite's
failure while the others still run, and one suite's runtime thread pools cannot share the cores with
the next suite's timings. The parent writes `results.json` after every suite and renders the report
from it, as `render_report(DIR)` (`torchspeed bench --report-only DIR`) does again.

A machine's first run builds what the suites share (the demo photos, the demo model) before them, each
in its own process like a suite, so that no suite's time budget pays for it (`PREPARE`).

The console reads at 80 columns as well as wider: the plan first, from the first second (each part
and its budget: this module imports torch only after printing it), then a line per phase (the
preparation, each suite as it starts and as it ends with its headline; a suite's own progress on a
live status line, or as lines where the output is not a terminal), then the summary, one line per
suite, and where the report is. Every suite's table is in the report; the console shows them too with
`verbose` or when it is at least `WIDE` columns wide.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.text import Text

from torchspeed.atomic import write_json
from torchspeed.bench import suites
from torchspeed.bench.budget import CACHED_S, ENV, PREPARE_S, QUICK_TARGET_S, cut_share, seconds_for
from torchspeed.bench.ceilings import ABOVE_CEILING_NOTE, annotate, busy_cores, ceiling_cell, ceiling_rows, load_cached
from torchspeed.bench.report import (IN_SHORT, WHAT, console_summary, over_budget, over_budget_parts, suite_cells,
                                     write_report)
from torchspeed.bench.rows import rows_of
from torchspeed.measure import OthersLoad, busy_warning, wait_for_quiet_machine
from torchspeed.tables import format_number, print_table

RESULTS = "results.json"
QUIET_WAIT_S = 5.0  # before each suite, the most it waits for other processes to leave the cores
WIDE = 150          # a console at least this wide shows every suite's table after the summary
_MARK = "\x1etorchspeed-bench-progress:"  # a progress line on the child's stdout
# One-off work of a machine's first run, done before the suites that need it and outside their budgets:
# step -> (the modules that need it, the function of PREPARE_MODULE that builds it, run like a suite)
PREPARE_MODULE = "torchspeed.bench.demo_model"
PREPARE = {
    "demo photos": (("torchspeed.bench.ceilings", "torchspeed.bench.suites.data", "torchspeed.bench.suites.train",
                     "torchspeed.bench.suites.infer", "torchspeed.bench.suites.compress"), "prepare_photos"),
    "demo model": (("torchspeed.bench.suites.infer", "torchspeed.bench.suites.compress"), "prepare_model"),
}


def run_suites(names: Sequence[str], quick: bool = False, out: str = "torchspeed-report",
               json_path: str | None = None, console: Console | None = None,
               command: str = "torchspeed bench", refresh_ceilings: bool = False,
               verbose: bool = False) -> dict[str, Any]:
    """Run each suite in turn, each in its own process (a suite given as an object that is not a module runs
    in this one); a failing or crashing suite is recorded with its error and the others still run. Writes
    `results.json` (after each suite; `json_path` at the end), `report.md` and the plots into `out`. The
    ceilings come first when suites judged against them run: from the cache in quick mode unless
    `refresh_ceilings`, measured again (keeping the best) otherwise. `verbose`: every suite's table on the
    console too, after the summary."""
    console = console or Console()
    began = time.perf_counter()
    todo = list(names)
    if any(n in suites.UNDER_CEILINGS for n in todo):  # measured (or read from the cache) before the suites
        todo.insert(0, "ceilings")
    expected = {n: seconds_for(n, quick) for n in todo}
    print_plan(todo, expected, quick, console)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the report directory {out!r}: {e.strerror}") from None
    from torchspeed.runtime import describe, describe_line

    machine = describe()
    console.print(Text(f"Machine: {describe_line(machine)}"))
    results: dict[str, Any] = {"machine": machine, "quick": quick, "command": command}
    modules = {n: suites.load(n) for n in todo}
    measuring = "ceilings" in todo and _measures_ceilings(machine, quick, refresh_ceilings)
    if "ceilings" in todo and not measuring:
        expected["ceilings"] = min(expected["ceilings"], CACHED_S["ceilings"])
    start = time.perf_counter()
    results_path = os.path.join(out, RESULTS)
    try:
        prepared = prepare(preparations(todo, modules, measuring), quick, console)
        if prepared:
            results["prepared"] = prepared
        budgeted = {n for n in todo if n != "ceilings" and _takes_a_budget(modules[n])}
        cut_said = False
        for i, name in enumerate(todo, 1):
            mode = quick and not (name == "ceilings" and refresh_ceilings)  # the ceilings measure in full mode
            budget_s, given, share = expected[name], None, 1.0
            if quick and name in budgeted and not os.environ.get(ENV):
                share = cut_share(sum(expected[n] for n in todo[i - 1:] if n in budgeted),
                                  sum(expected[n] for n in todo[i - 1:] if n not in budgeted),
                                  time.perf_counter() - began)
                if share < 1:
                    budget_s = given = expected[name] * share
                    if not cut_said:
                        _line(console, f"      budgets cut to {share:.0%}: {time.perf_counter() - began:.0f} s spent, "
                                       f"the report ends by {QUICK_TARGET_S / 60:.0f} min")
                        cut_said = True
            left_after = sum(expected[n] * (share if n in budgeted else 1.0) for n in todo[i:])
            results[name], title = _run_suite(name, modules[name], mode, console, f"[{i}/{len(todo)}]",
                                              budget_s, left_after, given)
            if name == "ceilings":
                _print_ceilings_line(results[name], console)
                continue
            annotate({name: results[name]}, results.get("ceilings"))
            _print_end_line(name, results[name], busy_cores(results.get("ceilings")) is not None, console)
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
    render_report(out, console, command=command, verbose=verbose)  # from the file, as --report-only does
    return results


# ---------------------------------------------------------------- the plan and the phases

def print_plan(todo: Sequence[str], expected: dict[str, float], quick: bool, console: Console) -> None:
    """What will be measured and how long each part may take, before anything is (and before torch loads)."""
    total = sum(expected.values())
    _line(console, f"torchspeed bench{' --quick' if quick else ''}: {len(todo)} parts, about {total / 60:.1f} min "
                   "(each part's budget:)", style="bold")
    for name in todo:
        _line(console, f"  {name:<9}{expected[name]:>4.0f} s  {IN_SHORT.get(name, '')}")


def _measures_ceilings(machine: dict[str, Any], quick: bool, refresh: bool) -> bool:
    """Whether the ceilings will be measured in this run (else read from this machine's cache)."""
    return not quick or refresh or load_cached(machine) is None


def preparations(todo: Sequence[str], modules: dict[str, Any], measuring_ceilings: bool) -> list[str]:
    """The one-off steps of `PREPARE` this run needs and the cache lacks (only the real suites need any)."""
    users = {getattr(modules[n], "__name__", None) for n in todo if n != "ceilings" or measuring_ceilings}
    steps = [step for step, (needers, _) in PREPARE.items() if users & set(needers)]
    if not steps:
        return []
    ready = importlib.import_module(PREPARE_MODULE).ready()
    return [step for step in steps if not ready.get(step)]


def prepare(steps: Sequence[str], quick: bool, console: Console) -> dict[str, Any]:
    """Build what the suites share before them, each step in its own process like a suite; a step that fails
    is reported and left to the suites (they build it themselves, inside their budgets)."""
    done: dict[str, Any] = {}
    if steps:
        about = sum(PREPARE_S.get(s, 60) for s in steps)
        _line(console, f"First run on this machine: about {about / 60:.1f} min more, to build what the suites share "
                       "(once, outside their budgets)")
    for i, step in enumerate(steps, 1):
        budget = PREPARE_S.get(step, 60)
        _line(console, f"[prepare {i}/{len(steps)}] {step} (about {budget:.0f} s)")
        t0 = time.perf_counter()
        with _phase(console, f"{step}:", budget, 0.0) as progress:
            result, _ = run_in_child(step, PREPARE_MODULE, quick, progress, console, step,
                                     timeout_s=hang_timeout(budget), entry=PREPARE[step][1])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if "error" in result:
            console.print(Text(f"{step} failed: {result['error']}; the suites that need it build it themselves",
                               style="red"))
        else:
            accuracy = result.get("accuracy")
            extra = f", held-out top-1 {accuracy:.3f}" if isinstance(accuracy, (int, float)) else ""
            _line(console, f"      {step} ready in {result['seconds']:.0f} s{extra}")
        done[step] = result
    return done


def _line(console: Console, text: str, style: str | None = None) -> None:
    """One line, cut to the console's width (a phase line never wraps)."""
    console.print(Text(text, style=style or ""), no_wrap=True, overflow="ellipsis", crop=True)


@contextlib.contextmanager
def _phase(console: Console, label: str, budget_s: float, left_after: float) -> Iterator[Callable[[str], None]]:
    """The progress callback of one part: a live status line on a terminal (with the time spent and the time
    left to the whole run), else each message as a line (a pipe, CI)."""
    t0 = time.perf_counter()

    def text(message: str) -> Text:
        elapsed = time.perf_counter() - t0
        left = max(budget_s - elapsed, 0.0) + left_after
        return Text(f"{label} {message}  ({elapsed:.0f} s; ~{left / 60:.1f} min left)", no_wrap=True,
                    overflow="ellipsis")

    if console.is_terminal:
        with console.status(text("starting")) as status:
            yield lambda message: status.update(text(message))
    else:
        yield lambda message: _line(console, f"      {time.perf_counter() - t0:4.0f} s  {message}")


def _takes_a_budget(module: Any) -> bool:
    """Whether a suite sizes its measurement windows by a budget it is given (its `run` takes `budget_s`)."""
    try:
        return "budget_s" in inspect.signature(module.run).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _run_suite(name: str, module: Any, quick: bool, console: Console, step: str, budget_s: float,
               left_after: float, given_s: float | None = None) -> tuple[dict[str, Any], str]:
    """One suite (or the ceilings) with its phase lines: (its JSON, with its seconds and budget, and its title).
    `step` is "[i/n]"; `left_after` the budget of the suites still to come, for the time-left estimate;
    `given_s`: a budget the suite is given in place of its own (`budget.cut_share`)."""
    title = getattr(module, "TITLE", name)
    _line(console, f"{step} {name} ({budget_s:.0f} s; about {(budget_s + left_after) / 60:.1f} min left): "
                   f"{IN_SHORT.get(name, title)}", style="bold")
    quiet = wait_for_quiet_machine(max_s=QUIET_WAIT_S)  # the previous suite's processes, or others, leave the cores
    t0 = time.perf_counter()
    load = OthersLoad()  # other processes' use of the cores while the suite (and its process) runs
    with _phase(console, f"{name}:", budget_s, left_after) as progress:
        if isinstance(module, ModuleType):
            result, title = run_in_child(name, module.__name__, quick, progress, console, title,
                                         timeout_s=hang_timeout(budget_s), budget_s=given_s)
        else:
            result = _run_here(module, quick, progress, given_s)
    if "error" in result:
        console.print(Text(f"suite {name} failed: {result['error']}", style="red"))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["budget_s"] = budget_s
    others = load.cores()
    result["others_cores"] = round(others, 2) if others is not None else None
    result["quiet_wait"] = {"waited_s": round(quiet.waited_s, 1),
                            "others_cores": round(quiet.others_cores, 2) if quiet.others_cores is not None else None}
    return result, title


def _print_end_line(name: str, result: dict[str, Any], busy_ceiling: bool, console: Console) -> None:
    """A suite's last line: its time against its budget and its headline (the summary's cells)."""
    if "error" in result:
        return
    measured, speedup, share, machine = suite_cells(result, busy_ceiling)
    over = ": over it" if over_budget(result) else ""
    figures = ", ".join(c for c in (measured, speedup and f"{speedup} plain", share, machine != "quiet" and machine)
                        if c)
    _line(console, f"      {name} done in {result['seconds']:.0f} s (budget {result['budget_s']:.0f} s{over}): "
                   f"{figures}")


def _print_ceilings_line(result: dict[str, Any], console: Console) -> None:
    """The ceilings in one line (the table is in the report), and what a busy measurement means for them."""
    if "error" in result:
        return
    items = result.get("items") or {}
    shown = [f"{n} {format_number(items[n]['value'])} {items[n].get('unit', '')}".strip()
             for n in ("fp32", "bf16", "int8", "decode") if isinstance((items.get(n) or {}).get("value"), (int, float))]
    source = "measured now" if result.get("source") == "measured" else f"cached {result.get('measured_at', '')}".strip()
    _line(console, f"      ceilings ({source}): {', '.join(shown) or 'none measured'}")
    busy = busy_cores(result)
    if busy is not None:
        console.print(Text(f"The ceilings were measured while other processes used {busy:.1f} cores: not kept as "
                           "this machine's, measured again next run; every share below is marked busy and judges "
                           "no goal.", style="yellow"))
    elif result.get("not_kept"):
        console.print(Text(f"Ceilings {result['not_kept']['why']}.", style="yellow"))


def _run_here(module: Any, quick: bool, progress: Callable[[str], None], budget_s: float | None = None) -> dict[str, Any]:
    try:
        given = {"budget_s": budget_s} if budget_s is not None else {}
        return module.run(quick=quick, progress=progress, **given)
    except Exception as e:  # noqa: BLE001 - one suite's failure must not lose the others
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


# ---------------------------------------------------------------- a suite in its own process

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


def _child_env(budget_s: float | None = None) -> dict[str, str]:
    # torch.profiler's Kineto logs every start/stop (and, on a CUDA build without a GPU, an ERROR line) to
    # the console; the report has its own progress lines. Level 6, above USDT (5): Kineto prints nothing; a
    # user's own setting wins. PYTHONFAULTHANDLER: a native crash in the child prints where it happened.
    # `budget_s`: the suite's budget, cut (`budget.cut_share`), through the variable that overrides it.
    given = {ENV: f"{budget_s:.1f}"} if budget_s is not None else {}
    return {"KINETO_LOG_LEVEL": "6", **os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1", **given}


def hang_timeout(budget_s: float) -> float:
    """Seconds after which a suite's process is taken for hung and ended: far beyond its budget (first runs
    build the demo photos and model too), so only a deadlock reaches it."""
    return 4 * budget_s + 600


def run_in_child(name: str, module_name: str, quick: bool, progress: Callable[[str], None], console: Console,
                 title: str = "", timeout_s: float | None = None, entry: str = "run",
                 budget_s: float | None = None) -> tuple[dict[str, Any], str]:
    """Run `entry` (a suite's `run`) of the module `module_name` in a fresh Python process: (its JSON, its
    title). Its progress lines drive `progress`, its other output is passed on; a child that dies (a signal,
    an exit without a report) gives a result whose "error" says how; one still running after `timeout_s`
    (hung: e.g. a deadlocked worker process) is killed with its process group and reported as such."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tmp = tempfile.mkdtemp(prefix=f"torchspeed-bench-{name.replace(' ', '-')}-")
    result_path = os.path.join(tmp, "suite.json")
    code = (f"import sys; sys.path.append({root!r}); "
            "from torchspeed.bench.orchestration import child_main; child_main()")
    argv = [sys.executable, "-c", code, module_name, name, result_path, "quick" if quick else "full", entry]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, errors="replace", env=_child_env(budget_s),
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


def _end_with_parent(parent: int, every_s: float = 1.0) -> threading.Thread:
    """End this suite's process group (the suite and its loader workers) once `parent` is gone: the suite
    runs in its own session, so a `torchspeed bench` ended by SIGTERM or SIGKILL would otherwise leave it
    running, holding the cores."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="torchspeed-bench-parent-watch", daemon=True)
    thread.start()
    return thread


def child_main(argv: Sequence[str] | None = None) -> None:
    """The child side of `run_in_child`: argv is MODULE NAME RESULT_PATH quick|full [ENTRY] (default `run`)."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()
    module_name, name, result_path, mode, *entry = list(argv if argv is not None else sys.argv[1:])
    _end_with_parent(os.getppid())

    def progress(text: str) -> None:
        sys.stdout.write(_MARK + " ".join(str(text).split("\n")) + "\n")
        sys.stdout.flush()

    title = name
    try:
        module = importlib.import_module(module_name)
        title = getattr(module, "TITLE", name)
        result = getattr(module, entry[0] if entry else "run")(quick=mode == "quick", progress=progress)
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


# ---------------------------------------------------------------- the report and the console's summary

def render_report(out: str, console: Console | None = None, command: str | None = None,
                  verbose: bool = False) -> dict[str, Any]:
    """Write `out/report.md` and the plots from `out/results.json`, print the summary (one line per suite) and
    where the report is, then, with `verbose` or on a console `WIDE` enough, every suite's table; returns the
    results."""
    console = console or Console()
    results = read_results(out)
    report = write_report(results, out, command=command or results.get("command") or "torchspeed bench")
    print_summary(results, console)
    took = f" ({results['seconds'] / 60:.1f} min)" if results.get("seconds") is not None else ""
    console.print(Text(f"Full report: {report}{took}", style="bold"))
    if verbose or console.width >= WIDE:
        print_tables(results, console)
    return results


def print_summary(results: dict[str, Any], console: Console) -> None:
    """One line per suite: its headline's figure, speed-up over plain PyTorch, share of its ceiling and
    whether other processes used the cores meanwhile; then the suites over their budget."""
    rows = console_summary(results)
    if rows:
        print_table("Summary: each suite's best against plain PyTorch on this machine",
                    ["suite", "measured", "speed-up", "of ceiling", "machine"], rows, console)
    if any("*" in row[3] for row in rows):
        console.print(Text("* above its ceiling: see the report"))
    if busy_cores(results.get("ceilings")) is not None:
        console.print(Text("(busy): the ceilings were measured on a busy machine; shares against them judge no "
                           "goal. Measure them again on a quiet one: torchspeed bench --refresh-ceilings"))
    if any(busy_warning(results[n].get("others_cores")) for n in suites.SUITE_NAMES
           if isinstance(results.get(n), dict)):
        console.print(Text("busy: other processes used the cores while that suite ran, so its figures may be off; "
                           "measure again on a quiet machine"))
    late = [f"{n} {seconds:.0f} s of {budget:.0f}" for n, seconds, budget in over_budget_parts(results)]
    if late:
        console.print(Text(f"Over their time budget: {', '.join(late)}"))


def print_tables(results: dict[str, Any], console: Console) -> None:
    """Every suite's table and the ceilings', as in the report (`verbose`, or a wide console)."""
    if isinstance(results.get("ceilings"), dict):
        print_ceilings(results["ceilings"], console)
    for name in suites.SUITE_NAMES:
        if isinstance(results.get(name), dict):
            print_suite(name, results[name], console, busy_ceiling=busy_cores(results.get("ceilings")) is not None)


def print_suite(name: str, result: dict[str, Any], console: Console, title: str | None = None,
                busy_ceiling: bool = False) -> None:
    """A suite's table on the console."""
    if "error" in result:
        return
    rows = [(r.technique, r.median, r.unit, r.ratio, r.cumulative, r.metric_drop, ceiling_cell(r, busy_ceiling))
            for r in rows_of(result)]
    print_table(title or f"{name}: {WHAT.get(name, name)}",
                ["technique", "median", "unit", "ratio", "cumulative", "metric drop", "achieved of ceiling"], rows,
                console)
    if any("%*" in row[-1] for row in rows):
        console.print(Text(ABOVE_CEILING_NOTE))


def print_ceilings(result: dict[str, Any], console: Console) -> None:
    """The machine's ceilings on the console."""
    if "error" in result:
        return
    print_table(f"Ceilings of this machine ({result.get('source', '')}, measured {result.get('measured_at', '?')})",
                ["ceiling", "value", "route", "what"], ceiling_rows(result), console)
