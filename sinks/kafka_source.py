"""The captured topics as a Spark stream: a task reads a group of partitions with one consumer.

Spark's own Kafka source gives every topic partition a task's worth of work: a consumer
taken from a cache of 64 (or made), a seek and a fetch each, 7-9 ms warm and 35-57 ms
cold whatever the partition holds. A schema of 1,000 tables spends most of a batch on
that (docs/benchmarks.md, the stores at width). Here the driver plans a batch as a few
groups of partitions, one per executor core, and a task's one librdkafka consumer fetches
all of its group at once: a fetch request covers many partitions.

The offsets are what Spark's Kafka source writes in the checkpoint, `{topic: {"partition":
offset}}`, so a checkpoint it wrote goes on here, and the rest of the job reads them the
same way (sinks.checkpoint). The rows have its columns and, within a task, its order: a
topic partition's records together, in offset order (what the stores rely on). Like the
job's use of Spark's source (`failOnDataLoss` false), offsets that compaction or a deleted
topic left behind are skipped, not failed on.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import orjson
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from cdc.config import TopicConfig
from cdc.kafka.clients import confluent_consumer

NAME = "cdc_topics"
CLIENT_ID = "cdc-sink"
#: Spark's Kafka source's columns (without headers)
SCHEMA = StructType([
    StructField("key", BinaryType()), StructField("value", BinaryType()), StructField("topic", StringType()),
    StructField("partition", IntegerType()), StructField("offset", LongType()),
    StructField("timestamp", TimestampType()), StructField("timestampType", IntegerType()),
])
#: a task's read that makes no progress this long fails (Spark's source waits `spark.network.timeout`, 120 s)
POLL_TIMEOUT_S = 120.0
#: the driver's look at where the topics end (every request of it together) fails after this long
METADATA_TIMEOUT_S = 30.0
ROWS_PER_ARROW_BATCH = 10_000
EARLIEST = -2  # a partition the batch starts from its earliest offset (new since the last batch)

#: (topic, partition, start or EARLIEST, end)
Range = tuple[str, int, int, int]
Offsets = dict[str, dict[str, int]]


class TopicsUnreachable(ConnectionError):
    """The brokers did not answer the driver's look at the topics or a task's fetch: the batch
    is tried again (sinks.runner.TRANSIENT names this class)."""


def register(spark: SparkSession) -> None:
    """Make `format(NAME)` known to the session (again is harmless)."""
    spark.dataSource.register(TopicSource)


def grouped(ranges: list[Range], groups: int) -> list[list[Range]]:
    """`ranges` in at most `groups` groups of about equal records (a new partition counts its
    end offset), each in topic and partition order; no empty group."""
    loads = [0] * max(1, groups)
    out: list[list[Range]] = [[] for _ in loads]
    for item in sorted(ranges, key=lambda r: (-(r[3] - max(r[2], 0)), r[0], r[1])):
        least = loads.index(min(loads))
        out[least].append(item)
        loads[least] += item[3] - max(item[2], 0)
    return [sorted(group) for group in out if group]


def rate_limited(start: dict[tuple[str, int], int], end: dict[tuple[str, int], int], limit: int) -> dict[
        tuple[str, int], int]:
    """Ends for at most about `limit` records, shared by the partitions in proportion to what
    each has waiting (every partition with records moves, by one at least), as Spark's Kafka
    source shares `maxOffsetsPerTrigger`. `start` has every partition of `end`."""
    sizes = {tp: max(0, offset - start[tp]) for tp, offset in end.items()}
    total = sum(sizes.values())
    if total <= limit:
        return end
    out = {}
    for tp, offset in end.items():
        share = limit * sizes[tp] / total
        out[tp] = min(offset, start[tp] + (int(share) if share >= 1 else (1 if sizes[tp] else 0)))
    return out


def offsets_of(ends: dict[tuple[str, int], int]) -> Offsets:
    """`{topic: {"partition": offset}}`, as Spark's Kafka source writes them in the checkpoint."""
    out: Offsets = {}
    for (topic, partition), offset in sorted(ends.items()):
        out.setdefault(topic, {})[str(partition)] = offset
    return out


