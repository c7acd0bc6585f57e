"""A column's canonical JSON text (compaction.canonical) rendered by PostgreSQL itself, as
cdc.events.types converts PostgreSQL's text: the sides of `cdc verify` that are PostgreSQL
databases (the source, the read model store) hash their rows on the server with it.

The SQL assumes the settings the walsender pins (cdc.source.session: DateStyle, IntervalStyle,
extra_float_digits), so text output is what the events were rendered from.
"""

from __future__ import annotations

from cdc.source.pgtypes import PgType
from cdc.source.session import PINNED_SETTINGS

#: the session settings the SQL renders under: a connection that hashes with it sets them
SESSION_SETTINGS = PINNED_SETTINGS

_TEXT_LIKE = frozenset({
    "text", "varchar", "bpchar", "char", "name", "citext", "uuid", "xml", "ltree", "inet", "cidr", "macaddr",
    "macaddr8", "tsvector", "tsquery", "numeric", "int4range", "int8range", "numrange", "tsrange", "tstzrange",
    "daterange", "box", "circle", "line", "lseg", "path", "polygon", "pg_lsn", "txid_snapshot",
})
_INTEGERS = frozenset({"int2", "int4", "int8", "oid"})
_TS_INFINITY = {"ms": ("9223372036825200", "-9223372036832400"), "us": ("9223372036825200000", "-9223372036832400000")}


def builtin_type(name: str) -> PgType:
    """A built-in base type by name (a table the SQL reads that cdc's catalog does not know)."""
    return PgType(0, name, "b")


def base_type(pgtype: PgType, typmod: int) -> tuple[PgType, int]:
    while pgtype.kind == "d" and pgtype.base is not None:
        typmod = pgtype.base_typmod if pgtype.base_typmod >= 0 else typmod
        pgtype = pgtype.base
    return pgtype, typmod


def _precision(typmod: int) -> int:
    return 6 if typmod < 0 else typmod


def _iso_utc(c: str) -> str:
    """A finite timestamptz as cdc writes it: '2024-01-02T03:04:05.12Z' (astronomical years,
    '+' beyond 9999, fraction without trailing zeros)."""
    utc = f"({c} AT TIME ZONE 'UTC')"
    year = f"CASE WHEN extract(year FROM {utc}) < 0 THEN extract(year FROM {utc}) + 1 ELSE extract(year FROM {utc}) END"
    shown = (
        f"CASE WHEN ({year}) > 9999 THEN '+' || ({year})::int::text "
        f"WHEN ({year}) < 0 THEN '-' || lpad((-({year}))::int::text, 4, '0') "
        f"ELSE lpad(({year})::int::text, 4, '0') END"
    )
    fraction = f"rtrim(to_char({utc}, 'US'), '0')"
    return (
        f"({shown}) || to_char({utc}, '-MM-DD\"T\"HH24:MI:SS') || "
        f"CASE WHEN {fraction} = '' THEN '' ELSE '.' || {fraction} END || 'Z'"
    )


def value_sql(c: str, pgtype: PgType, typmod: int) -> str | None:
    """SQL of the canonical JSON text of column expression `c` (not null), or None when SQL
    cannot reproduce cdc's conversion exactly."""
    pgtype, typmod = base_type(pgtype, typmod)
    name = pgtype.name
    if pgtype.element is not None:
        element, _ = base_type(pgtype.element, typmod)
        if element.name in _INTEGERS or element.name == "bool":
            return f"array_to_json({c})::text"
        if (element.name in _TEXT_LIKE and element.name != "bpchar") or element.kind == "e":  # (text[] trims char(n))
            return f"array_to_json({c}::text[])::text"
        return None
    if pgtype.kind in ("e", "r", "m"):
        return f"to_json({c}::text)::text"
    if pgtype.kind != "b":
        return None
    if name == "bool":
        return f"CASE WHEN {c} THEN 'true' ELSE 'false' END"
    if name in _INTEGERS:
        return f"{c}::text"
    if name in ("float4", "float8"):
        return (f"to_json(CASE WHEN {c}::text IN ('NaN', 'Infinity', '-Infinity') THEN {c}::text "
                f"ELSE trim_scale({c}::text::numeric)::text END)::text")
    if name == "money":
        return f"to_json({c}::numeric::text)::text"
    if name == "bpchar":  # its output keeps the padding a cast to text trims
        return f"to_json(format('%s', {c}))::text"
    if name in _TEXT_LIKE:
        return f"to_json({c}::text)::text"
    if name == "bytea":
        return f"to_json(translate(encode({c}, 'base64'), E'\\n', ''))::text"
    if name == "date":
        return (f"CASE WHEN {c} = 'infinity' THEN '-2147472692' WHEN {c} = '-infinity' THEN '-2147472691' "
                f"ELSE ({c} - DATE '1970-01-01')::text END")
    if name == "time":
        scale = "1000" if _precision(typmod) <= 3 else "1000000"
        return f"(extract(epoch FROM {c}) * {scale})::bigint::text"
    if name == "timestamp":
        unit = "ms" if _precision(typmod) <= 3 else "us"
        scale = "1000" if unit == "ms" else "1000000"
        high, low = _TS_INFINITY[unit]
        return (f"CASE WHEN {c} = 'infinity' THEN '{high}' WHEN {c} = '-infinity' THEN '{low}' "
                f"ELSE floor(extract(epoch FROM {c}) * {scale})::bigint::text END")
    if name == "timestamptz":
        return f"to_json(CASE WHEN isfinite({c}) THEN {_iso_utc(c)} ELSE {c}::text END)::text"
    if name == "interval":
        micros = (
            f"(((extract(year FROM {c}) * 12 + extract(month FROM {c})) * 2629800 + extract(day FROM {c}) * 86400 "
            f"+ extract(hour FROM {c}) * 3600 + extract(minute FROM {c}) * 60) * 1000000 "
            f"+ extract(microseconds FROM {c}))"
        )
        return f"greatest(least({micros}, 9223372036854775807), -9223372036854775808)::bigint::text"
    return None


def escaped(sql: str) -> str:
    """Generated SQL before a parameter is added: its own `%` (in literals, names) stays a `%`."""
    return sql.replace("%", "%%")


def row_sql(rendered: list[tuple[str, str]]) -> str:
    """The canonical row text (a JSON array) of (column expression, value_sql of it) pairs."""
    return "'[' || " + " || ',' || ".join(
        f"coalesce(CASE WHEN {c} IS NULL THEN NULL ELSE {sql} END, 'null')" for c, sql in rendered) + " || ']'"


def hashed_sql(key_sql: str, row: str, source: str, shift: int) -> str:
    """Each row of `source` as (k: key text, b: its segment, h: its row hash, r: its row text),
    as compaction.canonical computes them (`shift`: MAX_BITS less the table's bits)."""
    return (
        f"SELECT k, ('x' || substr(md5(k), 1, 4))::bit(16)::int >> {shift} AS b, "
        f"('x' || substr(md5(r), 1, 16))::bit(64)::bigint AS h, r "
        f"FROM (SELECT {key_sql} AS k, {row} AS r FROM {source}) rendered"
    )


def digest_sql(hashed: str) -> str:
    """A digest (segment, rows, XOR of the row hashes) of `hashed_sql`'s rows."""
    return f"SELECT b, count(*), coalesce(bit_xor(h), 0) FROM ({hashed}) hashed GROUP BY b"


def segments_sql(hashed: str) -> str:
    """The key and row hash of `hashed_sql`'s rows in some segments (one parameter: their list)."""
    return f"SELECT k, h FROM ({escaped(hashed)}) hashed WHERE b = ANY(%s)"
