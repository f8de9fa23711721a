"""Printing and writing reports: the phase table, where the memory goes, the ranked advice, the lint tables,
markdown.

Works on plain dicts (the JSON payloads), so a profile, a doctor run and a lint print the same way.
"""
from __future__ import annotations

import os
import shlex
from typing import Any

from rich.console import Console

from torchspeed.doctor.trying import markdown_tried
from torchspeed.tables import print_table

__all__ = ["print_profile", "print_memory", "markdown_memory", "print_findings", "print_lint", "format_lint",
           "format_profile", "markdown"]

PART_NAMES = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
              "activations": "activations (saved for backward)", "rest": "the rest"}
TOP_PRODUCERS_SHOWN = 5


def _console(console: Any = None) -> Any:
    return console if console is not None else Console()


def _capture(fn, *args) -> str:
    con = Console(width=120, record=True, file=open(os.devnull, "w"))
    fn(*args, con)
    return con.export_text()


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def print_findings(findings: list[dict[str, Any]], console: Any = None, title: str = "Advice, ranked by expected gain") -> None:
    """A numbered list (a table is unreadable with sentences in the cells): rule, gain, seen, fix, command."""
    con = _console(console)
    if not findings:
        con.print("No findings: nothing this doctor knows how to improve.")
        return
    con.print(f"[bold]{title}[/]")
    for i, f in enumerate(findings, 1):
        f = f.to_dict() if hasattr(f, "to_dict") else f
        gain = {"bug": "BUG", "info": "info"}.get(f["severity"], f"~{f['expected_gain']:.0%} of the time")
        if f.get("measured"):
            gain = f"measured {f['measured_speedup']:.2f}x by --try: {f['measured']}"
        con.print(f"{i}. [bold]{f['rule']}[/] ({gain}): {f['message']}", highlight=False)
        con.print(f"   fix: {f['fix']}", highlight=False, markup=False)
        con.print(f"   measure: {f['command']}", highlight=False, markup=False)


def print_profile(d: dict[str, Any], console: Any = None) -> None:
    """The phase table, the verdict with its evidence, and the ranked advice."""
    con = _console(console)
    wall = d.get("wall_s") or 0.0
    steps = d.get("steps") or 0
    if not steps:
        for e in d.get("evidence", []):
            con.print(f"  - {e}", highlight=False)
        return
    rows = []
    for phase, s in d.get("phases", {}).items():
        if phase == "eval" and not s:
            continue
        rows.append((phase, f"{s * 1e3 / max(steps, 1):,.1f}", f"{s / wall:.0%}" if wall else "-"))
    rows.append(("step (wall)", f"{wall * 1e3 / max(steps, 1):,.1f}", "100%"))
    print_table(f"Per-step time ({steps} steps)", ["phase", "ms/step", "share"], rows, con)
    extra = []
    if d.get("throughput"):
        extra.append(f"throughput {d['throughput']:,.1f} samples/s")
    if d.get("peak_memory_bytes"):
        extra.append(f"peak memory of the run {_mb(d['peak_memory_bytes'])}")  # beside one step's, below
    if extra:
        con.print(", ".join(extra))
    con.print(f"[bold]Verdict: {d.get('verdict')}[/]")
    for e in d.get("evidence", []):
        con.print(f"  - {e}", highlight=False)
    if d.get("memory"):
        print_memory(d["memory"], con)
    if d.get("hotspots"):
        print_table("Python hot spots (cProfile, cumulative)", ["function", "calls", "cum s", "self s"],
                    [(h["function"], h["calls"], h["cumulative_s"], h["self_s"]) for h in d["hotspots"]], con)
    print_findings(d.get("findings", []), con)


def print_memory(m: dict[str, Any], console: Any = None) -> None:
    """Where a step's memory goes (a `memory_breakdown.MemoryBreakdown` as a dict): its peak split by part,
    the peak of each phase, the modules whose forwards saved the most, and what the figures are read from."""
    con = _console(console)
    if m.get("skipped"):
        con.print(f"Memory: not measured ({m['skipped']})", highlight=False, markup=False)
        return
    peak = m.get("peak_bytes") or 0
    con.print(f"[bold]Where the memory goes[/] (step {m['step']}): peak {_mb(peak)} in {m['peak_phase']}",
              highlight=False)
    con.print(f"read from the {m['source']} on {m['device']}", highlight=False, markup=False)
    rows = [(PART_NAMES.get(k, k), f"{v / 2**20:,.1f}", f"{v / peak:.0%}" if peak else "-")
            for k, v in m.get("parts", {}).items()]
    print_table("The peak by part", ["part", "MiB", "share"], rows, con)
    if m.get("phases"):
        con.print("peak per phase: " + ", ".join(f"{p} {_mb(v)}" for p, v in m["phases"].items()),
                  highlight=False, markup=False)
    if m.get("producers"):
        shown = m["producers"][:TOP_PRODUCERS_SHOWN]
        con.print(f"activations saved for backward: {_mb(m['activations_bytes'])} at most", highlight=False)
        print_table("Largest activation producers", ["module", "type", "MiB", "share"],
                    [(p["module"], p["type"], f"{p['bytes'] / 2**20:,.1f}", f"{p['share']:.0%}") for p in shown], con)
    for note in m.get("notes", []):
        con.print(f"  - {note}", highlight=False, markup=False)


