"""The Delta warehouse: `current/<schema>/<table>`, one change log `changes/` for the whole
prefix, and `history/<schema>/<table>`, with delta-spark.

A micro-batch makes one commit per table whose records it read (`current`: a MERGE by key;
a table's first batch makes the table with its rows) and one for the whole batch (`changes`:
every table's records appended to one Delta table, partitioned by `_cdc_topic`). `history/`
is kept from that log by a streaming query of its own (sinks.stores.delta.history): the
current state never waits for history's MERGEs, and history commits once per table per batch
of its own, which gathers many of the job's. A Delta
commit through Spark costs about a CPU-second whatever it holds, so the commits, not the
rows, set a batch's cost: a table's small batch ([delta] small_merge_rows) is MERGEd by
delta-rs from the driver instead (sinks.stores.delta.rs), a tenth of that.

Exactly once per micro-batch, also across a crash between two commits, and also when the
checkpoint is deleted and the topics are replayed:
- `current` MERGEs by key and applies a change only over a lower stored position (a
  lone tombstone, which has none, only over a lower offset of the same partition);
- `changes` rows are appended only above the log's own per-topic, per-partition offset
  watermark, read back from the log when the job starts. Delta's `txnAppId`/`txnVersion`
  alone would tie this to the checkpoint (a deleted checkpoint restarts batch ids at 0 and
  Delta would skip those versions); the append carries them too (the checkpoint's query id
  and the batch id), so a batch whose append committed though the call failed is not
  appended twice when it is read again.
Tables use column mapping (any PostgreSQL column name works) and type widening. The job's
bookkeeping (sinks.store) is `<root>/_cdc/<job>.json`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdc.config import Config, ConfigError
from sinks import hadoop
from sinks.batch import UNAVAILABLE, TableBatch, TypeConflict
from sinks.envelope import CHANGE_COLUMNS
from sinks.handover import LiveSide
from sinks.store import SinkStopped, TableStore, Truncate
from sinks.stores.delta.rs import Clause, DeltaRs, ReaderError, quote, remote

if TYPE_CHECKING:
    from sinks.query import StopSignal

log = logging.getLogger(__name__)

KINDS = ("current", "changes", "history")
#: where `cdc delta migrate` moves the per-table change tables of an older warehouse, until copied
MOVED_ASIDE = "_cdc/changes-per-table"
#: a change log append of fewer records is written by one task (a file per table)
SMALL_BATCH = 100_000
#: a table's batch of at most this many records is MERGEd by delta-rs ([delta] small_merge_rows)
SMALL_MERGE_ROWS = 10_000
#: a table is compacted (OPTIMIZE's bin-packing) after this many of the job's commits to it:
#: each batch adds small files, and a MERGE or a scan pays per file
COMPACT_EVERY = 50


def _struct(*fields: tuple[str, DataType]) -> StructType:
    return StructType([StructField(name, kind) for name, kind in fields])


_LONG, _TEXT, _TIME, _FLAG = LongType(), StringType(), TimestampType(), BooleanType()
_COORDINATES = (("_cdc_partition", IntegerType()), ("_cdc_offset", _LONG))
_POSITION = (("_cdc_lsn", _LONG), ("_cdc_seq", _LONG), ("_cdc_ts", _TIME), ("_cdc_tx_id", _LONG))
_CURRENT_META = _struct(("_cdc_key", _TEXT), ("_cdc_op", _TEXT), *_POSITION, *_COORDINATES)
_CHANGES = _struct(
    ("_cdc_topic", _TEXT), *_COORDINATES, ("_cdc_key", _TEXT), ("_cdc_op", _TEXT), *_POSITION,
    ("_cdc_snapshot", _TEXT), ("_cdc_tombstone", _FLAG), ("before", _TEXT), ("after", _TEXT),
)
HISTORY_META = _struct(
    ("_cdc_key", _TEXT), ("_cdc_op", _TEXT), ("_cdc_valid_from", _TIME), ("_cdc_valid_to", _TIME),
    ("_cdc_valid_from_lsn", _LONG), ("_cdc_valid_from_seq", _LONG), ("_cdc_valid_to_lsn", _LONG),
    ("_cdc_valid_to_seq", _LONG), ("_cdc_is_current", _FLAG), ("_cdc_deleted", _FLAG), ("_cdc_tx_id", _LONG),
    *_COORDINATES,
)

# Column mapping lets a table hold any PostgreSQL column name, but only some readers know it
# (delta-rs's `to_pyarrow_table()` reads such a table as nulls; its QueryBuilder reads it
# right), so a table gets it only for a name Parquet cannot hold. Likewise type widening
# (delta-rs cannot read it at all) is enabled only when a column widens.
_COLUMN_MAPPING = {"delta.columnMapping.mode": "name", "delta.minReaderVersion": "2", "delta.minWriterVersion": "5"}
_PARQUET_UNSAFE = set(" ,;{}()\n\t=")
_INTEGRAL = (ShortType, IntegerType, LongType)


def q(name: str) -> str:
    """A column name quoted for Spark SQL."""
    return "`" + name.replace("`", "``") + "`"


def widens(old: DataType, new: DataType) -> bool:
    """Changes Delta's type widening takes in place (integral and float widening, a decimal's
    precision and scale growing, date to timestamp_ntz)."""
    if isinstance(old, _INTEGRAL) and isinstance(new, _INTEGRAL):
        return _INTEGRAL.index(type(old)) < _INTEGRAL.index(type(new))
    if isinstance(old, FloatType) and isinstance(new, DoubleType):
        return True
    if isinstance(old, DecimalType) and isinstance(new, DecimalType):
        return new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale
    return isinstance(old, DateType) and isinstance(new, TimestampNTZType)


def needs_column_mapping(columns: dict[str, DataType]) -> bool:
    """A column name Parquet cannot hold (Delta refuses it without column mapping)."""
    return any(_PARQUET_UNSAFE.intersection(name) for name in columns)


def table_path(root: str, kind: str, topic: str) -> str:
    """`<root>/<kind>/<schema>/<table>` with the topic's escaped names (its last two parts)."""
    schema, table = topic.rsplit(".", 2)[-2:]
    return hadoop.under(root, f"{kind}/{schema}/{table}")


