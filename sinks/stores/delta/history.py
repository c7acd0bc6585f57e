"""`history/`: SCD type 2, kept from the warehouse's change log by a streaming query of its own.

`cdc sink delta` runs two queries in one process: the topics into `current/` and the change
log (sinks.stores.delta.store), and this one, the change log (Delta as a streaming source) into
`history/`, with its own checkpoint (`<checkpoint_dir>/delta-history`) and trigger (`[delta]
history_interval_s`). The current state never waits for history's MERGEs, and history makes
one commit per table per batch of its own, which gathers many of the job's batches.

It is a sink job like the others (sinks.pipeline) on another feed: the same decoding with
the table versions, the same truncate bookkeeping (each table's newest truncate in its own
record, `<root>/_cdc/delta-history.json`, so `TableBatch.known` carries the truncates read
in earlier batches), the same check that the store holds what the query committed. Exactly
once: new versions are written only above the history table's own per-partition offset
watermark, read back from the table when the query starts; ending a version is
offset-guarded; one MERGE per table and batch ends the old versions and inserts the new
ones, so they commit together (by delta-rs for a small batch of a table without truncates,
as `current`'s). A history found behind its checkpoint (a restored backup)
reads the whole log again, and the watermarks skip what it holds.

Its progress in LSNs: the log holds no heartbeats, so the warehouse job's progress records
vouch instead. The warehouse is complete up to an LSN only once the log holds every change
at or below it; history is complete up to it once it read the log to the version that was
newest then (sinks.pipeline.SinkJob._complete).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc.config import Config
from sinks import hadoop
from sinks.batch import TableBatch, decode_table, table_batch
from sinks.checkpoint import last_committed, source_offset
from sinks.envelope import CHANGE_COLUMNS
from sinks.pipeline import Feed
from sinks.progress import Completed
from sinks.store import Truncate
from sinks.stores.delta import scd2
from sinks.stores.delta.rs import Clause, quote
from sinks.stores.delta.store import (
    HISTORY_META,
    SMALL_MERGE_ROWS,
    Warehouse,
    above,
    check_layout,
    ensure_log,
    log_path,
    q,
    table_path,
)
from sinks.topics import SchemaFeed

if TYPE_CHECKING:
    from sinks.pipeline import SinkJob

#: the current versions apart from the ended ones: the MERGE that ends versions reads and
#: rewrites the current ones' files (as many rows as `current` holds), not every version
#: the table ever held
PARTITIONED_BY = "_cdc_is_current"


class LogFeed(Feed):
    """The warehouse's change log as a Delta streaming source: its rows are change rows already;
    the warehouse job (`upstream`) vouches for the LSNs (sinks.progress.Completed)."""

    in_batches = False

    def __init__(self, path: str, upstream: str) -> None:
        self.path = path
        self.upstream = upstream

    def vouches(self, config: Config) -> Completed:
        return Completed(config.topic, self.upstream)

    def ends(self, job: SinkJob) -> int:
        """The log's newest version."""
        newest = DeltaTable.forPath(job.spark, self.path).history(1).select("version").head()
        return -1 if newest is None else int(newest[0])

    def read(self, spark: SparkSession, checkpoint: str, batch: int | None) -> int | None:
        """The newest log version read to its end by batch `batch` (None: the last committed one)."""
        if batch is None:
            batch = last_committed(spark, checkpoint)
        offset: Any = None if batch is None else source_offset(spark, checkpoint, batch)
        if offset is None:
            return None
        # Delta's source offset: every version below `reservoirVersion` is read, none while the
        # query still reads the snapshot of the log it began with (`isStartingVersion`)
        return -1 if offset.get("isStartingVersion") else int(offset["reservoirVersion"]) - 1

    def within(self, ends: int, read: int) -> bool:
        return read >= ends

    def stream(self, spark: SparkSession, config: Config) -> DataFrame:
        return (spark.readStream.format("delta").option("maxFilesPerTrigger", "1000000")
                .option("maxBytesPerTrigger", str(config.delta.history_batch_bytes)).load(self.path))

    def rows(self, records: DataFrame) -> DataFrame:
        none = F.lit(None).cast("string")
        return records.select(*CHANGE_COLUMNS, none.alias("_cdc_error"), none.alias("_value"))

    def interval_s(self, config: Config) -> float:
        return config.delta.history_interval_s