def markdown_memory(m: dict[str, Any]) -> list[str]:
    """`print_memory` as markdown lines."""
    if m.get("skipped"):
        return [f"Memory: not measured ({m['skipped']})", ""]
    peak = m.get("peak_bytes") or 0
    lines = [f"## Where the memory goes (step {m['step']}, peak {_mb(peak)} in {m['peak_phase']}, "
             f"{m['source']}, {m['device']})", "", "| part | MiB | share |", "|---|---:|---:|"]
    lines += [f"| {PART_NAMES.get(k, k)} | {v / 2**20:,.1f} | {v / peak:.0%} |" if peak else f"| {k} | - | - |"
              for k, v in m.get("parts", {}).items()]
    lines += ["", "Peak per phase: " + ", ".join(f"{p} {_mb(v)}" for p, v in m.get("phases", {}).items()), ""]
    if m.get("producers"):
        lines += ["| module | type | MiB | share of activations |", "|---|---|---:|---:|"]
        lines += [f"| {p['module']} | {p['type']} | {p['bytes'] / 2**20:,.1f} | {p['share']:.0%} |"
                  for p in m["producers"][:TOP_PRODUCERS_SHOWN]] + [""]
    return lines + [f"- {n}" for n in m.get("notes", [])] + [""]


def format_profile(d: dict[str, Any]) -> str:
    """`print_profile` as text (what `str(ProfileResult)` shows)."""
    return _capture(print_profile, d)


def print_lint(rep: Any, console: Any = None, top: int = 12) -> None:
    """The model's totals, its `top` layers by measured time, the time per op kind and the ranked findings."""
    con = _console(console)
    d = rep.to_dict() if hasattr(rep, "to_dict") else rep
    t = d["totals"]
    con.print(f"[bold]{d['model']}[/] input {tuple(d['input_shape'])}: {t['flops'] / 1e9:,.2f} GFLOPs, "
              f"memory access {_mb(t['memory_bytes'])}, {t['params'] / 1e6:,.2f} M params, "
              f"forward {t['time_s'] * 1e3:,.2f} ms measured ({int(t['ops'])} ops)")
    print_table(f"Top {top} layers by measured time", ["layer", "type", "ops", "MFLOPs", "memory MiB", "ms", "share"],
                [(r["layer"] or "(top)", r["type"], ",".join(r["ops"][:3]), f"{r['flops'] / 1e6:,.1f}",
                  f"{r['memory_bytes'] / 2**20:,.2f}", f"{r['time_s'] * 1e3:,.2f}", f"{r['time_share']:.0%}")
                 for r in d["layers"][:top]], con)
    print_table("By op kind", ["kind", "ops", "FLOPs share", "memory share", "time share"],
                [(k, int(v["ops"]), f"{v['flops'] / max(t['flops'], 1):.1%}",
                  f"{v['memory_bytes'] / max(t['memory_bytes'], 1):.0%}", f"{v['time_share']:.0%}")
                 for k, v in sorted(d["by_kind"].items(), key=lambda kv: -kv[1]["time_s"]) if k != "view"], con)
    if d.get("by_part"):  # a transformer: its cost split into embeddings, attention, MLP, head and the rest
        print_table("By part", ["part", "ops", "MFLOPs", "FLOPs share", "ms", "time share"],
                    [(k, int(v["ops"]), f"{v['flops'] / 1e6:,.1f}", f"{v['flops'] / max(t['flops'], 1):.1%}",
                      f"{v['time_s'] * 1e3:,.2f}", f"{v['time_share']:.0%}") for k, v in d["by_part"].items()], con)
    if d.get("busy"):
        waited = f"; lint waited {d['waited_s']:.1f} s for quiet before timing" if d.get("waited_s") else ""
        con.print(f"[bold]{d['busy']}[/] (the layer times above{waited})", highlight=False)
    print_findings(d["findings"], con, title="Lint findings, ranked by expected gain (share of forward time)")


def format_lint(rep: Any) -> str:
    """`print_lint` as text (what `str(LintResult)` shows)."""
    return _capture(print_lint, rep)


def markdown(d: dict[str, Any], title: str) -> str:
    """A short markdown report (written by `doctor --out DIR`)."""
    lines = [f"# {title}", ""]
    if "command" in d:
        lines += [f"Command: `{shlex.join(d['command'])}`  ", f"Exit status: {d.get('exit_status')}", ""]
    if "phases" in d:
        wall, steps = d.get("wall_s") or 0.0, max(d.get("steps") or 0, 1)
        lines += [f"Steps measured: {d.get('steps')}, verdict: **{d.get('verdict')}**", "",
                  "| phase | ms/step | share |", "|---|---:|---:|"]
        for p, s in d["phases"].items():
            lines.append(f"| {p} | {s * 1e3 / steps:.2f} | {s / wall:.0%} |" if wall else f"| {p} | - | - |")
        lines += [""] + [f"- {e}" for e in d.get("evidence", [])] + [""]
    if d.get("memory"):
        lines += markdown_memory(d["memory"])
    lines += ["## Advice (ranked)", ""]
    for i, f in enumerate(d.get("findings", []), 1):
        gain = "bug" if f["severity"] == "bug" else f"~{f['expected_gain']:.0%}"
        if f.get("measured"):
            gain = f"measured {f['measured_speedup']:.2f}x: {f['measured']}"
        lines += [f"{i}. **{f['rule']}** ({gain}): {f['message']}", f"   - fix: {f['fix']}",
                  f"   - measure: `{f['command']}`", f"   - gain basis: {f['gain_basis']}"]
    if d.get("try"):
        lines += [""] + markdown_tried(d["try"])
    if d.get("error"):
        lines += ["", f"The script raised: `{d['error']}`"]
    return "\n".join(lines) + "\n"