def rs_clauses(columns: list[str], toasted: set[str]) -> list[Clause]:
    """`current`'s MERGE (DeltaStore._current) in delta-rs's SQL: the same position guards,
    deletes and unchanged TOASTed values."""
    s = {n: f"s.{quote(n)}" for n in [*columns, *_CURRENT_META.names, "_cdc_delete", UNAVAILABLE]}
    t = {n: f"t.{quote(n)}" for n in [*columns, *_CURRENT_META.names]}
    newer = (f"({s['_cdc_lsn']} > {t['_cdc_lsn']} OR ({s['_cdc_lsn']} = {t['_cdc_lsn']} "
             f"AND {s['_cdc_seq']} > {t['_cdc_seq']}))")
    lone = (f"{s['_cdc_lsn']} IS NULL AND {s['_cdc_partition']} = {t['_cdc_partition']} "
            f"AND {s['_cdc_offset']} > {t['_cdc_offset']}")
    literal = {n: "'" + n.replace("'", "''") + "'" for n in toasted}
    kept = {n: f"CASE WHEN array_has({s[UNAVAILABLE]}, {literal[n]}) THEN {t[n]} ELSE {s[n]} END" for n in toasted}
    meta = {quote(n): s[n] for n in _CURRENT_META.names}
    return [
        ("delete", f"{s['_cdc_delete']} AND ({newer} OR ({lone}))", None),
        ("update", f"NOT {s['_cdc_delete']} AND {newer}", {quote(n): kept.get(n, s[n]) for n in columns} | meta),
        ("insert", f"NOT {s['_cdc_delete']}", {quote(n): s[n] for n in columns} | meta),
    ]


def _newer(s: str = "s", t: str = "t") -> str:
    return f"({s}._cdc_lsn > {t}._cdc_lsn OR ({s}._cdc_lsn = {t}._cdc_lsn AND {s}._cdc_seq > {t}._cdc_seq))"


