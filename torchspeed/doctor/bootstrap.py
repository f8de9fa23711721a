"""What `torchspeed doctor` runs inside the user's process: install the `Recorder` from outside the
user's code, run the unchanged script with runpy, and write what was seen to a JSON file the parent reads.
The child is `python [interpreter options] -c BOOT MODE TARGET ARGS...` (MODE: script, module or code;
`launch.child_command`), so the user's interpreter and options are kept. The Recorder, `ranks` and
`runtime` (torch with them) are imported inside functions: under torchrun `main()` first ties this worker
to its launcher (`_die_with_the_launcher`), so a doctor killed while torch imports leaves no worker behind.
"""
from __future__ import annotations

import cProfile
import ctypes
import json
import os
import pstats
import runpy
import signal
import sys
import traceback
from typing import Any

from torchspeed.atomic import write_json
from torchspeed.doctor.child_env import (ENV_CPROFILE, ENV_FIXES, ENV_MEMORY, ENV_OUT, ENV_PROBE, ENV_SEED, ENV_STEPS,
                                         ENV_TRACE)

__all__ = ["main"]


def main() -> None:
    """Bootstrap entry: sys.argv is ['-c', MODE, TARGET, *args]."""
    _die_with_the_launcher()
    from torchspeed.doctor.recorder import StopScript
    from torchspeed.ranks import env

    out = os.environ.pop(ENV_OUT, None)
    where = env()
    if out and where.distributed:  # a torchrun worker: one record per rank
        out = f"{out}.rank{where.rank}"
    rec, prof = _recorder_from_env()
    # --try's first run measures the attention it saw, after its steps (under torchrun on rank 0 only)
    rec.measure_attention = os.environ.pop(ENV_PROBE, "") == "attention" and where.rank == 0
    mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    _become_the_script(mode, target, args)
    status, code, error, pending = "finished", 0, None, None
    try:
        _run_script(mode, target)
    except StopScript:
        status = "stopped"
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        status, pending = ("finished" if code == 0 else "exited"), e
    except BaseException as e:  # the report is written even when the script fails
        status, code, error, pending = "error", 1, f"{type(e).__name__}: {e}", e
    finally:
        if prof:
            prof.disable()
    rec.enabled = False
    if out:
        try:
            payload = rec.results()
            payload.update(status=status, exit_status=code, error=error,
                           hotspots=_hotspots(prof) if prof and rec.steps > 1 else [])
            write_json(out, payload)
        except Exception as e:  # never hide the script's own outcome behind a reporting failure
            print(f"torchspeed doctor: could not write the report: {type(e).__name__}: {e}", file=sys.stderr)
    if isinstance(pending, Exception):
        _print_user_traceback(pending)
        sys.exit(1)
    if pending is not None:
        raise pending
    sys.exit(0)


def _die_with_the_launcher() -> None:
    """Under torchrun, die when torchrun dies: its workers run in sessions of their own, so a killed
    doctor (which takes torchrun with it) would leave them running. Linux only (PR_SET_PDEATHSIG)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _recorder_from_env() -> tuple[Any, Any]:
    """The installed Recorder as the parent's environment asks (step limit, trace, memory, fixes, seed), and the
    cProfile profiler when asked (enabled by the Recorder at the first step)."""
    from torchspeed.doctor.recorder import Recorder
    from torchspeed.runtime import seed_everything

    steps = os.environ.pop(ENV_STEPS, "") or None
    trace = os.environ.pop(ENV_TRACE, "") or None
    use_cprofile = os.environ.pop(ENV_CPROFILE, "") == "1"
    seed = os.environ.pop(ENV_SEED, "")
    fixes = os.environ.pop(ENV_FIXES, "")
    memory = os.environ.pop(ENV_MEMORY, "") == "1"
    rec = Recorder(max_steps=int(steps) if steps else None, trace_path=trace, memory=memory)
    rec.install()
    if fixes:
        rec.inject(json.loads(fixes))
    if seed:
        seed_everything(int(seed))  # every --try run alike, so their losses compare
    prof = None
    if use_cprofile:
        prof = rec.cprofile = cProfile.Profile()
    return rec, prof


def _become_the_script(mode: str, target: str, args: list[str]) -> None:
    """sys.argv and sys.path[0] as Python sets them for the script, module or code run directly."""
    if mode == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    else:
        sys.argv = ["-m" if mode == "module" else "-c", *args]
        sys.path[0] = "" if mode == "code" else os.getcwd()


def _run_script(mode: str, target: str) -> None:
    """Run the user's script, module or code as `__main__`."""
    if mode == "script":
        runpy.run_path(target, run_name="__main__")
    elif mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


def _hotspots(prof: Any, n: int = 15) -> list[dict[str, Any]]:
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in stats.items():
        if file.startswith(here) or "runpy" in file or "importlib" in file or func in ("<module>", "exec") \
                or "__import__" in func or "disable' of '_lsprof" in func:
            continue
        short = file if file.startswith("<") else os.path.join(os.path.basename(os.path.dirname(file)), os.path.basename(file))
        rows.append({"function": f"{short}:{line}({func})", "calls": nc, "cumulative_s": round(ct, 4),
                     "self_s": round(tt, 4)})
    rows.sort(key=lambda r: -r["cumulative_s"])
    return rows[:n]


def _print_user_traceback(e: BaseException) -> None:
    """The traceback as Python would print it for the script alone (without doctor's and runpy's frames)."""
    tb = e.__traceback__
    here = os.path.dirname(os.path.abspath(__file__))
    while tb is not None and (tb.tb_frame.f_code.co_filename.startswith((here, "<frozen")) or
                              tb.tb_frame.f_code.co_filename == "<string>" and tb.tb_next is not None):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb or e.__traceback__)
