"""Pinned session settings for every PostgreSQL connection that renders values.

The same row must always give byte-identical key bytes, or compaction keeps stale
rows. Values reach us as PostgreSQL's text output, which depends on these GUCs,
so the walsender (pgoutput) and any snapshot reader run with exactly these.
"""

from __future__ import annotations

PINNED_SETTINGS: dict[str, str] = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, MDY",
    "IntervalStyle": "iso_8601",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "lc_monetary": "C",
    "client_encoding": "UTF8",
}


def libpq_options() -> str:
    """The value for libpq's `options` connection parameter (`-c name=value ...`)."""
    parts = []
    for name, value in PINNED_SETTINGS.items():
        escaped = value.replace("\\", "\\\\").replace(" ", "\\ ")
        parts.append(f"-c {name}={escaped}")
    return " ".join(parts)
