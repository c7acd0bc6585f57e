"""What a snapshot reads from one table, and the SQL that reads it.

The columns are the ones pgoutput publishes (in attribute order, no dropped or generated
columns), described in the renderer's own terms so snapshot rows are rendered by the very
code that renders streamed changes: same converters, same key bytes, same envelope.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from cdc.events.changes import ColumnDef
from cdc.naming import qualified, quote_ident, quote_literal
from cdc.source.catalog import CapturedTable, column_facts

_COLUMNS_SQL = """
SELECT a.attname, a.atttypid, a.atttypmod, format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""


@dataclass(frozen=True)
class SnapshotTable:
    captured: CapturedTable
    columns: tuple[ColumnDef, ...]
    key_types: tuple[str, ...]  # format_type of each key column, for typed range literals

    @property
    def display(self) -> str:
        return self.captured.display

    @property
    def key_indexes(self) -> list[int]:
        names = [c.name for c in self.columns]
        return [names.index(k) for k in self.captured.key_columns]

    def copy_sql(self, after: list[str] | None = None, upto: list[str] | None = None, limit: int | None = None) -> str:
        """COPY of the rows with after < key <= upto (either bound optional), in key order when limited."""
        columns = ", ".join(quote_ident(c.name) for c in self.columns)
        sql = f"SELECT {columns} FROM {qualified(self.captured.schema, self.captured.table)}"
        conditions = []
        if after is not None:
            conditions.append(f"{self._key_tuple()} > {self._literal_tuple(after)}")
        if upto is not None:
            conditions.append(f"{self._key_tuple()} <= {self._literal_tuple(upto)}")
        if conditions:
            sql += " WHERE " + " AND ".join(conditions)
        if limit is not None:
            sql += f" ORDER BY {', '.join(quote_ident(k) for k in self.captured.key_columns)} LIMIT {int(limit)}"
        return f"COPY ({sql}) TO STDOUT"

    def sample_keys_sql(self, percent: float) -> str:
        """COPY of a sample of the keys in key order, to split a large table into ranges."""
        keys = ", ".join(quote_ident(k) for k in self.captured.key_columns)
        table = qualified(self.captured.schema, self.captured.table)
        return f"COPY (SELECT {keys} FROM {table} TABLESAMPLE SYSTEM ({percent:.6f}) ORDER BY {keys}) TO STDOUT"

    def _key_tuple(self) -> str:
        return "(" + ", ".join(quote_ident(k) for k in self.captured.key_columns) + ")"

    def _literal_tuple(self, values: list[str]) -> str:
        parts = [f"{quote_literal(v)}::{t}" for v, t in zip(values, self.key_types, strict=True)]
        return "(" + ", ".join(parts) + ")"


def describe(conn: psycopg.Connection, captured: CapturedTable) -> SnapshotTable:
    """Preflight already refused tables without a key, which no snapshot could order or resume by."""
    rows = conn.execute(_COLUMNS_SQL, (captured.oid,)).fetchall()
    keys = set(captured.key_columns)
    facts = column_facts(conn, captured.oid)  # in the same snapshot: the shape the rows have
    columns = tuple(
        ColumnDef(
            name, type_oid, typmod, name in keys,
            facts[name].not_null, facts[name].default, max(facts[name].dimensions, 1),
        )
        for name, type_oid, typmod, _ in rows
    )
    types = {name: shown for name, _, _, shown in rows}
    return SnapshotTable(captured, columns, tuple(types[k] for k in captured.key_columns))