class Group(InputPartition):
    """A task's partitions: `(topic, partition, start, end)`, `start` EARLIEST for a new one."""

    def __init__(self, ranges: list[Range]) -> None:
        self.ranges = ranges


class TopicSource(DataSource):
    """Options: `topic` (`[topic]` as JSON: servers, security, message sizes), `kafka`
    (librdkafka settings on top, as JSON), `subscribe` (a regex a topic's whole name
    matches), `maxOffsetsPerTrigger`, `groups` (at most a task per group)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TopicStream(self.options)


class TopicStream(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """On the driver: where the topics end and how a batch is split; on the executors: `read`."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.topic = TopicConfig(**orjson.loads(options["topic"]))
        self.settings: dict[str, Any] = orjson.loads(options["kafka"])
        self.pattern = re.compile(options["subscribe"])
        self.max_offsets = int(options.get("maxOffsetsPerTrigger") or 0)
        self.groups = int(options.get("groups") or 1)
        self._client: Any = None
        self._target: dict[tuple[str, int], int] | None = None  # `availableNow`: where the query stops

    def _consumer(self) -> Any:
        if self._client is None:
            self._client = confluent_consumer(self.topic, CLIENT_ID, self.settings)
        return self._client

    # -- on the driver ---------------------------------------------------------------
    def initialOffset(self) -> Offsets:
        return {}  # every partition from its earliest offset

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_offsets) if self.max_offsets > 0 else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._ends(time.monotonic() + METADATA_TIMEOUT_S)

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        known = {(t, int(p)): offset for t, offsets in start.items() for p, offset in offsets.items()}
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        ends = self._ends(deadline) if self._target is None else self._target
        if isinstance(limit, ReadMaxRows):
            new = [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends if (t, p) not in known]
            begins = {**known, **self._listed(lambda client: _offsets(client, new, deadline))}
            ends = rate_limited({tp: begins.get(tp, 0) for tp in ends}, ends, limit.max_rows)
        # a partition the listing left out (a topic the broker answered with an error this
        # once) keeps where it was: dropped, it would come back as new, from its earliest offset
        return offsets_of({**known, **ends})

    def _ends(self, deadline: float) -> dict[tuple[str, int], int]:
        """Per topic partition the subscription matches, its end offset now."""
        from confluent_kafka import OFFSET_END, TopicPartition

        def ends(client: Any) -> dict[tuple[str, int], int]:
            metadata = client.list_topics(timeout=_left(deadline))
            parts = [
                TopicPartition(name, p, OFFSET_END) for name, topic in sorted(metadata.topics.items())
                if topic.error is None and self.pattern.fullmatch(name) for p in sorted(topic.partitions)
            ]
            return _offsets(client, parts, deadline)

        return self._listed(ends)

    def _listed(self, look: Callable[[Any], dict[tuple[str, int], int]]) -> dict[tuple[str, int], int]:
        """`look` at the topics with the driver's client; a broker that does not answer in
        time fails the batch with what to check."""
        from confluent_kafka import KafkaException

        try:
            return look(self._consumer())
        except KafkaException as exc:
            raise TopicsUnreachable(
                f"could not list the topics' end offsets within {METADATA_TIMEOUT_S:.0f} s ({exc.args[0]}): "
                f"check that the brokers at {self.topic.bootstrap_servers} are up and that the driver "
                "reaches them ([topic] bootstrap_servers and security settings)"
            ) from None

    def partitions(self, start: Offsets, end: Offsets) -> Sequence[InputPartition]:
        ranges = [
            (topic, int(p), start.get(topic, {}).get(p, EARLIEST), offset)
            for topic, offsets in end.items() for p, offset in offsets.items()
        ]
        return [Group(group) for group in grouped([r for r in ranges if r[2] < r[3]], self.groups)]

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- on an executor --------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, Group)
        client = confluent_consumer(self.topic, CLIENT_ID, {**self.settings, "enable.partition.eof": True})
        try:
            yield from _read(client, partition.ranges)
        finally:
            client.close()


def _left(deadline: float) -> float:
    """Seconds until `deadline`, at least a moment (librdkafka reads 0 as "do not wait")."""
    return max(deadline - time.monotonic(), 0.001)


