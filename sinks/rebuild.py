"""Rebuilds: a store filled again beside the one readers use, then switched.

- `cdc search rebuild`: every table's index again from the topics, in the next generation
  behind hidden aliases, then the readers' aliases swapped in one step;
- `cdc cache rebuild`: the cache again from the topics in another Redis database, then
  SWAPDB (sinks.cache_rebuild);
- `cdc delta rebuild`: current/ again from the topics in a folder of its own, then one
  commit per table replacing its rows (sinks.delta_rebuild);
- `cdc delta rebuild-history`: history/ again from the change log `changes/`. A
  compacted topic has lost superseded versions, so history/ is only as complete as the
  topic was when the job first read it; changes/ keeps every event the job ever read, and
  the same version rules (sinks.history) turn it into history/ again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol, TypeVar

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc.config import Config
from sinks import checkpoint as checkpoints
from sinks.batch import decode_table, table_batch
from sinks.delta_history import HistoryStore
from sinks.query import StopSignal, ensure_topics
from sinks.runner import check, checkpoint, keep_running
from sinks.search import SearchStore
from sinks.spark import job_session
from sinks.store import SinkStopped, Store
from sinks.topics import ProgressLog, SchemaFeed

S = TypeVar("S", covariant=True)

REBUILD_PASSES = 6  # a search rebuild's passes before its swap, at most
CAUGHT_UP_S = 10.0  # a pass this short: the new indexes are close enough behind to swap


def rebuild_search_here(config: Config, stop: StopSignal) -> list[tuple[str, list[str], str, int]]:
    """`cdc search rebuild`: every table's index again from the topics, beside the current
    one, then the aliases swapped; (alias, old indexes, new index, documents) per table.

    Readers and a running search job keep the current indexes until the swap. Passes to
    the topics' end follow each other until one is short, so that the new indexes are
    seconds behind the current ones when the aliases move. The job's writes to the old
    indexes that the rebuild had not read yet are in the topics before the swap, so one
    more pass after it brings them over (position-guarded like every write)."""
    check(config, "search")
    ensure_topics(config)
    with job_session("cdc-search-rebuild", config.spark) as spark:
        stop.install()
        store = SearchStore(config.search, config.topic.prefix, rebuild=True)
        _passes(spark, config, store, stop)
        if stop():
            raise SinkStopped("the rebuild stopped before its swap; the current indexes are untouched: run "
                              "`cdc search rebuild` again to go on from where it stopped")
        moved = store.swap()
        keep_running(spark, config, store, True, lambda: False)  # after the swap it finishes
        moved += store.swap()  # tables first seen in that pass
        store.finish()
        checkpoints.drop(spark, checkpoint(config, store.name))
        ProgressLog(config.topic, store.name).forget()
        counts = store.documents([alias for alias, _, _ in moved])
        return [(alias, old, new, counts[alias]) for alias, old, new in moved]


def rebuild_cache_here(config: Config, stop: StopSignal) -> tuple[int, int, dict[str, int]]:
    """`cdc cache rebuild`: the cache again from the topics into another Redis database
    (sinks.cache_rebuild), then SWAPDB; (the rebuilt database's number before the swap,
    the live one's, rows per table).

    The shape of `cdc search rebuild`: passes until one is short, the switch, one more
    position-guarded pass into the live database for what the live job wrote after the
    rebuild's last pass, then the old generation flushed."""
    from sinks.cache_rebuild import Generations

    check(config, "cache")
    generations = Generations(config.cache, config.topic.prefix)
    generations.check()
    ensure_topics(config)
    with job_session("cdc-cache-rebuild", config.spark) as spark:
        stop.install()
        _fill_and_switch(spark, config, generations, stop, "the cache", "cdc cache rebuild")
        return generations.target, generations.live, generations.rows()


def rebuild_delta_here(config: Config, stop: StopSignal) -> list[tuple[str, int]]:
    """`cdc delta rebuild`: every table's `current/` again from the topics, beside the one
    readers use (sinks.delta_rebuild), then one commit per table replacing its rows;
    (table path, rows) per table switched.

    The shape of `cdc search rebuild`: passes until one is short, then the switch, with a
    running `cdc sink delta` paused between two batches (sinks.handover) while the rebuilt
    tables catch up to exactly its offsets and replace its tables; then the rebuilt tables
    and the rebuild's checkpoint go."""
    from sinks.delta_rebuild import Rebuild

    check(config, "delta")
    ensure_topics(config)
    with job_session("cdc-delta-rebuild", config.spark) as spark:
        stop.install()
        return _fill_and_switch(spark, config, Rebuild(spark, config, stop), stop, "current/",
                                "cdc delta rebuild") or []


class _Generations(Protocol[S]):
    """A store's generation beside the live one (sinks.cache_rebuild, sinks.delta_rebuild)."""

    name: str  # the rebuild's job: its checkpoint folder and progress record
    #: after the switch, one more position-guarded pass into the live store brings what the
    #: live job wrote after the rebuild's last pass (the cache: the live job never stops)
    last_pass: bool

    def swapped(self) -> bool: ...
    def store(self, swapped: bool) -> Store: ...
    def prepare(self, resumed: bool) -> None: ...
    def swap(self) -> S: ...
    def finish(self) -> None: ...


def _fill_and_switch(spark: SparkSession, config: Config, generations: _Generations[S], stop: StopSignal,
                     untouched: str, command: str) -> S | None:
    """The rebuilds' one shape after the store's own checks: passes into the new generation,
    the switch, the last pass into the live store where the generations want one, the
    clean-up; what the switch returned (None: an earlier run had switched and stopped
    before its clean-up)."""
    switched = None
    if not generations.swapped():  # else an earlier run stopped after its switch
        store = generations.store(swapped=False)
        generations.prepare(resumed=checkpoints.last_committed(spark, checkpoint(config, store.name)) is not None)
        _passes(spark, config, store, stop)
        if stop():
            raise SinkStopped(f"the rebuild stopped before its switch; {untouched} is untouched: run `{command}` "
                              "again to go on from where it stopped")
        switched = generations.swap()
    if generations.last_pass:
        keep_running(spark, config, generations.store(swapped=True), True, lambda: False)  # it finishes
    generations.finish()
    checkpoints.drop(spark, checkpoint(config, generations.name))
    ProgressLog(config.topic, generations.name).forget()
    return switched


def _passes(spark: SparkSession, config: Config, store: Store, stop: StopSignal) -> None:
    """Passes to the topics' end, again until one is short (under CAUGHT_UP_S, or, after the
    first, one micro-batch: a store whose every batch takes longer, as a warehouse's MERGE
    on a small machine, still stops): what came while the last one ran."""
    for done in range(REBUILD_PASSES):
        started = time.monotonic()
        progress = keep_running(spark, config, store, True, stop)
        if stop() or time.monotonic() - started < CAUGHT_UP_S or (done and progress.batches <= 1):
            return


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
