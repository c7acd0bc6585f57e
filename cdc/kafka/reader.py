"""Read a topic's records from offset 0 (or given offsets) up to the end offsets taken at the start.

Shared by `cdc tail`, the snapshot state, the topic read as a table (compaction), `cdc status`
and the tests: it reads without a consumer group (assign, not subscribe), so reading never
moves anyone's committed offsets.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from cdc.config import TopicConfig
from cdc.kafka.clients import consumer


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
) -> Iterator[TopicRecord]:
    """Every record of `topic` in per-partition offset order, partitions interleaved.

    Without `follow` it stops at the end offsets seen when it started (written into `ends`
    when given, so a later call can go on from there with `start`); with `follow` it keeps
    waiting for new records. `idle_timeout_s` bounds a wait that makes no progress."""
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
        for tp in tps:
            if from_end:
                client.seek(tp, last[tp])
            elif start is not None and tp.partition in start:
                client.seek(tp, start[tp.partition])
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
