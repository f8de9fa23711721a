"""Run benchmark suites, keep going when one fails, collect their JSON under the suite names, and
write the report."""
from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from torchspeed.atomic import write_json
from torchspeed.bench import suites
from torchspeed.tables import print_table
from torchspeed.runtime import describe, describe_line

# Expected seconds per suite on a 2-core machine with warm caches (quick, full): the time-left estimate.
EXPECTED_S = {"data": (75, 300), "train": (100, 600), "infer": (130, 900), "compress": (100, 600), "design": (30, 180)}


def run_suites(names: Sequence[str], quick: bool = False, out: str = "torchspeed-report",
               json_path: str | None = None, console: Console | None = None,
               command: str = "torchspeed bench") -> dict[str, Any]:
    """Run each suite in turn; a failing suite is recorded with its error and the others still run.

    Writes `results.json` (and `--json PATH`), `report.md` and the plots into `out`.
    """
    console = console or Console()
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the report directory {out!r}: {e.strerror}") from None
    machine = describe()
    console.print(f"[bold]Machine:[/] {describe_line(machine)}")
    results: dict[str, Any] = {"machine": machine, "quick": quick}
    todo = [n for n in names if suites.load(n) is not None]
    missing = [n for n in names if n not in todo]
    if missing:
        console.print(f"not built into this version yet: {', '.join(missing)}")
    expected = {n: EXPECTED_S.get(n, (60, 300))[0 if quick else 1] for n in todo}
    start = time.perf_counter()
    for i, name in enumerate(todo, 1):
        module = suites.load(name)
        t0 = time.perf_counter()
        with console.status(f"[{i}/{len(todo)}] {name}: starting") as status:
            def progress(text: str, _name: str = name, _i: int = i) -> None:
                elapsed = time.perf_counter() - t0
                left = max(expected[_name] - elapsed, 0) + sum(expected[n] for n in todo[_i:])
                status.update(f"[{_i}/{len(todo)}] {_name}: {text}  ({elapsed:.0f} s in suite, ~{left / 60:.1f} min left)")
            try:
                results[name] = module.run(quick=quick, progress=progress)
            except Exception as e:  # one suite's failure must not lose the others
                results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                console.print(f"[red]suite {name} failed:[/] {type(e).__name__}: {e}")
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print_suite(name, results[name], console)
        write_json(os.path.join(out, "results.json"), results)  # after each suite: an interrupted run keeps the rest
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_json(os.path.join(out, "results.json"), results)
    if json_path:
        write_json(json_path, results)
    from torchspeed.bench.report import summary_rows, write_report

    report = write_report(results, out, command=command)
    print_table("Summary: speed-up of each technique over plain PyTorch on this machine",
                ["suite", "technique", "measured", "speed-up", "accuracy drop"], summary_rows(results), console)
    console.print(f"report: {report} ({results['seconds'] / 60:.1f} min)")
    return results


def print_suite(name: str, result: dict[str, Any], console: Console) -> None:
    if "error" in result:
        return
    rows = [
        (r["technique"], r.get("median"), r.get("unit", ""), r.get("ratio"), r.get("cumulative"), r.get("metric_drop"))
        for r in result.get("rows", [])
    ]
    title = getattr(suites.load(name), "TITLE", name)
    print_table(title, ["technique", "median", "unit", "ratio", "cumulative", "metric drop"], rows, console)
