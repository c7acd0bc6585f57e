"""PostgreSQL's side of `cdc verify`: the captured tables in one REPEATABLE READ snapshot whose LSN
is known, hashed where they are.

Each column is rendered in SQL into its canonical form (compaction.canonical): the event's JSON
value, as cdc.events.types converts PostgreSQL's text, with floats written out in full. The
row's canonical text, its MD5 and its key segment are computed by the server, which returns
one (rows, XOR) pair per segment; narrowing asks for the row hashes of some segments, then the
rows of some keys. A table with a column whose conversion SQL cannot reproduce exactly (json,
jsonb and hstore, compared by meaning; point, bit strings, timetz, arrays of other than
integers, booleans and text-like types; a float in the key) is read with COPY in the same
snapshot and rendered by cdc's own event code instead (the report says which tables).

Every session pins the settings the walsender pins (cdc.source.session), so text output is
what the events were rendered from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg

from cdc.config import Config
from cdc.events.records import TableEvents
from cdc.naming import qualified, quote_ident, quote_literal, topic_name
from cdc.source.catalog import CapturedTable, Catalog
from cdc.source.pgtypes import PgType
from cdc.source.replication import parse_lsn, pinned_conninfo
from compaction.canonical import MAX_BITS, Column, bits_for, row_values
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of
from snapshot.copy_text import parse_line
from snapshot.initial import table_events
from snapshot.tables import SnapshotTable, describe

_TEXT_LIKE = frozenset({
    "text", "varchar", "bpchar", "char", "name", "citext", "uuid", "xml", "ltree", "inet", "cidr", "macaddr",
    "macaddr8", "tsvector", "tsquery", "numeric", "int4range", "int8range", "numrange", "tsrange", "tstzrange",
    "daterange", "box", "circle", "line", "lseg", "path", "polygon", "pg_lsn", "txid_snapshot",
})
_INTEGERS = frozenset({"int2", "int4", "int8", "oid"})
_TS_INFINITY = {"ms": ("9223372036825200", "-9223372036832400"), "us": ("9223372036825200000", "-9223372036832400000")}


def _base(pgtype: PgType, typmod: int) -> tuple[PgType, int]:
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
    pgtype, typmod = _base(pgtype, typmod)
    name = pgtype.name
    if pgtype.element is not None:
        element, _ = _base(pgtype.element, typmod)
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


def _escaped(sql: str) -> str:
    """Generated SQL before a parameter is added: its own `%` (in literals, names) stays a `%`."""
    return sql.replace("%", "%%")


@dataclass
class SourceTable:
    """One captured table as PostgreSQL's side compares it."""

    spec: TableSpec
    table: SnapshotTable
    events: TableEvents
    key_sql: str | None  # the key's JSON text (the record key's bytes), or None: rendered in Python
    row_sql: str | None  # the canonical row text
    why_python: str | None = None  # the columns SQL cannot render, when rendered in Python


