"""The one table style: rich tables for the terminal, and the number format tables and reports share.

A table prints as a grid when it fits the console with every cell on one line, wrapping at most one
column (its widest, kept at least `WRAPPED_MIN` characters wide and as wide as the next: a sentence
wraps well). Squeezed into a narrower console (80 columns: a pipe, CI, a default terminal), a grid of
many columns breaks every cell into one-word lines, so each row is then printed as a short block
instead: its first cell, then the other columns as "column value" pairs wrapped under it. Nothing is
cut in either form.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

__all__ = ["print_table", "format_number", "grid_fits"]

WRAPPED_MIN = 30  # the one column a grid may wrap keeps at least this many characters
ROW_INDENT = 4    # a row printed as a block: its other columns, under its first cell


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], console: Any = None) -> None:
    """Print a rich table (the one table style every command uses): a grid where it fits the console's
    width (`grid_fits`), else one block per row."""
    console = console or Console()
    cells = [[format_number(v) for v in row] for row in rows]
    if grid_fits(columns, cells, console.width):
        table = Table(title=title, title_justify="left")
        for i, col in enumerate(columns):
            table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")  # nothing cut
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return
    console.print(Text(title, style="italic"))
    for row in cells:
        console.print(Text(row[0] if row else "", style="bold"))
        rest = "; ".join(f"{col} {cell}" for col, cell in zip(columns[1:], row[1:]) if cell)
        if rest:
            console.print(Padding(Text(rest), (0, 0, 0, ROW_INDENT)))


def grid_fits(columns: Sequence[str], cells: Sequence[Sequence[str]], width: int) -> bool:
    """Whether a grid of these cells fits `width` columns with every cell on one line but those of its widest
    column, which keeps at least `WRAPPED_MIN` characters and the width of the next widest."""
    if not columns:
        return True
    natural = []
    for i, col in enumerate(columns):
        lines = [cell_len(line) for row in cells if i < len(row) for line in (str(row[i]).splitlines() or [""])]
        natural.append(max([cell_len(str(col)), *lines]))  # rich lays a header out whole where it can
    ordered = sorted(natural, reverse=True)
    second = ordered[1] if len(ordered) > 1 else 0
    kept = min(ordered[0], max(WRAPPED_MIN, second))  # rich narrows the widest column first, down to the next one
    borders_and_padding = 3 * len(columns) + 1
    return sum(ordered[1:]) + kept + borders_and_padding <= width


def format_number(v: Any) -> str:
    """Table cell text: 3 significant digits, thousands separators for large numbers."""
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)
