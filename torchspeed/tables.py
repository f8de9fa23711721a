"""The one table style: rich tables for the terminal, and the number format tables and reports share."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_table", "format_number"]


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], console: Any = None) -> None:
    """Print a rich table (the one table style every command uses)."""
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(format_number(v) for v in row))
    (console or Console()).print(table)


def format_number(v: Any) -> str:
    """Table cell text: 3 significant digits, thousands separators for large numbers."""
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)