def _offsets(client: Any, parts: list[Any], deadline: float) -> dict[tuple[str, int], int]:
    """Per topic partition, the offset `parts` ask for (OFFSET_END or OFFSET_BEGINNING), in
    one request per broker."""
    from confluent_kafka import KafkaException

    if not parts:
        return {}
    out = {}
    for tp in client.offsets_for_times(parts, timeout=_left(deadline)):
        if tp.error is not None:
            raise KafkaException(tp.error)
        out[(tp.topic, tp.partition)] = tp.offset
    return out


def _read(client: Any, ranges: list[Range]) -> Iterator[Any]:
    """The records of `ranges`, a topic partition's all together once it is read to its end,
    in Arrow batches; records at or past a range's end are not the batch's."""
    import pyarrow as pa
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

    # per topic partition still read: its records so far and its end
    pending: dict[tuple[str, int], tuple[list[tuple[Any, ...]], int]] = {(t, p): ([], end) for t, p, _, end in ranges}
    client.assign([TopicPartition(t, p, s if s >= 0 else OFFSET_BEGINNING) for t, p, s, _ in ranges])
    ready: list[tuple[tuple[str, int], list[tuple[Any, ...]]]] = []  # read to their ends: (tp, records)
    held = 0  # records in `ready`
    progress = time.monotonic()
    last_error = ""

    while pending:
        done, moved = [], False
        for message in client.consume(ROWS_PER_ARROW_BATCH, 0.5):
            error = message.error()
            tp = (message.topic(), message.partition())
            if error is not None:
                if tp in pending and (error.code() == KafkaError._PARTITION_EOF or (
                        error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and _deleted(client, tp[0]))):
                    done.append(tp)  # read to its end, or deleted: what compaction or a deletion took is skipped
                else:
                    last_error = error.str()
                continue
            state = pending.get(tp)
            if state is None:
                continue
            moved = True
            offset = message.offset()
            if offset < state[1]:
                state[0].append((message.key(), message.value(), offset, *message.timestamp()))
            if offset + 1 >= state[1]:
                done.append(tp)
        if moved:
            progress = time.monotonic()
        for tp in dict.fromkeys(done):
            if tp in pending:
                records = pending.pop(tp)[0]
                ready.append((tp, records))
                held += len(records)
        if done:
            client.pause([TopicPartition(*tp) for tp in dict.fromkeys(done)])
        if held >= ROWS_PER_ARROW_BATCH or (held and not pending):
            yield _arrow(pa, ready)
            ready, held = [], 0
        if pending and time.monotonic() - progress > POLL_TIMEOUT_S:
            raise TopicsUnreachable(
                f"read nothing of {len(pending)} topic partitions for {POLL_TIMEOUT_S:.0f} s"
                + (f" ({last_error})" if last_error else "")
            )


def _deleted(client: Any, topic: str) -> bool:
    """Whether the brokers say `topic` does not exist (a broker that has not loaded it yet
    after a restart may answer a fetch the same way: that is not a deletion, and skipping
    the rest of the partition would lose its records)."""
    from confluent_kafka import KafkaError, KafkaException

    try:
        found = client.list_topics(topic, timeout=METADATA_TIMEOUT_S).topics.get(topic)
    except KafkaException:
        return False
    return found is None or (found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)


def _arrow(pa: Any, ready: list[tuple[tuple[str, int], list[tuple[Any, ...]]]]) -> Any:
    """Records of whole topic partitions, each `(key, value, offset, timestamp type, ms)`,
    as a batch in SCHEMA's columns."""
    keys, values, offsets, kinds, stamps = zip(*(record for _, records in ready for record in records), strict=True)
    return pa.RecordBatch.from_arrays([
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array([topic for (topic, _), records in ready for _ in records], pa.string()),
        pa.array([partition for (_, partition), records in ready for _ in records], pa.int32()),
        pa.array(offsets, pa.int64()),
        # librdkafka: 0 none, 1 create time, 2 log append time; Spark's source: -1, 0, 1
        pa.array([ms * 1000 if kind else None for kind, ms in zip(kinds, stamps, strict=True)],
                 pa.timestamp("us", tz="UTC")),
        pa.array([kind - 1 for kind in kinds], pa.int32()),
    ], names=SCHEMA.fieldNames())
