"""A sink job's micro-batch, on the driver (the work runs on the executors).

Per batch: decode the envelopes; the table versions read up to date (a version not there
yet fails the batch once, which is read again, before its records become dead letters);
each table's truncates recorded and applied (sinks.store: a truncate is remembered, and
every later change below it dropped); then the store writes, either every table in one
pass of last changes per key (sinks.rows) or table by table in typed steps; the dead
letters sent once per batch; the store's bookkeeping checked and written; last, the
progress in LSN terms (`SinkJob._complete`). Offsets live in the Spark checkpoint, which
advances only after the batch function returned: a batch whose writes failed is read again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka.errors import KafkaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc.config import Config
from cdc.kafka.follow import Heartbeats
from cdc.kafka.topics import TopicAdmin, TopicError
from cdc.naming import is_table_topic, table_of_topic
from sinks import topics
from sinks.batch import TableBatch, decode_table, table_batch
from sinks.checkpoint import last_committed, offsets, query_id
from sinks.envelope import change_rows
from sinks.metrics import SinkMetrics
from sinks.rows import RowStore
from sinks.store import (
    Bookkeeping,
    SinkStopped,
    Store,
    StoreLost,
    TableStore,
    check_batch,
    check_resumed,
)
from sinks.versions import Registry

log = logging.getLogger(__name__)

TABLE_THREADS = 4
QUIET_S = 2.0  # no batch and no look for this long: the streaming job looks how complete its store is
MARKS_KEPT = 100  # LSNs vouched for whose ends the job has not read to yet (a long backlog takes no more)
#: what a look at the feed's progress may meet (the broker, the checkpoint, the log): it is tried again
LOOK_FAILURES = (TopicError, KafkaError, OSError, PySparkException)
LETTER_COLUMNS = ("_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_key", "_cdc_error", "_value")


class Vouches(Protocol):
    """A follower of the LSNs a feed vouches for: every change committed at or below one is in
    the feed (cdc.kafka.follow.Heartbeats, sinks.progress.Completed)."""

    @property
    def newest(self) -> int | None: ...

    def poll(self) -> None: ...

    def close(self) -> None: ...


class Feed:
    """Where a job's records come from: the table topics (and the daemon's heartbeats), read
    by the job's stream (sinks.kafka_source). A store may keep a feed of its own (sinks.store.Store.feed).

    A feed also says how complete the store is, in LSNs (sinks.pipeline.SinkJob._complete):
    the LSNs it vouches for (the heartbeats), where it ends (the table topics' end offsets)
    and where a batch of the job ended (its offsets in the checkpoint)."""

    #: its batches hold the LSNs it vouches for (the heartbeat topic is read with the tables)
    in_batches = True

    def vouches(self, config: Config) -> Vouches:
        """The daemon's heartbeats, followed."""
        return Heartbeats(config.topic)

    def ends(self, job: SinkJob) -> Any:
        """Where the feed ends now: per table topic and partition, its end offset."""
        admin = job.ends_admin()
        tables = [t for t in admin.topics_with_prefix(job.prefix) if is_table_topic(job.prefix, t)]
        return admin.end_offsets(tables)

    def read(self, spark: SparkSession, checkpoint: str, batch: int | None) -> Any:
        """Where batch `batch` of the query on `checkpoint` ends (None: its last committed
        batch); None when there is no such batch."""
        if batch is None:
            batch = last_committed(spark, checkpoint)
        return None if batch is None else offsets(spark, checkpoint, batch)

    def within(self, ends: Any, read: Any) -> bool:
        """Whether a job that read to `read` read everything up to `ends`."""
        return drained(read, ends)

    def stream(self, spark: SparkSession, config: Config) -> DataFrame:
        """The streaming DataFrame of the job's query."""
        return topics.read_stream(spark, config.topic, config.spark.max_offsets_per_trigger)

    def rows(self, records: DataFrame) -> DataFrame:
        """A micro-batch's records as change rows (sinks.envelope.CHANGE_COLUMNS, `_cdc_error`, `_value`)."""
        return change_rows(records)

    def interval_s(self, config: Config) -> float:
        """Seconds between the streaming query's batches."""
        return config.spark.trigger_interval_s


TOPICS = Feed()


class UnknownVersion(Exception):
    """Records of a table whose version is not in the schemas topic yet (the daemon sends a
    version ahead of its events, to another topic): the batch is read again."""


class StopRequested(Exception):
    """Raised by a batch that starts after SIGTERM, or after a rebuild asked the job to pause
    (sinks.handover): it is read again next time, uncommitted."""


@dataclass
class Progress:
    """How far a job got, in source terms (see `cdc status`)."""

    tables: dict[str, int] = field(default_factory=dict)  # topic -> highest commit LSN applied
    complete_lsn: int = 0  # every transaction committed at or below it is in the store
    heartbeat_lsn: int = 0  # the newest LSN the feed vouched for (complete once the job read to the feed's end then)
    batches: int = 0
    dead_letters: int = 0
    records: int = 0  # applied to the store, ever (`cdc top` and `cdc report` tell its rate)

    def as_record(self, job: str, batch_id: int) -> dict[str, Any]:
        return {
            "job": job, "batch": batch_id, "tables": {t: str(v) for t, v in self.tables.items()},
            "complete_lsn": str(self.complete_lsn), "heartbeat_lsn": str(self.heartbeat_lsn),
            "dead_letters": self.dead_letters, "records": self.records, "ts_ms": int(time.time() * 1000),
        }

    @classmethod
    def from_record(cls, raw: dict[str, Any] | None) -> Progress:
        if not raw:
            return cls()
        return cls(
            {t: int(v) for t, v in raw.get("tables", {}).items()}, int(raw.get("complete_lsn", 0)),
            int(raw.get("heartbeat_lsn", 0)), 0, int(raw.get("dead_letters", 0)), int(raw.get("records", 0)),
        )


class SinkJob:
    """The batch function of one job and its state between batches, across the runner's
    retries: its store, the table versions, the bookkeeping, the progress."""

    def __init__(
        self, spark: SparkSession, config: Config, store: Store, stop_requested: Callable[[], bool] = lambda: False,
        metrics: SinkMetrics | None = None,
    ) -> None:
        self.spark = spark
        self.metrics = metrics
        self.stop_requested = stop_requested
        self.config = config
        self.store = store
        self.feed = store.feed or TOPICS
        self.prefix = config.topic.prefix
        self.heartbeat_topic = topics.internal(self.prefix, topics.HEARTBEAT)
        self.schemas = topics.SchemaFeed(config.topic)
        self.progress_log = topics.ProgressLog(config.topic, store.name)
        self.progress = Progress.from_record(self.progress_log.last())
        self.state = Bookkeeping()
        self.checkpoint = ""  # its folder (`begin`): a new one's query id is there once the query started
        self.lineage: str | None = None
        self.running = False  # a batch is being applied (SIGTERM waits for it)
        self.last_batch: int | None = None  # the id of the last batch this run committed
        self.batch_ended = 0.0  # when it ended (monotonic)
        self._unknown: dict[int, set[str]] = {}  # batch -> tables it failed for once, without a version
        self._admin: TopicAdmin | None = None
        self.failure: BaseException | None = None
        self._lock = threading.Lock()  # tables are applied in parallel threads; `look` runs beside batches
        # progress records are built under `_lock` and numbered, then sent one at a time without it (`_publish`)
        self._sending = threading.Lock()
        self._built = 0  # the number of the newest progress record built
        self._sent = 0  # and of the newest one sent
        # the LSNs the feed vouched for, each with where the feed ended then (`_complete`), LSNs rising
        self._marks: list[tuple[int, Any]] = []
        self._vouches: Vouches | None = None
        self._ends_admin: TopicAdmin | None = None
        self._looked = 0.0  # when the job last looked how complete its store is (monotonic)
        self._look_failed = False
        self._marking = threading.Lock()  # the marks and their clients: batches and looks take turns
        if metrics is not None:
            metrics.follow(lambda: self.progress.complete_lsn)

    # -- the store's bookkeeping -----------------------------------------------------
    def begin(self, checkpoint: str) -> None:
        """Before the query starts on `checkpoint`: the store opened and found holding what
        the job committed (sinks.store.check_resumed)."""
        self.failure = None
        self.checkpoint = checkpoint
        committed = last_committed(self.spark, checkpoint)
        self.lineage = lineage = query_id(self.spark, checkpoint)
        store = self.store
        store.open(resumed=committed is not None)
        self.state = check_resumed(store, store.load(), committed, lineage)
        if committed is None:
            store.save(self.state.as_record())
        self._check_topics([])  # one deleted and created again while the job was away

    def forget(self) -> None:
        """The store was cleared: it is complete up to nothing, until the replay says more."""
        with self._lock:
            self.progress = Progress(dead_letters=self.progress.dead_letters, records=self.progress.records)
            self._marks = []
            record = self._built_record(-1)
        self._publish(record)

    # -- one batch -------------------------------------------------------------------
    def __call__(self, records: DataFrame, batch_id: int) -> None:
        handover = self.store.handover
        if self.stop_requested() or (handover is not None and handover.requested()):
            # batches follow each other at once: a stop, or a rebuild's pause, must come from here
            self.failure = StopRequested()
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
        letters_before = self.progress.dead_letters
        # One read of the batch from Kafka, stored with its plan cut short: the batch's later
        # jobs neither read Kafka again nor plan the envelope decoding again. A task per
        # topic partition would be mostly scheduling on a small batch: the executors' cores
        # read them, a whole topic partition each time, in offset order (what stores rely on)
        cores = self.spark.sparkContext.defaultParallelism
        persisted = self.feed.rows(records.coalesce(max(1, cores))).localCheckpoint(eager=True)
        read = time.monotonic()
        rows = persisted.where(F.col("_cdc_topic") != self.heartbeat_topic)
        try:
            stats = self._stats(persisted)
            counted = time.monotonic()
            beat = stats.pop(self.heartbeat_topic, {}).get("beat")
            registry = self.schemas.refresh() if stats else self.schemas.registry
            if self.lineage is None:  # a new checkpoint's id: Spark wrote it when the query started
                self.lineage = self.state.extra["checkpoint"] = query_id(self.spark, self.checkpoint)
            self._check_topics(list(stats))
            letters = [rows.where(F.col("_cdc_error").isNotNull())] if any(s["errors"] for s in stats.values()) else []
            good = rows.where(F.col("_cdc_error").isNull())
            work = []
            unknown = [topic for topic in sorted(stats) if not registry.versions(topic)]
            self._unknown_once(batch_id, unknown)
            for topic, stat in sorted(stats.items()):
                if stat["low"] is None and not stat["truncates"] and stat["count"] == stat["errors"]:
                    continue  # nothing but dead letters
                if topic in unknown:
                    reason = f"no table version for {topic} in {topics.internal(self.prefix, topics.SCHEMAS)}"
                    letters.append(good.where(F.col("_cdc_topic") == topic).withColumn("_cdc_error", F.lit(reason)))
                    continue
                work.append((topic, stat))
            self._stop_on_malformed(letters)  # before any store write: with on_malformed = stop nothing is applied
            earlier = {topic: self.state.truncates.get(topic) for topic, _ in work}
            for topic, stat in work:
                newest = self.state.truncated(topic, stat["truncates"])
                if newest is not None:
                    self.store.truncate(topic, newest)
            store = self.store
            if store.writes == "rows":
                assert isinstance(store, RowStore)  # for mypy: the declared kind's base
                if work:
                    written = [topic for topic, _ in work]
                    changes = good.where(F.col("_cdc_topic").isin(*written))
                    changes = changes.where(F.col("_cdc_op").isNull() | (F.col("_cdc_op") != "t"))
                    store.prepare(written, registry)
                    cuts = {t: cut for t in written if (cut := self.state.cut(t)) is not None}
                    rejected = store.write(changes, registry, cuts)
                    store.after_batch(written)
                    if rejected:
                        letters.append(self._rejected(persisted, rejected))
                self._send_letters(letters, batch_id)
            else:
                assert isinstance(store, TableStore)
                self._apply_tables(store, registry, good, work, earlier, letters, batch_id)
            written_at = time.monotonic()
            check_batch(store, store.load(), batch_id)
            self.state.batch = batch_id
            store.save(self.state.as_record())
            applied = {topic: stat["high"] for topic, stat in work if stat["high"] is not None}
            counts = {topic: stat["count"] - stat["errors"] for topic, stat in work}
            self._record(batch_id, applied, beat, sum(counts.values()))
            ended = time.monotonic()
            if self.metrics is not None:
                self.metrics.batch(ended - started, counts, self.progress.dead_letters - letters_before)
            log.info(
                "%sbatch %d: %d records of %d tables in %.1f s (read %.1f, statistics %.1f, store %.1f, progress %.1f)",
                "" if self.feed is TOPICS else f"{store.name} ",  # a store's own feed: its job's name
                batch_id, sum(s["count"] for s in stats.values()), len(stats), ended - started, read - started,
                counted - read, written_at - counted, ended - written_at,
                extra={"batch": batch_id, "store": self.store.name},
            )
        finally:
            release(persisted)

    def _unknown_once(self, batch_id: int, unknown: list[str]) -> None:
        """Tables without a version fail a batch once (read again, with the versions read
        again) before their records become dead letters."""
        if not unknown:
            return
        tried = self._unknown.setdefault(batch_id, set())
        new = [topic for topic in unknown if topic not in tried]
        if new:
            tried.update(new)
            raise UnknownVersion(
                f"no table version for {', '.join(new)} in {topics.internal(self.prefix, topics.SCHEMAS)} yet: the "
                "batch is read again"
            )

    def _check_topics(self, names: list[str]) -> None:
        """A table topic deleted and created again under the job: its offsets started over,
        and what the store and the checkpoint know of the old one no longer holds. Looks at
        `names` and at every topic the job saw before (Spark's Kafka source reads nothing
        of a new topic whose offsets are below the checkpoint's: no batch may bring it)."""
        known = self.state.extra.setdefault("topic_ids", {})
        names = sorted({*names, *known})
        if not names:
            return
        try:
            if self._admin is None:
                self._admin = TopicAdmin(self.config.topic)
            ids = self._admin.topic_ids(names)
        except TopicError as exc:  # the batch's read succeeded: this look is not worth failing it
            log.warning("could not look up the topics' ids: %s", exc)
            return
        for name, topic_id in sorted(ids.items()):
            was = known.setdefault(name, topic_id)
            if was != topic_id:
                raise SinkStopped(
                    f"topic {name} was deleted and created again (id {was}, now {topic_id}): its offsets started "
                    f"over, and the {self.store.name} job's checkpoint and store follow the old topic; rebuild the "
                    "store from the topics: stop the job, clear the store and delete its checkpoint folder "
                    f"({self.store.name} under [spark] checkpoint_dir)"
                )

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
        self, store: TableStore, registry: Registry, good: DataFrame, work: list[tuple[str, dict[str, Any]]],
        earlier: dict[str, Any], letters: list[DataFrame], batch_id: int,
    ) -> None:
        """Tables in parallel threads: a table's writes are a chain of small Spark jobs and
        Delta commits, mostly waiting; several chains keep the executors busy. The decoded
        rows stay stored until every thread is done with them, also when one failed."""
        decoded: list[DataFrame] = []
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(TABLE_THREADS, len(work)))) as pool:
                futures = [pool.submit(self._decode, registry, good, w, earlier.get(w[0]), decoded) for w in work]
                wait(futures)
                decodes = [future.result() for future in futures]
                letters += [bad for _, bad in decodes]
                self._stop_on_malformed(letters)  # before any write of the tables
                for step in store.steps():
                    done = [pool.submit(step, batch) for batch, _ in decodes]
                    wait(done)
                    for future in done:
                        future.result()
            store.after_tables([batch for batch, _ in decodes], batch_id, self.lineage)
            self._send_letters(letters, batch_id)
        finally:
            for rows in decoded:
                release(rows)

    def _decode(
        self, registry: Registry, good: DataFrame, work: tuple[str, dict[str, Any]], earlier: Any,
        kept: list[DataFrame],
    ) -> tuple[TableBatch, DataFrame]:
        """One table's rows decoded (and kept in `kept` until the batch is written), and those
        that do not decode (the dead letters)."""
        topic, stat = work
        rows = good.where(F.col("_cdc_topic") == topic)  # built here: a row store's batch never needs it
        low = stat["low"] if stat["low"] is not None else 0
        high = stat["high"] if stat["high"] is not None else low
        started = time.monotonic()
        decoded, columns = decode_table(rows, registry, topic, low, high)
        decoded = decoded.localCheckpoint(eager=True)  # stored, and the typed plan cut short
        with self._lock:
            kept.append(decoded)
        log.debug("%s: decoded in %.1f s", topic, time.monotonic() - started)
        newest = registry.at(topic, high) or registry.versions(topic)[0]
        batch = table_batch(
            decoded.where(F.col("_cdc_error").isNull()), newest, columns, stat["truncates"], stat["offsets"], earlier,
            stat["count"],
        )
        return batch, decoded.where(F.col("_cdc_error").isNotNull())

    def _rejected(self, rows: DataFrame, rejected: list[tuple[str, int, int, str]]) -> DataFrame:
        """The change rows a store refused, with its reason."""
        reasons = self.spark.createDataFrame(
            rejected, "_cdc_topic string, _cdc_partition int, _cdc_offset long, _reason string"
        )
        return (rows.join(reasons, ["_cdc_topic", "_cdc_partition", "_cdc_offset"])
                .withColumn("_cdc_error", F.col("_reason")).drop("_reason"))

    def _stop_on_malformed(self, bad: list[DataFrame]) -> None:
        """With `[spark] on_malformed = "stop"`: the first bad record stops the job."""
        if self.config.spark.on_malformed != "stop" or not bad:
            return
        first = _first(bad)
        if first is not None:
            raise SinkStopped(
                f"record {first[0]} partition {first[1]} offset {first[2]} cannot be decoded: {first[3]} (set "
                "[spark] on_malformed = \"dlq\" to send such records to the dead-letter topic and go on)"
            )

    def _send_letters(self, bad: list[DataFrame], batch_id: int) -> None:
        """The batch's dead letters, once: a batch read again (a failed write, a crash) finds
        in the store's bookkeeping that its letters went out already."""
        if not bad:
            return
        self._stop_on_malformed(bad)
        first = _first(bad)
        if first is None:
            return
        where = f"{first[0]} partition {first[1]} offset {first[2]}"
        if self.state.letters == batch_id:
            log.info("batch %d: its dead letters went out before it was read again (the first %s)", batch_id, where)
            return
        letters = _union(bad).select(*LETTER_COLUMNS).persist()  # written, then counted
        try:
            topics.write_dead_letters(letters, self.config.topic)
            count = letters.count()
        finally:
            letters.unpersist()
        self.state.letters = batch_id
        self.store.save(self.state.as_record())
        with self._lock:
            self.progress.dead_letters += count
        log.warning("%d records to %s, the first %s: %s", count, topics.internal(self.prefix, topics.DLQ), where,
                    first[3], extra={"table": table_of_topic(first[0]), "batch": batch_id, "store": self.store.name})

    # -- progress --------------------------------------------------------------------
    def _record(self, batch_id: int, applied: dict[str, int], beat: int | None, records: int) -> None:
        """The batch's progress record: the highest commit LSN applied per table, how complete
        the store is now (`_complete`, with `beat`, the newest heartbeat the batch read)."""
        progress = self.progress
        with self._lock:
            for topic, lsn in applied.items():
                progress.tables[topic] = max(progress.tables.get(topic, 0), lsn)
            progress.batches += 1
            progress.records += records
        self._complete(batch_id, beat, ask=not self.feed.in_batches)
        with self._lock:
            self.last_batch, self.batch_ended = batch_id, time.monotonic()
            record = self._built_record(batch_id)
        self._publish(record)

    def _built_record(self, batch_id: int) -> tuple[int, dict[str, Any]]:
        """The progress record as things stand, numbered (`_lock` held: it reads them whole)."""
        self._built += 1
        return self._built, self.progress.as_record(self.store.name, batch_id)

    def _publish(self, record: tuple[int, dict[str, Any]]) -> None:
        """Send a `_built_record`, without `_lock`: the send waits out the broker's timeouts (90 s
        when it is away), and the query loop, which notices a stop, takes `_lock` to look. One at
        a time, and never after a newer one (the compacted topic keeps the last record per job):
        a newer one sent already stands for it."""
        number, progress = record
        with self._sending:
            if number < self._sent:
                return
            self.progress_log.send(progress)
            self._sent = number

    def _complete(self, batch: int | None, beat: int | None = None, ask: bool = False) -> bool:
        """Mark `beat` (`ask`: the newest LSN the feed vouches for now) with where the feed ends
        now, then complete the store up to the newest mark that batch `batch` (None: the last
        committed one) read to; True when that moved it. Every change committed at or below a
        vouched-for LSN was in the feed before its end was taken: a job that read to that end
        holds them, whatever its batches held and whether any batch comes after."""
        progress = self.progress
        with self._marking:
            try:
                if ask:
                    if self._vouches is None:
                        self._vouches = self.feed.vouches(self.config)
                    self._vouches.poll()
                    beat = self._vouches.newest
                if beat is not None and beat > max(progress.complete_lsn, self._marks[-1][0] if self._marks else 0):
                    with self._lock:
                        progress.heartbeat_lsn = max(progress.heartbeat_lsn, beat)
                    if len(self._marks) < MARKS_KEPT:
                        self._marks.append((beat, self.feed.ends(self)))
                if not self._marks or not self.checkpoint:
                    return False
                read = self.feed.read(self.spark, self.checkpoint, batch)
            except LOOK_FAILURES as exc:  # the store is written; its progress is looked at again
                if not self._look_failed:
                    log.warning("sink %s: how complete the store is stays unknown for now: %s", self.store.name,
                                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                                extra={"store": self.store.name})
                self._look_failed = True
                return False
            self._look_failed = False
            done = [lsn for lsn, ends in self._marks if read is not None and self.feed.within(ends, read)]
            if not done:
                return False
            self._marks = [(lsn, ends) for lsn, ends in self._marks if lsn > max(done)]
            with self._lock:
                if max(done) <= progress.complete_lsn:
                    return False
                progress.complete_lsn = max(done)
            return True

    def quiet(self) -> bool:
        """No batch runs, and for QUIET_S none ended and the job did not look: time to `look`."""
        return not self.running and time.monotonic() - max(self.batch_ended, self._looked) >= QUIET_S

    def look(self) -> None:
        """Between batches (quiet, the end of a `--once` run, a stop): how complete the store is
        against the newest LSN the feed vouches for now, from the committed batches. No batch
        has to come for it: a source without traffic, a run that starts right after the
        writes and reads only the heartbeat from before them, a job started again with
        nothing new to read, the history query while the warehouse job moves on."""
        self._looked = time.monotonic()
        if self._complete(None, ask=True):
            with self._lock:
                record = self._built_record(self.state.batch)
            self._publish(record)

    def ends_admin(self) -> TopicAdmin:
        """The admin client the marks take the topics' end offsets with (`_marking` held)."""
        if self._ends_admin is None:
            self._ends_admin = TopicAdmin(self.config.topic)
        return self._ends_admin

    def close(self) -> None:
        self.schemas.close()
        self.progress_log.close()
        for client in (self._admin, self._ends_admin, self._vouches):
            if client is not None:
                client.close()
        self.store.close()