def above(watermarks: dict[int, int]) -> Column:
    """Rows above the per-partition offset watermarks (partitions without one: all rows)."""
    cond = F.lit(True)
    for partition, offset in watermarks.items():
        cond = cond & ((F.col("_cdc_partition") != partition) | (F.col("_cdc_offset") > offset))
    return cond


class Warehouse(TableStore):
    """What the warehouse's stores share (the job's `current` and change log, the history
    query's `history`): its tables, created or evolved; their offset watermarks; their
    compaction; a bookkeeping record under `<root>/_cdc/`."""

    #: Delta's optimistic concurrency lost a race (another writer committed first): it passes on
    #: a retry (what every store's retry cures is sinks.runner.TRANSIENT)
    transient = ("io.delta.exceptions.Concurrent", "DELTA_CONCURRENT_")

    def __init__(self, spark: SparkSession, root: str, name: str, small_merge_rows: int = SMALL_MERGE_ROWS) -> None:
        self.name = name
        self.spark = spark
        self.root = root
        # delta-rs reads and writes local tables only (a remote warehouse's credentials are Spark's)
        self.small_merge_rows = 0 if remote(root) else small_merge_rows
        self._rs: DeltaRs | None = None
        self.where = f"the Delta warehouse at {root}"
        self.record = hadoop.under(root, f"_cdc/{name}.json")
        # per table path: steps of different tables run in parallel threads, so each entry is
        # its own table's; the lock keeps the dictionaries themselves whole
        self._lock = threading.Lock()
        self._watermarks: dict[str, dict[int, int]] = {}  # table path -> partition -> offset
        self._schemas: dict[str, dict[str, DataType]] = {}  # table path -> its columns, as last seen
        self._commits: dict[str, int] = {}  # table path -> this job's writes to it
        self._spark_merges: dict[str, str] = {}  # table path -> why Spark, not delta-rs, merges it

    # -- bookkeeping -----------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        raw = hadoop.read_bytes(self.spark, self.record)
        return None if raw is None else orjson.loads(raw)

    def save(self, record: dict[str, Any]) -> None:
        hadoop.write_bytes(self.spark, self.record, orjson.dumps(record))

    # -- tables ----------------------------------------------------------------------
    def _table(
        self, path: str, columns: dict[str, DataType], meta: StructType, what: str, partitioned_by: str | None = None
    ) -> DeltaTable:
        """The Delta table at `path` with at least `columns` + `meta`: created (partitioned by
        the `partitioned_by` column), or evolved (new columns added, types widened); a change it
        cannot take raises TypeConflict."""
        spark = self.spark
        if self._fits(path, columns):
            return DeltaTable.forPath(spark, path)
        if not DeltaTable.isDeltaTable(spark, path):
            schema = StructType([StructField(n, t) for n, t in columns.items()] + list(meta.fields))
            builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
            if partitioned_by is not None:
                builder = builder.partitionedBy(partitioned_by)
            for key, value in (_COLUMN_MAPPING if needs_column_mapping(columns) else {}).items():
                builder = builder.property(key, value)
            builder.execute()
            table = DeltaTable.forPath(spark, path)
            self._remember(path, table)
            return table
        table = DeltaTable.forPath(spark, path)
        existing = {f.name: f.dataType for f in table.toDF().schema.fields}
        added = [(n, t) for n, t in columns.items() if n not in existing]
        if added:
            detail = table.detail().first()
            mapped = detail is not None and detail["properties"].get("delta.columnMapping.mode", "none") != "none"
            if needs_column_mapping(dict(added)) and not mapped:
                self._set_properties(path, _COLUMN_MAPPING)
            ddl = ", ".join(f"{q(n)} {t.simpleString()}" for n, t in added)
            spark.sql(f"ALTER TABLE delta.{q(path)} ADD COLUMNS ({ddl})")
            log.info("%s: added columns %s", path, ", ".join(n for n, _ in added))
        for name, new in columns.items():
            old = existing.get(name)
            if old is None or old == new:
                continue
            if not widens(old, new):
                raise TypeConflict(
                    f"table {what} column {name} changed from {old.simpleString()} to {new.simpleString()}, which "
                    f"the Delta table {path} cannot take: rebuild it (delete the table and the sink's checkpoint) "
                    "or cast the column back in PostgreSQL"
                )
            self._set_properties(path, {"delta.enableTypeWidening": "true"})
            spark.sql(f"ALTER TABLE delta.{q(path)} ALTER COLUMN {q(name)} TYPE {new.simpleString()}")
            log.info("%s: column %s widened from %s to %s", path, name, old.simpleString(), new.simpleString())
            added.append((name, new))
        if added:
            table = DeltaTable.forPath(spark, path)  # a new schema needs a new handle
        self._remember(path, table)
        return table

    def _fits(self, path: str, columns: dict[str, DataType]) -> bool:
        """The table as this job last saw it holds `columns` with their types (nothing to evolve)."""
        with self._lock:
            known = self._schemas.get(path)
        return known is not None and all(known.get(n) == t for n, t in columns.items())

    def _created_by(
        self, path: str, rows: DataFrame, columns: dict[str, DataType], meta: StructType,
        partitioned_by: str | None = None,
    ) -> bool:
        """A table not made yet is made by its first batch's rows, in one commit: a MERGE into an
        empty table costs a commit to create it and a join against nothing (a first snapshot of
        many tables pays that per table). False when the table exists, or needs column mapping
        (`_table` creates it with that property first)."""
        with self._lock:
            if path in self._schemas:
                return False
        if needs_column_mapping(columns) or DeltaTable.isDeltaTable(self.spark, path):
            return False
        typed = rows.select(
            *[F.col(q(n)).cast(t).alias(n) for n, t in columns.items()],
            *[F.col(f.name).cast(f.dataType) for f in meta.fields],
        )
        # this job is the table's only writer: a table that appeared meanwhile is an error, not an append
        writer = typed.write.format("delta").mode("errorifexists")
        if partitioned_by is not None:
            writer = writer.partitionBy(partitioned_by)
        writer.save(path)
        self._remember(path, DeltaTable.forPath(self.spark, path))
        with self._lock:
            self._watermarks[path] = {}  # what it held before these rows: `_advance` adds theirs
        return True

    def _remember(self, path: str, table: DeltaTable) -> None:
        columns = {f.name: f.dataType for f in table.toDF().schema.fields}
        with self._lock:
            self._schemas[path] = columns

    def _merged_by_delta_rs(self, path: str, records: int, source: DataFrame, on: str, clauses: list[Clause]) -> bool:
        """A small batch's MERGE (`source` as `s` into the table as `t`) done by delta-rs from
        the driver, in one commit: a Spark MERGE plans a dozen jobs whatever it holds (about a
        CPU-second), delta-rs does the same in a tenth of that (bench/delta_commit.py), which
        sets the cost of a batch that touches many tables. False: Spark merges it (a bigger
        batch, or a table delta-rs does not write right, from then on until its compaction)."""
        if records > self.small_merge_rows or path in self._spark_merges:
            return False
        try:
            declined = self._delta_rs().merge(path, source.toArrow(), on, clauses)
        except ReaderError as exc:  # nothing committed, or all of it: Spark's MERGE then changes nothing
            log.warning("%s: delta-rs failed to merge a batch (%s); Spark merges it", path, exc)
            declined = str(exc)
            with self._lock:
                if self._rs is not None and self._rs.child.poll() is not None:  # the child ended: a new one next time
                    self._rs.close()
                    self._rs = None
        return True if declined is None else self._merged_by_spark(path, declined)

    def _merged_by_spark(self, path: str, why: str) -> bool:
        """Spark merges this table from now on (logged once): False."""
        with self._lock:
            self._spark_merges[path] = why
        log.info("%s: Spark merges its batches: %s", path, why)
        return False

    def _delta_rs(self) -> DeltaRs:
        with self._lock:
            if self._rs is None:
                self._rs = DeltaRs()
            return self._rs

    def close(self) -> None:
        if self._rs is not None:
            self._rs.close()
            self._rs = None

    def _set_properties(self, path: str, properties: dict[str, str]) -> None:
        listed = ", ".join(f"{_sql_string(k)} = {_sql_string(v)}" for k, v in properties.items())
        self.spark.sql(f"ALTER TABLE delta.{q(path)} SET TBLPROPERTIES ({listed})")

    def _watermark(self, path: str) -> dict[int, int]:
        """Per partition, the highest offset the table holds (read once, then kept)."""
        with self._lock:
            found = self._watermarks.get(path)
        if found is None:
            found = {}
            if DeltaTable.isDeltaTable(self.spark, path):
                rows = self.spark.read.format("delta").load(path).groupBy("_cdc_partition").agg(F.max("_cdc_offset"))
                found = {int(p): int(o) for p, o in rows.collect() if p is not None}
            with self._lock:
                self._watermarks[path] = found
        return dict(found)

    def _advance(self, path: str, offsets: dict[int, int]) -> None:
        marks = self._watermark(path)
        for partition, offset in offsets.items():
            marks[partition] = max(marks.get(partition, -1), offset)
        with self._lock:
            self._watermarks[path] = marks

    def _write(self, kind: str, write: Callable[[TableBatch], None], batch: TableBatch) -> None:
        started = time.monotonic()
        write(batch)
        self._compact_now_and_then(table_path(self.root, kind, batch.topic))
        log.debug("%s: %s %.1f s", batch.display, kind, time.monotonic() - started)

    def _compact_now_and_then(self, path: str) -> None:
        """Bin-pack the table's small files every COMPACT_EVERY writes (after the write: a
        crash in between leaves a table that is only less compact)."""
        with self._lock:
            done = self._commits[path] = self._commits.get(path, 0) + 1
        if done % COMPACT_EVERY == 0:
            started = time.monotonic()
            removed, added = self._compact(path)
            with self._lock:  # new files: delta-rs may write the table now (sinks.stores.delta.rs)
                self._spark_merges.pop(path, None)
            log.info("%s: %d files compacted into %d in %.1f s", path, removed, added, time.monotonic() - started)

    def _compact(self, path: str) -> tuple[int, int]:
        """OPTIMIZE's bin-packing of one table: (files removed, files added)."""
        metrics = DeltaTable.forPath(self.spark, path).optimize().executeCompaction().collect()[0].metrics
        return int(metrics.numFilesRemoved), int(metrics.numFilesAdded)


