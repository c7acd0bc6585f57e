"""`cdc delta rebuild-history`: history/ again from changes/, the complete change log.

A compacted topic has lost superseded versions, so history/ is only as complete as the
topic was when the job first read it; changes/ keeps every event the job ever read, and
the same version rules (sinks.history) turn it into history/ again.
"""

from __future__ import annotations

from collections.abc import Iterator

from pyspark.sql import functions as F

from cdc.config import Config
from sinks.batch import decode_table, table_batch
from sinks.delta import DeltaStore
from sinks.topics import SchemaFeed


def rebuild_history(store: DeltaStore, config: Config) -> Iterator[tuple[str, int]]:
    """Rebuild every table's history; yields (table, versions written)."""
    feed = SchemaFeed(config.topic)
    try:
        registry = feed.refresh()
        for path in store.tables(("changes",)):
            rows = store.spark.read.format("delta").load(path).withColumn("_cdc_error", F.lit(None).cast("string"))
            rows = rows.withColumn("_value", F.lit(None).cast("string"))
            topic = rows.select("_cdc_topic").first()
            if topic is None or not registry.versions(topic[0]):
                continue
            span = rows.agg(F.min("_cdc_lsn"), F.max("_cdc_lsn")).first()
            assert span is not None
            low, high = (span[0] or 0), (span[1] or 0)
            decoded, columns = decode_table(rows, registry, topic[0], low, high)
            decoded = decoded.where(F.col("_cdc_error").isNull())
            truncates = sorted(
                (r[0], r[1], r[2]) for r in decoded.where(F.col("_cdc_op") == "t")
                .select("_cdc_lsn", "_cdc_seq", F.unix_millis("_cdc_ts")).collect()
            )
            newest = registry.at(topic[0], high) or registry.versions(topic[0])[0]
            batch = table_batch(decoded, newest, columns, truncates, {})
            store.rebuild_history(decoded, batch)
            yield batch.display, decoded.where(F.col("_cdc_op").isin("r", "c", "u")).count()
    finally:
        feed.close()
