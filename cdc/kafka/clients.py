"""Kafka clients besides the daemon's producer, with their settings from `[topic]` in one place.

Everything that reads topics (`cdc tail`, the topic read as a table, `cdc status`, the snapshot
state, the sinks' driver) or writes small records of its own (the sinks' progress, the
truncate clean-up when no daemon runs) takes its client here: servers, security, and message
sizes that fit the topics' `max.message.bytes`. The daemon's producer (cdc.kafka.producer)
adds the ordering settings of docs/design.md on top of the same security settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdc.config import TopicConfig
from cdc.kafka.security import librdkafka_security, security_settings


def consumer(config: TopicConfig, client_id: str, **overrides: Any) -> Any:
    """A consumer without a group (assign, not subscribe): reading never moves anyone's
    committed offsets. Fetch sizes fit the largest record a topic takes."""
    from kafka import KafkaConsumer

    settings: dict[str, Any] = {
        "bootstrap_servers": config.bootstrap_servers.split(","),
        "client_id": client_id,
        "group_id": None,
        "enable_auto_commit": False,
        "max_partition_fetch_bytes": max(1048576, config.max_message_bytes * 2),
        "fetch_max_bytes": max(52428800, config.max_message_bytes * 2),
        "bootstrap_timeout_ms": int(config.connect_timeout_s * 1000),
        **security_settings(config),
    }
    settings.update(overrides)
    return KafkaConsumer(**settings)


def producer(config: TopicConfig, client_id: str, **overrides: Any) -> Any:
    """A producer of bookkeeping records (acks=all); not for change events, whose order the
    daemon's own producer keeps."""
    from kafka import KafkaProducer

    settings: dict[str, Any] = {
        "bootstrap_servers": config.bootstrap_servers.split(","),
        "client_id": client_id,
        "acks": "all",
        "bootstrap_timeout_ms": int(config.connect_timeout_s * 1000),
        **security_settings(config),
    }
    settings.update(overrides)
    return KafkaProducer(**settings)


def confluent_consumer(config: TopicConfig, client_id: str, extra: Mapping[str, Any] | None = None) -> Any:
    """A confluent-kafka (librdkafka) consumer, for `[topic] client = "confluent"` and the
    sinks' stream (`extra`: librdkafka settings on top): assigned partitions only, nothing
    committed (its group id is never used)."""
    from confluent_kafka import Consumer

    return Consumer({
        "bootstrap.servers": config.bootstrap_servers,
        "client.id": client_id,
        "group.id": client_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "fetch.max.bytes": max(52428800, config.max_message_bytes * 2),
        "max.partition.fetch.bytes": max(1048576, config.max_message_bytes * 2),
        **librdkafka_security(config),
        **(extra or {}),
    })
