"""How the commands print for people: aligned columns under a header row, and moments."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``rows`` under ``header``, each column as wide as its widest cell, two spaces apart."""
    table = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


def moment(at: float | None, *, none: str = "-", now: float | None = None) -> str:
    """``2026-06-01 13:00Z (3 h ago)``, ``… (in 2 d)``, or ``none`` for none."""
    if at is None:
        return none
    now = time.time() if now is None else now
    gap = abs(now - at)
    unit = next(
        (f"{gap / size:.0f} {name}" for size, name in ((86400, "d"), (3600, "h"), (60, "min"))
         if gap >= size),
        f"{gap:.0f} s",
    )  # fmt: skip
    when = f"in {unit}" if at > now else f"{unit} ago"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%MZ") + f" ({when})"
