"""Read a topic's records from offset 0 (or given offsets) up to the end offsets taken at the start.

Shared by `cdc tail`, the snapshot state, the topic read as a table (compaction), `cdc status`
and the tests: it reads without a consumer group (assign, not subscribe), so reading never
moves anyone's committed offsets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from cdc.config import TopicConfig
from cdc.kafka.clients import confluent_consumer, consumer


@dataclass(frozen=True, slots=True)
class TopicRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int = 0  # ms, as the broker keeps it (the producer's create time by default)


def read_topic(
    config: TopicConfig,
    topic: str,
    follow: bool = False,
    from_end: bool = False,
    idle_timeout_s: float = 60.0,
    start: Mapping[int, int] | None = None,
    ends: dict[int, int] | None = None,
    from_ms: int | None = None,
    tail: int | None = None,
) -> Iterator[TopicRecord]:
    """Every record of `topic` in per-partition offset order, partitions interleaved.

    Without `follow` it stops at the end offsets seen when it started (written into `ends`
    when given, so a later call can go on from there with `start`); with `follow` it keeps
    waiting for new records. `idle_timeout_s` bounds a wait that makes no progress. `from_ms`:
    start at the first record written at or after this time (ms since the epoch). `tail`: only
    the last this many offsets of each partition (a compacted topic's newest record). With
    `[topic] client = "confluent"` a bounded read goes through librdkafka (several times faster)."""
    if config.client == "confluent" and not follow and not from_end and from_ms is None:
        yield from _read_confluent(config, topic, idle_timeout_s, start, ends, tail)
        return
    from kafka.structs import TopicPartition

    client = consumer(config, "cdc-reader")
    try:
        partitions = client.partitions_for_topic(topic)
        if not partitions:
            raise LookupError(f"topic {topic} does not exist")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        client.assign(tps)
        last = client.end_offsets(tps)
        if ends is not None:
            ends.update({tp.partition: offset for tp, offset in last.items()})
        found = client.offsets_for_times({tp: from_ms for tp in tps}) if from_ms is not None else {}
        for tp in tps:
            if from_end:
                client.seek(tp, last[tp])
            elif from_ms is not None:
                at = found.get(tp)
                client.seek(tp, last[tp] if at is None else at.offset)
            elif start is not None and tp.partition in start:
                client.seek(tp, start[tp.partition])
            elif tail is not None and last[tp] > tail:
                client.seek(tp, last[tp] - tail)
            else:
                client.seek_to_beginning(tp)
        remaining = {tp for tp in tps if client.position(tp) < last[tp]}
        while remaining or follow:
            batches = client.poll(timeout_ms=int(idle_timeout_s * 1000) if not follow else 1000)
            if not batches and not follow:
                stuck = ", ".join(f"{tp.partition}@{client.position(tp)}<{last[tp]}" for tp in remaining)
                raise TimeoutError(f"no progress reading {topic} for {idle_timeout_s} s (partitions {stuck})")
            for tp, records in batches.items():
                end = last[tp]
                for r in records:
                    if not follow and r.offset >= end:
                        continue
                    yield TopicRecord(topic, tp.partition, r.offset, r.key, r.value, r.timestamp)
                if tp in remaining and client.position(tp) >= end:
                    remaining.discard(tp)
    finally:
        client.close()


def _read_confluent(
    config: TopicConfig, topic: str, idle_timeout_s: float, start: Mapping[int, int] | None, ends: dict[int, int] | None,
    tail: int | None = None,
) -> Iterator[TopicRecord]:
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    client = confluent_consumer(config, "cdc-reader")
    try:
        found = client.list_topics(topic, timeout=idle_timeout_s).topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            raise LookupError(f"topic {topic} does not exist")
        marks = {p: client.get_watermark_offsets(TopicPartition(topic, p), timeout=idle_timeout_s) for p in found.partitions}
        last = {p: high for p, (_, high) in marks.items()}
        if ends is not None:
            ends.update(last)
        first = {p: (start or {}).get(p, OFFSET_BEGINNING if tail is None or last[p] <= tail else last[p] - tail)
                 for p in last}
        remaining = {p for p in last if max(marks[p][0], first[p]) < last[p]}
        client.assign([TopicPartition(topic, p, first[p]) for p in sorted(remaining)])
        progress = time.monotonic()
        while remaining:
            batch = client.consume(10000, timeout=0.2)  # returns at 10000 records or after the timeout
            if not batch:
                positions = {tp.partition: tp.offset for tp in client.position([TopicPartition(topic, p) for p in remaining])}
                done = {p for p, at in positions.items() if at >= last[p]}
                if not done and time.monotonic() - progress > idle_timeout_s:
                    raise TimeoutError(f"no progress reading {topic} for {idle_timeout_s} s")
                remaining -= done
                continue
            progress = time.monotonic()
            for m in batch:
                if m.error() is not None:
                    raise LookupError(f"reading topic {topic} failed: {m.error()}")
                partition, offset = m.partition(), m.offset()
                if offset < last[partition]:
                    yield TopicRecord(topic, partition, offset, m.key(), m.value(), m.timestamp()[1])
                if offset >= last[partition] - 1:
                    remaining.discard(partition)
            if remaining:  # compaction leaves gaps: a partition may end before its last offset shows
                positions = client.position([TopicPartition(topic, p) for p in remaining])
                remaining -= {tp.partition for tp in positions if tp.offset >= last[tp.partition]}
    finally:
        client.close()