class HistoryStore(Warehouse):
    """`history/<schema>/<table>` from the change log's rows, one MERGE per table and batch."""

    feed: LogFeed

    def __init__(self, spark: SparkSession, root: str, name: str = "delta-history", upstream: str = "delta",
                 small_merge_rows: int = SMALL_MERGE_ROWS) -> None:
        super().__init__(spark, root, name, small_merge_rows)
        self.where = f"the history of the Delta warehouse at {root}"
        self.feed = LogFeed(log_path(root), upstream)

    def open(self, resumed: bool) -> None:
        check_layout(self.spark, self.root)
        ensure_log(self.spark, self.feed.path)

    def clear(self) -> None:
        """Only the bookkeeping: `history/` keeps every version (the topics no longer hold the
        superseded ones), and its watermarks skip what it has when the log is read again."""
        hadoop.delete(self.spark, self.record)

    def truncate(self, topic: str, truncate: Truncate) -> None:
        """Nothing here: the history MERGE ends the versions a truncate ends (`TableBatch.known`)."""

    def steps(self) -> tuple:
        return (self._history_step,)

    def _history_step(self, batch: TableBatch) -> None:
        self._write("history", self._history, batch)

    def _history(self, batch: TableBatch) -> None:
        """One MERGE: it ends the current versions of the batch's keys and inserts the batch's
        new versions (those with a null `_merge_key`, which match nothing)."""
        path = table_path(self.root, "history", batch.topic)
        if self._created_by(path, scd2.versions(batch.rows, batch.columns, batch.known), batch.columns, HISTORY_META,
                            PARTITIONED_BY):
            self._advance(path, batch.offsets)
            return
        if not self._fits(path, batch.columns):
            self._table(path, batch.columns, HISTORY_META, batch.display, PARTITIONED_BY)  # evolved first, by Spark
        new = scd2.versions(batch.rows, batch.columns, batch.known).where(above(self._watermark(path)))
        source = scd2.first_changes(batch.rows).withColumn("_merge_key", F.col("_cdc_key")).unionByName(
            new.withColumn("_merge_key", F.lit(None).cast("string")), allowMissingColumns=True
        )
        # a table without truncates: versions end at their key's next change alone (_ended)
        if not batch.known and self._merged_by_delta_rs(path, batch.records, source, RS_ON,
                                                        rs_clauses([*batch.columns, *HISTORY_META.names])):
            self._advance(path, batch.offsets)
            return
        table = self._table(path, batch.columns, HISTORY_META, batch.display, PARTITIONED_BY)
        (
            table.alias("t")
            .merge(source.alias("s"), "t._cdc_key = s._merge_key AND t._cdc_is_current AND t._cdc_offset < s._cdc_offset")
            .whenMatchedUpdate(set=_ended(batch.known))
            .whenNotMatchedInsert(
                condition="s._merge_key IS NULL",
                values={q(n): f"s.{q(n)}" for n in [*batch.columns, *HISTORY_META.fieldNames()]},
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

    def rebuild(self, rows: DataFrame, batch: TableBatch) -> None:
        """Replace `history` of one table by the versions of every change in the log (a
        history written before its partitioning gets it)."""
        path = table_path(self.root, "history", batch.topic)
        detail = self._table(path, batch.columns, HISTORY_META, batch.display, PARTITIONED_BY).detail().first()
        unpartitioned = detail is not None and detail["partitionColumns"] != [PARTITIONED_BY]
        scd2.versions(rows, batch.columns, batch.truncates).write.format("delta").mode("overwrite").partitionBy(
            PARTITIONED_BY
        ).option("overwriteSchema", str(unpartitioned).lower()).save(path)
        with self._lock:
            self._watermarks.pop(path, None)


RS_ON = 't."_cdc_key" = s."_merge_key" AND t."_cdc_is_current" AND t."_cdc_offset" < s."_cdc_offset"'


def rs_clauses(columns: list[str]) -> list[Clause]:
    """History's MERGE for a table without truncates, in delta-rs's SQL: a key's first change
    of the batch ends its current version (_ended without truncates), the new versions go in."""
    ended = {'"_cdc_valid_to"': 's."_cdc_ts"', '"_cdc_valid_to_lsn"': 's."_cdc_lsn"',
             '"_cdc_valid_to_seq"': 's."_cdc_seq"', '"_cdc_is_current"': "false", '"_cdc_deleted"': 's."_deletes"'}
    return [("update", "true", ended),
            ("insert", 's."_merge_key" IS NULL', {quote(n): f"s.{quote(n)}" for n in columns})]


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


def rebuild_history(store: HistoryStore, config: Config) -> Iterator[tuple[str, int]]:
    """Rebuild every table's history from the change log; yields (table, versions written)."""
    feed = SchemaFeed(config.topic)
    try:
        registry = feed.refresh()
        log = store.spark.read.format("delta").load(store.feed.path)
        for (topic,) in log.select("_cdc_topic").distinct().orderBy("_cdc_topic").collect():
            if not registry.versions(topic):
                continue
            rows = store.feed.rows(log.where(F.col("_cdc_topic") == topic))
            span = rows.agg(F.min("_cdc_lsn"), F.max("_cdc_lsn")).first()
            assert span is not None
            low, high = (span[0] or 0), (span[1] or 0)
            decoded, columns = decode_table(rows, registry, topic, low, high)
            decoded = decoded.where(F.col("_cdc_error").isNull())
            truncates = sorted(
                (r[0], r[1], r[2]) for r in decoded.where(F.col("_cdc_op") == "t")
                .select("_cdc_lsn", "_cdc_seq", F.unix_millis("_cdc_ts")).collect()
            )
            newest = registry.at(topic, high) or registry.versions(topic)[0]
            batch = table_batch(decoded, newest, columns, truncates, {})
            store.rebuild(decoded, batch)
            yield batch.display, decoded.where(F.col("_cdc_op").isin("r", "c", "u")).count()
    finally:
        feed.close()
