"""How the operator's views write numbers (`cdc top`, `cdc report`): bytes, durations, rates."""

from __future__ import annotations


def size(n: float | None) -> str:
    """Bytes as people read them: 512 B, 27.4 kB, 1.7 MB."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


def duration(s: float | None) -> str:
    """0.25 s, 7.4 s, 28.4 s, 2.2 min, 3.0 h."""
    if s is None:
        return "-"
    if s < 10:
        return (f"{s:.2f}".rstrip("0").rstrip(".") or "0") + " s"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def rate(r: float | None) -> str:
    """Per second: whole above 10, one decimal below."""
    return "-" if r is None else f"{r:,.0f}" if r >= 10 else f"{r:,.1f}"
