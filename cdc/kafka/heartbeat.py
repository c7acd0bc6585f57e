"""The daemon's progress in the topics, for consumers: `<prefix>.__cdc_heartbeat`.

One compacted record per slot, sent whenever the confirmed LSN moved (at most once a
second): "every transaction that committed at or below `lsn` is in the topics". A sink
that has read every topic past this record's offset is complete up to `lsn`, also for
tables that see no traffic (Debezium's heartbeat topic plays the same part).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:  # the events (and their C renderer) load only where heartbeats are sent;
    # the sinks follow heartbeats (cdc.kafka.follow): no capture code at their import
    from cdc.config import TopicConfig
    from cdc.events.records import Record

HEARTBEAT_SUFFIX = "__cdc_heartbeat"
INTERVAL_S = 1.0


def heartbeat_topic(prefix: str) -> str:
    """One segment after the prefix: never a table's topic (those have two)."""
    return f"{prefix}.{HEARTBEAT_SUFFIX}"


def heartbeat_record(prefix: str, slot: str, lsn: int) -> Record:
    from cdc.events.records import Record

    value = orjson.dumps({"slot": slot, "lsn": str(lsn), "ts_ms": int(time.time() * 1000)})
    return Record(heartbeat_topic(prefix), slot.encode(), value, HEARTBEAT_SUFFIX)


def newest_heartbeat(config: TopicConfig) -> int:
    """The LSN of the newest heartbeat in the topic (0 when there is none yet): every
    transaction committed at or below it was in the topics before this returned."""
    from cdc.kafka.reader import read_topic

    try:
        beats = read_topic(config, heartbeat_topic(config.prefix), idle_timeout_s=10, tail=1)  # LSNs only rise
        return max((int(orjson.loads(r.value)["lsn"]) for r in beats if r.value is not None), default=0)
    except LookupError:  # no daemon ever ran
        return 0
