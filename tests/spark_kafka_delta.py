"""A miniature sink job for the Spark smoke tests: Kafka -> position-guarded Delta MERGE.

Imported by tests/test_spark_stack.py for the in-process `local[2]` run, and run as
a script (a separate driver) against a standalone cluster:
``python -m tests.spark_kafka_delta --master spark://... --servers ... --topic ... --table ... --checkpoint ...``
(the repository on PYTHONPATH) prints one JSON line: the batch read, the micro-batch ids and the table's rows.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from sinks.spark import build_session

VALUE_SCHEMA = "id BIGINT, name STRING, pos BIGINT, op STRING"
TABLE_SCHEMA = StructType(
    [StructField("id", LongType()), StructField("name", StringType()), StructField("pos", LongType())]
)


def kafka_options(servers: str, topic: str) -> dict[str, str]:
    return {"kafka.bootstrap.servers": servers, "subscribe": topic, "startingOffsets": "earliest"}


def read_batch(spark: SparkSession, servers: str, topic: str) -> list[tuple[str, str]]:
    """Every record of `topic` as (key, value) text, through Spark's batch Kafka source."""
    df = spark.read.format("kafka").options(**kafka_options(servers, topic)).load()
    rows = df.select(F.col("key").cast("string"), F.col("value").cast("string")).collect()
    return sorted((row[0], row[1]) for row in rows)


def _latest_per_key(batch: DataFrame) -> DataFrame:
    """The highest-position change of each id in the micro-batch (MERGE wants one per key)."""
    changes = batch.select(F.from_json(F.col("value").cast("string"), VALUE_SCHEMA).alias("v")).select("v.*")
    newest_first = Window.partitionBy("id").orderBy(F.col("pos").desc())
    return changes.withColumn("rank", F.row_number().over(newest_first)).where("rank = 1").drop("rank")


def apply_topic(spark: SparkSession, servers: str, topic: str, table: str, checkpoint: str) -> list[int]:
    """Apply the topic's backlog to the Delta table at `table`; the micro-batch ids it ran.

    A change applies only over a lower stored position, so replays and stale
    records leave the table alone; a second call resumes from the checkpoint.
    """
    DeltaTable.createIfNotExists(spark).location(table).addColumns(TABLE_SCHEMA).execute()
    batch_ids: list[int] = []

    def merge(batch: DataFrame, batch_id: int) -> None:
        (
            DeltaTable.forPath(spark, table).alias("t")
            .merge(_latest_per_key(batch).alias("s"), "t.id = s.id")
            .whenMatchedDelete(condition="s.op = 'd' AND s.pos > t.pos")
            .whenMatchedUpdate(condition="s.op <> 'd' AND s.pos > t.pos", set={"name": "s.name", "pos": "s.pos"})
            .whenNotMatchedInsert(condition="s.op <> 'd'", values={"id": "s.id", "name": "s.name", "pos": "s.pos"})
            .execute()
        )
        batch_ids.append(batch_id)

    query = (
        spark.readStream.format("kafka").options(**kafka_options(servers, topic)).load()
        .writeStream.foreachBatch(merge)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return batch_ids


def table_rows(spark: SparkSession, table: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(row) for row in spark.read.format("delta").load(table).collect())


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("master", "servers", "topic", "table", "checkpoint"):
        parser.add_argument(f"--{name}", required=True)
    args = parser.parse_args()
    spark = build_session("test-kafka-delta-driver", master=args.master)
    try:
        result = {
            "batch": read_batch(spark, args.servers, args.topic),
            "batch_ids": apply_topic(spark, args.servers, args.topic, args.table, args.checkpoint),
            "rows": table_rows(spark, args.table),
            "master": spark.sparkContext.master,
        }
    finally:
        spark.stop()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
