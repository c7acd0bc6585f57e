"""A sink job: one Structured Streaming query from the table topics into one store.

Per micro-batch (on the driver; the work runs on the executors): decode the records,
send what cannot be decoded to the dead-letter topic, then either split by table, decode
each event with its table version and let a store of typed columns apply each table
(Delta), or hand every table's events to a store of the events' JSON in one pass (the
cache, the search index; what it rejects goes to the dead-letter topic too); last, record
the progress in LSN terms. Offsets live in the Spark checkpoint, which advances only
after the batch function returned: a batch whose store write failed is read again.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc.config import Config
from cdc.kafka.topics import TopicAdmin, TopicError
from sinks import topics
from sinks.batch import ChangeBatch, TableBatch, TypeConflict, decode_table, table_batch
from sinks.envelope import change_rows
from sinks.shapes import Registry

log = logging.getLogger(__name__)

TABLE_THREADS = 4
QUIET_S = 2.0  # no batch for this long: the streaming job looks whether its last heartbeat is complete
LETTER_COLUMNS = ("_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_key", "_cdc_error", "_value")


class _Lifecycle(Protocol):
    name: str

    def start(self, resumed: bool) -> None:
        """Before the query starts; `resumed`: the checkpoint holds committed batches."""

    def done(self) -> None:
        """After every table of a batch, before it commits: a store that finds it lost
        writes raises StoreLost."""


@runtime_checkable
class TableStore(_Lifecycle, Protocol):
    """A store of typed columns (the warehouse): one table of a batch at a time, in steps. The
    job runs a step for every table of the batch before the next step, so what the first step
    writes (the current state) waits for no table's later steps."""

    def steps(self) -> tuple[Callable[[TableBatch], None], ...]: ...


@runtime_checkable
class ChangeStore(_Lifecycle, Protocol):
    """A store of the events' JSON (the cache, the search index): every table of a batch
    in one pass, no typed decoding. Returns the records the store rejected (the change
    rows with `_cdc_error` saying why), for the dead-letter topic, or None."""

    def apply_changes(self, batch: ChangeBatch) -> DataFrame | None: ...


Store = TableStore | ChangeStore


class StoreLost(Exception):
    """The store lost writes of committed batches (a server restarted without its data):
    the job rebuilds it from the topics, from the earliest offsets."""


class SinkStopped(Exception):
    """The job stopped on purpose: a record it must not skip, or a change the store cannot take."""


class _StopRequested(Exception):
    """Raised by a batch that starts after SIGTERM: it is read again next time, uncommitted."""


@dataclass
class Progress:
    """How far a job got, in source terms (see `cdc status`)."""

    tables: dict[str, int] = field(default_factory=dict)  # topic -> highest commit LSN applied
    complete_lsn: int = 0  # every transaction committed at or below it is in the store
    heartbeat_lsn: int = 0  # the newest daemon heartbeat read (complete after the next batch, or `settle`)
    batches: int = 0
    dead_letters: int = 0

    def as_record(self, job: str, batch_id: int) -> dict[str, Any]:
        return {
            "job": job, "batch": batch_id, "tables": {t: str(v) for t, v in self.tables.items()},
            "complete_lsn": str(self.complete_lsn), "heartbeat_lsn": str(self.heartbeat_lsn),
            "dead_letters": self.dead_letters, "ts_ms": int(time.time() * 1000),
        }

    @classmethod
    def from_record(cls, raw: dict[str, Any] | None) -> Progress:
        if not raw:
            return cls()
        return cls(
            {t: int(v) for t, v in raw.get("tables", {}).items()}, int(raw.get("complete_lsn", 0)),
            int(raw.get("heartbeat_lsn", 0)), 0, int(raw.get("dead_letters", 0)),
        )


