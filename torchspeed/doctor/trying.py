"""`torchspeed doctor --try`: measure each proposed fix on the user's unchanged script.

After the seeded baseline run the script runs once per fix (injected by the bootstrap, `injection`),
over as many steps, with the baseline again after every fix (A B A C A ...), so a busy machine's drift
shows as spread, not gain. A fix is compared with the baseline runs around it; `spread` is
(max - min) / median of the baseline's per-run medians. A fix is a gain only when its speed-up exceeds
1 + spread, stays below what removing the phases it changes would give (more means the load changed)
and its numerics hold; such a fix, and one measured slower, is run once more and judged on both runs
(one quiet or busy minute is not a verdict), then the kept fixes are measured together. A compiling fix
also pays its compile seconds (the first steps' time beyond the baseline's): it is kept only when the
saving per step repays them within the steps the script plans (`settings.planned_steps`), where those
can be read. Imports no torch (the parent launches, reads, judges).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

from torchspeed.args import progress_fn
from torchspeed.doctor import child_env, fixes as fx
from torchspeed.doctor.advice import SEVERITY_ORDER
from torchspeed.measure import OthersLoad, Timing, busy_warning
from torchspeed.tables import print_table

__all__ = ["apply_measured", "launcher", "markdown_tried", "note_load", "print_tried", "step_times", "timed_windows",
           "try_fixes"]


def step_times(raw: dict[str, Any]) -> list[float]:
    """The steady step times of one run: windows after the first (and after the step that compiled), but
    the one measured for memory."""
    windows = raw.get("windows") or []
    skip = 1 if raw.get("compile_window") is None else raw["compile_window"] + 2
    return [w["wall"] for w in windows[skip:] if not w.get("memory")]


def timed_windows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's step windows but the one measured for memory (its hooks were on: not a time figure)."""
    return [w for w in raw.get("windows") or [] if not w.get("memory")]


def _median(times: list[float]) -> float | None:
    return Timing("steps", times).median_s if times else None


