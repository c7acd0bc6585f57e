"""A sink job's Structured Streaming checkpoint (`[spark] checkpoint_dir/<job>`): what the
job reads of it and how it forgets it. The offsets in it are Spark's own."""

from __future__ import annotations

import orjson
from pyspark.sql import SparkSession

from sinks import hadoop


def last_committed(spark: SparkSession, checkpoint: str) -> int | None:
    """The id of the checkpoint's last committed batch (None: no batch committed)."""
    ids = [int(name) for name in hadoop.names(spark, checkpoint.rstrip("/") + "/commits") if name.isdigit()]
    return max(ids) if ids else None


def query_id(spark: SparkSession, checkpoint: str) -> str | None:
    """The query id Spark keeps in a checkpoint (None before the query first started on it):
    a deleted checkpoint's successor gets a new one."""
    raw = hadoop.read_bytes(spark, checkpoint.rstrip("/") + "/metadata")
    return str(orjson.loads(raw)["id"]) if raw else None


def drop(spark: SparkSession, checkpoint: str) -> None:
    """Forget the job's offsets: it reads the topics from the earliest offsets again."""
    hadoop.delete(spark, checkpoint)