class DeltaStore(Warehouse):
    """The job's writes: every table's `current` of a micro-batch, then the batch's records in
    the change log, in one append."""

    def __init__(self, spark: SparkSession, root: str, name: str = "delta",
                 small_merge_rows: int = SMALL_MERGE_ROWS) -> None:
        super().__init__(spark, root, name, small_merge_rows)
        self.handover: LiveSide | None = LiveSide(spark, root, name)
        self.log = log_path(root)
        self._log_marks: dict[str, dict[int, int]] | None = None  # topic -> partition -> offset

    def open(self, resumed: bool) -> None:
        check_layout(self.spark, self.root)
        ensure_log(self.spark, self.log)

    def clear(self) -> None:
        """`current/`, which the topics rebuild; the change log and `history/` keep what they
        hold (superseded versions the compacted topics no longer have), and their offset
        watermarks skip what they already have."""
        hadoop.delete(self.spark, hadoop.under(self.root, "current"))
        hadoop.delete(self.spark, self.record)
        with self._lock:
            for path in [p for p in self._schemas if "/current/" in p]:
                del self._schemas[path]
        log.info("%s: current/ cleared", self.where)

    def truncate(self, topic: str, truncate: Truncate) -> None:
        path = table_path(self.root, "current", topic)
        if DeltaTable.isDeltaTable(self.spark, path):
            lsn, seq, _ = truncate
            DeltaTable.forPath(self.spark, path).delete(f"_cdc_lsn < {lsn} OR (_cdc_lsn = {lsn} AND _cdc_seq < {seq})")

    # -- writes ----------------------------------------------------------------------
    def steps(self) -> tuple[Callable[[TableBatch], None], ...]:
        """`current` only: readers of the current state wait for nothing else."""
        return (self._current_step,)

    def _current_step(self, batch: TableBatch) -> None:
        self._write("current", self._current, batch)

    def _current(self, batch: TableBatch) -> None:
        path = table_path(self.root, "current", batch.topic)
        if self._created_by(path, batch.latest.where("NOT _cdc_delete"), batch.columns, _CURRENT_META):
            return
        if not self._fits(path, batch.columns):
            self._table(path, batch.columns, _CURRENT_META, batch.display)  # evolved first, by Spark
        toasted = {n for n, t in batch.columns.items() if isinstance(t, (StringType, BinaryType, ArrayType))}
        # what the clauses read; a table without TOASTable columns has an array of nulls, which Arrow lacks
        source = batch.latest.select(*[q(n) for n in batch.columns], *_CURRENT_META.names, "_cdc_delete",
                                     F.col(UNAVAILABLE).cast(ArrayType(StringType())).alias(UNAVAILABLE))
        if self._merged_by_delta_rs(path, batch.records, source, f"t.{quote('_cdc_key')} = s.{quote('_cdc_key')}",
                                    rs_clauses(list(batch.columns), toasted)):
            return
        table = self._table(path, batch.columns, _CURRENT_META, batch.display)
        values: dict[str, str | Column] = {
            q(n): (f"CASE WHEN array_contains(s.{UNAVAILABLE}, {_sql_string(n)}) THEN t.{q(n)} ELSE s.{q(n)} END"
                   if n in toasted else f"s.{q(n)}")
            for n in batch.columns
        }
        meta: dict[str, str | Column] = {q(f.name): f"s.{f.name}" for f in _CURRENT_META.fields}
        inserts: dict[str, str | Column] = {q(n): f"s.{q(n)}" for n in batch.columns}
        inserts.update(meta)
        lone_tombstone = "s._cdc_lsn IS NULL AND s._cdc_partition = t._cdc_partition AND s._cdc_offset > t._cdc_offset"
        (
            table.alias("t")
            .merge(batch.latest.alias("s"), "t._cdc_key = s._cdc_key")
            .whenMatchedDelete(condition=f"s._cdc_delete AND ({_newer()} OR ({lone_tombstone}))")
            .whenMatchedUpdate(condition=f"NOT s._cdc_delete AND {_newer()}", set=values | meta)
            .whenNotMatchedInsert(condition="NOT s._cdc_delete", values=inserts)
            .execute()
        )

    def after_tables(self, batches: list[TableBatch], batch_id: int, lineage: str | None) -> None:
        """Every table's records of the batch in the change log, one append; above the log's
        per-topic, per-partition offset watermark."""
        if not batches:
            return
        started = time.monotonic()
        marks = self._log_watermarks()
        parts = [b.rows.where(above(marks.get(b.topic, {}))).select(*CHANGE_COLUMNS) for b in batches]
        rows = parts[0]
        for more in parts[1:]:
            rows = rows.unionByName(more)
        # one task writes a small batch (a file per table), the executors' cores a big one
        small = sum(b.records for b in batches) < SMALL_BATCH
        rows = rows.coalesce(1 if small else max(1, self.spark.sparkContext.defaultParallelism))
        writer = rows.write.format("delta").mode("append")
        if lineage is not None:
            writer = writer.option("txnAppId", lineage).option("txnVersion", str(batch_id))
        writer.save(self.log)
        with self._lock:
            for b in batches:
                topic_marks = marks.setdefault(b.topic, {})
                for partition, offset in b.offsets.items():
                    topic_marks[partition] = max(topic_marks.get(partition, -1), offset)
        self._compact_now_and_then(self.log)
        log.debug("changes: %d tables %.1f s", len(batches), time.monotonic() - started)

    def _log_watermarks(self) -> dict[str, dict[int, int]]:
        """Per topic and partition, the highest offset the change log holds (read once, then kept)."""
        if self._log_marks is None:
            rows = (self.spark.read.format("delta").load(self.log)
                    .groupBy("_cdc_topic", "_cdc_partition").agg(F.max("_cdc_offset")).collect())
            marks: dict[str, dict[int, int]] = {}
            for topic, partition, offset in rows:
                if partition is not None:
                    marks.setdefault(topic, {})[int(partition)] = int(offset)
            self._log_marks = marks
        return self._log_marks

    # -- maintenance -----------------------------------------------------------------
    def tables(self, kinds: tuple[str, ...] = KINDS) -> Iterator[str]:
        """Every Delta table of the warehouse: `current/<schema>/<table>`, the change log,
        `history/<schema>/<table>`."""
        for kind in kinds:
            if kind == "changes":
                if DeltaTable.isDeltaTable(self.spark, self.log):
                    yield self.log
                continue
            for schema in hadoop.folders(self.spark, hadoop.under(self.root, kind)):
                for path in hadoop.folders(self.spark, schema):
                    if DeltaTable.isDeltaTable(self.spark, path):
                        yield path

    def optimize(self) -> list[tuple[str, int, int]]:
        """Compact small files; (table, files removed, files added) per table."""
        return [(path, *self._compact(path)) for path in self.tables()]

    def vacuum(self, retain_hours: float) -> list[str]:
        """Delete files no version younger than `retain_hours` needs."""
        out = []
        for path in self.tables():
            DeltaTable.forPath(self.spark, path).vacuum(retain_hours)
            out.append(path)
        return out

    def migrate(self) -> list[tuple[str, int]]:
        """Move a warehouse from per-table change tables (`changes/<schema>/<table>`, cdc before
        the one change log) to the one log; (old table, rows moved) per table.

        The old tables are moved aside to `_cdc/changes-per-table/` (one rename), each is
        appended to the new log with its own `txnAppId` (a run stopped half-way and started
        again appends none twice), and the moved-aside folder is deleted last."""
        aside = hadoop.under(self.root, MOVED_ASIDE)
        if hadoop.exists(self.spark, self.log) and not DeltaTable.isDeltaTable(self.spark, self.log):
            if hadoop.exists(self.spark, aside):
                raise SinkStopped(f"both {self.log} and {aside} hold per-table change tables: merge them by hand")
            hadoop.rename(self.spark, self.log, aside)
        if not hadoop.exists(self.spark, aside):
            return []
        ensure_log(self.spark, self.log)
        moved = []
        for schema in hadoop.folders(self.spark, aside):
            for path in hadoop.folders(self.spark, schema):
                if not DeltaTable.isDeltaTable(self.spark, path):
                    continue
                name = path.rstrip("/").rsplit("/", 2)
                table = f"{name[-2]}/{name[-1]}"
                rows = self.spark.read.format("delta").load(path).select(*CHANGE_COLUMNS)
                (rows.write.format("delta").mode("append").option("txnAppId", f"cdc-migrate {table}")
                 .option("txnVersion", "0").save(self.log))
                moved.append((f"changes/{table}", rows.count()))
        hadoop.delete(self.spark, aside)
        return moved


