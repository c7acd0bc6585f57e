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

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import psycopg

from cdc.config import Config
from cdc.events.canonical_sql import (
    base_type,
    digest_sql,
    escaped,
    hashed_sql,
    row_sql,
    segments_sql,
    value_sql,
)
from cdc.events.records import TableEvents
from cdc.naming import qualified, quote_ident, quote_literal, topic_name
from cdc.source.catalog import CapturedTable, Catalog
from cdc.source.replication import parse_lsn, pinned_conninfo
from compaction.canonical import MAX_BITS, Column, bits_for, row_values
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of
from snapshot.copy_text import parse_line
from snapshot.initial import table_events
from snapshot.tables import SnapshotTable, describe

SETTLE_S = 3.0  # how long a snapshot waits for the transactions running when it starts


class Snapshot(NamedTuple):
    """The LSNs that bound a snapshot: every commit it sees is below `lsn`, and it sees every
    commit at or below `visible`. They differ because PostgreSQL writes a commit's WAL record
    before the commit becomes visible: a commit below `lsn` may still be unseen."""

    lsn: int
    visible: int


RUNNING_SQL = "SELECT transactionid::text FROM pg_locks WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock'"
HELD_SQL = (  # committed, waiting for a synchronous standby (seen where the role may read others' sessions)
    "SELECT l.transactionid::text FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE l.locktype = "
    "'transactionid' AND l.mode = 'ExclusiveLock' AND l.transactionid::text = ANY(%s) AND a.wait_event = 'SyncRep'"
)


def take_snapshot(conn: psycopg.Connection, now: psycopg.Connection, settle_s: float = SETTLE_S) -> Snapshot:
    """Begins a REPEATABLE READ snapshot on `conn` (idle, autocommit), using `now` (autocommit)
    to look around it. `visible` is the WAL's position before the snapshot, once every
    transaction then holding an id has ended (its lock on its own id, which outlasts its
    commit's visibility, is gone): a commit below it had its record written by then, so its
    transaction was running or done, and is done now. A transaction still running after
    `settle_s` has not reached its commit, unless it waits for a synchronous standby: then no
    snapshot can see every commit below the WAL, and this says so."""
    row = now.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    visible = parse_lsn(row[0])
    running = [x for (x,) in now.execute(RUNNING_SQL)]
    deadline = time.monotonic() + settle_s
    while running and time.monotonic() <= deadline:
        time.sleep(0.01)
        running = [x for (x,) in now.execute(RUNNING_SQL + " AND transactionid::text = ANY(%s)", (running,))]
    held = [x for (x,) in now.execute(HELD_SQL, (running,))] if running else []
    if held:
        raise TimeoutError(
            f"transaction {held[0]} committed but is not visible after {settle_s:.0f} s: a synchronous "
            "standby holds it back (see pg_stat_replication); verify again once it answers"
        )
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # the snapshot is taken first
    assert row is not None
    return Snapshot(parse_lsn(row[0]), visible)


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

    def snapshot(self) -> Snapshot:
        """A new REPEATABLE READ snapshot (see `take_snapshot`)."""
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self.conn.execute("COMMIT")
        taken = take_snapshot(self.conn, self.now)
        self.lsn = taken.lsn
        return taken

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
            base, _ = base_type(self.catalog.pg_type(col.type_oid), col.type_modifier)
            if sql is None or base.name in ("float4", "float8"):  # a key's float is the event's spelling, not SQL's
                lacking.append(name)
                continue
            keys.append(f"to_json({quote_literal(name)}::text)::text || ':' || {sql}")
        if lacking:
            return SourceTable(spec, table, events, None, None, ", ".join(sorted(set(lacking))))
        key_sql = "'{' || " + " || ',' || ".join(keys) + " || '}'"
        row = row_sql([(quote_ident(c.name), str(sql)) for c, sql in zip(table.columns, rendered, strict=True)])
        return SourceTable(spec, table, events, key_sql, row)

    # -- the three questions -------------------------------------------------------------
    def _hashed(self, table: SourceTable) -> str:
        assert table.key_sql is not None and table.row_sql is not None
        source = qualified(table.table.captured.schema, table.table.captured.table)
        return hashed_sql(table.key_sql, table.row_sql, source, MAX_BITS - table.spec.bits)

    def digest(self, table: SourceTable) -> Digest:
        if table.key_sql is None:
            return digest_of(self._rendered(table), lambda values: values, table.spec.bits)
        return {b: (int(n), int(x)) for b, n, x in self.conn.execute(digest_sql(self._hashed(table)))}

    def hashes(self, table: SourceTable, segments: set[int]) -> dict[bytes, int]:
        if table.key_sql is None:
            return hashes_of(self._rendered(table), lambda values: values, table.spec.bits, segments)
        return {k.encode(): int(h) for k, h in self.conn.execute(segments_sql(self._hashed(table)), (list(segments),))}

    def fetch(self, table: SourceTable, keys: list[bytes], now: bool = False) -> dict[bytes, Found]:
        """The rows of these keys in the snapshot, or (`now`) as PostgreSQL holds them now."""
        conn = self.now if now else self.conn
        if table.key_sql is None:
            wanted = set(keys)
            return {k: Found(v) for k, v in self._rendered(table, conn) if k in wanted}
        query = f"SELECT k, r FROM ({escaped(self._hashed(table))}) hashed WHERE k = ANY(%s)"
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
