"""A sink job's Structured Streaming checkpoint (`[spark] checkpoint_dir/<job>`): what the
job reads of it and how it forgets it. The offsets in it are Spark's own."""

from __future__ import annotations

from typing import Any

import orjson
from pyspark.sql import SparkSession

from sinks import hadoop


def last_committed(spark: SparkSession, checkpoint: str) -> int | None:
    """The id of the checkpoint's last committed batch (None: no batch committed)."""
    ids = [int(name) for name in hadoop.names(spark, hadoop.under(checkpoint, "commits")) if name.isdigit()]
    return max(ids) if ids else None


def query_id(spark: SparkSession, checkpoint: str) -> str | None:
    """The query id Spark keeps in a checkpoint (None before the query first started on it):
    a deleted checkpoint's successor gets a new one."""
    raw = hadoop.read_bytes(spark, hadoop.under(checkpoint, "metadata"))
    return str(orjson.loads(raw)["id"]) if raw else None


def drop(spark: SparkSession, checkpoint: str) -> None:
    """Forget the job's offsets: it reads the topics from the earliest offsets again."""
    hadoop.delete(spark, checkpoint)


def source_offset(spark: SparkSession, checkpoint: str, batch: int | None = None) -> Any:
    """Where batch `batch` (None: the last batch planned, committed or not) ends in the
    query's source, as the source writes it in Spark's offset log (None: no such batch)."""
    folder = hadoop.under(checkpoint, "offsets")
    if batch is None:
        ids = [int(name) for name in hadoop.names(spark, folder) if name.isdigit()]
        if not ids:
            return None
        batch = max(ids)
    raw = hadoop.read_bytes(spark, f"{folder}/{batch}")
    if raw is None:
        return None
    # "v1", the batch's metadata, then a line per source (a job's query has one)
    return orjson.loads(raw.decode().splitlines()[2])


def offsets(spark: SparkSession, checkpoint: str, batch: int | None = None) -> dict[str, dict[int, int]] | None:
    """Per topic and partition, where batch `batch` ends (None: the last batch planned,
    committed or not), from the source's line of the offset log, as Spark's Kafka source and
    the job's stream (sinks.kafka_source) both write it (None: no such batch)."""
    source = source_offset(spark, checkpoint, batch)
    if source is None:
        return None
    return {topic: {int(part): int(offset) for part, offset in parts.items()} for topic, parts in source.items()}


def committed_offsets(spark: SparkSession, checkpoint: str) -> dict[str, dict[int, int]] | None:
    """Per topic and partition, where the checkpoint's last committed batch ends (None: none)."""
    committed = last_committed(spark, checkpoint)
    return None if committed is None else offsets(spark, checkpoint, committed)