def log_path(root: str) -> str:
    """The change log of the whole prefix."""
    return hadoop.under(root, "changes")


_LOG_CREATION = threading.Lock()  # the job and the history query start in one process


def ensure_log(spark: SparkSession, path: str) -> None:
    """The change log, created empty when missing (the history query streams it from its start)."""
    with _LOG_CREATION:
        if not DeltaTable.isDeltaTable(spark, path):
            DeltaTable.createIfNotExists(spark).location(path).addColumns(_CHANGES).partitionedBy(
                "_cdc_topic"
            ).execute()


def check_layout(spark: SparkSession, root: str) -> None:
    """A warehouse written by cdc before the one change log keeps `changes/<schema>/<table>`:
    the job stops and says how to move it."""
    log_at = log_path(root)
    old = hadoop.exists(spark, log_at) and not DeltaTable.isDeltaTable(spark, log_at)
    if old or hadoop.exists(spark, hadoop.under(root, MOVED_ASIDE)):
        raise SinkStopped(
            f"the Delta warehouse at {root} keeps changes/ per table (cdc before the one change log): stop the "
            "delta sink and run `cdc delta migrate --config <file>` once, which moves it to the one change log"
        )


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def check(config: Config) -> None:
    if not config.delta.path:
        raise ConfigError("[delta] path is not set: set it (or CDC_DELTA_PATH) to the warehouse folder or URI")


