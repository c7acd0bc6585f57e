"""The Delta warehouse: `current/`, `changes/` and `history/` per table, with delta-spark.

Exactly once per micro-batch, also across a crash between two commits, and also when the
checkpoint is deleted and the topics are replayed:
- `current` MERGEs by key and applies a change only over a lower stored position (a
  lone tombstone, which has none, only over a lower offset of the same partition);
- `changes` rows and new `history` versions are written only above the table's own
  per-partition offset watermark, read back from the table when the job starts. This
  is what Delta's `txnAppId`/`txnVersion` gives, without tying it to a checkpoint: a
  deleted checkpoint restarts batch ids at 0, and Delta would skip those versions;
- ending `history` versions is offset-guarded, so a retried batch ends nothing twice; one
  MERGE ends the old versions and inserts the new ones, so they commit together.
Tables use column mapping (any PostgreSQL column name works) and type widening. The job's
bookkeeping (sinks.store) is `<root>/_cdc/<job>.json`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from sinks import hadoop, history
from sinks.batch import UNAVAILABLE, TableBatch, TypeConflict
from sinks.envelope import CHANGE_COLUMNS
from sinks.handover import LiveSide
from sinks.store import TableStore, Truncate

log = logging.getLogger(__name__)

KINDS = ("current", "changes", "history")
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
_HISTORY_META = _struct(
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
    return f"{root.rstrip('/')}/{kind}/{schema}/{table}"


def _newer(s: str = "s", t: str = "t") -> str:
    return f"({s}._cdc_lsn > {t}._cdc_lsn OR ({s}._cdc_lsn = {t}._cdc_lsn AND {s}._cdc_seq > {t}._cdc_seq))"


def _above(watermarks: dict[int, int]) -> Column:
    """Rows above the per-partition offset watermarks (partitions without one: all rows)."""
    cond = F.lit(True)
    for partition, offset in watermarks.items():
        cond = cond & ((F.col("_cdc_partition") != partition) | (F.col("_cdc_offset") > offset))
    return cond


class DeltaStore(TableStore):
    """Writes every table of a micro-batch to the warehouse under `root`."""

    #: Delta's optimistic concurrency lost a race (another writer committed first), and a block
    #: of the batch's stored source went missing (a known Spark pitfall): both pass on a retry
    transient = ("io.delta.exceptions.Concurrent", "DELTA_CONCURRENT_", "CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND")

    def __init__(self, spark: SparkSession, root: str, name: str = "delta") -> None:
        self.name = name
        self.spark = spark
        self.root = root
        self.where = f"the Delta warehouse at {root}"
        self.record = f"{root.rstrip('/')}/_cdc/{name}.json"
        self.handover: LiveSide | None = LiveSide(spark, root, name)
        # per table path: steps of different tables run in parallel threads, so each entry is
        # its own table's; the lock keeps the dictionaries themselves whole
        self._lock = threading.Lock()
        self._watermarks: dict[str, dict[int, int]] = {}  # table path -> partition -> offset
        self._schemas: dict[str, dict[str, DataType]] = {}  # table path -> its columns, as last seen
        self._commits: dict[str, int] = {}  # table path -> this job's writes to it

    # -- bookkeeping -----------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        raw = hadoop.read_bytes(self.spark, self.record)
        return None if raw is None else orjson.loads(raw)

    def save(self, record: dict[str, Any]) -> None:
        hadoop.write_bytes(self.spark, self.record, orjson.dumps(record))

    def clear(self) -> None:
        """`current/`, which the topics rebuild; `changes/` and `history/` keep what they hold
        (superseded versions the compacted topics no longer have), and their offset
        watermarks skip what they already have."""
        hadoop.delete(self.spark, f"{self.root.rstrip('/')}/current")
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

    # -- tables ----------------------------------------------------------------------
    def _table(self, path: str, columns: dict[str, DataType], meta: StructType, what: str) -> DeltaTable:
        """The Delta table at `path` with at least `columns` + `meta`: created, or evolved
        (new columns added, types widened); a change it cannot take raises TypeConflict."""
        spark = self.spark
        with self._lock:
            known = self._schemas.get(path)
        if known is not None and all(known.get(n) == t for n, t in columns.items()):
            return DeltaTable.forPath(spark, path)
        if not DeltaTable.isDeltaTable(spark, path):
            schema = StructType([StructField(n, t) for n, t in columns.items()] + list(meta.fields))
            builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
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

    def _remember(self, path: str, table: DeltaTable) -> None:
        columns = {f.name: f.dataType for f in table.toDF().schema.fields}
        with self._lock:
            self._schemas[path] = columns

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

    # -- writes ----------------------------------------------------------------------
    def steps(self) -> tuple[Callable[[TableBatch], None], ...]:
        """`current` first (every table's schema changes before it): readers of the current
        state wait for nothing else; then the append-only `changes` and `history`."""
        return (self._schemas_and_current, self._changes_and_history)

    def _schemas_and_current(self, batch: TableBatch) -> None:
        # every schema change first: a type change a table cannot take stops before any write
        self._table(table_path(self.root, "changes", batch.topic), {}, _CHANGES, batch.display)
        for kind, meta in (("current", _CURRENT_META), ("history", _HISTORY_META)):
            self._table(table_path(self.root, kind, batch.topic), batch.columns, meta, batch.display)
        self._write("current", self._current, batch)

    def _changes_and_history(self, batch: TableBatch) -> None:
        self._write("changes", self._changes, batch)
        self._write("history", self._history, batch)

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
            log.info("%s: %d files compacted into %d in %.1f s", path, removed, added, time.monotonic() - started)

    def _compact(self, path: str) -> tuple[int, int]:
        """OPTIMIZE's bin-packing of one table: (files removed, files added)."""
        metrics = DeltaTable.forPath(self.spark, path).optimize().executeCompaction().collect()[0].metrics
        return int(metrics.numFilesRemoved), int(metrics.numFilesAdded)

    def _changes(self, batch: TableBatch) -> None:
        path = table_path(self.root, "changes", batch.topic)
        self._table(path, {}, _CHANGES, batch.display)
        rows = batch.rows.where(_above(self._watermark(path))).select(*CHANGE_COLUMNS)
        rows.write.format("delta").mode("append").save(path)
        self._advance(path, batch.offsets)

    def _current(self, batch: TableBatch) -> None:
        path = table_path(self.root, "current", batch.topic)
        table = self._table(path, batch.columns, _CURRENT_META, batch.display)
        toasted = {n for n, t in batch.columns.items() if isinstance(t, (StringType, BinaryType, ArrayType))}
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

    def _history(self, batch: TableBatch) -> None:
        """One MERGE: it ends the current versions of the batch's keys and inserts the batch's
        new versions (those with a null `_merge_key`, which match nothing)."""
        path = table_path(self.root, "history", batch.topic)
        table = self._table(path, batch.columns, _HISTORY_META, batch.display)
        new = history.versions(batch.rows, batch.columns, batch.known).where(_above(self._watermark(path)))
        source = history.first_changes(batch.rows).withColumn("_merge_key", F.col("_cdc_key")).unionByName(
            new.withColumn("_merge_key", F.lit(None).cast(_TEXT)), allowMissingColumns=True
        )
        (
            table.alias("t")
            .merge(source.alias("s"), "t._cdc_key = s._merge_key AND t._cdc_is_current AND t._cdc_offset < s._cdc_offset")
            .whenMatchedUpdate(set=_ended(batch.known))
            .whenNotMatchedInsert(
                condition="s._merge_key IS NULL",
                values={q(n): f"s.{q(n)}" for n in [*batch.columns, *_HISTORY_META.fieldNames()]},
            )
            .execute()
        )
        for lsn, seq, ts_ms in batch.truncates:  # the versions of keys the batch did not change
            table.update(
                condition=f"_cdc_is_current AND (_cdc_valid_from_lsn < {lsn} OR "
                f"(_cdc_valid_from_lsn = {lsn} AND _cdc_valid_from_seq < {seq}))",
                set={
                    "_cdc_valid_to": f"timestamp_millis({ts_ms})",
                    "_cdc_valid_to_lsn": str(lsn),
                    "_cdc_valid_to_seq": str(seq),
                    "_cdc_is_current": "false",
                    "_cdc_deleted": "true",
                },
            )
        self._advance(path, batch.offsets)

    # -- maintenance -----------------------------------------------------------------
    def tables(self, kinds: tuple[str, ...] = KINDS) -> Iterator[str]:
        """Every Delta table under the warehouse (`<kind>/<schema>/<table>`)."""
        jvm, jsc = self.spark._jvm, self.spark._jsc
        assert jvm is not None and jsc is not None
        conf = jsc.hadoopConfiguration()
        for kind in kinds:
            top = jvm.org.apache.hadoop.fs.Path(f"{self.root.rstrip('/')}/{kind}")
            fs = top.getFileSystem(conf)
            if not fs.exists(top):
                continue
            for schema in fs.listStatus(top):
                if not schema.isDirectory():
                    continue
                for table in fs.listStatus(schema.getPath()):
                    path = table.getPath().toString()
                    if table.isDirectory() and DeltaTable.isDeltaTable(self.spark, path):
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

    def rebuild_history(self, rows: DataFrame, batch: TableBatch) -> None:
        """Replace `history` of one table by the versions of every change in `changes`."""
        path = table_path(self.root, "history", batch.topic)
        self._table(path, batch.columns, _HISTORY_META, batch.display)
        history.versions(rows, batch.columns, batch.truncates).write.format("delta").mode("overwrite").option(
            "overwriteSchema", "false"
        ).save(path)
        with self._lock:
            self._watermarks.pop(path, None)


def _ended(truncates: list[tuple[int, int, int]]) -> dict[str, str | Column]:
    """How history's MERGE ends a current version `t` by the key's first change `s`: at the first
    truncate after `t` began, when that comes before `s` (or `s`, a lone tombstone, has no
    position), else at `s`; a truncate or a delete marks it deleted."""
    ends = {"ts": "s._cdc_ts", "lsn": "s._cdc_lsn", "seq": "s._cdc_seq"}
    cases = {name: "" for name in ends}
    deleted = "s._deletes"
    for lsn, seq, ts_ms in truncates:
        after_t = f"({lsn} > t._cdc_valid_from_lsn OR ({lsn} = t._cdc_valid_from_lsn AND {seq} > t._cdc_valid_from_seq))"
        before_s = f"(s._cdc_lsn IS NULL OR {lsn} < s._cdc_lsn OR ({lsn} = s._cdc_lsn AND {seq} < s._cdc_seq))"
        when = f" WHEN {after_t} AND {before_s} THEN "
        for name, value in (("ts", f"timestamp_millis({ts_ms})"), ("lsn", str(lsn)), ("seq", str(seq))):
            cases[name] += when + value
        deleted = f"({after_t} AND {before_s}) OR " + deleted
    end = {name: f"CASE{cases[name]} ELSE {ends[name]} END" if cases[name] else ends[name] for name in ends}
    return {
        "_cdc_valid_to": end["ts"],
        "_cdc_valid_to_lsn": end["lsn"],
        "_cdc_valid_to_seq": end["seq"],
        "_cdc_is_current": "false",
        "_cdc_deleted": deleted,
    }


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def check(config: Config) -> None:
    if not config.delta.path:
        raise ConfigError("[delta] path is not set: set it (or CDC_DELTA_PATH) to the warehouse folder or URI")


def build(spark: SparkSession, config: Config) -> DeltaStore:
    return DeltaStore(spark, config.delta.path)


def local(workdir: Path) -> tuple[Any, dict[str, str]]:
    """No server: a warehouse folder (the demo's)."""
    return None, {"CDC_DELTA_PATH": str(workdir / "warehouse")}


# delta-rs in a child: a process that read a table with it can abort at exit (ENVIRONMENT.md)
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
        import subprocess

        if self.child.stdin is not None:
            self.child.stdin.close()
        try:
            self.child.wait(10)
        except subprocess.TimeoutExpired:
            self.child.kill()


def counter(config: Config) -> _Rows:
    return _Rows(config)
