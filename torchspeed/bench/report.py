"""The report: `report.md` (machine, summary, one table per suite), PNG plots, and the console's summary.

Input is the dict `orchestration.run_suites` collects: {"machine": ..., "<suite>": suite JSON, ...},
each suite JSON holding "rows" as described in `torchspeed.bench.suites`, read back as `Row`s. The
console gets one line per suite (`console_summary`, 80 columns wide); the tables are the report's.
"""
from __future__ import annotations

import math
import os
import textwrap
from typing import Any

from torchspeed.atomic import atomic_write
from torchspeed.bench import suites
from torchspeed.bench.ceilings import ABOVE_CEILING_NOTE, busy_cores, ceiling_cell
from torchspeed.bench.rows import Row, rows_of
from torchspeed.measure import busy_warning
from torchspeed.tables import format_number

# each part's heading in the report
WHAT = {
    "data": "Data loading: images/s delivered to the model, ready to use",
    "train": "Training: samples/s of a ResNet-18 step, techniques added one by one",
    "infer": "Inference: latency of each variant, with its accuracy effect",
    "compress": "Compression: structured pruning and distillation",
    "design": "Model design: the ShuffleNet V2 guidelines measured on this machine",
    "gpt": "Training a small GPT: tokens/s, techniques added one by one",
}
# each part in a few words, for the console's plan and phase lines
IN_SHORT = {
    "ceilings": "this machine's ceilings (measured once, then cached)",
    "data": "images/s delivered to the model",
    "train": "ResNet-18 training samples/s, technique by technique",
    "infer": "inference latency per variant, accuracy kept",
    "compress": "structured pruning and distillation",
    "design": "the ShuffleNet V2 design guidelines",
    "gpt": "small-GPT training tokens/s, technique by technique",
}
OVER_BUDGET = 1.15  # a part is over its budget beyond this factor (and a few seconds of process start-up)