def build(spark: SparkSession, config: Config) -> DeltaStore:
    return DeltaStore(spark, config.delta.path, small_merge_rows=config.delta.small_merge_rows)


def rebuild(config: Config, stop: StopSignal) -> list[str]:
    from sinks.stores.delta.generations import rebuild_here

    switched = rebuild_here(config, stop)
    return [f"delta rebuild: {len(switched)} tables of current/ replaced, {sum(n for _, n in switched)} rows"]


def followers(spark: SparkSession, config: Config) -> list[TableStore]:
    """`history/`, kept from the change log by a query of its own (sinks.stores.delta.history)."""
    from sinks.stores.delta.history import HistoryStore

    return [HistoryStore(spark, config.delta.path, small_merge_rows=config.delta.small_merge_rows)]


def local(workdir: Path) -> tuple[Any, dict[str, str]]:
    """No server: a warehouse folder (the demo's)."""
    return None, {"CDC_DELTA_PATH": str(workdir / "warehouse")}


# delta-rs in a child: a process that read a table with it can abort at interpreter exit
_READ_CURRENT = """
import json, os, sys
from deltalake import DeltaTable
rows = sorted(DeltaTable(sys.argv[1]).to_pyarrow_table().to_pylist(), key=lambda r: r["_cdc_key"])
keep = lambda r: {k: v for k, v in r.items() if not k.startswith("_cdc_") or k in ("_cdc_op", "_cdc_lsn")}
sys.stdout.write(json.dumps([keep(r) for r in rows], default=str))
sys.stdout.flush()
os._exit(0)
"""


