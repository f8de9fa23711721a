"""`torchspeed doctor -- python your_train.py ARGS`: run an unchanged script under the instrumentation,
then judge what it saw. Parent side: build the child command, run it, read its JSON, report.

The child keeps the user's interpreter and interpreter options; only `-c BOOTSTRAP` is put in front
of the script, which then runs under runpy as `__main__` with its own argv.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from rich.console import Console
from rich.markup import escape

from torchspeed.args import progress_fn
from torchspeed.atomic import atomic_write, write_json
from torchspeed.doctor import child_env, trying
from torchspeed.doctor.advice import rank
from torchspeed.doctor.fixes import check_names, plan
from torchspeed.doctor.output import markdown, print_profile
from torchspeed.doctor.phases import PHASES, verdict
from torchspeed.doctor.rules import loop_findings
from torchspeed.doctor.transformer_rules import transformer_findings
from torchspeed.measure import OthersLoad, busy_warning, wait_for_quiet_machine
from torchspeed.outputs import check_output_file, claim_output_dir

__all__ = ["QUIET_WAIT_S", "REPORT_FILES", "TRY_STEPS", "build_payload", "check_interpreter", "child_command", "run_doctor"]

TRY_STEPS = 8  # steps per run under --try when --steps is not given
QUIET_WAIT_S = 5.0  # --try waits at most this long for other processes to leave the cores before its first run

_PY = re.compile(r"^(python|pypy)(\d+(\.\d+)*)?(\.exe)?$")
_OPTS_WITH_VALUE = {"-W", "-X", "-Q"}


def _torchrun_split(command: list[str]) -> tuple[str, list[str], list[str]] | None:
    """(interpreter, torchrun options, script and its args) for `torchrun ... script.py ARGS` or
    `python -m torch.distributed.run ... script.py ARGS`; None for any other command."""
    exe = command[0]
    if os.path.basename(exe) == "torchrun":
        py, rest = sys.executable, command[1:]
        where = shutil.which(exe)
        if where:
            with open(where, "rb") as f:
                first = f.readline().decode(errors="replace")
            if first.startswith("#!") and "python" in first:
                py = first[2:].strip().split()[0]
    elif command[1:3] == ["-m", "torch.distributed.run"] or command[1:3] == ["-m", "torch.distributed.launch"]:
        py, rest = exe, command[3:]
    else:
        return None
    for i, a in enumerate(rest):
        if a.endswith(".py") and not a.startswith("-"):
            return py, rest[:i], rest[i:]
    raise ValueError("doctor follows torchrun into its workers for a script: torchspeed doctor -- torchrun "
                     "--nproc-per-node N your_train.py ARGS")


def child_command(command: list[str]) -> list[str]:
    """The instrumented child command for `command` (e.g. ['python', '-u', 'train.py', '--lr', '0.1']).

    Under torchrun each worker process runs the bootstrap (`torchrun --no-python python -c BOOT ...`)
    and writes its own record (rank-suffixed)."""
    if not command:
        raise ValueError("doctor needs a command after `--`: torchspeed doctor -- python your_train.py ARGS")
    tr = _torchrun_split(command)
    if tr is not None:
        py, tr_opts, script = tr
        return [py, "-m", "torch.distributed.run", *[o for o in tr_opts if o not in ("--no-python", "--no_python")],
                "--no-python", *child_command([py, *script])]
    exe, rest = command[0], list(command[1:])
    if exe.endswith(".py"):
        exe, rest = sys.executable, [exe, *rest]
    elif not (_PY.match(os.path.basename(exe)) or os.path.realpath(exe) == os.path.realpath(sys.executable)):
        raise ValueError(f"doctor runs Python scripts: the command must start with a Python interpreter, got {exe!r} "
                         "(use: torchspeed doctor -- python your_train.py ARGS)")
    opts, mode, target, args = _python_arguments(rest)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # this torchspeed is found first, then sys.path is put back before anything else is imported (the
    # bootstrap's imports resolve as the script's will). Ctrl-C or doctor's --timeout (SIGINT) ends the
    # child with status 130 and no traceback of doctor's frames; the report of what ran is written
    # before (bootstrap.main) when the script had started.
    boot = (f"import sys\ntry:\n    sys.path.insert(0, {root!r}); import torchspeed; sys.path.remove({root!r}); "
            f"sys.path.append({root!r})\n    from torchspeed.doctor.bootstrap import main; main()\n"
            "except KeyboardInterrupt:\n    sys.exit(130)")
    return [exe, *opts, "-c", boot, mode, target, *args]


def _python_arguments(rest: list[str]) -> tuple[list[str], str, str, list[str]]:
    """(interpreter options, mode, target, script arguments) of a Python command line after the
    interpreter; mode is script, module or code."""
    opts: list[str] = []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a in ("-m", "-c"):
            if i + 1 >= len(rest):
                raise ValueError(f"`{a}` needs an argument")
            return opts, ("module" if a == "-m" else "code"), rest[i + 1], rest[i + 2:]
        if a.startswith("-m") and len(a) > 2:
            return opts, "module", a[2:], rest[i + 1:]
        if a == "-" or a == "-i" or a.startswith("-i"):
            raise ValueError(f"doctor cannot run Python with {a!r} (interactive / stdin); give a script file")
        if a.startswith("-"):
            opts.append(a)
            if a in _OPTS_WITH_VALUE and i + 1 < len(rest):
                opts.append(rest[i + 1])
                i += 1
            i += 1
            continue
        if not os.path.exists(a):
            raise FileNotFoundError(f"script {a!r} does not exist")
        return opts, "script", a, rest[i + 1:]
    raise ValueError("no script given: torchspeed doctor -- python your_train.py ARGS")


def _sum(windows: list[dict[str, Any]]) -> tuple[float, dict[str, float], int]:
    phases = dict.fromkeys(PHASES + ("eval",), 0.0)
    for w in windows:
        for k, v in w["phases"].items():
            phases[k] = phases.get(k, 0.0) + v
    return sum(w["wall"] for w in windows), phases, sum(w.get("samples", 0) for w in windows)


def build_payload(raw: dict[str, Any], command: list[str], exit_status: int) -> dict[str, Any]:
    """The doctor report (the JSON contract) from the child's raw record."""
    windows = raw.get("windows") or []
    settings = raw.get("settings") or {}
    timed = trying.timed_windows(raw)  # the step measured for memory had its hooks on: not a time figure
    wall, phases, samples = _sum(timed)
    # the first step carries one-time costs (worker start-up, lazy init, kernel selection): judge the rest
    steady = timed[1:] if len(timed) >= 2 else timed
    s_wall, s_phases, s_samples = _sum(steady)
    # data time of evaluation-only loaders is evaluation, not training input
    for ld in settings.get("loaders", []):
        if not ld.get("training") and ld.get("batches"):
            for ph in (phases, s_phases):
                moved = min(ld.get("data_s", 0.0), ph["data"])
                ph["data"] -= moved
                ph["eval"] += moved
    syncs = settings.get("host_syncs", 0) / max(1, len(windows))
    made = [ld["dataset"] for ld in settings.get("loaders", [])
            if ld.get("kind") == "batch function" and ld.get("batches")]
    v, evidence = verdict(s_phases, s_wall, host_syncs_per_step=syncs if settings.get("device") == "cuda" else None,
                          data_source=f"making batches in {made[0]}" if made else None)
    if len(steady) < len(timed):
        evidence.append(f"first step excluded as warm-up ({timed[0]['wall']:.2f} s)")
    if len(timed) < len(windows):
        step = (raw.get("memory") or {}).get("step") or len(windows)
        which = f"step {step}" if len(windows) - len(timed) == 1 else f"steps {step - 1}-{step}"
        evidence.append(f"{which} measured where the memory goes (on a CPU the profiler starts a step early) and "
                        "left out of the time figures")
    if settings.get("grad_scaler_off"):
        evidence.append(f"GradScaler off: {settings['grad_scaler_off']}")
    facts = {"device": settings.get("device", "cpu"), "steps": len(steady), "wall_s": s_wall, "phases": s_phases,
             "settings": settings, "verdict": v, "all_steps": len(windows)}
    findings = rank(loop_findings(facts) + transformer_findings(facts)) if windows else []
    cmd = shlex.join(command)  # the suggested commands are pasted into a shell as they are printed
    py_script = shlex.join(command[1:]) if len(command) > 1 and _PY.match(os.path.basename(command[0])) else cmd
    for f in findings:  # the measuring command runs on this very script
        f.command = f.command.replace("torchrun --nproc-per-node N your_train.py",
                                      f"torchrun --nproc-per-node N {py_script}").replace("python your_train.py", cmd)
    times = sorted(w["wall"] * 1e3 for w in steady)
    return {
        "command": list(command), "exit_status": exit_status, "status": raw.get("status", "no-report"),
        "error": raw.get("error"), "steps": len(windows), "wall_s": wall, "phases": phases,
        "steady": {"steps": len(steady), "wall_s": s_wall, "phases": s_phases},
        "per_step_ms": {"median": statistics.median(times), "min": times[0], "max": times[-1]} if times else {},
        "throughput": s_samples / s_wall if s_wall > 0 and s_samples else None,
        "peak_memory_bytes": raw.get("peak_memory_bytes"), "script_s": raw.get("script_s"),
        "verdict": v if windows else None, "evidence": evidence if windows else
        ["no training step was seen: doctor measures training steps (optimizer.step(), or loss.backward() in a loop without a torch.optim optimizer)"],
        "settings": settings, "findings": [f.to_dict() for f in findings], "hotspots": raw.get("hotspots", []),
        "trace": raw.get("trace"), "memory": raw.get("memory"),
    }


