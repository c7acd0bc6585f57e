"""What the captured tables look like in PostgreSQL's catalog.

pgoutput's Relation message names a table and its columns, but not the primary key's
column order (the key bytes must list columns in key order) nor what a non-builtin type
is (enum, domain, array of either): those come from here, on a normal SQL connection.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from cdc.naming import TablePattern, parse_table_pattern
from cdc.source.pgtypes import PgType, load_type
from cdc.source.replication import pinned_conninfo


@dataclass(frozen=True)
class CapturedTable:
    oid: int
    schema: str
    table: str
    replica_identity: str  # d default, f full, i index, n nothing
    key_columns: tuple[str, ...]  # primary key (or replica identity index) in key order; () if none
    has_primary_key: bool
    toastable_columns: tuple[str, ...]

    @property
    def display(self) -> str:
        return str(TablePattern(self.schema, self.table))


_TABLES_SQL = """
SELECT c.oid, n.nspname, c.relname, c.relreplident
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_toast%%'
ORDER BY n.nspname, c.relname
"""

# Both take an array of table oids: a wide schema's tables are described in two queries.
_KEY_SQL = """
SELECT i.indrelid, i.indisprimary, i.indisreplident, a.attname
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = ANY(%s) AND (i.indisprimary OR i.indisreplident)
ORDER BY i.indrelid, k.ord
"""

_TOAST_SQL = """
SELECT a.attrelid, a.attname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = ANY(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
  AND t.typlen = -1 AND a.attstorage IN ('x', 'e')
ORDER BY a.attrelid, a.attnum
"""


#: What pgoutput's Relation message leaves out of a column, read per relation version:
#: NOT NULL (the field schema's `optional`), the default's text (its `default`) and the
#: declared array depth (`int[][]`: nested array schemas). The snapshot's describe runs
#: it inside the exported snapshot; the stream runs it when a Relation message arrives.
COLUMN_FACTS_SQL = """
SELECT a.attname, a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attndims
FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""


@dataclass(frozen=True)
class ColumnFacts:
    not_null: bool
    default: str | None  # pg_get_expr of the default under the pinned session settings
    dimensions: int  # pg_attribute.attndims: declared, not enforced by PostgreSQL


def column_facts(conn: psycopg.Connection, oid: int) -> dict[str, ColumnFacts]:
    rows = conn.execute(COLUMN_FACTS_SQL, (oid,)).fetchall()
    return {name: ColumnFacts(bool(nn), default, int(dims)) for name, nn, default, dims in rows}


class Catalog:
    """Catalog look-ups on one autocommit connection with the pinned session settings."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = self._connect()
        self._types: dict[int, PgType] = {}

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(pinned_conninfo(self.dsn, application_name="cdc-catalog"), autocommit=True)

    def ensure_connected(self) -> bool:
        """Reconnect after the server went away (the daemon outlives PostgreSQL restarts);
        True when it did, so session state (locks) must be taken again."""
        if self.conn.closed or self.conn.broken:
            self.conn.close()
            self.conn = self._connect()
            return True
        return False

    def close(self) -> None:
        self.conn.close()

    def database(self) -> str:
        row = self.conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        return row[0]

    def pg_type(self, oid: int) -> PgType:
        found = self._types.get(oid)
        if found is None:
            found = self._types[oid] = load_type(self.conn, oid)
        return found

    def column_facts(self, oid: int) -> dict[str, ColumnFacts]:
        """NOT NULL, default and array depth per column, as the catalog says *now*: read when
        a Relation message arrives, so a later ALTER is seen early (see docs/events.md)."""
        return column_facts(self.conn, oid)

    def all_tables(self) -> list[tuple[int, str, str, str]]:
        return [tuple(r) for r in self.conn.execute(_TABLES_SQL).fetchall()]

    def resolve(self, patterns: list[str]) -> tuple[list[CapturedTable], list[str]]:
        """The tables the patterns name, and the patterns that named nothing."""
        parsed = [parse_table_pattern(p) for p in patterns]
        tables = self.all_tables()
        chosen: dict[int, tuple[int, str, str, str]] = {}
        unmatched = []
        for text, pattern in zip(patterns, parsed, strict=True):
            hits = [t for t in tables if pattern.matches(t[1], t[2])]
            if not hits:
                unmatched.append(text)
            for hit in hits:
                chosen[hit[0]] = hit
        return self.describe_many(list(chosen.values())), unmatched

    def describe(self, oid: int, schema: str, table: str, replica_identity: str) -> CapturedTable:
        """The key is the primary key, or the replica identity index where one is set: the
        columns PostgreSQL sends as the old key, so a key change is always seen."""
        return self.describe_many([(oid, schema, table, replica_identity)])[0]

    def describe_many(self, tables: list[tuple[int, str, str, str]]) -> list[CapturedTable]:
        """`describe` of each (oid, schema, table, replica identity), in two queries for all."""
        oids = [t[0] for t in tables]
        primary: dict[int, list[str]] = {}
        identity: dict[int, list[str]] = {}
        for oid, is_pk, is_ident, name in self.conn.execute(_KEY_SQL, (oids,)).fetchall():
            if is_pk:
                primary.setdefault(oid, []).append(name)
            if is_ident:
                identity.setdefault(oid, []).append(name)
        toast: dict[int, list[str]] = {}
        for oid, name in self.conn.execute(_TOAST_SQL, (oids,)).fetchall():
            toast.setdefault(oid, []).append(name)
        out = []
        for oid, schema, table, replica_identity in tables:
            pk = tuple(primary.get(oid, ()))
            key = tuple(identity.get(oid, ())) if replica_identity == "i" else pk
            out.append(CapturedTable(oid, schema, table, replica_identity, key, bool(pk), tuple(toast.get(oid, ()))))
        return out

    def table_by_oid(self, oid: int) -> CapturedTable | None:
        row = self.conn.execute(
            "SELECT c.oid, n.nspname, c.relname, c.relreplident FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s",
            (oid,),
        ).fetchone()
        return None if row is None else self.describe(*row)
