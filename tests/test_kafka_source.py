"""The sinks' stream of the topics (sinks.kafka_source) on the real Kafka and Spark: the
records Spark's own Kafka source has, each once, in batches no larger than asked, a topic
partition's records together and in offset order; a checkpoint Spark's source wrote goes on
where it ended; a partition whose start was deleted is read from its new start; and the
cache's job rides out its broker killed -9 under load."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from cdc.config import TopicConfig
from cdc.local.kafka import LocalKafka
from cdc.local.process import free_port
from sinks import kafka_source
from sinks.checkpoint import offsets
from sinks.kafka_source import EARLIEST, Group, TopicStream, TopicsUnreachable
from sinks.runner import transient
from sinks.topics import SOURCE_SETTINGS, read_stream
from tests.store_kits import kit
from tests.support import Sink, acct_under_load, write_config

COLUMNS = ("topic", "partition", "offset", "key", "value", "timestamp", "timestampType")


@pytest.fixture
def broker_servers(local_broker: LocalKafka) -> str:
    """This module's tests kill or fill a broker of their own (the daemon too talks to it)."""
    return local_broker.bootstrap_servers


def _topics(servers: str, prefix: str, partitions: dict[str, int]) -> None:
    admin = AdminClient({"bootstrap.servers": servers})
    for future in admin.create_topics([NewTopic(f"{prefix}.{name}", n, 1) for name, n in partitions.items()]).values():
        future.result()