class SourceSide:
    """PostgreSQL, read in one snapshot at a time (`snapshot()` takes a new one)."""

    name = "postgres"

    def __init__(self, config: Config, catalog: Catalog) -> None:
        self.config = config
        self.catalog = catalog
        self.conn = psycopg.connect(pinned_conninfo(config.source.dsn, application_name="cdc-verify"), autocommit=True)
        # outside the snapshot: what PostgreSQL holds now (each statement sees the latest commits)
        self.now = psycopg.connect(pinned_conninfo(config.source.dsn, application_name="cdc-verify"), autocommit=True)
        self.lsn = 0

    def snapshot(self) -> int:
        """A new REPEATABLE READ snapshot; returns its LSN: every transaction it sees committed
        below it (the snapshot is taken before the LSN is read, in the same statement)."""
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self.conn.execute("COMMIT")
        self.conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        row = self.conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        self.lsn = parse_lsn(row[0])
        return self.lsn

    def describe(self, captured: CapturedTable, rows_per_segment: int = 64) -> SourceTable:
        """The table's columns, key and SQL, in the current snapshot."""
        table = describe(self.conn, captured)
        events = table_events(self.catalog, self.config, table)
        columns = tuple(Column(c.name, c.schema) for c in events.columns)
        estimate = self.conn.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s", (captured.oid,)).fetchone()
        spec = TableSpec(
            topic_name(self.config.topic.prefix, captured.schema, captured.table), captured.display, columns,
            bits_for(max(0, int(estimate[0] if estimate else 0)), rows_per_segment),
        )
        rendered, lacking = [], []
        for col in table.columns:
            sql = value_sql(quote_ident(col.name), self.catalog.pg_type(col.type_oid), col.type_modifier)
            rendered.append(sql)
            if sql is None:
                lacking.append(col.name)
        by_name = {c.name: (c, sql) for c, sql in zip(table.columns, rendered, strict=True)}
        keys = []
        for name in captured.key_columns:
            col, sql = by_name[name]
            base, _ = _base(self.catalog.pg_type(col.type_oid), col.type_modifier)
            if sql is None or base.name in ("float4", "float8"):  # a key's float is the event's spelling, not SQL's
                lacking.append(name)
                continue
            keys.append(f"to_json({quote_literal(name)}::text)::text || ':' || {sql}")
        if lacking:
            return SourceTable(spec, table, events, None, None, ", ".join(sorted(set(lacking))))
        key_sql = "'{' || " + " || ',' || ".join(keys) + " || '}'"
        row_sql = "'[' || " + " || ',' || ".join(
            f"coalesce(CASE WHEN {quote_ident(c.name)} IS NULL THEN NULL ELSE {sql} END, 'null')"
            for c, sql in zip(table.columns, rendered, strict=True)
        ) + " || ']'"
        return SourceTable(spec, table, events, key_sql, row_sql)

    # -- the three questions -------------------------------------------------------------
    def _hashed(self, table: SourceTable) -> str:
        assert table.key_sql is not None and table.row_sql is not None
        source = qualified(table.table.captured.schema, table.table.captured.table)
        shift = MAX_BITS - table.spec.bits
        return (
            f"SELECT k, ('x' || substr(md5(k), 1, 4))::bit(16)::int >> {shift} AS b, "
            f"('x' || substr(md5(r), 1, 16))::bit(64)::bigint AS h, r "
            f"FROM (SELECT {table.key_sql} AS k, {table.row_sql} AS r FROM {source}) rendered"
        )

    def digest(self, table: SourceTable) -> Digest:
        if table.key_sql is None:
            return digest_of(self._rendered(table), lambda values: values, table.spec.bits)
        query = f"SELECT b, count(*), coalesce(bit_xor(h), 0) FROM ({self._hashed(table)}) hashed GROUP BY b"
        return {b: (int(n), int(x)) for b, n, x in self.conn.execute(query)}

    def hashes(self, table: SourceTable, segments: set[int]) -> dict[bytes, int]:
        if table.key_sql is None:
            return hashes_of(self._rendered(table), lambda values: values, table.spec.bits, segments)
        query = f"SELECT k, h FROM ({_escaped(self._hashed(table))}) hashed WHERE b = ANY(%s)"
        return {k.encode(): int(h) for k, h in self.conn.execute(query, (list(segments),))}

    def fetch(self, table: SourceTable, keys: list[bytes], now: bool = False) -> dict[bytes, Found]:
        """The rows of these keys in the snapshot, or (`now`) as PostgreSQL holds them now."""
        conn = self.now if now else self.conn
        if table.key_sql is None:
            wanted = set(keys)
            return {k: Found(v) for k, v in self._rendered(table, conn) if k in wanted}
        query = f"SELECT k, r FROM ({_escaped(self._hashed(table))}) hashed WHERE k = ANY(%s)"
        return {k.encode(): Found(orjson.loads(r)) for k, r in conn.execute(query, ([k.decode() for k in keys],))}

    # -- tables SQL cannot render: COPY, and cdc's own renderer ---------------------------
    def _rendered(self, table: SourceTable, conn: psycopg.Connection | None = None) -> Iterator[tuple[bytes, list[Any]]]:
        events, columns = table.events, table.spec.columns
        with (conn or self.conn).cursor().copy(table.table.copy_sql()) as copy:
            for line in copy:
                row = events.row(parse_line(line))
                yield events.key(row), row_values(row, columns)

    def close(self) -> None:
        self.conn.close()
        self.now.close()