def try_fixes(baseline: dict[str, Any], payload: dict[str, Any], launch: Callable[[dict[str, Any], str], dict[str, Any]],
              planned: fx.Plan, progress: bool | Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run every planned fix and the interleaved baseline through `launch(fixes, title) -> raw record`.

    `baseline` is the first (seeded) run's raw record, `payload` its report (findings, settings),
    `planned` what `fixes.plan` made of it; `progress` (True or a callable) gets a line per run.
    Returns {"tried": rows, "skipped": [...], "baseline_runs": [...], "spread": float}."""
    plan, skipped = planned
    say = progress_fn(progress)
    launch = _sampled(launch)

    def run(spec: dict[str, Any], title: str, tag: str) -> dict[str, Any]:
        raw = launch(spec, title)
        say(f"[{tag}] {title}: {_summary(raw)}")
        return raw

    runs_total = 1 + 2 * len(plan)
    base_runs = [baseline]
    results: list[tuple[str, Any, dict[str, Any]]] = []
    say(f"[1/{runs_total}+] baseline: {_summary(baseline)}")
    for k, (name, value) in enumerate(plan):
        results.append((name, value, run({name: value}, fx.label(name, value), f"{2 * k + 2}/{runs_total}+")))
        base_runs.append(run({}, "baseline", f"{2 * k + 3}/{runs_total}+"))
    reproducible = _reproducible(base_runs)
    # each fix with the baseline runs just before and just after it
    pairs = [([raw], base_runs[k:k + 2]) for k, (_, _, raw) in enumerate(results)]
    rows = _rows(results, pairs, base_runs, reproducible, payload)
    # a kept fix, and one measured slower, runs once more (fix, baseline): one quiet or busy minute is no verdict
    confirm = [k for k, r in enumerate(rows) if r["kept"] or r["verdict"] == "slower"]
    for n, k in enumerate(confirm, 1):
        name, value, _ = results[k]
        raw = run({name: value}, fx.label(name, value), f"confirm {n}/{len(confirm)}")
        b = run({}, "baseline", f"confirm {n}/{len(confirm)}")
        pairs[k] = (pairs[k][0] + [raw], pairs[k][1] + [base_runs[-1], b])
        base_runs.append(b)
    if confirm:
        rows = _rows(results, pairs, base_runs, reproducible, payload)
    spread = rows[0]["spread"] if rows else _spread(base_runs)
    best: dict[str, dict[str, Any]] = {}  # per fix name, the kept candidate that finishes the run first
    for r in rows:
        if r["kept"] and (r["name"] not in best or _run_s(r) < _run_s(best[r["name"]])):
            best[r["name"]] = r
    for group in fx.CONFLICTS:  # fixes of the same loader are alternatives: the faster one joins the combination
        rivals = sorted((r for n, r in best.items() if n in group), key=lambda r: r["step_s"])
        for r in rivals[1:]:
            del best[r["name"]]
    rows.sort(key=lambda r: (not r["kept"], -(r["speedup"] or 0.0)))
    if len(best) >= 2:
        spec = {r["name"]: r["value"] for r in best.values()}
        title = " + ".join(fx.label(n, v) for n, v in spec.items())
        raw = launch(spec, f"combined: {title}")
        say(f"[combined] {title}: {_summary(raw)}")
        row = _row("combined", spec, [raw], base_runs[-1:], spread, reproducible, payload)
        row["fix"] = f"combined: {title}"
        row["code"] = "\n".join(r["code"] for r in best.values())
        rows.append(row)
    return {"tried": rows, "skipped": skipped, "spread": spread, "baseline_reproducible": reproducible,
            "baseline_runs": [{"step_s": _median(step_times(r)), "steps": len(step_times(r)),
                               "others_cores": r.get("others_cores")} for r in base_runs],
            "numerics_steps": fx.NUMERICS_STEPS, "tolerances": dict(fx.TOLERANCES)}


def _run_s(row: dict[str, Any]) -> float:
    """What a candidate costs over the planned run (its compile seconds included), or per step where the
    run's length is unknown: how two candidates of one fix (compile whole / regional) are ranked."""
    c = row.get("compile") or {}
    return row["step_s"] * c["planned_steps"] + c["compile_s"] if c.get("planned_steps") else row["step_s"]


def _sampled(launch: Callable[[dict[str, Any], str], dict[str, Any]]) -> Callable[[dict[str, Any], str], dict[str, Any]]:
    """`launch` with the cores other processes used during each run recorded in its raw record."""
    def run(spec: dict[str, Any], title: str) -> dict[str, Any]:
        load = OthersLoad()
        raw = launch(spec, title)
        raw["others_cores"] = load.cores()
        return raw
    return run


def _most(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def note_load(t: dict[str, Any], others_cores: float | None, quiet: Any = None) -> None:
    """Record the cores other processes used over all runs (`others_cores`) in `t`, and how long doctor
    waited for quiet before the first run (`quiet`, a `measure.Quiet`); when the machine was busy, name
    it in `t["busy"]` with the figures it disturbed (`t["busy_figures"]`: each run that had other
    processes on the cores, and how many), and in the verdicts that would otherwise read as the
    script's own variation ("within the spread", "slower")."""
    t["others_cores"] = others_cores
    if quiet is not None:
        t["quiet_wait"] = {"waited_s": round(quiet.waited_s, 2), "others_cores": quiet.others_cores}
    runs = [(f"baseline run {i}", r.get("others_cores")) for i, r in enumerate(t.get("baseline_runs") or [], 1)]
    runs += [(r["fix"], r.get("others_cores")) for r in t.get("tried") or []]
    t["busy_figures"] = [{"figure": name, "others_cores": round(c, 2)} for name, c in runs if busy_warning(c)]
    worst = _most([others_cores] + [c for _, c in runs])
    t["busy"] = None
    if busy_warning(worst) is None:
        return
    avg = "-" if others_cores is None else f"{others_cores:.1f}"
    named = ", ".join(f"{b['figure']} ({b['others_cores']:.1f})" for b in t["busy_figures"])
    t["busy"] = (f"the machine was busy: other processes used {avg} of {os.cpu_count()} cores on average while "
                 f"doctor --try ran (up to {worst:.1f} during one fix's runs)"
                 + (f"; busy during: {named}" if named else "")
                 + f"; the spread of {t.get('spread', 0.0):.0%} comes from that; measure again on a quiet machine")
    for r in t.get("tried") or []:
        if r["verdict"] == "within the spread":
            r["verdict"] = "within the spread of a busy machine"
        elif r["verdict"] == "slower" and busy_warning(r.get("others_cores")):
            r["verdict"] = "slower on a busy machine"


def _spread(base_runs: list[dict[str, Any]]) -> float:
    """(max - min) / median of the baseline's per-run median step times."""
    medians = [m for r in base_runs if (m := _median(step_times(r))) is not None]
    return (max(medians) - min(medians)) / statistics.median(medians) if len(medians) >= 2 else 0.0


def _rows(results: list[tuple[str, Any, dict[str, Any]]], pairs: list[tuple[list, list]],
          base_runs: list[dict[str, Any]], reproducible: bool | None, payload: dict[str, Any]) -> list[dict[str, Any]]:
    spread = _spread(base_runs)
    return [_row(name, value, pairs[k][0], pairs[k][1], spread, reproducible, payload)
            for k, (name, value, _) in enumerate(results)]


def _summary(raw: dict[str, Any]) -> str:
    times = step_times(raw)
    if not times:
        return f"no steady step measured ({raw.get('status', 'no report')}{': ' + raw['error'] if raw.get('error') else ''})"
    return f"median {_median(times):.3f} s/step over {len(times)} steps"


def _reproducible(base_runs: list[dict[str, Any]]) -> bool | None:
    """Do the baseline's own runs give the same first losses (same seed)? If not, numerics are not judged."""
    losses = [r.get("losses") or [] for r in base_runs if r.get("losses")]
    if len(losses) < 2:
        return None
    k = min(fx.NUMERICS_STEPS, *(len(x) for x in losses))
    ref = losses[0][:k]
    return all(max((abs(a - b) / max(abs(a), 1e-8) for a, b in zip(ref, x[:k])), default=0.0) <= 1e-6
               for x in losses[1:])


def _row(name: str, value: Any, raws: list[dict[str, Any]], around: list[dict[str, Any]], spread: float,
         reproducible: bool | None, payload: dict[str, Any]) -> dict[str, Any]:
    """One fix's row: its runs `raws` (one, or two when a kept fix was measured again) against the
    baseline runs `around` them."""
    raw = raws[0]
    base_times = [t for r in around for t in step_times(r)]
    fix_times = [t for r in raws for t in step_times(r)]
    base_s, step_s = _median(base_times), _median(fix_times)
    speedup = base_s / step_s if base_s and step_s else None
    if name == "combined":
        checks = [fx.numerics(n, around[0], raw) for n in value]
        num = {"ok": None if any(c["ok"] is None for c in checks) else all(c["ok"] for c in checks),
               "tolerance": "each fix's own", "max_rel_diff": max((c["max_rel_diff"] or 0.0 for c in checks), default=None)}
        code = ""
    else:
        num = fx.numerics(name, around[0], raw)
        code = fx.code_for(name, value, payload)
    if reproducible is False and num.get("kind") != "loader":
        num["ok"] = None
        num["tolerance"] += " (not judged: the baseline's own losses differ between runs)"
    error = None
    if any(r.get("status") == "error" for r in raws) or not step_times(raw):
        error = raw.get("error") or f"no steady step measured (status {raw.get('status', 'no report')})"
    names = list(value) if name == "combined" else [name]
    notes = [(r.get("fix_notes") or {}).get(n) or {} for r in raws for n in names]
    if error is None and (missed := next((n for n in notes if n.get("applied") is False), None)) is not None:
        error = f"not applied: {missed.get('reason')}"  # the fix found nothing to change in the script
    gain_ok = speedup is not None and speedup > 1.0 + spread
    bound = fx.max_speedup(name, payload) if name != "combined" else None
    implausible = bool(gain_ok and bound and speedup > bound)
    kept = bool(gain_ok and num["ok"] is not False and error is None and not implausible)
    cost = _compile_cost(raws, around, base_s, step_s, payload)
    repaid = cost is None or cost["pays_back"] is not False
    if error:
        verdict = f"failed: {error}"
    elif num["ok"] is False:
        verdict = "changes results"
    elif implausible:
        verdict = f"implausible (max {bound:.2f}x)"  # the load changed during the runs
    elif kept and not repaid:
        verdict, kept = "does not pay back", False
    elif kept:
        verdict = "kept"
    elif speedup is not None and speedup < 1.0 - spread:
        verdict = "slower"
    else:
        verdict = "within the spread"
    row = {"fix": fx.label(name, value) if name != "combined" else name, "name": name, "value": value,
           "baseline_step_s": base_s, "step_s": step_s, "speedup": speedup, "spread": spread,
           "numerics_ok": num["ok"], "numerics": num, "kept": kept, "verdict": verdict, "code": code,
           "steps": len(fix_times), "runs": len(raws), "max_speedup": bound,
           "others_cores": _most([r.get("others_cores") for r in raws + around])}
    if cost is not None:
        row["compile"] = cost
        row["compile_s"] = cost["compile_s"]
    return row


def _compile_cost(raws: list[dict[str, Any]], around: list[dict[str, Any]], base_s: float | None,
                  step_s: float | None, payload: dict[str, Any]) -> dict[str, Any] | None:
    """A compiling run's one-off cost and whether it pays back: the compile seconds are the time of its
    first windows, up to the one the compile landed in, beyond the baseline runs' same windows (median);
    the break-even is those seconds over the saving per step, against the script's planned steps."""
    extra = []
    for raw in (r for r in raws if r.get("compile_window") is not None):
        n = raw["compile_window"] + 2
        base = [sum(w["wall"] for w in timed_windows(r)[:n]) for r in around if len(timed_windows(r)) >= n]
        if len(raw.get("windows") or []) >= n and base:
            extra.append(max(0.0, sum(w["wall"] for w in raw["windows"][:n]) - statistics.median(base)))
    if not extra:
        return None
    compile_s = statistics.median(extra)
    saving = (base_s - step_s) if base_s and step_s else 0.0
    breakeven = math.ceil(compile_s / saving - 1e-9) if saving > 0 else None  # 10 s / 0.2 s is 50 steps, not 51
    planned = (payload.get("settings") or {}).get("planned_steps") or {}
    steps = planned.get("steps")
    return {"compile_s": compile_s, "saving_s_per_step": saving, "break_even_steps": breakeven,
            "planned_steps": steps, "planned_source": planned.get("source"),
            "pays_back": None if steps is None else breakeven is not None and breakeven <= steps}


def _compile_note(c: dict[str, Any]) -> str:
    """The compile figures a row's verdict carries: seconds, break-even, planned steps."""
    be = "never (no saving per step)" if c["break_even_steps"] is None else f"after {c['break_even_steps']:,} steps"
    plan = (f" of {c['planned_steps']:,} planned ({c['planned_source']})" if c.get("planned_steps")
            else "; the script's planned steps could not be read")
    return f" (compile {c['compile_s']:.1f} s, pays back {be}{plan})"


def apply_measured(payload: dict[str, Any], tried: list[dict[str, Any]], command: list[str]) -> None:
    """Replace the estimated gain of every finding a fix measured with the measured one, and re-rank."""
    by_rule: dict[str, dict[str, Any]] = {}
    for r in tried:
        if r["name"] == "combined" or r["speedup"] is None:
            continue
        for rule in fx.RULES.get(r["name"], ()):
            if rule not in by_rule or r["speedup"] > by_rule[rule]["speedup"]:
                by_rule[rule] = r
    for f in payload.get("findings") or []:
        r = by_rule.get(f["rule"])
        if r is None or f.get("severity") == "bug":
            continue
        gain = 1.0 - r["step_s"] / r["baseline_step_s"]
        f["estimated_gain"] = f["expected_gain"]
        f["measured_gain"] = round(gain, 4)
        f["measured_speedup"] = round(r["speedup"], 4)
        f["expected_gain"] = round(max(0.0, gain), 4) if r["kept"] else 0.0  # no gain beyond the noise: none
        f["gain_basis"] = (f"measured by doctor --try {r['fix']}: {r['baseline_step_s']:.3f} -> {r['step_s']:.3f} "
                           f"s/step ({r['speedup']:.2f}x, spread {r['spread']:.0%}): {r['verdict']}")
        f["measured"] = r["verdict"]
    payload["findings"] = sorted(payload.get("findings") or [], key=_measured_rank)


def _measured_rank(f: dict[str, Any]) -> tuple[int, int, float, float, str]:
    """Bugs first; then fixes --try measured as gains, fixes not measured (estimates), fixes measured
    without a gain (within the spread, slower, changed results), each by expected gain, then by what was
    estimated before measuring; info last."""
    tier = 1 if "measured" not in f else 0 if f["measured"] == "kept" else 2
    return (SEVERITY_ORDER.get(f["severity"], 3), tier, -f["expected_gain"], -(f.get("estimated_gain") or 0.0),
            f["rule"])


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _numerics_cell(r: dict[str, Any]) -> str:
    ok = r["numerics_ok"]
    return "n/a" if ok is None else "ok" if ok else "CHANGED"


def print_tried(t: dict[str, Any], console: Any) -> None:
    if t.get("error"):
        console.print(f"--try: {t['error']}", highlight=False, markup=False)
        return
    rows = [(r["fix"], _fmt(r["baseline_step_s"], ".3f"), _fmt(r["step_s"], ".3f"),
             _fmt(r["speedup"], ".2f") + ("x" if r["speedup"] else ""), _numerics_cell(r),
             r["verdict"] + (_compile_note(r["compile"]) if r.get("compile") else ""))
            for r in t["tried"]]
    print_table(f"Fixes measured on this script: median s/step, baseline re-measured between fixes, "
                f"spread {t['spread']:.0%}", ["fix", "baseline", "with fix", "speed-up", "numerics", "verdict"],
                rows, console)
    console.print(f"a fix is kept when its speed-up exceeds 1 + spread (the baseline's run-to-run range) and what "
                  "removing the phases it changes could give, and its "
                  f"first {t['numerics_steps']} losses (before and after the first update) stay within {t['tolerances']['math']:g} (fp32 fixes) or "
                  f"{t['tolerances']['precision']:g} (precision fixes) relative; loader fixes must yield the same "
                  "batches in the same order; fast_loader the same files and labels, with per-channel image "
                  "statistics within tolerance", highlight=False, markup=False)
    if t.get("busy"):
        console.print(t["busy"], style="bold", highlight=False, markup=False)
    kept = [r for r in t["tried"] if r["kept"] and r["code"]]
    if kept:
        console.print("[bold]To keep a fix, add to the script:[/]")
        for r in kept:
            console.print(f"# {r['fix']} ({r['speedup']:.2f}x)", highlight=False, markup=False)
            console.print(r["code"], highlight=False, markup=False)
    for s in t["skipped"]:
        console.print(f"not tried: {s['fix']}: {s['reason']}", highlight=False, markup=False)


def markdown_tried(t: dict[str, Any]) -> list[str]:
    if t.get("error"):
        return ["## Fixes measured (doctor --try)", "", t["error"], ""]
    lines = ["## Fixes measured (doctor --try)", "", f"Median s/step per run; the baseline re-measured between "
             f"fixes; spread (run-to-run range of the baseline) {t['spread']:.0%}.", "",
             "| fix | baseline s/step | with fix s/step | speed-up | spread | numerics | verdict |",
             "|---|---:|---:|---:|---:|---|---|"]
    if t.get("busy"):
        lines[3:3] = [f"**{t['busy']}**", ""]
    for r in t["tried"]:
        lines.append(f"| {r['fix']} | {_fmt(r['baseline_step_s'], '.3f')} | {_fmt(r['step_s'], '.3f')} | "
                     f"{_fmt(r['speedup'], '.2f')} | {r['spread']:.0%} | {_numerics_cell(r)} | {r['verdict']}"
                     f"{_compile_note(r['compile']) if r.get('compile') else ''} |")
    lines.append("")
    for r in t["tried"]:
        if r["kept"] and r["code"]:
            lines += [f"{r['fix']} ({r['speedup']:.2f}x):", "", "```python", r["code"], "```", ""]
    lines += [f"- not tried: {s['fix']}: {s['reason']}" for s in t["skipped"]]
    return lines + [""]


def launcher(argv: list[str], env: dict[str, str], steps: int, timeout: float | None,
             run_child: Callable[..., tuple[int, dict[str, Any]]]) -> Callable[[dict[str, Any], str], dict[str, Any]]:
    """A `launch(fixes, title)` for try_fixes: the instrumented script, quiet (its output kept in a log,
    its last lines shown if it fails), seeded, with `fixes` injected."""
    def launch(spec: dict[str, Any], title: str) -> dict[str, Any]:
        e = dict(env)
        e[child_env.ENV_STEPS] = str(steps)
        e[child_env.ENV_SEED] = "0"
        e[child_env.ENV_FIXES] = json.dumps(spec) if spec else ""
        e[child_env.ENV_TRACE] = ""
        e[child_env.ENV_CPROFILE] = ""
        e[child_env.ENV_PROBE] = ""  # the attention was measured in the first run
        e[child_env.ENV_MEMORY] = ""  # and the memory
        with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log:
            status, raw = run_child(argv, e, timeout, log)
            if status not in (0, None) and raw.get("status") != "stopped":
                log.seek(0)
                tail = log.read()[-2000:]
                raw.setdefault("error", None)
                raw["error"] = raw["error"] or f"exit status {status}: {tail.strip().splitlines()[-1] if tail.strip() else ''}"
                raw["status"] = "error"
        return raw
    return launch