def _times(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else ""


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


SUMMARY_COLUMNS = ["suite", "technique", "measured (median)", "speed-up vs plain PyTorch", "accuracy",
                   "achieved of this machine's ceiling"]
# suites with no plain-PyTorch baseline to be faster than: their own section only, not the Summary
NOT_IN_SUMMARY = ("design",)


def summary_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """(suite, technique, measured, speed-up, accuracy, achieved of ceiling) per suite."""
    busy = busy_cores(results.get("ceilings")) is not None
    out = []
    for name in suites.SUITE_NAMES:
        result = results.get(name)
        if not isinstance(result, dict) or name in NOT_IN_SUMMARY:
            continue
        if "error" in result:
            first = (result["error"].strip().splitlines() or ["(no message)"])[0]
            out.append((name, "failed", first[:120], "", "", ""))
            continue
        row = headline(result)
        if row is not None:
            out.append((name, row.technique, _median(row), _times(row.speedup), _accuracy(row),
                        ceiling_cell(row, busy)))
    return out


def suite_cells(result: dict[str, Any], busy_ceiling: bool = False) -> tuple[str, str, str, str]:
    """A suite in four short cells: its headline's figure, its speed-up over plain PyTorch, its share of the
    ceiling it is judged against ("(busy)" when that ceiling was a busy reading) and whether other processes
    used the cores while it ran ("" where that cannot be told)."""
    others = result.get("others_cores")
    machine = "" if others is None else f"busy: {others:.1f} cores" if busy_warning(others) else "quiet"
    if "error" in result:
        return "failed (see the report)", "", "", machine
    holds = result.get("holds")
    if isinstance(holds, dict) and holds:  # the design suite: guidelines, not a speed-up
        return f"{sum(bool(v) for v in holds.values())} of {len(holds)} rules hold", "", "", machine
    row = headline(result)
    if row is None:
        return "", "", "", machine
    share = ""
    if isinstance(row.pct_of_ceiling, (int, float)) and row.pct_of_ceiling > 0:
        share = (f"{row.pct_of_ceiling:.0f}%{'*' if row.pct_of_ceiling > 100 else ''} {row.ceiling}"
                 + (" (busy)" if busy_ceiling else ""))
    return _median(row) or _accuracy(row), _times(row.speedup), share, machine


def console_summary(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(suite, measured, speed-up, of ceiling, machine): one short line per suite that ran (`suite_cells`)."""
    busy = busy_cores(results.get("ceilings")) is not None
    return [(name, *suite_cells(results[name], busy)) for name in suites.SUITE_NAMES
            if isinstance(results.get(name), dict)]


def over_budget(result: dict[str, Any]) -> bool:
    """Whether a part took clearly longer than its budget (its `seconds` against its `budget_s`)."""
    seconds, budget = result.get("seconds"), result.get("budget_s")
    return isinstance(seconds, (int, float)) and isinstance(budget, (int, float)) and seconds > OVER_BUDGET * budget + 5


def over_budget_parts(results: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(part, seconds, budget) of each part of a run that was over its budget (`over_budget`)."""
    return [(n, results[n]["seconds"], results[n]["budget_s"]) for n in ("ceilings", *suites.SUITE_NAMES)
            if isinstance(results.get(n), dict) and over_budget(results[n])]


def busy_lines(results: dict[str, Any]) -> list[str]:
    """One line per suite measured while other processes used the cores (`others_cores` in its JSON)."""
    lines = []
    for name in ("ceilings", *suites.SUITE_NAMES):
        result = results.get(name)
        warning = busy_warning(result.get("others_cores")) if isinstance(result, dict) else None
        if warning:
            lines.append(f"{name}: {warning}")
    return lines


def _md_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |")
    return "\n".join(lines)


def _with_note(table: str, cells: list[str]) -> str:
    """A table, with the above-the-ceiling footnote once when one of its cells is starred."""
    return table + ("\n\n" + ABOVE_CEILING_NOTE if any("%*" in c for c in cells) else "")


def _median(row: Row) -> str:
    """The median column: a speed (an accuracy row leaves it empty; its figure is in the accuracy column)."""
    if row.is_accuracy or not row.measured:
        return ""
    return f"{format_number(row.median)} {row.unit}".strip()


def _accuracy(row: Row) -> str:
    """The accuracy column: the row's accuracy when that is its figure, and the drop against the baseline."""
    drop = f"drop {format_number(row.metric_drop)}" if isinstance(row.metric_drop, (int, float)) else ""
    if not (row.is_accuracy and row.measured):
        return drop
    spread = f" ({_spread(row)})" if _spread(row) else ""
    return f"{row.unit} {format_number(row.median)}{spread}" + (f"; {drop}" if drop else "")


def _what(row: Row) -> str:
    """The row's "what this is", with what re-measuring it against the row above found, or the load
    other processes put on the machine while it was timed."""
    if row.vs_above:
        return f"{row.what}. **Slower than the row above at first:** {row.vs_above}"
    warning = busy_warning(row.others_cores)
    if warning:
        return f"{row.what}. **Busy:** other processes used {row.others_cores:.1f} cores while this row was timed"
    return row.what


def suite_table(result: dict[str, Any], busy_ceiling: bool = False) -> str:
    """A suite's rows as a markdown table (the ceiling column only when a row reaches one; each share marked
    when the ceiling was a busy reading)."""
    table = rows_of(result)
    cells = [ceiling_cell(r, busy_ceiling) for r in table]
    with_ceiling = any(cells)
    rows = [(r.technique, _median(r), "" if r.is_accuracy else _spread(r), _times(r.ratio), _times(r.cumulative),
             _accuracy(r), *((cell,) if with_ceiling else ()), _what(r)) for r, cell in zip(table, cells)]
    columns = ["technique", "median", "spread (min-max)", "vs plain PyTorch", "cumulative", "accuracy",
               *(("achieved of this machine's ceiling",) if with_ceiling else ()), "what this is"]
    return _with_note(_md_table(columns, rows), cells)


def ceilings_section(ceilings: dict[str, Any]) -> list[str]:
    """The report's ceilings: what each row is judged against, with when and under what load it was measured."""
    from torchspeed.bench.ceilings import ceiling_rows

    if "error" in ceilings:
        return ["## Ceilings of this machine", "", f"Not measured: {ceilings['error'].splitlines()[0]}"]
    load = ceilings.get("load_avg_1min")
    busy = busy_cores(ceilings)
    lines = [
        "## Ceilings of this machine", "",
        "The best throughput this machine's cores reach on each kind of work (every figure all cores unless "
        "it says one thread; a ceiling keeps the best of its quiet measurements on this machine). Train and infer "
        "rows count their FLOPs with torch.utils.flop_counter and are judged against the ceiling of their "
        "precision; data rows against the decode-only ceiling.", "",
        _md_table(["ceiling", "value", "route", "what"], ceiling_rows(ceilings)), "",
        f"Measured {ceilings.get('measured_at', '?')}"
        + (f" (1-minute load average {load:.1f} then)" if isinstance(load, (int, float)) else "")
        + ("; read from this machine's cache for this report" if ceilings.get("source") == "cache" else ""),
    ]
    if busy is not None:
        lines += ["", f"**Busy ceilings:** other processes used {busy:.1f} cores while these were measured, so they "
                      "read low. They are not kept as this machine's ceilings (the next run measures again), every "
                      "share against them is marked \"busy ceiling\", and no goal below is judged against them. "
                      "Measure them on a quiet machine: `torchspeed bench --refresh-ceilings`."]
    elif isinstance(ceilings.get("not_kept"), dict):
        lines += ["", f"Ceilings {ceilings['not_kept'].get('why', 'measured again: not kept')}."]
    return lines


def limits_section(results: dict[str, Any]) -> list[str]:
    """Each suite's goals against the machine's limits, met or not, with the measured reason; a goal set
    against a ceiling (its text names one) is not judged against a busy reading of the ceilings."""
    busy = busy_cores(results.get("ceilings"))
    rows = []
    for name in suites.SUITE_NAMES:
        result = results.get(name)
        if not isinstance(result, dict):
            continue
        for lim in result.get("limits", []) or []:
            met = lim.get("met")
            verdict = "yes" if met else ("no" if met is False else "not measured")
            if busy is not None and "ceiling" in str(lim.get("goal", "")):
                verdict = f"not judged: busy ceiling (others used {busy:.1f} cores while it was measured)"
            rows.append((name, lim.get("goal", ""), lim.get("measured", ""), verdict, lim.get("why", "")))
    if not rows:
        return []
    return ["## How close to the limits", "",
            _md_table(["suite", "goal", "measured here", "met", "why (measured)"], rows)]


# colour = the ceiling (precision) a row is judged against; no red, which reads as "bad"
PRECISION_COLOURS = {"decode": "#4C72B0", "fp32": "#55A868", "bf16": "#DD8452", "fp16": "#CCB974",
                     "int8": "#8172B2"}
# a GPU's ceilings: its precision's colour (a suite's rows run on one device), nvjpeg apart from the CPU decode
PRECISION_COLOURS |= {gpu: PRECISION_COLOURS[cpu] for cpu, gpu in
                      {"fp32": "gpu_tf32", "bf16": "gpu_bf16", "fp16": "gpu_fp16", "int8": "gpu_int8"}.items()}
PRECISION_COLOURS |= {"nvjpeg": "#DA8BC3", "mem_bw": "#8C8C8C", "gpu_mem_bw": "#8C8C8C"}
OTHER_COLOUR = "#937860"
BAR_COLOUR = "#4C72B0"
ALLOWED_DROP = 0.01  # the infer suite's accuracy guard (top-1), when its JSON does not name one


def _wrap(text: str, width: int = 48) -> str:
    """A long label on several lines, so it fits beside its bar instead of running out of the figure."""
    return textwrap.fill(str(text).strip(), width=width) or "-"


def _save_png(fig: Any, path: str) -> None:
    """A figure as a PNG, written atomically (an interrupted report leaves the old plot, not half a new one)."""
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)


def _finish(fig: Any, out: str, fname: str, plt: Any) -> str:
    _save_png(fig, os.path.join(out, fname))
    plt.close(fig)
    return fname


def _bar_panel(ax: Any, rows: list[Row], values: list[float], xlabel: str, title: str,
               colours: list[str] | None = None, labels: list[str] | None = None) -> None:
    """Horizontal bars, one per row, its value (or its label) written at the bar's end."""
    y = list(range(len(rows)))
    ax.barh(y, values, color=colours or BAR_COLOUR)
    ax.set_yticks(y, [_wrap(r.technique) for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(_wrap(xlabel, 70), fontsize=8)
    ax.set_title(_wrap(title, 70), fontsize=9)
    for i, v in enumerate(values):
        ax.text(v, i, f" {labels[i] if labels else format_number(float(v))}", va="center", fontsize=6)
    ax.margins(x=0.18)  # room for the value labels inside the axes


def _height(rows: int) -> float:
    return 0.32 * rows + 1.6


def _plot_bars(name: str, rows: list[Row], out: str, plt: Any) -> str:
    """One bar chart of a suite's main figure (cumulative speed-up for train, else the median)."""
    cumulative = [r for r in rows if isinstance(r.cumulative, (int, float))]
    if name == "train" and cumulative:
        rows, values = cumulative, [r.cumulative for r in cumulative]
        xlabel, fname = "cumulative speed-up over plain PyTorch (x)", "train_speedup.png"
    else:
        rows = [r for r in rows if r.unit == rows[0].unit]  # one unit per axis
        values = [r.median for r in rows]
        if rows[0].unit == "ms":
            xlabel, fname = "median latency (ms, lower is better)", f"{name}_latency.png"
        else:
            xlabel, fname = f"median {rows[0].unit} (higher is better)", f"{name}.png"
    fig, ax = plt.subplots(figsize=(9, _height(len(rows))), layout="constrained")
    _bar_panel(ax, rows, values, xlabel, WHAT.get(name, name))
    return _finish(fig, out, fname, plt)


def _by_batch(rows: list[Row]) -> dict[int, list[Row]]:
    groups: dict[int, list[Row]] = {}
    for r in rows:
        groups.setdefault(int(r.batch) if isinstance(r.batch, (int, float)) else 0, []).append(r)
    return dict(sorted(groups.items()))


def _plot_infer_latency(rows: list[Row], out: str, plt: Any) -> str:
    """Inference latency, one panel per batch size (a batch of 8 takes longer than a batch of 1)."""
    groups = _by_batch([r for r in rows if r.unit == "ms" and math.isfinite(r.median)])
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, sum(_height(len(g)) for g in groups.values())),
                             layout="constrained", squeeze=False,
                             height_ratios=[len(g) + 2 for g in groups.values()])
    for ax, (batch, group) in zip(axes[:, 0], groups.items()):
        _bar_panel(ax, group, [r.median for r in group], "median latency (ms, lower is better)",
                   f"Inference latency, batch {batch}" if batch else "Inference latency")
    return _finish(fig, out, "infer_latency.png", plt)


def _plot_accuracy(rows: list[Row], out: str, plt: Any, allowed: float = ALLOWED_DROP) -> str:
    """Inference variants: accuracy drop against latency, one panel per batch size, with the allowed drop."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    groups = _by_batch(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 5), layout="constrained", squeeze=False)
    for ax, (batch, group) in zip(axes[0], groups.items()):
        ax.scatter([r.median for r in group], [100 * r.metric_drop for r in group], color=BAR_COLOUR,
                   label="variant")
        points: dict[tuple[float, float], list[str]] = {}
        for r in group:  # variants at the same point share one label
            points.setdefault((r.median, 100 * r.metric_drop), []).append(
                r.technique.split(": ", 1)[-1] if batch else r.technique)
        for i, (xy, names) in enumerate(points.items()):
            ax.annotate(_wrap(" = ".join(names), 28), xy, fontsize=6, textcoords="offset points",
                        xytext=(4, 4 + 7 * (i % 3)))
        ax.axhline(100 * allowed, color="black", linestyle="--", linewidth=1,
                   label=f"allowed drop ({allowed:g} top-1)")
        ax.set_xscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 5, 10, 20 ms rather than 5 x 10^0
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # 1, 2, 5, 10, 20, 50: labelled, not crowded
        ax.xaxis.set_minor_formatter(plain)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_xlabel("median latency (ms, log scale)", fontsize=8)
        ax.set_ylabel("accuracy drop vs fp32 (percentage points)", fontsize=8)
        ax.set_title(f"Accuracy vs latency, batch {batch}" if batch else "Accuracy vs latency", fontsize=9)
        ax.margins(x=0.25, y=0.3)
        ax.legend(fontsize=7, loc="upper right")
    return _finish(fig, out, "infer_accuracy_vs_latency.png", plt)


def _plot_compress(result: dict[str, Any], out: str, plt: Any) -> str | None:
    """Pruning: latency before and after, side by side at each batch size it was timed."""
    prune = result.get("prune") if isinstance(result.get("prune"), dict) else {}
    report, batched = prune.get("report") or {}, prune.get("batched") or {}
    pairs = []
    if isinstance(report.get("latency_before_ms"), (int, float)) and isinstance(report.get("latency_after_ms"),
                                                                                 (int, float)):
        pairs.append((1, report["latency_before_ms"], report["latency_after_ms"]))
    if isinstance(batched.get("original_ms"), (int, float)) and isinstance(batched.get("pruned_ms"), (int, float)):
        pairs.append((batched.get("batch", "?"), batched["original_ms"], batched["pruned_ms"]))
    if not pairs:
        return None
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 4), layout="constrained", squeeze=False)
    for ax, (batch, before, after) in zip(axes[0], pairs):
        bars = ax.bar([0, 1], [before, after], color=[OTHER_COLOUR, BAR_COLOUR])
        ax.set_xticks([0, 1], ["unpruned", "pruned"], fontsize=8)
        for bar, v in zip(bars, (before, after)):
            ax.text(bar.get_x() + bar.get_width() / 2, v, format_number(float(v)), ha="center", va="bottom",
                    fontsize=7)
        ax.set_ylabel("median latency (ms, lower is better)", fontsize=8)
        ax.set_title(f"batch {batch}: {before / after:.2f}x faster pruned", fontsize=9)
        ax.margins(y=0.15)
    fig.suptitle("Structured pruning: latency before and after", fontsize=10)
    return _finish(fig, out, "compress_latency.png", plt)


def _plot_ceiling(name: str, table: list[Row], out: str, plt: Any) -> list[str]:
    """One plot per suite: each row's % of the ceiling of its precision (100% = this machine's best)."""
    from matplotlib.patches import Patch

    rows = [r for r in table if isinstance(r.pct_of_ceiling, (int, float))]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(9, _height(len(rows))), layout="constrained")
    colours = [PRECISION_COLOURS.get(r.ceiling or "", OTHER_COLOUR) for r in rows]
    _bar_panel(ax, rows, [r.pct_of_ceiling for r in rows],
               "% of this machine's ceiling for the row's precision (100 = the ceiling)",
               f"{name}: how close each row comes to this machine's limit", colours=colours,
               labels=[f"{r.pct_of_ceiling:.0f}%" for r in rows])
    ax.axvline(100, color="black", linewidth=1)
    used = list(dict.fromkeys(r.ceiling or "other" for r in rows))
    handles = [Patch(color=PRECISION_COLOURS.get(c, OTHER_COLOUR), label=f"{c} ceiling") for c in used]
    ax.legend(handles=handles, title="judged against", fontsize=7, title_fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1))  # beside the axes: never over a bar
    return [_finish(fig, out, f"{name}_ceiling.png", plt)]


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
    if name == "infer" and any(r.unit == "ms" for r in rows):
        written.append(_plot_infer_latency(rows, out, plt))
        scatter = [r for r in rows if isinstance(r.metric_drop, (int, float)) and r.unit == "ms"
                   and math.isfinite(r.median)]
        if scatter:
            written.append(_plot_accuracy(scatter, out, plt, result.get("max_metric_drop", ALLOWED_DROP)))
        return written
    compress = _plot_compress(result, out, plt) if name == "compress" else None
    written.append(compress or _plot_bars(name, rows, out, plt))
    return written


def summary_section(results: dict[str, Any]) -> list[str]:
    """The Summary table, its footnote, the suites measured on a busy machine, and where design went."""
    rows = summary_rows(results)
    parts = ["## Summary", "", _with_note(_md_table(SUMMARY_COLUMNS, rows), [r[-1] for r in rows])]
    busy = busy_lines(results)
    if busy:
        parts += ["", "Measured on a busy machine:", "", *(f"- {line}" for line in busy)]
    shown = [n for n in NOT_IN_SUMMARY if isinstance(results.get(n), dict)]
    if shown:
        parts += ["", f"Not in the summary ({', '.join(shown)}): no plain-PyTorch baseline to compare with; "
                      "see its own section below."]
    late = [f"{n} {seconds:.0f} s (budget {budget:.0f} s)" for n, seconds, budget in over_budget_parts(results)]
    if late:
        parts += ["", f"Over their time budget (`torchspeed.bench.budget`): {', '.join(late)}."]
    prepared = results.get("prepared")
    if isinstance(prepared, dict) and prepared:
        done = [f"{step} {r['seconds']:.0f} s" + (" (failed: the suites built it)" if "error" in r else "")
                for step, r in prepared.items() if isinstance(r, dict) and isinstance(r.get("seconds"), (int, float))]
        parts += ["", "First run on this machine: built before the suites, outside their budgets: "
                      f"{', '.join(done)}."]
    return parts


def _suite_section(name: str, result: dict[str, Any], out: str, busy_ceiling: bool = False) -> list[str]:
    """A suite's heading, table, plots, figures and notes (or its error)."""
    parts = ["", f"## {name}: {WHAT.get(name, '')}", ""]
    if "error" in result:
        return parts + ["**This suite failed**; the other suites ran. Its error:", "", "```",
                        result.get("traceback") or result["error"], "```"]
    warning = busy_warning(result.get("others_cores"))
    if warning:
        parts += [f"**Note:** {warning}.", ""]
    parts.append(suite_table(result, busy_ceiling))
    try:
        images = plot_suite(name, result, out)
    except ImportError:
        images = []
        parts += ["", "(plots need matplotlib: `pip install 'torchspeed[report]'`)"]
    for img in images:
        parts += ["", f"![{name}]({img})"]
    figures = {k: v for k, v in result.items()
               if k not in ("rows", "notes", "traceback", "limits", "others_cores") and not isinstance(v, (dict, list))
               and v is not None}
    if figures:
        parts += ["", "Figures: " + ", ".join(f"`{k}` = {format_number(v)}" for k, v in figures.items())]
    for note in result.get("notes", []):
        parts += ["", f"- {note}"]
    return parts


def write_report(results: dict[str, Any], out: str, command: str = "torchspeed bench") -> str:
    """Write report.md and the plots into `out`; returns the path of report.md."""
    from torchspeed.runtime import describe_line

    parts = ["# torchspeed report", "", f"Machine: {describe_line(results['machine'])}", "",
             f"Command: `{command}`" + (" (quick mode: short runs, wider spread)" if results.get("quick") else ""), "",
             *summary_section(results)]
    if isinstance(results.get("ceilings"), dict):
        parts += [""] + ceilings_section(results["ceilings"])
    limits = limits_section(results)
    if limits:
        parts += [""] + limits
    for name in suites.SUITE_NAMES:
        if isinstance(results.get(name), dict):
            parts += _suite_section(name, results[name], out, busy_cores(results.get("ceilings")) is not None)
    path = os.path.join(out, "report.md")
    with atomic_write(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return path
