"""The read model's side of `cdc verify`: each table hashed by its PostgreSQL, with the SQL the
source side uses (cdc.events.canonical_sql), the key being the stored record key.

A column whose canonical text SQL renders exactly (what the source side renders in SQL, kept
in its type) is hashed on the server; a table with any other column (json, jsonb, arrays as
jsonb, the types kept as text that are not strings in the event) is read and hashed here,
each value turned back into the event's form first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from cdc.config import Config
from cdc.events.canonical_sql import (
    SESSION_SETTINGS,
    builtin_type,
    digest_sql,
    escaped,
    hashed_sql,
    row_sql,
    segments_sql,
    value_sql,
)
from cdc.naming import quote_ident
from compaction.canonical import MAX_BITS, Column, row_values
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of
from sinks.stores.postgres import required_dsn
from sinks.stores.postgres.store import connect, table_of

#: a column as the read side renders it: its expression, its value SQL (None: read as text, here)
_Rendered = tuple[str, str | None]


@dataclass
class _Table:
    source: str  # the qualified table
    columns: list[_Rendered]
    #: the canonical row text's SQL, when every column has one
    row: str | None


class PostgresSide:
    """The read model's tables, read in one connection (verify reads each side from one thread)."""

    #: its name in the report: the reference is PostgreSQL, the source, already named "postgres"
    name = "read-model"
    store = "postgres"

    def __init__(self, dsn: str) -> None:
        self.conn = connect(dsn, autocommit=True)
        for name, value in SESSION_SETTINGS.items():  # the settings the SQL renders under
            self.conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        self._tables: dict[str, _Table | None] = {}

    def _table(self, spec: TableSpec) -> _Table | None:
        if spec.topic not in self._tables:
            self._tables[spec.topic] = self._describe(spec)
        return self._tables[spec.topic]

    def _describe(self, spec: TableSpec) -> _Table | None:
        source = table_of(self.conn, spec.topic)
        if source is None:
            return None
        types: dict[str, tuple[str, int]] = {name: (kind, modifier) for name, kind, modifier in self.conn.execute(
            "SELECT a.attname, t.typname, a.atttypmod FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped", (source,))}
        columns: list[_Rendered] = []
        for column in spec.columns:
            name = quote_ident(column.name)
            found = types.get(column.name)
            if found is None:  # a column the table has not seen a version of yet: null
                columns.append(("NULL", "'null'"))
                continue
            kind, modifier = found
            sql = value_sql(name, builtin_type(kind), modifier)
            text_for_text = kind == "text" and column.connect.get("type") != "string"
            columns.append((name, None if text_for_text or sql is None else sql))
        whole = None if any(sql is None for _, sql in columns) else row_sql([(c, str(s)) for c, s in columns])
        return _Table(source, columns, whole)

    def _hashed(self, spec: TableSpec, table: _Table) -> str:
        assert table.row is not None
        return hashed_sql("_cdc_key", table.row, table.source, MAX_BITS - spec.bits)

    def _read(self, spec: TableSpec, table: _Table, keys: list[str] | None = None
              ) -> Iterator[tuple[bytes, list[Any], tuple[int, int]]]:
        """Rows read here: (key, canonical values, position)."""
        shown = ", ".join(f"CASE WHEN {c} IS NULL THEN NULL ELSE {sql} END" if sql is not None else f"{c}::text"
                          for c, sql in table.columns)
        query = f"SELECT _cdc_key, _cdc_lsn, _cdc_seq, {shown} FROM {table.source}"
        if keys is not None:
            query = escaped(query) + " WHERE _cdc_key = ANY(%s)"
        for key, lsn, seq, *texts in self.conn.execute(query, (keys,) if keys is not None else None):
            row = {}
            for column, (_, sql), text in zip(spec.columns, table.columns, texts, strict=True):
                row[column.name] = None if text is None else _event_value(column, text, sql is not None)
            yield key.encode(), row_values(row, spec.columns), (int(lsn), int(seq))

    def digest(self, spec: TableSpec) -> Digest:
        table = self._table(spec)
        if table is None:
            return {}
        if table.row is None:
            return digest_of(((k, v) for k, v, _ in self._read(spec, table)), lambda v: v, spec.bits)
        return {b: (int(n), int(x)) for b, n, x in self.conn.execute(digest_sql(self._hashed(spec, table)))}

    def hashes(self, spec: TableSpec, segments: set[int]) -> dict[bytes, int]:
        table = self._table(spec)
        if table is None:
            return {}
        if table.row is None:
            return hashes_of(((k, v) for k, v, _ in self._read(spec, table)), lambda v: v, spec.bits, segments)
        query = segments_sql(self._hashed(spec, table))
        return {k.encode(): int(h) for k, h in self.conn.execute(query, (list(segments),))}

    def fetch(self, spec: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        table = self._table(spec)
        if table is None:
            return {}
        return {k: Found(v, pos) for k, v, pos in self._read(spec, table, [k.decode() for k in keys])}

    def close(self) -> None:
        self.conn.close()


def _event_value(column: Column, text: str, canonical: bool) -> Any:
    """A stored value in the event's form: canonical JSON text as rendered by SQL, or the
    column's own text (a string in the event, or the JSON of a structured value)."""
    if canonical:
        return orjson.loads(text)
    if column.connect.get("type") == "string":
        return text
    return orjson.loads(text)


def check(config: Config) -> None:
    required_dsn(config.postgres)


def side(config: Config, spark: Callable[[], Any]) -> PostgresSide:
    return PostgresSide(config.postgres.dsn)
