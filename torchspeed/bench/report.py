"""The report: `report.md` (machine, summary, one table per suite), PNG plots and the summary table.

Input is the dict `orchestration.run_suites` collects: {"machine": ..., "<suite>": suite JSON, ...},
each suite JSON holding "rows" as described in `torchspeed.bench.suites`, read back as `Row`s.
"""
from __future__ import annotations

import os
from typing import Any

from torchspeed.atomic import atomic_write
from torchspeed.bench import suites
from torchspeed.bench.rows import Row, rows_of
from torchspeed.tables import format_number

WHAT = {
    "data": "Data loading: images/s delivered to the model, ready to use",
    "train": "Training: samples/s of a ResNet-18 step, techniques added one by one",
    "infer": "Inference: latency of each variant, with its accuracy effect",
    "compress": "Compression: structured pruning and distillation",
    "design": "Model design: the ShuffleNet V2 guidelines measured on this machine",
}


def _spread(row: Row) -> str:
    lo, hi = row.min, row.max
    if lo is None or hi is None:
        return ""
    return f"{format_number(lo)}-{format_number(hi)}"


def headline(result: dict[str, Any]) -> Row | None:
    """The row that sums a suite up: one marked `"headline": True`, else the largest speed-up."""
    rows = rows_of(result)
    marked = [r for r in rows if r.headline]
    if marked:
        return marked[0]
    scored = [r for r in rows if isinstance(r.speedup, (int, float))]
    return max(scored, key=lambda r: r.speedup, default=None)


SUMMARY_COLUMNS = ["suite", "technique", "measured (median)", "speed-up vs plain PyTorch", "accuracy drop",
                   "% of this machine's ceiling"]


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(suite, technique, measured, speed-up, accuracy effect, % of ceiling) per suite."""
    out = []
    for name in suites.SUITE_NAMES:
        result = results.get(name)
        if not isinstance(result, dict):
            continue
        if "error" in result:
            out.append((name, "failed", result["error"].splitlines()[0][:120], "", "", ""))
            continue
        row = headline(result)
        if row is None:
            continue
        ratio = row.speedup
        out.append((
            name,
            row.technique,
            f"{format_number(row.median)} {row.unit}".strip(),
            f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else "",
            format_number(row.metric_drop),
            _pct(row),
        ))
    return out


def _md_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |")
    return "\n".join(lines)


def _pct(row: Row) -> str:
    p = row.pct_of_ceiling
    if not isinstance(p, (int, float)):
        return ""
    unit = {"decode": "img/s"}.get(row.ceiling or "", "GOP/s" if row.ceiling == "int8" else "GFLOP/s")
    above = (" - above the ceiling: a ceiling is the fastest route timed on its reference GEMM, not a hard limit "
             "(or it was timed at a busier moment: `--refresh-ceilings` on a quiet machine)") if p > 100 else ""
    return f"{p:.0f}% of {row.ceiling} ({format_number(row.achieved)} {unit}){above}"


def suite_table(result: dict[str, Any]) -> str:
    """A suite's rows as a markdown table (the ceiling column only when a row reaches one)."""
    table = rows_of(result)
    with_ceiling = any(isinstance(r.pct_of_ceiling, (int, float)) for r in table)
    rows = [
        (
            r.technique,
            f"{format_number(r.median)} {r.unit}".strip(),
            _spread(r),
            f"{r.ratio:.2f}x" if isinstance(r.ratio, (int, float)) else "",
            f"{r.cumulative:.2f}x" if isinstance(r.cumulative, (int, float)) else "",
            format_number(r.metric_drop),
            *((_pct(r),) if with_ceiling else ()),
            r.what,
        )
        for r in table
    ]
    return _md_table(["technique", "median", "spread (min-max)", "vs plain PyTorch", "cumulative", "accuracy drop",
                      *(("% of this machine's ceiling",) if with_ceiling else ()), "what this is"], rows)


def ceilings_section(ceilings: dict[str, Any]) -> list[str]:
    """The report's ceilings: what each row is judged against, with when and under what load it was measured."""
    from torchspeed.bench.ceilings import ceiling_rows

    if "error" in ceilings:
        return ["## Ceilings of this machine", "", f"Not measured: {ceilings['error'].splitlines()[0]}"]
    load = ceilings.get("load_avg_1min")
    return [
        "## Ceilings of this machine", "",
        "The best throughput this machine's cores reach on each kind of work (every figure all cores unless "
        "it says one thread; a ceiling keeps the best of its measurements on this machine). Train and infer rows "
        "count their FLOPs with torch.utils.flop_counter and are judged against the ceiling of their precision; "
        "data rows against the decode-only ceiling.", "",
        _md_table(["ceiling", "value", "route", "what"], ceiling_rows(ceilings)), "",
        f"Measured {ceilings.get('measured_at', '?')}"
        + (f" (1-minute load average {load:.1f} then)" if isinstance(load, (int, float)) else "")
        + ("; read from this machine's cache for this report" if ceilings.get("source") == "cache" else ""),
    ]


def limits_section(results: dict[str, Any]) -> list[str]:
    """Each suite's goals against the machine's limits, met or not, with the measured reason."""
    rows = []
    for name in suites.SUITE_NAMES:
        result = results.get(name)
        if not isinstance(result, dict):
            continue
        for lim in result.get("limits", []) or []:
            met = lim.get("met")
            rows.append((name, lim.get("goal", ""), lim.get("measured", ""),
                         "yes" if met else ("no" if met is False else "not measured"), lim.get("why", "")))
    if not rows:
        return []
    return ["## How close to the limits", "",
            _md_table(["suite", "goal", "measured here", "met", "why (measured)"], rows)]