def _no_report(status: int) -> str:
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = f"signal {status - 128}"
        return f"the script was killed by {name} (exit status {status}) before doctor could report"
    return f"the script ended (exit status {status}) before doctor could report: see its error output above"


def _read_raw(tmpdir: str, raw_path: str) -> tuple[dict[str, Any], int]:
    """The child's record, and the number of ranks under torchrun (0 for one process): rank 0's record
    is the report (each rank measures its own loop; they run in lockstep)."""
    ranks = sorted(f for f in os.listdir(tmpdir) if f.startswith("raw.json.rank"))
    path = raw_path if os.path.exists(raw_path) else os.path.join(tmpdir, "raw.json.rank0")
    raw: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    shutil.rmtree(tmpdir, ignore_errors=True)
    return raw, len(ranks)


def check_interpreter(argv: list[str], env: dict[str, str] | None = None) -> None:
    """The child interpreter must import torch (doctor instruments it): one clear error naming it if not."""
    exe = argv[0]
    where = shutil.which(exe) or exe
    if os.path.abspath(where) == os.path.abspath(sys.executable):
        return  # this interpreter runs torchspeed, so it has torch (a venv's python may link to one without)
    opts = argv[1:argv.index("-c")]
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"
    try:
        r = subprocess.run([exe, *opts, "-c", probe], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
    except FileNotFoundError:
        raise FileNotFoundError(f"the script's interpreter {exe!r} was not found") from None
    except (OSError, subprocess.TimeoutExpired):
        return  # let the real run say what is wrong
    if r.returncode == 3:
        raise ValueError(f"the script's interpreter {exe!r} ({where}) cannot import torch: install torch for it, or "
                         f"run the script with an interpreter that has it, e.g. torchspeed doctor -- "
                         f"{sys.executable} your_train.py")


_TMP_PREFIX = "torchspeed-doctor-"


def _script_stdout() -> int | None:
    """Where the script's output goes: where this process's `sys.stdout` writes now. Under `--json -`
    the command line points it at stderr, so the script's prints never mix with the JSON on stdout."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    return None if fd == 1 else fd


def _die_with_parent() -> Any:
    """A `preexec_fn` that makes the child die when doctor dies (SIGKILL included), so a killed doctor
    never leaves the script running (Linux: PR_SET_PDEATHSIG); None where that is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # doctor died before the signal was armed
            os._exit(137)
    return preexec


def _clean_stale_tmpdirs() -> None:
    """Remove record folders of doctor runs whose process no longer exists (a killed doctor's)."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid = name[len(_TMP_PREFIX):].split("-", 1)[0]
        if name.startswith(_TMP_PREFIX) and pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            except OSError:
                pass


def _run_child(argv: list[str], env: dict[str, str], timeout: float | None,
               log: Any = None) -> tuple[int, dict[str, Any], int, bool, bool]:
    """Run one instrumented child: (exit status, its raw record, ranks, timed out, interrupted). `log`
    (a file) takes the script's output instead of the terminal. The child dies with doctor."""
    _clean_stale_tmpdirs()
    tmpdir = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")
    raw_path = os.path.join(tmpdir, "raw.json")
    env = {**env, child_env.ENV_OUT: raw_path}
    try:
        proc = subprocess.Popen(argv, env=env, stdout=log if log is not None else _script_stdout(),
                                stderr=subprocess.STDOUT if log is not None else None,
                                preexec_fn=_die_with_parent())
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    timed_out = interrupted = False
    try:
        status = proc.wait(timeout=timeout)
    except KeyboardInterrupt:  # the child got the SIGINT too: let it write its report
        interrupted = True
        status = proc.wait()
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    if status < 0:
        status = 128 - status  # killed by signal N: 128 + N, as the shell reports it
    raw, ranks = _read_raw(tmpdir, raw_path)
    return status, raw, ranks, timed_out, interrupted


def run_doctor(command: list[str], steps: int | None = None, out: str | None = None, json_path: str | None = None,
               trace: bool = False, cprofile: bool = False, console: Any = None,
               timeout: float | None = None, try_fixes: list[str] | None | bool = None,
               memory: bool = True) -> tuple[int, dict[str, Any]]:
    """Run `command` instrumented; print the report; write `json_path` and `out`/doctor.{json,md} (and
    the trace). Returns (the script's exit status, the report).

    `memory`: one step (the second; after the trace's with `trace`) is measured for where its memory goes
    (`memory_breakdown`) and left out of the time figures.

    `try_fixes` (True: every fix the findings call for; a list: those fixes) then measures each fix on
    the unchanged script (`trying.try_fixes`), `steps` steps per run (default TRY_STEPS)."""
    measure_fixes, requested, steps = _fixes_requested(try_fixes, steps)
    if trace and not out:  # the trace is a file of its own: into a folder doctor owns, never the current one
        raise ValueError("--trace needs --out DIR: the trace is written to DIR/doctor-trace.json")
    argv = child_command(command)
    report_dir = _claim_outputs(out, json_path)
    env = _child_env(steps, cprofile, trace, out, seeded=measure_fixes, memory=memory)
    check_interpreter(argv, env)
    quiet = wait_for_quiet_machine(max_s=QUIET_WAIT_S) if measure_fixes else None  # before the first timed run
    load = OthersLoad()  # other processes' load over the run (and, under --try, every fix run after it)
    status, raw, ranks, timed_out, interrupted = _run_child(argv, env, timeout)
    raw["others_cores"] = load.cores()
    payload = build_payload(raw, command, status)
    busy = busy_warning(raw["others_cores"])
    if busy and payload["verdict"] is not None:  # named beside the step times it inflated
        payload["evidence"].append(busy)
    payload["others_cores"] = raw["others_cores"]
    _note_how_it_ended(payload, raw, status, ranks, timeout if timed_out else None, interrupted)
    con = None if console is False else console or Console()
    if measure_fixes:
        _try(payload, raw, command, argv, env, (steps, timeout, requested), con, timed_out or interrupted, (quiet, load))
    # what a person reads: the steady steps (the first step's one-time costs are in the JSON's totals)
    shown = {**payload, "steps": payload["steady"]["steps"], "wall_s": payload["steady"]["wall_s"],
             "phases": payload["steady"]["phases"]}
    if con is not None:
        _print_report(con, command, status, payload, shown, timeout if timed_out else None)
    _write_report(payload, shown, json_path, out)
    if report_dir is not None:
        report_dir.record(*(n for n in REPORT_FILES if report_dir.holds(n)))
    return status, payload


REPORT_FILES = ("doctor.json", "doctor.md", "doctor-trace.json")  # what doctor writes into --out


def _claim_outputs(out: str | None, json_path: str | None) -> Any:
    """Check `--out` and `--json` before the script runs, so a bad one costs no run. `--out` is new or a
    folder torchspeed wrote (never one holding a user's file); an earlier doctor report there is
    replaced. Returns the claimed folder (`torchspeed.outputs.OutputDir`) or None."""
    if json_path:
        check_output_file(json_path, "--json")
    if not out:
        return None
    return claim_output_dir(out, "doctor", overwrite=True, replaces=REPORT_FILES)


def _fixes_requested(try_fixes: list[str] | None | bool, steps: int | None) -> tuple[bool, list[str] | None, int | None]:
    """(measure fixes, the fixes named or None for those the findings call for, steps per run), checked
    before anything runs."""
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    measure_fixes = try_fixes is not None and try_fixes is not False
    # None (also for True or an empty list): the fixes the findings call for
    requested = (list(try_fixes) or None) if measure_fixes and try_fixes is not True else None
    if measure_fixes:
        if steps is not None and steps < 3:
            raise ValueError(f"--try needs --steps >= 3 (one warm-up step and at least two measured), got {steps}")
        steps = steps or TRY_STEPS
        check_names(requested)
    return measure_fixes, requested, steps


def _child_env(steps: int | None, cprofile: bool, trace: bool, out: str | None, seeded: bool,
               memory: bool = True) -> dict[str, str]:
    """This process's environment plus what the bootstrap reads: step limit, cProfile, trace path, memory, seed."""
    env = dict(os.environ)
    env[child_env.ENV_MEMORY] = "1" if memory else ""
    env[child_env.ENV_STEPS] = str(steps or "")
    env[child_env.ENV_CPROFILE] = "1" if cprofile else ""
    env[child_env.ENV_TRACE] = os.path.abspath(os.path.join(out, "doctor-trace.json")) if trace and out else ""
    if seeded:
        env[child_env.ENV_SEED] = "0"  # the baseline run is seeded like the runs it is compared with
        env[child_env.ENV_PROBE] = "attention"  # and measures the attention it sees, after its steps
    return env


def _note_how_it_ended(payload: dict[str, Any], raw: dict[str, Any], status: int, ranks: int,
                       timed_out_after: float | None, interrupted: bool) -> None:
    """Ranks, a timeout or an interruption (doctor's own, not the script's error), or why no record came."""
    if ranks:
        payload["ranks"] = ranks
    if timed_out_after is not None:
        payload["status"], payload["timed_out_s"] = "timeout", timed_out_after
    elif interrupted:
        payload["status"] = "interrupted"
    stopped = timed_out_after is not None or interrupted
    if stopped and str(payload.get("error") or "").startswith("KeyboardInterrupt"):
        payload["error"] = None
    if not raw and not payload.get("error") and not stopped:
        payload["error"] = _no_report(status)


def _print_report(con: Any, command: list[str], status: int, payload: dict[str, Any], shown: dict[str, Any],
                  timed_out_after: float | None) -> None:
    con.print(f"[bold]torchspeed doctor[/]: {escape(shlex.join(command))} -> exit status {status}, "
              f"{payload['steps']} training steps seen ({payload['status']})", highlight=False)
    if payload.get("error"):
        con.print(f"the script raised: {payload['error']}", highlight=False, markup=False)
    print_profile(shown, con)
    if payload.get("trace"):
        con.print(f"torch.profiler trace (open in https://ui.perfetto.dev or chrome://tracing): {payload['trace']}")
    if payload.get("try"):
        trying.print_tried(payload["try"], con)
    if timed_out_after is not None:
        con.print(f"torchspeed doctor: the script ran past --timeout {timed_out_after:g} s and was stopped; the report "
                  "covers the steps it ran (exit status 124, as timeout(1))", highlight=False, markup=False)


def _write_report(payload: dict[str, Any], shown: dict[str, Any], json_path: str | None, out: str | None) -> None:
    if json_path:
        write_json(json_path, payload)
    if out:
        write_json(os.path.join(out, "doctor.json"), payload)
        with atomic_write(os.path.join(out, "doctor.md"), "w") as f:
            f.write(markdown(shown, "torchspeed doctor report"))


def _try(payload: dict[str, Any], raw: dict[str, Any], command: list[str], argv: list[str], env: dict[str, str],
         how: tuple[int, float | None, list[str] | None], con: Any, stopped: bool, machine: tuple[Any, Any]) -> None:
    """doctor --try after the baseline run: measure the fixes, add `tried`, put measured gains in the findings.
    `how` is (steps per run, timeout per run, the fixes asked for); `machine` is (the `measure.Quiet`
    waited for before the baseline run, the OthersLoad started then), so a busy machine is named
    beside the figures it disturbed."""
    steps, timeout, requested = how
    quiet, load = machine
    if stopped or len(raw.get("windows") or []) < 2:
        payload["try"] = {"tried": [], "skipped": [], "error": "the baseline run measured fewer than 2 steps: "
                          "nothing to compare fixes with"}
        payload["tried"] = []
        return

    def run_child(a: list[str], e: dict[str, str], t: float | None, log: Any) -> tuple[int, dict[str, Any]]:
        status, r, _, _, interrupted = _run_child(a, e, t, log)
        if interrupted:
            raise KeyboardInterrupt
        return status, r

    planned = plan(payload, requested)
    say = progress_fn((lambda m: con.print(m, highlight=False, markup=False)) if con is not None else False)
    if quiet is not None and quiet.busy:
        say(f"torchspeed doctor --try: other processes still used {quiet.others_cores:.1f} cores after waiting "
            f"{quiet.waited_s:.1f} s for quiet; measuring anyway, their load is named beside the figures")
    say(f"torchspeed doctor --try: {len(planned.run)} fix run(s), each followed by a baseline run, "
        f"{steps} steps each (the script's output is hidden)")
    launch = trying.launcher(argv, env, steps, timeout, run_child)
    result = trying.try_fixes(raw, payload, launch, planned, progress=say)
    trying.note_load(result, load.cores() if load is not None else None, quiet)
    payload["try"] = result
    payload["tried"] = [{k: r[k] for k in ("fix", "baseline_step_s", "step_s", "speedup", "spread", "numerics_ok",
                                           "code", "kept", "verdict", "numerics", "steps", "others_cores")}
                        | ({"compile_s": r["compile_s"], "compile": r["compile"]} if "compile" in r else {})
                        for r in result["tried"]]
    trying.apply_measured(payload, result["tried"], command)
