"""The PostgreSQL read model: each captured table kept as `<schema_prefix><schema>.<table>` in
another PostgreSQL database (a reporting database, a second region), as Debezium's JDBC sink
connector keeps one.

A batch is one transaction on the driver, all or nothing in the store:
- its truncates: the rows below each truncate's position deleted, whatever partition wrote them;
- each table made to fit its newest version (CREATE, ADD COLUMN; a changed type altered with a
  cast, or the job stops naming `cdc postgres rebuild`); a dropped column stays, null in newer rows;
- the batch's last change of each key (the shared fold, sinks.latest, above each table's newest
  truncate) COPYed by the executors, each Spark partition in a transaction of its own, into
  the job's staging table (`_cdc.stage_<job>`, unlogged, emptied before each batch), analyzed,
  then on the driver one MERGE per table: a change applies
  only over a lower stored position (a lone tombstone, which has none, over a lower offset of
  the same partition) and above its key's delete marker (`_cdc.deletes`, kept [postgres]
  marker_ttl_s: a rebuild's last pass behind the live job cannot bring a deleted row back),
  an unchanged TOASTed value keeps the stored one;
- the job's bookkeeping record (`_cdc.bookkeeping`), then COMMIT.
A batch read again after a crash finds either all of its writes or none of them (staging rows
are not the store's: the next batch empties the table first), and a task Spark runs again
deletes what its earlier attempt staged before it stages anew. The tables
of a topic are listed in `_cdc.tables`, whose schemas the store owns: `clear` drops them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from cdc.config import Config, ConfigError
from cdc.naming import quote_ident, quote_literal
from cdc.redact import redact_dsn
from sinks.rows import PartitionWriter, Rejected, RowStore, RowWriter
from sinks.store import SinkStopped, StoreUnavailable, Truncate
from sinks.stores.postgres import MAX_NAME, PostgresConfig, required_dsn
from sinks.stores.postgres.columns import META, META_NAMES, Target, column_list, targets
from sinks.versions import Registry

if TYPE_CHECKING:
    from sinks.query import StopSignal

log = logging.getLogger(__name__)

MIN_VERSION = 150000  # MERGE
META_SCHEMA = "_cdc"
#: the comment on every schema the store made: `clear` and a rebuild drop only these
OWNED = "cdc read model"
CONNECT_TIMEOUT_S = 10


def connect(dsn: str, autocommit: bool = False) -> psycopg.Connection:
    """A connection to the read model's database, or StoreUnavailable naming it (the job retries)."""
    try:
        return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S,
                               application_name="cdc-sink-postgres")
    except psycopg.OperationalError as exc:
        reason = redact_dsn(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise StoreUnavailable(f"PostgreSQL at {redact_dsn(dsn)} is unreachable ({reason})") from None


def ensure_meta(conn: psycopg.Connection) -> None:
    """The store's own schema: the jobs' bookkeeping, the table of every topic, and the delete
    markers (`deletes`: the position of each key's newest delete, for [postgres] marker_ttl_s)."""
    conn.execute(f"CREATE SCHEMA IF NOT EXISTS {META_SCHEMA}")
    conn.execute(f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.bookkeeping (name text PRIMARY KEY, record jsonb NOT NULL)")
    conn.execute(f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.deletes (topic text, key text, lsn bigint NOT NULL, "
                 "seq bigint NOT NULL, deleted_at timestamptz NOT NULL, PRIMARY KEY (topic, key))")
    conn.execute(f"CREATE TABLE IF NOT EXISTS {META_SCHEMA}.tables (topic text PRIMARY KEY, schema_name text NOT NULL, "
                 "table_name text NOT NULL)")


def stage_of(job: str) -> str:
    """The staging table of a job's batches (`job`: the store's name and generation suffix)."""
    return f"{META_SCHEMA}.{quote_ident('stage_' + job)}"


def table_of(conn: psycopg.Connection, topic: str, suffix: str = "") -> str | None:
    """The qualified name of a topic's table in the generation of `suffix` (None: none yet)."""
    found = conn.execute(f"SELECT schema_name, table_name FROM {META_SCHEMA}.tables WHERE topic = %s",
                         (topic,)).fetchone()
    if found is None:
        return None
    table = f"{quote_ident(found[0] + suffix)}.{quote_ident(found[1])}"
    return None if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() == (None,) else table


def rows_of(conn: psycopg.Connection, topic: str, suffix: str = "") -> int | None:
    """The rows of a topic's table in the generation of `suffix` (None: no table yet)."""
    table = table_of(conn, topic, suffix)
    counted = conn.execute(f"SELECT count(*) FROM {table}").fetchone() if table else None
    return None if counted is None else int(counted[0])


class _Stage(RowWriter):
    """A Spark partition's last changes COPYed into the job's staging table, in one transaction
    of its own connection (on an executor; on the driver for `write_changes`). A task Spark runs
    again deletes its earlier attempt's rows first: the MERGE needs one row per key."""

    def __init__(self, dsn: str, stage: str) -> None:
        self.dsn, self.stage = dsn, stage
        self._conn: psycopg.Connection | None = None
        self._task = 0

    def open(self) -> None:
        from pyspark import TaskContext

        task = TaskContext.get()
        self._task = task.partitionId() if task is not None else 0
        self._conn = connect(self.dsn)
        self._conn.execute(f"DELETE FROM {self.stage} WHERE task = %s", (self._task,))

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
                conn.commit()
        finally:
            conn.close()

    def held(self, topic: str, keys: list[str], columns: set[str]) -> list[dict[str, Any] | None]:
        raise NotImplementedError("the MERGE keeps a stored TOASTed value itself")

    def write(self, changes: pa.Table) -> list[Rejected]:
        assert self._conn is not None
        task = self._task
        with self._conn.cursor().copy(
                f'COPY {self.stage} (task, topic, key, kind, lsn, seq, part, "offset", row, missing) FROM STDIN') as copy:
            for c in changes.to_pylist():
                copy.write_row((task, c["topic"], c["key"], c["kind"], c["lsn"], c["seq"], c["partition"],
                                c["offset"], c["row"], c["missing"]))
        return []

    def positions(self, topic: str) -> Iterator[list[tuple[str, str]]]:
        raise NotImplementedError("a truncate is one DELETE by position")


class _Staged(PartitionWriter):
    """The shared fold and truncate cuts, without the look-ups of TOASTed values: `missing`
    goes to the staging table, and the MERGE takes those columns from the stored row."""

    def fill_toasted(self, changes: pa.Table) -> pa.Table:
        return changes


class PostgresStore(RowStore):
    """Keeps the read model's tables equal to the source tables; `suffix` names a rebuild's
    generation of the schemas (`cdc_public__next`)."""

    transient = ("psycopg.OperationalError",)  # StoreUnavailable: every store's (sinks.runner)
    partition_class = _Staged

    def __init__(self, config: PostgresConfig, name: str = "postgres", suffix: str = "") -> None:
        required_dsn(config)
        self.config, self.name, self.suffix = config, name, suffix
        self.where = f"PostgreSQL at {redact_dsn(config.dsn)}"
        self._conn: psycopg.Connection | None = None
        self._targets: dict[str, tuple[str, list[Target]]] = {}  # topic -> its table, its columns (this batch)
        self.stage = stage_of(name + suffix)
        self._side: psycopg.Connection | None = None  # empties the staging table outside the batch's transaction

    # -- the batch's transaction --------------------------------------------------------------
    def conn(self) -> psycopg.Connection:
        """The job's connection, its transaction the batch's; one left failed is rolled back."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = connect(self.config.dsn)
        elif self._conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            self._conn.rollback()
        return self._conn

    def open(self, resumed: bool) -> None:
        conn = self.conn()
        check_server(conn, self.where)
        ensure_meta(conn)
        conn.execute(f"CREATE UNLOGGED TABLE IF NOT EXISTS {self.stage} (task integer NOT NULL, topic text, key text, "
                     'kind text, lsn bigint, seq bigint, part integer, "offset" bigint, row text, missing text[])')
        conn.commit()

    def load(self) -> dict[str, Any] | None:
        found = self.conn().execute(f"SELECT record::text FROM {META_SCHEMA}.bookkeeping WHERE name = %s",
                                    (self.name,)).fetchone()
        return None if found is None else orjson.loads(found[0])

    def save(self, record: dict[str, Any]) -> None:
        """The record, and the batch's writes with it: the transaction commits here."""
        conn = self.conn()
        conn.execute(f"INSERT INTO {META_SCHEMA}.bookkeeping VALUES (%s, %s::jsonb) ON CONFLICT (name) "
                     "DO UPDATE SET record = EXCLUDED.record", (self.name, orjson.dumps(record).decode()))
        conn.commit()

    def clear(self) -> None:
        """Every schema the store made for this generation, and the bookkeeping record."""
        conn = self.conn()
        conn.rollback()
        for schema in owned_schemas(conn, self.config.schema_prefix, self.suffix):
            conn.execute(f"DROP SCHEMA {quote_ident(schema)} CASCADE")
        conn.execute(f"DELETE FROM {META_SCHEMA}.bookkeeping WHERE name = %s", (self.name,))
        conn.commit()
        log.info("%s: dropped the read model's schemas of %s", self.where, self.config.schema_prefix)

    def close(self) -> None:
        for conn in (self._conn, self._side):
            if conn is not None:
                conn.close()
        self._conn = self._side = None

    # -- the writes -----------------------------------------------------------------------------
    def truncate(self, topic: str, truncate: Truncate) -> None:
        """Every row below the truncate's position, in the batch's transaction."""
        conn = self.conn()
        table = table_of(conn, topic, self.suffix)
        if table is not None:
            conn.execute(f"DELETE FROM {table} WHERE (_cdc_lsn, _cdc_seq) < (%s, %s)", truncate[:2])

    def prepare(self, topics: list[str], registry: Registry) -> None:
        """Each table made to fit its newest version, in the batch's transaction."""
        conn = self.conn()
        self._targets = {}
        for topic in topics:
            versions = registry.versions(topic)
            newest = versions[-1]
            schema = self.config.schema_prefix + newest.schema
            if len(schema + self.suffix) > MAX_NAME or len(newest.table) > MAX_NAME:
                raise SinkStopped(f"{newest.display}: the read model's name {schema}.{newest.table} is longer than "
                                  f"PostgreSQL's {MAX_NAME} bytes: shorten [postgres] schema_prefix")
            columns = targets(versions)
            clash = [t.name for t in columns if t.name in META_NAMES]
            if clash:
                raise SinkStopped(f"{newest.display}: column {clash[0]} has a name the read model keeps for itself")
            table = f"{quote_ident(schema + self.suffix)}.{quote_ident(newest.table)}"
            self._fit(conn, schema + self.suffix, table, columns, newest.display)
            conn.execute(f"INSERT INTO {META_SCHEMA}.tables VALUES (%s, %s, %s) ON CONFLICT (topic) DO UPDATE SET "
                         "schema_name = EXCLUDED.schema_name, table_name = EXCLUDED.table_name",
                         (topic, schema, newest.table))
            self._targets[topic] = (table, columns)

    def _fit(self, conn: psycopg.Connection, schema: str, table: str, columns: list[Target], display: str) -> None:
        if conn.execute("SELECT to_regnamespace(%s)", (quote_ident(schema),)).fetchone() == (None,):
            conn.execute(f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}")
            conn.execute(f"COMMENT ON SCHEMA {quote_ident(schema)} IS {quote_literal(OWNED)}")
        held: dict[str, str] = dict(conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attnum > 0 AND NOT attisdropped", (table,)).fetchall())
        if not held:
            defined = [f"{n} {t}" for n, t in META] + [f"{quote_ident(c.name)} {c.type}" for c in columns]
            conn.execute(f"CREATE TABLE {table} ({', '.join(defined)})")
            return
        for column in columns:
            if column.name not in held:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {quote_ident(column.name)} {column.type}")
            elif held[column.name] != column.type:
                name = quote_ident(column.name)
                conn.execute("SAVEPOINT retype")
                try:
                    conn.execute(f"ALTER TABLE {table} ALTER COLUMN {name} TYPE {column.type} USING {name}::{column.type}")
                except psycopg.Error as exc:
                    conn.execute("ROLLBACK TO SAVEPOINT retype")
                    raise SinkStopped(
                        f"{display}: column {column.name} changed from {held[column.name]} to {column.type}, which "
                        f"its stored values do not convert to ({str(exc).splitlines()[0]}): give every row an event "
                        "of the new type (an UPDATE of each row in the source), then run `cdc postgres rebuild` to "
                        "fill the table again with the new type") from None
                log.info("%s: column %s of %s is now %s", self.where, column.name, table, column.type)

    def writer(self, registry: Registry) -> _Stage:
        return _Stage(self.config.dsn, self.stage)

    def partition_writer(self, registry: Registry, cuts: dict[str, tuple[int, int]]) -> PartitionWriter:
        """The staging table emptied first, from a connection of its own: in the batch's
        transaction, TRUNCATE's lock would last until COMMIT and stop the executors' COPY."""
        if self._side is None or self._side.closed or self._side.broken:
            self._side = connect(self.config.dsn, autocommit=True)
        self._side.execute(f"TRUNCATE {self.stage}")
        return super().partition_writer(registry, cuts)

    def write(self, rows: DataFrame, registry: Registry, cuts: dict[str, tuple[int, int]]) -> list[Rejected]:
        """The executors stage the batch's last changes (a COPY refuses nothing: a value that does
        not convert fails its MERGE), then one MERGE per table `prepare` made ready."""
        super().write(rows, registry, cuts)
        self.merge()
        return []

    def write_changes(self, batches: Iterable[pa.RecordBatch], cuts: dict[str, tuple[int, int]]) -> list[Rejected]:
        """`write` on the driver, for change rows at hand (sinks.latest.ROWS, each key's in
        offset order)."""
        for _ in self.partition_writer(Registry(), cuts)(batches):
            pass
        self.merge()
        return []

    def merge(self) -> None:
        """One MERGE per table `prepare` made ready, of the rows the batch staged."""
        conn = self.conn()
        conn.execute(f"ANALYZE {self.stage}")  # the MERGE's plan needs its size: an estimate of a few
        # rows picks a nested loop over the table's scan, quadratic in the batch
        for topic, (table, columns) in self._targets.items():
            self._merge(conn, topic, table, columns)
        conn.execute(f"DELETE FROM {META_SCHEMA}.deletes WHERE deleted_at < now() - make_interval(secs => %s)",
                     (self.config.marker_ttl_s,))

    def _merge(self, conn: psycopg.Connection, topic: str, table: str, columns: list[Target]) -> None:
        def value(c: Target, held: str) -> str:
            return f"CASE WHEN {quote_literal(c.name)} = ANY(s.missing) THEN {held} ELSE {c.value} END"

        names = [quote_ident(c.name) for c in columns]
        updates = ", ".join(f"{n} = {value(c, f't.{n}')}" for n, c in zip(names, columns, strict=True))
        inserts = ", ".join(value(c, "NULL") for c in columns)
        newer = "(s.lsn, s.seq) > (t._cdc_lsn, t._cdc_seq)"
        lone = "s.lsn IS NULL AND s.part = t._cdc_partition AND s.\"offset\" > t._cdc_offset"
        # an upsert below its key's delete marker is older than a delete already applied (a
        # rebuild's last pass behind the live job, a replay): it changes nothing. A delete always
        # goes on: the same delete again removes what a generation switched in still held
        changes = (f"SELECT s.*, s.row::jsonb AS _cdc_r FROM {self.stage} s LEFT JOIN {META_SCHEMA}.deletes m "
                   "ON m.topic = s.topic AND m.key = s.key WHERE s.topic = %s AND (s.kind = 'd' OR m.key IS NULL "
                   "OR (s.lsn, s.seq) > (m.lsn, m.seq))")
        conn.execute(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")  # a rebuild's last pass writes it too
        try:
            conn.execute(
                f"MERGE INTO {table} t USING ({changes}) s "
                "ON t._cdc_key = s.key "
                f"WHEN MATCHED AND s.kind = 'd' AND ({newer} OR ({lone})) THEN DELETE "
                f"WHEN MATCHED AND s.kind = 'u' AND {newer} THEN UPDATE SET {updates}"
                f"{', ' if updates else ''}_cdc_lsn = s.lsn, _cdc_seq = s.seq, _cdc_partition = s.part, "
                "_cdc_offset = s.\"offset\" "
                f"WHEN NOT MATCHED AND s.kind = 'u' THEN INSERT (_cdc_key{', ' if names else ''}{column_list([c.name for c in columns])}, "
                "_cdc_lsn, _cdc_seq, _cdc_partition, _cdc_offset) "
                f"VALUES (s.key{', ' if inserts else ''}{inserts}, s.lsn, s.seq, s.part, s.\"offset\")",
                (topic,),
            )
        except psycopg.errors.DataError as exc:
            raise SinkStopped(f"{table}: a value does not fit its column ({str(exc).splitlines()[0]}): fix the "
                              "column's type in the source, or run `cdc postgres rebuild`") from None
        conn.execute(
            f"INSERT INTO {META_SCHEMA}.deletes SELECT topic, key, lsn, seq, now() FROM {self.stage} WHERE topic = %s "
            "AND kind = 'd' AND lsn IS NOT NULL ON CONFLICT (topic, key) DO UPDATE SET lsn = EXCLUDED.lsn, "
            "seq = EXCLUDED.seq, deleted_at = EXCLUDED.deleted_at "
            "WHERE (deletes.lsn, deletes.seq) < (EXCLUDED.lsn, EXCLUDED.seq)", (topic,))


def check_server(conn: psycopg.Connection, where: str) -> None:
    """PostgreSQL 15 or later (MERGE), and the right to make the store's schemas."""
    version = conn.info.server_version
    if version < MIN_VERSION:
        raise ConfigError(f"{where} runs PostgreSQL {version // 10000}: the read model needs 15 or later (MERGE)")
    row = conn.execute("SELECT has_database_privilege(current_database(), 'CREATE')").fetchone()
    if not (row and row[0]):
        raise ConfigError(f"{where}: this user may not create schemas: GRANT CREATE ON DATABASE "
                          f"{conn.info.dbname} TO {conn.info.user}")


def owned_schemas(conn: psycopg.Connection, prefix: str, suffix: str) -> list[str]:
    """The schemas of the read model's generation `suffix` ('' for the live one)."""
    found = conn.execute(
        "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s) AND obj_description(oid, 'pg_namespace') = %s",
        (prefix, OWNED)).fetchall()
    generations = ("__next", "__old")
    return sorted(name for (name,) in found if (name.endswith(suffix) if suffix else not name.endswith(generations)))


def check(config: Config) -> None:
    """The DSN, the server's version and the right to make schemas, before any Spark starts."""
    settings: PostgresConfig = config.postgres
    try:
        conn = connect(required_dsn(settings), autocommit=True)
    except StoreUnavailable as exc:
        raise ConfigError(f"{exc}: check [postgres] dsn") from None
    try:
        check_server(conn, f"PostgreSQL at {redact_dsn(settings.dsn)}")
    finally:
        conn.close()


def build(spark: SparkSession, config: Config) -> PostgresStore:
    return PostgresStore(config.postgres)


def rebuild(config: Config, stop: StopSignal) -> list[str]:
    from sinks.stores.postgres.generations import rebuild_here

    rows = rebuild_here(config, stop)
    return [f"postgres rebuild: {len(rows)} tables switched in, {sum(rows.values())} rows"]


def local(workdir: Path) -> tuple[Any, dict[str, str]]:
    """A throwaway PostgreSQL (the demo's read model), and the settings that point the job at it."""
    from cdc.local.postgres import LocalPostgres

    server = LocalPostgres(workdir / "postgres-read-model").start()
    return server, {"CDC_POSTGRES_DSN": server.create_database("read_model")}


def show(config: Config, topics: list[str]) -> list[str]:
    """What a reader's SELECT finds, a line per row."""
    conn = connect(config.postgres.dsn, autocommit=True)
    try:
        lines = []
        for table in (table_of(conn, topic) for topic in topics):
            if table is None:
                continue
            for key, row in conn.execute(f"SELECT _cdc_key, to_jsonb(t) - '_cdc_key' - '_cdc_lsn' - '_cdc_seq' "
                                         f"- '_cdc_partition' - '_cdc_offset' FROM {table} t ORDER BY _cdc_key"):
                lines.append(f"SELECT FROM {table} {key} -> {orjson.dumps(row).decode()}")
        return lines
    finally:
        conn.close()


class _Rows:
    """Each topic's table's rows (count(*): exact, as the other stores count)."""

    def __init__(self, config: Config) -> None:
        self.dsn = config.postgres.dsn
        self.conn: psycopg.Connection | None = None

    def count(self, topics: list[str]) -> dict[str, int | None]:
        if self.conn is None or self.conn.closed:
            self.conn = connect(self.dsn, autocommit=True)
        if self.conn.execute("SELECT to_regclass(%s)", (f"{META_SCHEMA}.tables",)).fetchone() == (None,):
            return dict.fromkeys(topics)
        return {topic: rows_of(self.conn, topic) for topic in topics}

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def counter(config: Config) -> _Rows:
    return _Rows(config)
