"""Read a topic's records from offset 0 up to the end offsets taken at the start.

Shared by `cdc tail`, the topic-as-a-table view and the tests: it reads without a consumer
group (assign, not subscribe), so reading never moves anyone's committed offsets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cdc.config import TopicConfig
from cdc.kafka.security import security_settings


@dataclass(frozen=True, slots=True)
class TopicRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def read_topic(
    config: TopicConfig, topic: str, follow: bool = False, from_end: bool = False, idle_timeout_s: float = 60.0,
    from_ms: int | None = None,
) -> Iterator[TopicRecord]:
    """Every record of `topic` in per-partition offset order, partitions interleaved.

    Without `follow` it stops at the end offsets seen when it started; with `follow` it
    keeps waiting for new records. `idle_timeout_s` bounds a wait that makes no progress.
    `from_ms`: start at the first record written at or after this time (ms since the epoch)."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=config.bootstrap_servers.split(","),
        client_id="cdc-reader",
        group_id=None,
        enable_auto_commit=False,
        max_partition_fetch_bytes=max(1048576, config.max_message_bytes * 2),
        fetch_max_bytes=max(52428800, config.max_message_bytes * 2),
        **security_settings(config),
    )
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise LookupError(f"topic {topic} does not exist")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        if from_end:
            for tp in tps:
                consumer.seek(tp, ends[tp])
        elif from_ms is not None:
            found = consumer.offsets_for_times({tp: from_ms for tp in tps})
            for tp in tps:
                consumer.seek(tp, ends[tp] if found.get(tp) is None else found[tp].offset)
        else:
            consumer.seek_to_beginning(*tps)
        remaining = {tp for tp in tps if consumer.position(tp) < ends[tp]}
        while remaining or follow:
            batches = consumer.poll(timeout_ms=int(idle_timeout_s * 1000) if not follow else 1000)
            if not batches and not follow:
                stuck = ", ".join(f"{tp.partition}@{consumer.position(tp)}<{ends[tp]}" for tp in remaining)
                raise TimeoutError(f"no progress reading {topic} for {idle_timeout_s} s (partitions {stuck})")
            for tp, records in batches.items():
                for r in records:
                    if not follow and r.offset >= ends[tp]:
                        continue
                    yield TopicRecord(topic, tp.partition, r.offset, r.key, r.value)
                if tp in remaining and consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        consumer.close()