def release(frame: DataFrame) -> None:
    """Free the blocks of a `localCheckpoint`ed frame now: `DataFrame.unpersist` leaves them
    until the JVM collects the plan (its blocks stay cached), and a batch of a
    million records holds hundreds of MB. Whoever still reads the frame fails
    (CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND), so only after every reader is done."""
    frame._jdf.queryExecution().analyzed().rdd().unpersist(False)


def drained(read: dict[str, dict[int, int]], ends: dict[str, dict[int, int]]) -> bool:
    """Whether `read` (per topic and partition, the offset after the last record read) reaches
    every end offset of `ends` (a partition the run did not read has to be empty)."""
    return all(end <= read.get(topic, {}).get(part, 0) for topic, parts in ends.items() for part, end in parts.items())


def _union(frames: list[DataFrame]) -> DataFrame:
    out = frames[0]
    for more in frames[1:]:
        out = out.unionByName(more, allowMissingColumns=True)
    return out


def _first(bad: list[DataFrame]) -> Any:
    """(topic, partition, offset, reason) of the first bad row, or None."""
    found = _union(bad).select("_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_error").take(1)
    return found[0] if found else None


__all__ = ["TOPICS", "Feed", "Progress", "SinkJob", "StopRequested", "StoreLost", "UnknownVersion", "Vouches", "drained"]