def show(config: Config, topics: list[str]) -> list[str]:
    """Each table's `current/` as a reader without Spark finds it (delta-rs), a line each."""
    import subprocess
    import sys

    lines = []
    for topic in topics:
        path = table_path(config.delta.path, "current", topic)
        read = subprocess.run([sys.executable, "-c", _READ_CURRENT, path], capture_output=True, text=True)
        where = path.removeprefix(config.delta.path.rstrip("/") + "/")
        lines.append(f"{where} (read with delta-rs): {read.stdout.strip() or read.stderr.strip()[-500:]}")
    return lines



# One request a line (a table path), one answer a line (its row count, or null when there is no
# table yet); it ends with os._exit when its input closes (delta-rs can abort at exit).
_COUNT_CURRENT = r"""
import json, os, sys
from deltalake import DeltaTable, QueryBuilder
tables = {}
for line in sys.stdin:
    path = line.rstrip("\n")
    try:
        table = tables.get(path)
        if table is None:
            table = tables[path] = DeltaTable(path)
        else:
            table.update_incremental()
        count = QueryBuilder().register("t", table).execute("SELECT count(*) AS n FROM t").read_all()
        answer = int(count.column(0)[0].as_py())
    except Exception:
        tables.pop(path, None)
        answer = None
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
os._exit(0)
"""


class _Rows:
    """The rows of each table's `current/`, read by delta-rs in a child process that lives as
    long as the counter (a warm one reads only the log's new commits)."""

    def __init__(self, config: Config) -> None:
        import subprocess
        import sys

        self.root = config.delta.path
        self.child = subprocess.Popen([sys.executable, "-c", _COUNT_CURRENT], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def count(self, topics: list[str]) -> dict[str, int | None]:
        import json

        assert self.child.stdin is not None and self.child.stdout is not None
        out: dict[str, int | None] = {}
        for topic in topics:
            self.child.stdin.write(table_path(self.root, "current", topic) + "\n")
            self.child.stdin.flush()
            out[topic] = json.loads(self.child.stdout.readline() or "null")
        return out

    def close(self) -> None:
        from sinks.stores.delta.rs import end_child

        end_child(self.child)


def counter(config: Config) -> _Rows:
    return _Rows(config)