def _produce(servers: str, prefix: str, records: Sequence[tuple[str, int, bytes | None, bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": servers, "linger.ms": 5})
    for name, partition, key, value in records:
        producer.produce(f"{prefix}.{name}", key=key, value=value, partition=partition)
    assert producer.flush(30) == 0


def _stream(spark: SparkSession, servers: str, prefix: str, checkpoint: Path, max_offsets: int,
            spark_kafka: bool = False) -> list[list[dict[str, Any]]]:
    """Each batch's rows of an `availableNow` query (task, then the task's order, kept)."""
    if spark_kafka:
        stream = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", servers)
                  .option("subscribePattern", rf"{prefix}\..*").option("startingOffsets", "earliest").load())
    else:
        stream = read_stream(spark, TopicConfig(bootstrap_servers=servers, prefix=prefix), max_offsets)
    batches: list[list[dict[str, Any]]] = []

    def collect(records: Any, _: int) -> None:
        rows = records.select(*COLUMNS, F.spark_partition_id().alias("task"),
                              F.monotonically_increasing_id().alias("order")).collect()
        batches.append([row.asDict() for row in sorted(rows, key=lambda r: (r["task"], r["order"]))])

    query = (stream.writeStream.foreachBatch(collect).option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    query.awaitTermination(300)
    assert query.exception() is None, query.exception()
    return batches


def _spark_kafka_rows(spark: SparkSession, servers: str, prefix: str) -> list[tuple]:
    rows = (spark.read.format("kafka").option("kafka.bootstrap.servers", servers)
            .option("subscribePattern", rf"{prefix}\..*").load().select(*COLUMNS).collect())
    return sorted(tuple(row) for row in rows)


def test_many_topics_read_in_bounded_batches_as_sparks_kafka_source_has_them(
    spark: SparkSession, broker_servers: str, topic_prefix: str, tmp_path: Path,
) -> None:
    partitions = {f"public.t{i}": 3 if i % 5 == 0 else 1 for i in range(40)}
    _topics(broker_servers, topic_prefix, partitions)
    records = [
        (name, n % count, orjson.dumps({"id": n}), None if n % 7 == 0 else orjson.dumps({"n": n, "t": name}))
        for name, count in partitions.items() for n in range(25)
    ]
    _produce(broker_servers, topic_prefix, records)

    batches = _stream(spark, broker_servers, topic_prefix, tmp_path / "checkpoint", max_offsets=200)

    read = [row for batch in batches for row in batch]
    assert sorted(tuple(row[c] for c in COLUMNS) for row in read) == _spark_kafka_rows(
        spark, broker_servers, topic_prefix)
    assert len(read) == len(records) == 1000
    # the limit shared as Spark's source shares it: every partition with records moves by one at least
    assert len(batches) >= 5 and all(len(batch) <= 200 + 48 for batch in batches), [len(b) for b in batches]
    for batch in batches:
        for task in {row["task"] for row in batch}:
            seen: list[tuple[str, int]] = []
            for row in (r for r in batch if r["task"] == task):
                tp = (row["topic"], row["partition"])
                if not seen or seen[-1] != tp:
                    assert tp not in seen, f"{tp}'s records are not together in task {task}"
                    seen.append(tp)
            offsets = [(r["topic"], r["partition"], r["offset"]) for r in batch if r["task"] == task]
            assert offsets == sorted(offsets, key=lambda o: (seen.index(o[:2]), o[2]))


def test_a_checkpoint_of_sparks_kafka_source_goes_on_where_it_ended(
    spark: SparkSession, broker_servers: str, topic_prefix: str, tmp_path: Path,
) -> None:
    _topics(broker_servers, topic_prefix, {"public.a": 2, "public.b": 1})
    _produce(broker_servers, topic_prefix, [("public.a", n % 2, b"%d" % n, b"old") for n in range(10)])
    checkpoint = tmp_path / "checkpoint"
    assert sum(map(len, _stream(spark, broker_servers, topic_prefix, checkpoint, 0, spark_kafka=True))) == 10

    _produce(broker_servers, topic_prefix, [("public.a", 1, b"x", b"new"), ("public.b", 0, b"y", b"new")])
    rows = [row for batch in _stream(spark, broker_servers, topic_prefix, checkpoint, 1000) for row in batch]

    assert sorted((r["topic"], r["partition"], r["offset"], r["value"]) for r in rows) == [
        (f"{topic_prefix}.public.a", 1, 5, b"new"), (f"{topic_prefix}.public.b", 0, 0, b"new"),
    ]


def test_a_partition_whose_start_was_deleted_is_read_from_its_new_start(
    spark: SparkSession, broker_servers: str, topic_prefix: str, tmp_path: Path,
) -> None:
    topic = f"{topic_prefix}.public.a"
    _topics(broker_servers, topic_prefix, {"public.a": 1})
    _produce(broker_servers, topic_prefix, [("public.a", 0, b"k", b"%d" % n) for n in range(3)])
    checkpoint = tmp_path / "checkpoint"
    assert sum(map(len, _stream(spark, broker_servers, topic_prefix, checkpoint, 1000))) == 3
    _produce(broker_servers, topic_prefix, [("public.a", 0, b"k", b"%d" % n) for n in range(3, 10)])
    admin = AdminClient({"bootstrap.servers": broker_servers})
    for future in admin.delete_records([TopicPartition(topic, 0, 7)]).values():
        future.result()  # offsets 3-6, which the checkpoint has not read, are gone

    rows = [row for batch in _stream(spark, broker_servers, topic_prefix, checkpoint, 1000) for row in batch]

    assert [(r["offset"], r["value"]) for r in rows] == [(7, b"7"), (8, b"8"), (9, b"9")]


def test_a_topic_deleted_between_batches_keeps_its_offsets_and_the_others_read_on(
    spark: SparkSession, broker_servers: str, topic_prefix: str, tmp_path: Path,
) -> None:
    """A partition the listing leaves out keeps where it was in the checkpoint (were it
    dropped, a topic the broker answered with an error once would come back as new, read
    again from its earliest offset)."""
    _topics(broker_servers, topic_prefix, {"public.a": 1, "public.b": 1})
    _produce(broker_servers, topic_prefix, [(t, 0, b"k", b"1") for t in ("public.a", "public.b")])
    checkpoint = tmp_path / "checkpoint"
    assert sum(map(len, _stream(spark, broker_servers, topic_prefix, checkpoint, 1000))) == 2
    admin = AdminClient({"bootstrap.servers": broker_servers})
    for future in admin.delete_topics([f"{topic_prefix}.public.a"]).values():
        future.result()
    _produce(broker_servers, topic_prefix, [("public.b", 0, b"k", b"2")])

    rows = [row for batch in _stream(spark, broker_servers, topic_prefix, checkpoint, 1000) for row in batch]

    assert [(r["topic"], r["offset"], r["value"]) for r in rows] == [(f"{topic_prefix}.public.b", 1, b"2")]
    assert offsets(spark, str(checkpoint)) == {f"{topic_prefix}.public.a": {0: 1}, f"{topic_prefix}.public.b": {0: 2}}


def test_the_cache_job_rides_out_its_broker_killed_9_under_load(
    request: pytest.FixtureRequest, tmp_path: Path, db: Any, local_broker: LocalKafka, broker_servers: str,
    topic_prefix: str, run_daemon: Any,
) -> None:
    """Writers keep writing while the broker the daemon and the streaming job share is killed
    -9 twice, once for longer than the driver's wait for the topics' end offsets: the job
    waits or fails its batches while the broker is gone (whichever its read was doing when
    the broker went), goes on to the last heartbeat once it is back and stops cleanly, and
    the cache equals the table."""
    store = kit("cache")

    def broker_killed(sink: Sink) -> None:
        sink.start()
        for outage_s in (5, 35):
            sink.next_batch("a batch before the broker is killed")
            local_broker.kill9()
            time.sleep(outage_s)
            local_broker.start()  # same ports, same log dirs
        sink.next_batch("a batch after the broker came back")

    with store.reach(request, tmp_path, topic_prefix, own=False) as reach:
        config = write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                              cache=reach.section, spark={"checkpoint_dir": str(tmp_path / "checkpoints"),
                                                          "max_offsets_per_trigger": 700})
        sink = Sink(config, tmp_path / "sink.log", store="cache")
        log = acct_under_load(db, run_daemon, sink, broker_killed,
                              lambda: next(iter(store.views(reach, "acct", ("version", "note")).values())))
    assert "a batch failed for a reason a retry cannot cure" not in log, log[-3000:]


def _unreachable(monkeypatch: pytest.MonkeyPatch) -> TopicStream:
    """The stream's reader with a broker nobody listens on, and its waits cut to 2 s."""
    monkeypatch.setattr(kafka_source, "METADATA_TIMEOUT_S", 2.0)
    monkeypatch.setattr(kafka_source, "POLL_TIMEOUT_S", 2.0)
    topic = TopicConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", prefix="p")
    return TopicStream({"topic": orjson.dumps(dataclasses.asdict(topic)).decode(), "subscribe": r"p\..*",
                        "kafka": orjson.dumps(SOURCE_SETTINGS).decode(), "maxOffsetsPerTrigger": "100"})


def test_an_unreachable_broker_fails_the_driver_s_look_with_what_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _unreachable(monkeypatch)
    try:
        for limit in (ReadAllAvailable(), ReadMaxRows(100)):
            with pytest.raises(TopicsUnreachable, match=r"could not list the topics' end offsets within 2 s .*: "
                               r"check that the brokers at 127\.0\.0\.1:\d+ are up and that the driver reaches "
                               r"them \(\[topic\] bootstrap_servers and security settings\)$") as failed:
                stream.latestOffset({"p.a": {"0": 5}}, limit)
            # the job's runner sees it as the text Spark's Python worker sent: one to retry
            sent = RuntimeError("".join(traceback.format_exception(failed.value)))
            assert transient(sent, SimpleNamespace(transient=()))  # type: ignore[arg-type]
    finally:
        stream.stop()


def test_a_task_that_reads_nothing_fails_naming_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _unreachable(monkeypatch)
    with pytest.raises(TopicsUnreachable, match=r"^read nothing of 2 topic partitions for 2 s"):
        list(stream.read(Group([("p.a", 0, 0, 10), ("p.b", 0, EARLIEST, 3)])))


def test_the_stream_s_plan_shows_no_password(spark: SparkSession) -> None:
    config = TopicConfig(bootstrap_servers="127.0.0.1:9", prefix="p", security_protocol="SASL_PLAINTEXT",
                         sasl_mechanism="PLAIN", sasl_username="reader", sasl_password="s3cret-Pa55")
    plan = read_stream(spark, config, 100)._jdf.queryExecution().toString()
    assert "cdc_topics" in plan and "s3cret-Pa55" not in plan, plan
