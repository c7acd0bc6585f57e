"""The read model's columns: each source column's type there, and the SQL that turns the event's
JSON value (Debezium's rendering, cdc.events.types) back into it.

A column keeps its source type where the event's value converts back exactly (numbers,
booleans, text, uuid, network addresses, bytea, dates and times, json/jsonb); money becomes
numeric (its text is locale-bound) and an interval is rebuilt from the event's microseconds
(a month is 30.4375 days, as the event counts it). Arrays become jsonb arrays. Every other
type (enums, ranges, geometry, hstore, bit strings, timetz, user types) is text: the event's
string, or its JSON for a structured value. Every table also has `_cdc_key` (the record
key's JSON, its primary key) and the position of its last change (`_cdc_lsn`, `_cdc_seq`,
`_cdc_partition`, `_cdc_offset`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc.naming import quote_ident, quote_literal
from sinks.versions import ColumnShape, Version

#: the bookkeeping columns of every table: the key, and the last change's position
META = (("_cdc_key", "text PRIMARY KEY"), ("_cdc_lsn", "bigint NOT NULL"), ("_cdc_seq", "bigint NOT NULL"),
        ("_cdc_partition", "integer NOT NULL"), ("_cdc_offset", "bigint NOT NULL"))
META_NAMES = frozenset(name for name, _ in META)

#: source types kept as they are: the event's text converts back with a cast
_CAST = frozenset({
    "bool", "int2", "int4", "int8", "oid", "float4", "float8", "numeric", "text", "varchar", "bpchar", "name",
    "uuid", "inet", "cidr", "macaddr", "macaddr8", "timestamptz", "json", "jsonb", "xml", "pg_lsn",
})
_INFINITE_DATE = ("-2147472692", "-2147472691")  # infinity, -infinity as the event's days
_INFINITE_TS = {"ms": ("9223372036825200", "-9223372036832400"),
                "us": ("9223372036825200000", "-9223372036832400000")}


@dataclass(frozen=True)
class Target:
    """One column of a read model table: its name, its declared type there (format_type's
    spelling) and the SQL of its value from the change's row (`s._cdc_r`, jsonb)."""

    name: str
    type: str
    value: str
    #: the type PostgreSQL's side of verify renders it as (the source's name), or None: text
    kept: str | None


def _precision(modifier: int) -> int:
    return 6 if modifier < 0 else modifier


def declared(shape: ColumnShape) -> str:
    """The source type as PostgreSQL's format_type spells it, with its modifier
    (`numeric(10,2)`, `character varying(20)`, `timestamp(3) without time zone`): the spelling
    the table's catalog shows, so a column is altered only when its type changed."""
    name, modifier = shape.type, shape.modifier
    if name in ("time", "timestamp", "timestamptz"):
        zone = "with time zone" if name == "timestamptz" else "without time zone"
        return f"{'time' if name == 'time' else 'timestamp'}{f'({modifier})' if modifier >= 0 else ''} {zone}"
    if name == "numeric" and modifier >= 4:
        return f"numeric({(modifier - 4) >> 16},{(modifier - 4) & 0xFFFF})"
    if name in ("varchar", "bpchar") and modifier >= 4:
        return f"{'character varying' if name == 'varchar' else 'character'}({modifier - 4})"
    return {"int2": "smallint", "int4": "integer", "int8": "bigint", "float4": "real", "float8": "double precision",
            "bool": "boolean", "varchar": "character varying"}.get(name, name)


def target(shape: ColumnShape) -> Target:
    """Where the read model keeps a source column, and how its value gets there."""
    name, v = shape.name, f"(s._cdc_r->>{quote_literal(shape.name)})"
    kind = shape.type
    if shape.type.endswith("[]"):
        return Target(name, "jsonb", f"(s._cdc_r->{quote_literal(shape.name)})", None)
    if kind in _CAST:
        return Target(name, declared(shape), f"{v}::{declared(shape)}", kind)
    if kind == "money":
        return Target(name, "numeric", f"{v}::numeric", "numeric")
    if kind == "bytea":
        return Target(name, "bytea", f"decode({v}, 'base64')", kind)
    if kind == "date":
        high, low = _INFINITE_DATE
        return Target(name, "date", f"CASE {v} WHEN '{high}' THEN 'infinity'::date WHEN '{low}' THEN "
                      f"'-infinity'::date ELSE DATE '1970-01-01' + {v}::integer END", kind)
    unit = "millisecond" if _precision(shape.modifier) <= 3 else "microsecond"
    if kind == "time":  # 24:00:00 is a time of its own, not midnight again
        day = 86_400_000 if unit == "millisecond" else 86_400_000_000
        return Target(name, declared(shape), f"CASE WHEN {v}::bigint >= {day} THEN TIME '24:00:00' "
                      f"ELSE (TIME '00:00' + {v}::bigint * INTERVAL '1 {unit}')::{declared(shape)} END", kind)
    if kind == "timestamp":
        high, low = _INFINITE_TS["ms" if unit == "millisecond" else "us"]
        return Target(name, declared(shape), f"CASE {v} WHEN '{high}' THEN 'infinity'::timestamp WHEN '{low}' THEN "
                      f"'-infinity'::timestamp ELSE TIMESTAMP '1970-01-01' + {v}::bigint * INTERVAL '1 {unit}' END",
                      kind)
    if kind == "interval":
        return Target(name, "interval", f"{v}::bigint * INTERVAL '1 microsecond'", kind)
    return Target(name, "text", v, None)


def targets(versions: list[Version]) -> list[Target]:
    """Every column any version had, in order of appearance, each with its newest version's
    type (a dropped column stays: null in newer rows)."""
    shapes: dict[str, ColumnShape] = {}
    for version in versions:
        for shape in version.columns:
            shapes[shape.name] = shape
    return [target(shape) for shape in shapes.values()]


def column_list(names: list[str]) -> str:
    return ", ".join(quote_ident(n) for n in names)
