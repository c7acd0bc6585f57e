"""What a sink job reads and writes in Kafka besides the table topics.

- Spark's Kafka options from `[topic]` (servers and security, the same as the daemon's);
- the subscription: every table topic of the prefix and the daemon's heartbeat;
- `<prefix>.__cdc_schemas`, followed by the driver (table versions, cdc.events.shapes);
- `<prefix>.__cdc_dlq`: dead letters, written from the executors by Spark's Kafka writer;
- `<prefix>.__cdc_sinks`: each job's progress in LSN terms (sinks.progress, read by `cdc status`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import orjson
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc.config import TopicConfig
from cdc.kafka.clients import consumer
from cdc.kafka.policy import DLQ_SUFFIX as DLQ
from sinks import kafka_source
from sinks.progress import SINKS_SUFFIX as PROGRESS  # noqa: F401 (the job and the runner take them from here)
from sinks.progress import ProgressLog as ProgressLog
from sinks.versions import Registry, Version

SCHEMAS = "__cdc_schemas"
HEARTBEAT = "__cdc_heartbeat"

_JAAS = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def internal(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}"


_TABLE = r"[^.]+\.[^.]+"  # `<schema>.<table>` after the prefix; internal topics have one segment


def subscription(prefix: str) -> str:
    """Java regex of the topics a sink reads: `<prefix>.<schema>.<table>` and the heartbeat
    (the other internal topics have a single segment after the prefix, like the heartbeat)."""
    return rf"{re.escape(prefix)}\.({_TABLE}|{HEARTBEAT})"


def _jaas_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def spark_options(config: TopicConfig) -> dict[str, str]:
    """`kafka.*` options of Spark's Kafka source and sink: servers and security."""
    out = {"kafka.bootstrap.servers": config.bootstrap_servers, "kafka.security.protocol": config.security_protocol}
    if config.sasl_mechanism:
        out["kafka.sasl.mechanism"] = config.sasl_mechanism
        out["kafka.sasl.jaas.config"] = (
            f"{_JAAS[config.sasl_mechanism]} required username={_jaas_quote(config.sasl_username)} "
            f"password={_jaas_quote(config.sasl_password)};"
        )
    if config.ssl_cafile:
        out["kafka.ssl.truststore.type"] = "PEM"
        out["kafka.ssl.truststore.location"] = config.ssl_cafile
    if config.ssl_certfile:
        out["kafka.ssl.keystore.type"] = "PEM"
        out["kafka.ssl.keystore.certificate.chain"] = Path(config.ssl_certfile).read_text()
        out["kafka.ssl.keystore.key"] = Path(config.ssl_keyfile).read_text()
    return out


#: A read waits at most 1 ms for a fetch the broker holds (Kafka's default is 500 ms): it
#: asks only for offsets the driver saw, so nothing waits for data that is not there. At
#: 1 ms a Spark read of 1,000 single-partition topics took half its time at 10 ms (a
#: consumer per partition each waits once). Spark's Kafka source's name (`read_range`), and
#: librdkafka's with where a partition past its earliest offset starts (`read_stream`)
READ_OPTIONS = {"kafka.fetch.max.wait.ms": "1"}
SOURCE_SETTINGS = {"fetch.wait.max.ms": 1, "auto.offset.reset": "earliest"}


def read_stream(spark: SparkSession, config: TopicConfig, max_offsets_per_trigger: int) -> DataFrame:
    """The captured topics as a stream (sinks.kafka_source: a consumer per group of partitions),
    from the earliest offsets on a new checkpoint, in Spark's Kafka source's columns."""
    kafka_source.register(spark)
    return (
        spark.readStream.format(kafka_source.NAME)
        .option("topic", orjson.dumps(dataclasses.asdict(config)).decode())
        .option("kafka", orjson.dumps(SOURCE_SETTINGS).decode())
        .option("subscribe", subscription(config.prefix))
        .option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
        .option("groups", str(spark.sparkContext.defaultParallelism))
        .load()
    )


def read_range(spark: SparkSession, config: TopicConfig, start: dict[str, dict[int, int]],
               end: dict[str, dict[int, int]]) -> DataFrame:
    """The records of `end`'s partitions from `start` (-2 or none: the earliest) up to `end`,
    as one batch, in the columns the stream has (a rebuild's last pass to given offsets)."""
    starting = {topic: {str(p): start.get(topic, {}).get(p, -2) for p in parts} for topic, parts in end.items()}
    ending = {topic: {str(p): offset for p, offset in parts.items()} for topic, parts in end.items()}
    assign = {topic: sorted(parts) for topic, parts in end.items()}
    return (
        spark.read.format("kafka")
        .options(**spark_options(config))
        .option("assign", orjson.dumps(assign).decode())
        .option("startingOffsets", orjson.dumps(starting).decode())
        .option("endingOffsets", orjson.dumps(ending).decode())
        .option("failOnDataLoss", "false")
        .options(**READ_OPTIONS)
        .load()
    )


class SchemaFeed:
    """The driver's view of `<prefix>.__cdc_schemas`: `refresh` reads what is new."""

    def __init__(self, config: TopicConfig) -> None:
        from kafka.structs import TopicPartition

        self.registry = Registry()
        self._consumer = consumer(config, "cdc-sink")
        self._tp = TopicPartition(internal(config.prefix, SCHEMAS), 0)
        self._consumer.assign([self._tp])
        self._consumer.seek_to_beginning(self._tp)

    def refresh(self, timeout_s: float = 30.0) -> Registry:
        consumer, tp = self._consumer, self._tp
        end = consumer.end_offsets([tp])[tp]
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {tp.topic} made no progress for {timeout_s:.0f} s")
            for records in consumer.poll(timeout_ms=1000).values():
                for record in records:
                    if record.value is not None:
                        self.registry.add(Version.from_record(record.value))
        return self.registry

    def close(self) -> None:
        self._consumer.close()


def write_dead_letters(rows: DataFrame, config: TopicConfig) -> None:
    """Rows with `_cdc_error` to `<prefix>.__cdc_dlq`: key as it was, the value a JSON object
    with the reason, where the record was, and its value as text."""
    letter = F.to_json(F.struct(
        F.col("_cdc_error").alias("reason"),
        F.col("_cdc_topic").alias("topic"),
        F.col("_cdc_partition").alias("partition"),
        F.col("_cdc_offset").alias("offset"),
        F.col("_value").alias("value"),
    ))
    (
        rows.select(F.col("_cdc_key").alias("key"), letter.alias("value"))
        .write.format("kafka")
        .options(**spark_options(config))
        .option("topic", internal(config.prefix, DLQ))
        .save()
    )