class SinkJob:
    """The batch function of one job and its state between batches."""

    def __init__(
        self, spark: SparkSession, config: Config, store: Store, stop_requested: Callable[[], bool] = lambda: False
    ) -> None:
        self.spark = spark
        self.stop_requested = stop_requested
        self.config = config
        self.store = store
        self.prefix = config.topic.prefix
        self.heartbeat_topic = topics.internal(self.prefix, topics.HEARTBEAT)
        self.schemas = topics.SchemaFeed(config.topic)
        self.progress_log = topics.ProgressLog(config.topic, store.name)
        self.progress = Progress.from_record(self.progress_log.last())
        self.running = False  # a batch is being applied (SIGTERM waits for it)
        self.last_batch: int | None = None  # the id of the last batch this run committed
        self.batch_ended = 0.0  # when it ended (monotonic)
        self._settled: int | None = None  # the last batch `settle` looked after
        self.failure: BaseException | None = None
        self._lock = threading.Lock()  # tables are applied in parallel threads; `settle` runs beside batches

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        if self.stop_requested():  # batches follow each other at once: the stop must come from here
            self.failure = _StopRequested()
            raise self.failure
        self.running = True
        try:
            self._batch(records, batch_id)
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            self.running = False

    def _batch(self, records: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        # One read of the batch from Kafka, stored with its plan cut short: the batch's later
        # jobs neither read Kafka again nor plan the envelope decoding again. A task per
        # topic partition would be mostly scheduling on a small batch: the executors' cores
        # read them, a whole topic partition each time, in offset order (what stores rely on)
        cores = self.spark.sparkContext.defaultParallelism
        persisted = change_rows(records.coalesce(max(1, cores))).localCheckpoint(eager=True)
        read = time.monotonic()
        rows = persisted.where(F.col("_cdc_topic") != self.heartbeat_topic)
        try:
            stats = self._stats(persisted)
            counted = time.monotonic()
            beat = stats.pop(self.heartbeat_topic, {}).get("beat")
            registry = self.schemas.refresh() if stats else self.schemas.registry
            bad = [rows.where(F.col("_cdc_error").isNotNull())] if any(s["errors"] for s in stats.values()) else []
            good = rows.where(F.col("_cdc_error").isNull())
            work = []
            for topic, stat in sorted(stats.items()):
                if stat["low"] is None and not stat["truncates"] and stat["count"] == stat["errors"]:
                    continue  # nothing but dead letters
                table_rows = good.where(F.col("_cdc_topic") == topic)
                if not registry.versions(topic):
                    reason = f"no table version for {topic} in {topics.internal(self.prefix, topics.SCHEMAS)}"
                    bad.append(table_rows.withColumn("_cdc_error", F.lit(reason)))
                    continue
                work.append((topic, stat, table_rows))
            self._dead_letters(bad)  # before any store write: with on_malformed = stop nothing is applied
            store = self.store
            if isinstance(store, ChangeStore):
                if work:
                    written = F.col("_cdc_topic").isin(*[topic for topic, _, _ in work])
                    batch = ChangeBatch(good.where(written), {t: s["truncates"] for t, s, _ in work}, registry)
                    rejected = store.apply_changes(batch)
                    if rejected is not None:
                        self._dead_letters([rejected])
            else:
                self._apply_tables(store, registry, work)
            written_at = time.monotonic()
            store.done()
            applied = {topic: stat["high"] for topic, stat, _ in work if stat["high"] is not None}
            self._record(batch_id, applied, beat)
            ended = time.monotonic()
            log.info(
                "batch %d: %d records of %d tables in %.1f s (read %.1f, statistics %.1f, store %.1f, progress %.1f)",
                batch_id, sum(s["count"] for s in stats.values()), len(stats), ended - started, read - started,
                counted - read, written_at - counted, ended - written_at,
            )
        finally:
            persisted.unpersist()  # its blocks go with the reference (Spark's context cleaner)

    def _stats(self, rows: DataFrame) -> dict[str, dict[str, Any]]:
        """Per topic: record and error counts, commit LSN range, truncates, max offset per
        partition; for the heartbeat topic, the highest LSN (`beat`)."""
        good = F.col("_cdc_error").isNull()
        heartbeat = F.when(
            F.col("_cdc_topic") == self.heartbeat_topic, F.get_json_object(F.col("_value"), "$.lsn").try_cast("long")
        )
        truncate = F.when(good & (F.col("_cdc_op") == "t"), F.struct(
            "_cdc_lsn", "_cdc_seq", (F.unix_millis(F.col("_cdc_ts"))).alias("ts")
        ))
        per_partition = rows.groupBy("_cdc_topic", "_cdc_partition").agg(
            F.count(F.lit(1)).alias("count"),
            F.count(F.when(~good, 1)).alias("errors"),
            F.min(F.when(good, F.col("_cdc_lsn"))).alias("low"),
            F.max(F.when(good, F.col("_cdc_lsn"))).alias("high"),
            F.max("_cdc_offset").alias("offset"),
            F.collect_list(truncate).alias("truncates"),
            F.max(heartbeat).alias("beat"),
        ).collect()
        stats: dict[str, dict[str, Any]] = {}
        for row in per_partition:
            stat = stats.setdefault(row["_cdc_topic"], {
                "count": 0, "errors": 0, "low": None, "high": None, "offsets": {}, "truncates": [], "beat": None,
            })
            if row["beat"] is not None:
                stat["beat"] = max(stat["beat"] or 0, row["beat"])
            stat["count"] += row["count"]
            stat["errors"] += row["errors"]
            for name, pick in (("low", min), ("high", max)):
                if row[name] is not None:
                    stat[name] = row[name] if stat[name] is None else pick(stat[name], row[name])
            stat["offsets"][row["_cdc_partition"]] = row["offset"]
            stat["truncates"] += [(t["_cdc_lsn"], t["_cdc_seq"], t["ts"]) for t in row["truncates"]]
        for stat in stats.values():
            stat["truncates"].sort()
        return stats

    def _apply_tables(
        self, store: TableStore, registry: Registry, work: list[tuple[str, dict[str, Any], DataFrame]]
    ) -> None:
        """Tables in parallel threads: a table's writes are a chain of small Spark jobs and
        Delta commits, mostly waiting; several chains keep the executors busy."""
        decoded: list[DataFrame] = []
        with ThreadPoolExecutor(max_workers=max(1, min(TABLE_THREADS, len(work)))) as pool:
            try:
                batches = list(pool.map(lambda w: self._decode(registry, w, decoded), work))
                for step in store.steps():
                    list(pool.map(step, batches))
            finally:
                for rows in decoded:
                    rows.unpersist()

    def _decode(
        self, registry: Registry, work: tuple[str, dict[str, Any], DataFrame], kept: list[DataFrame]
    ) -> TableBatch:
        """One table's rows decoded (and kept in `kept` until the batch is written); those that
        do not decode go to the dead-letter topic."""
        topic, stat, rows = work
        low = stat["low"] if stat["low"] is not None else 0
        high = stat["high"] if stat["high"] is not None else low
        started = time.monotonic()
        decoded, columns = decode_table(rows, registry, topic, low, high)
        decoded = decoded.localCheckpoint(eager=True)  # stored, and the typed plan cut short
        with self._lock:
            kept.append(decoded)
        self._dead_letters([decoded.where(F.col("_cdc_error").isNotNull())])
        log.debug("%s: decoded in %.1f s", topic, time.monotonic() - started)
        newest = registry.at(topic, high) or registry.versions(topic)[0]
        return table_batch(
            decoded.where(F.col("_cdc_error").isNull()), newest, columns, stat["truncates"], stat["offsets"]
        )

    def _dead_letters(self, bad: list[DataFrame]) -> None:
        if not bad:
            return
        letters = bad[0]
        for more in bad[1:]:
            letters = letters.unionByName(more, allowMissingColumns=True)
        letters = letters.select(*LETTER_COLUMNS)
        first = letters.select("_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_error").take(1)
        if not first:
            return
        letters = letters.persist()  # written, then counted
        try:
            where = f"{first[0][0]} partition {first[0][1]} offset {first[0][2]}"
            if self.config.spark.on_malformed == "stop":
                raise SinkStopped(
                    f"record {where} cannot be decoded: {first[0][3]} (set [spark] on_malformed = \"dlq\" to send "
                    "such records to the dead-letter topic and go on)"
                )
            topics.write_dead_letters(letters, self.config.topic)
            count = letters.count()
            with self._lock:
                self.progress.dead_letters += count
            log.warning(
                "%d records to %s, the first %s: %s", count, topics.internal(self.prefix, topics.DLQ), where,
                first[0][3],
            )
        finally:
            letters.unpersist()

    def _record(self, batch_id: int, applied: dict[str, int], beat: int | None) -> None:
        """Every record below a heartbeat read in an earlier batch was in the topics when this
        batch's offsets were taken, so this batch completes the store up to that heartbeat."""
        progress = self.progress
        with self._lock:
            for topic, lsn in applied.items():
                progress.tables[topic] = max(progress.tables.get(topic, 0), lsn)
            progress.complete_lsn = max(progress.complete_lsn, progress.heartbeat_lsn)
            if beat is not None:
                progress.heartbeat_lsn = max(progress.heartbeat_lsn, beat)
            progress.batches += 1
            self.last_batch, self.batch_ended = batch_id, time.monotonic()
            self.progress_log.send(progress.as_record(self.store.name, batch_id))

    def quiet(self) -> bool:
        """No batch for QUIET_S since one that `settle` has not looked after."""
        return not self.running and self.last_batch != self._settled and time.monotonic() - self.batch_ended >= QUIET_S

    def settle(self, read: dict[str, dict[int, int]] | None) -> None:
        """When no next batch comes to complete the last heartbeat (see `_record`): at the end
        of a drained run (`--once`), or while the topics are quiet. If no table topic grew past
        `read` (per topic and partition, the offset after the last record the applied batches
        read; None: not known), every record below that heartbeat was read: the store is
        complete up to it. Once per batch: topics that grew bring a batch."""
        progress = self.progress
        with self._lock:
            batch, beat = self.last_batch, progress.heartbeat_lsn
            if read is None or batch is None or batch == self._settled:
                return
            self._settled = batch
            if beat <= progress.complete_lsn:
                return
        try:
            admin = TopicAdmin(self.config.topic)
            try:
                tables = [t for t in admin.topics_with_prefix(self.prefix) if topics.is_table_topic(self.prefix, t)]
                now = admin.end_offsets(tables)
            finally:
                admin.close()
        except TopicError as exc:  # the store is written; only this shortcut to its progress is lost
            log.warning("progress stays complete up to the heartbeat before the last one: %s", exc)
            return
        if drained(read, now):
            with self._lock:
                if beat > progress.complete_lsn:  # else a later batch completed it already
                    progress.complete_lsn = beat
                    self.progress_log.send(progress.as_record(self.store.name, batch))

    def close(self) -> None:
        self.schemas.close()
        self.progress_log.close()


def ensure_topics(config: Config) -> None:
    """The topics a job reads or writes beyond the tables' (a job may start before the daemon)."""
    prefix = config.topic.prefix
    admin = TopicAdmin(config.topic)
    try:
        admin.ensure([topics.internal(prefix, s) for s in (topics.SCHEMAS, topics.HEARTBEAT, topics.PROGRESS)], 1)
        admin.ensure([topics.internal(prefix, topics.DLQ)], 1, log_only=True)
    finally:
        admin.close()


def run(
    spark: SparkSession, config: Config, store: Store, checkpoint: str, once: bool,
    stop_requested: Callable[[], bool] = lambda: False,
) -> Progress:
    """Run the job until its topics are drained (`once`) or a stop is requested.

    A failed batch fails the query: the error is raised here, and the caller may start
    the job again from the same checkpoint (nothing after the last good batch is lost)."""
    job = SinkJob(spark, config, store, stop_requested)
    store.start(resumed=_has_commits(spark, checkpoint))
    reader = topics.read_stream(spark, config.topic, config.spark.max_offsets_per_trigger)
    writer = reader.writeStream.foreachBatch(job).option("checkpointLocation", checkpoint)
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{config.spark.trigger_interval_s} seconds")
    query = writer.queryName(f"cdc-sink-{store.name}").start()
    stopped = False
    try:
        while query.isActive:
            if stop_requested() and not job.running:
                # a batch that starts in between stops itself (_StopRequested), uncommitted
                stopped = True
                query.stop()
                break
            if not once and job.quiet():
                job.settle(_offsets_read(query))
            time.sleep(0.2)
        stopped = stopped or isinstance(job.failure, _StopRequested)
        if job.failure is not None and not stopped:
            raise job.failure
        if query.exception() is not None and not stopped:
            raise RuntimeError(str(query.exception()).splitlines()[0])
        if once and not stopped:
            job.settle(_offsets_read(query))
    finally:
        if query.isActive:
            query.stop()
        job.close()
    return job.progress


def drained(read: dict[str, dict[int, int]], ends: dict[str, dict[int, int]]) -> bool:
    """Whether `read` (per topic and partition, the offset after the last record read) reaches
    every end offset of `ends` (a partition the run did not read has to be empty)."""
    return all(end <= read.get(topic, {}).get(part, 0) for topic, parts in ends.items() for part, end in parts.items())


def _offsets_read(query: Any) -> dict[str, dict[int, int]] | None:
    """Per topic and partition, the offset after the last record the query read: its last
    committed batch's end offsets (lastProgress follows each commit); None before the first."""
    progress = query.lastProgress
    if progress is None or not progress.sources:
        return None
    end = progress.sources[0].endOffset
    offsets = orjson.loads(end) if isinstance(end, str) else end
    if not offsets:
        return None
    return {topic: {int(part): int(offset) for part, offset in parts.items()} for topic, parts in offsets.items()}


def _filesystem(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's FileSystem for `path` (a local folder or any URI Spark can write) and the path."""
    jvm, jsc = spark._jvm, spark._jsc
    assert jvm is not None and jsc is not None
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    return hadoop_path.getFileSystem(jsc.hadoopConfiguration()), hadoop_path


def _has_commits(spark: SparkSession, checkpoint: str) -> bool:
    fs, path = _filesystem(spark, checkpoint.rstrip("/") + "/commits")
    return bool(fs.exists(path) and fs.listStatus(path))


def drop_checkpoint(spark: SparkSession, checkpoint: str) -> None:
    """Forget the job's offsets: it reads the topics from the earliest offsets again."""
    fs, path = _filesystem(spark, checkpoint)
    fs.delete(path, True)


class StopSignal:
    """SIGTERM/SIGINT ask the job to stop after its running batch. `install` after the
    SparkContext started: pyspark puts its own SIGINT handler in (cancel every job)."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.requested.set())

    def __call__(self) -> bool:
        return self.requested.is_set()


__all__ = [
    "ChangeStore", "SinkJob", "SinkStopped", "Store", "StoreLost", "TableStore", "TypeConflict", "drained", "drop_checkpoint", "ensure_topics", "run", "StopSignal",
]
