"""One canonical form of a row, so that PostgreSQL, the topics and every store can be compared
by hashes computed where the data is.

The reference is the topic's JSON: each column's value as the event carries it (docs/events.md's
type table). A store holds it in its own form (Delta typed, OpenSearch converted by
sinks.stores.search.shapes, Redis the event's `after`); its reader turns it back into the event's
form, and this module makes the last steps exact on every side:
- floats: the shortest decimal that reads back as the same float, written out in full
  (`100`, `0.00015`, `1000000000000000000000`) as a JSON string; `NaN`, `Infinity` stay.
  PostgreSQL prints the same digits (extra_float_digits=3) and casts them to numeric exactly;
- JSON columns (json, jsonb, hstore): the parsed value with sorted keys, so that a store that
  parses them (the search index) compares by meaning;
- a row: the JSON array of its canonical values in PostgreSQL's column order (a column the
  row lacks is null); a TOASTed value the topic cannot resolve is `{"unavailable":"toast"}`.

Hashes: the first 8 bytes of the row text's MD5 as a signed 64-bit integer, XORed per segment;
segments are ranges of the key's MD5 (its first 16 bits, of which a table uses `bits`), which
PostgreSQL, Spark and Python compute alike whatever the key's type and collation. Loaded by
Spark executors too: no PostgreSQL, no Spark, no C extension here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson

JSON_NAMES = ("io.debezium.data.Json",)
UNAVAILABLE = {"unavailable": "toast"}  # a TOASTed value the topic no longer holds
MAX_BITS = 16


@dataclass(frozen=True)
class Column:
    """What the comparison knows of a column: its name and its Kafka Connect field schema
    (type, name, items), as the events declare it."""

    name: str
    connect: dict[str, Any]


def float_text(value: float) -> str:
    """The shortest decimal of a float, in full: `100`, `0.5`, `1e300` as 301 digits."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    text = format(Decimal(repr(value)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def value(raw: Any, connect: dict[str, Any]) -> Any:
    """A column's event value in canonical form."""
    if raw is None:
        return None
    kind = connect.get("type")
    if kind in ("float", "double"):
        return float_text(raw) if isinstance(raw, float | int) and not isinstance(raw, bool) else raw
    if kind == "array" and isinstance(raw, list):
        items = connect.get("items", {})
        return [value(x, items) for x in raw]
    if kind == "struct" and isinstance(raw, dict):
        fields = {f["field"]: f for f in connect.get("fields", ())}
        return {k: value(v, fields.get(k, {})) for k, v in raw.items()}
    if connect.get("name") in JSON_NAMES and isinstance(raw, str):
        try:
            return orjson.loads(raw)  # its keys sorted by row_text
        except orjson.JSONDecodeError:
            return raw
    return raw


def _needs_work(connect: dict[str, Any]) -> bool:
    """Whether a column's event value differs from its canonical one (else: taken as it is)."""
    kind = connect.get("type")
    return kind in ("float", "double", "array", "struct") or connect.get("name") in JSON_NAMES


_PLANS: dict[int, tuple[Sequence[Column], list[tuple[str, dict[str, Any] | None]]]] = {}


def _plan(columns: Sequence[Column]) -> list[tuple[str, dict[str, Any] | None]]:
    found = _PLANS.get(id(columns))
    if found is None or found[0] is not columns:
        found = _PLANS[id(columns)] = (columns, [(c.name, c.connect if _needs_work(c.connect) else None) for c in columns])
    return found[1]


def row_values(row: dict[str, Any], columns: Sequence[Column], unresolved: Iterable[str] = ()) -> list[Any]:
    """A row's canonical values in column order (most columns are taken as they are: the
    conversions are planned once per column list)."""
    plan = _plan(columns)
    values = [row.get(name) if connect is None else value(row.get(name), connect) for name, connect in plan]
    if unresolved:
        missing = set(unresolved)
        values = [UNAVAILABLE if name in missing else v for (name, _), v in zip(plan, values, strict=True)]
    return values


def row_text(values: list[Any]) -> bytes:
    """The canonical text PostgreSQL's SQL also builds (snapshot.digest)."""
    return orjson.dumps(values, option=orjson.OPT_SORT_KEYS)


def row_hash(text: bytes) -> int:
    return int.from_bytes(hashlib.md5(text).digest()[:8], "big", signed=True)  # noqa: S324 (a checksum)


def bucket(key: bytes, bits: int) -> int:
    """The key's segment: the top `bits` of the first 16 bits of its MD5."""
    top = int.from_bytes(hashlib.md5(key).digest()[:2], "big")  # noqa: S324 (a checksum)
    return top >> (MAX_BITS - bits)


def bits_for(rows: int, per_segment: int = 64) -> int:
    """Segments of about `per_segment` rows (at most 2^16)."""
    return max(0, min(MAX_BITS, math.ceil(math.log2(max(1, rows) / per_segment)) if rows > per_segment else 0))