def _save_png(fig: Any, path: str) -> None:
    """A figure as a PNG, written atomically (an interrupted report leaves the old plot, not half a new one)."""
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)


def plot_suite(name: str, result: dict[str, Any], out: str) -> list[str]:
    """PNG plots for one suite; returns the file names written (relative to `out`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows_of(result)
    rows = [r for r in table if r.measured]
    if not rows:
        return []
    written = _plot_ceiling(name, table, out, plt)
    cumulative_rows = [r for r in rows if isinstance(r.cumulative, (int, float))]
    if name == "train" and cumulative_rows:
        rows = cumulative_rows
        values = [r.cumulative for r in rows]
        xlabel, fname = "cumulative speed-up over plain PyTorch (x)", "train_speedup.png"
    else:
        rows = [r for r in rows if r.unit == rows[0].unit]  # one unit per axis
        values = [r.median for r in rows]
        if rows[0].unit == "ms":
            xlabel, fname = "median latency (ms, lower is better)", f"{name}_latency.png"
        else:
            xlabel, fname = f"median {rows[0].unit}", f"{name}.png"
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh(list(y), values, color="#4C72B0")
    ax.set_yticks(list(y), [r.technique for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(WHAT.get(name, name), fontsize=10)
    for i, v in enumerate(values):
        ax.text(v, i, f" {format_number(float(v))}", va="center", fontsize=7)
    fig.tight_layout()
    _save_png(fig, os.path.join(out, fname))
    plt.close(fig)
    written.append(fname)
    scatter = [r for r in rows if isinstance(r.metric_drop, (int, float)) and r.unit == "ms"]
    if name == "infer" and scatter:
        written.append(_plot_accuracy(scatter, out, plt))
    return written


def _plot_accuracy(rows: list[Row], out: str, plt: Any) -> str:
    """Inference variants: accuracy drop against latency."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r.median for r in rows], [100 * r.metric_drop for r in rows], color="#DD8452")
    for r in rows:
        ax.annotate(r.technique, (r.median, 100 * r.metric_drop), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("median latency (ms, log scale)")
    ax.set_ylabel("accuracy drop vs fp32 (percentage points)")
    ax.set_title("Inference candidates: accuracy vs latency", fontsize=10)
    fig.tight_layout()
    fname = "infer_accuracy_vs_latency.png"
    _save_png(fig, os.path.join(out, fname))
    plt.close(fig)
    return fname


def _plot_ceiling(name: str, table: list[Row], out: str, plt: Any) -> list[str]:
    """One plot per suite: each row's % of the ceiling of its kind of work (100% = this machine's best)."""
    rows = [r for r in table if isinstance(r.pct_of_ceiling, (int, float))]
    if not rows:
        return []
    fname = f"{name}_ceiling.png"
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.4))
    y = list(range(len(rows)))
    colours = {"decode": "#4C72B0", "fp32": "#55A868", "bf16": "#C44E52", "int8": "#8172B2"}
    ax.barh(y, [r.pct_of_ceiling for r in rows], color=[colours.get(r.ceiling, "#937860") for r in rows])
    ax.axvline(100, color="black", linewidth=1)
    ax.set_yticks(y, [f"{r.technique} [{r.ceiling}]" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of this machine's ceiling for the row's kind of work (100 = the ceiling)")
    ax.set_title(f"{name}: how close each row comes to this machine's limit", fontsize=10)
    for i, r in enumerate(rows):
        ax.text(r.pct_of_ceiling, i, f" {r.pct_of_ceiling:.0f}%", va="center", fontsize=6)
    fig.tight_layout()
    _save_png(fig, os.path.join(out, fname))
    plt.close(fig)
    return [fname]


def write_report(results: dict[str, Any], out: str, command: str = "torchspeed bench") -> str:
    """Write report.md and the plots into `out`; returns the path of report.md."""
    from torchspeed.runtime import describe_line

    parts = [
        "# torchspeed report",
        "",
        f"Machine: {describe_line(results['machine'])}",
        "",
        f"Command: `{command}`" + (" (quick mode: short runs, wider spread)" if results.get("quick") else ""),
        "",
        "## Summary",
        "",
        _md_table(SUMMARY_COLUMNS, summary_rows(results)),
    ]
    if isinstance(results.get("ceilings"), dict):
        parts += [""] + ceilings_section(results["ceilings"])
    limits = limits_section(results)
    if limits:
        parts += [""] + limits
    for name in suites.SUITE_NAMES:
        result = results.get(name)
        if not isinstance(result, dict):
            continue
        parts += ["", f"## {name}: {WHAT.get(name, '')}", ""]
        if "error" in result:
            parts += ["**This suite failed**; the other suites ran. Its error:", "", "```",
                      result.get("traceback") or result["error"], "```"]
            continue
        parts.append(suite_table(result))
        try:
            images = plot_suite(name, result, out)
        except ImportError:
            images = []
            parts += ["", "(plots need matplotlib: `pip install 'torchspeed[report]'`)"]
        for img in images:
            parts += ["", f"![{name}]({img})"]
        figures = {k: v for k, v in result.items()
                   if k not in ("rows", "notes", "traceback", "limits") and not isinstance(v, (dict, list))}
        if figures:
            parts += ["", "Figures: " + ", ".join(f"`{k}` = {format_number(v)}" for k, v in figures.items())]
        for note in result.get("notes", []):
            parts += ["", f"- {note}"]
    path = os.path.join(out, "report.md")
    with atomic_write(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return path
