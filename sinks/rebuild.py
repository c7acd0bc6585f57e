"""Rebuilds: a store filled again beside the one readers use, then switched.

- `cdc search rebuild`: every table's index again from the topics, in the next generation
  behind hidden aliases, then the readers' aliases swapped in one step;
- `cdc delta rebuild-history`: history/ again from the change log `changes/`. A
  compacted topic has lost superseded versions, so history/ is only as complete as the
  topic was when the job first read it; changes/ keeps every event the job ever read, and
  the same version rules (sinks.history) turn it into history/ again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from pyspark.sql import functions as F

from cdc.config import Config
from sinks import checkpoint as checkpoints
from sinks.batch import decode_table, table_batch
from sinks.delta_history import HistoryStore
from sinks.query import StopSignal, ensure_topics
from sinks.runner import check, checkpoint, keep_running
from sinks.search import SearchStore
from sinks.spark import build_session, log_conf
from sinks.store import SinkStopped
from sinks.topics import ProgressLog, SchemaFeed

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
    spark = build_session("cdc-search-rebuild", master=config.spark.master, conf=log_conf(config.spark.log_format))
    stop.install()
    store = SearchStore(config.search, config.topic.prefix, rebuild=True)
    try:
        for _ in range(REBUILD_PASSES):  # again until a pass finds little: what came while the last one ran
            started = time.monotonic()
            keep_running(spark, config, store, True, stop)
            if stop() or time.monotonic() - started < CAUGHT_UP_S:
                break
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
    finally:
        spark.stop()


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
