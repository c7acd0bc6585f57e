"""Following a small internal topic as it grows, and the daemon's heartbeats as a clock.

`Follower` reads without a consumer group (assign, never commit): each `poll()` returns the
records that arrived since the last one. `Heartbeats` keeps the recent heartbeats
(cdc.kafka.heartbeat) to answer, for a sink complete up to some LSN, how far behind the slot
it is in bytes and since when the topics hold a change it lacks. Used by `cdc top` and by
the sink jobs' metrics.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import orjson

from cdc.config import TopicConfig
from cdc.kafka.heartbeat import heartbeat_topic
from cdc.kafka.security import security_settings

BEATS_KEPT = 7200  # two hours of a busy slot's heartbeats (at most one a second)


class Follower:
    """The new records of a topic at each `poll()`; `tail`: begin this many records before
    the end of each partition (None: from the beginning). A topic not created yet is looked
    for again at the next poll."""

    def __init__(self, config: TopicConfig, topic: str, tail: int | None = None, client_id: str = "cdc-follow") -> None:
        from kafka import KafkaConsumer

        self.topic, self.tail = topic, tail
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap_servers.split(","), client_id=client_id, group_id=None,
            enable_auto_commit=False, fetch_max_wait_ms=50, **security_settings(config),
        )
        self._assigned = False
        self.skipped = False  # records before the first one read exist (the tail began after them)

    def _assign(self) -> bool:
        from kafka.structs import TopicPartition

        partitions = self._consumer.partitions_for_topic(self.topic)
        if not partitions:
            return False
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        if self.tail is None:
            self._consumer.seek_to_beginning(*tps)
        else:
            begins, ends = self._consumer.beginning_offsets(tps), self._consumer.end_offsets(tps)
            for tp in tps:
                self._consumer.seek(tp, max(begins[tp], ends[tp] - self.tail))
                self.skipped |= ends[tp] - self.tail > begins[tp]
        self._assigned = True
        return True

    def poll(self) -> list[Any]:
        if not self._assigned and not self._assign():
            return []
        out: list[Any] = []
        for _ in range(100):  # bounded: a long backlog is read over several polls
            batches = self._consumer.poll(timeout_ms=100, max_records=5000)
            if not batches:
                break
            for records in batches.values():
                out += records
        return out

    def close(self) -> None:
        self._consumer.close()


class Heartbeats:
    """The daemon's recent heartbeats, (LSN, time), LSNs rising. `slot`: only that slot's (a
    prefix should have one; None takes every heartbeat of the topic)."""

    def __init__(self, config: TopicConfig, slot: str | None = None, kept: int = BEATS_KEPT) -> None:
        self.slot = None if slot is None else slot.encode()
        self.kept = kept
        self.beats: deque[tuple[int, int]] = deque(maxlen=kept)
        self._follower = Follower(config, heartbeat_topic(config.prefix), tail=kept, client_id="cdc-heartbeats")

    def poll(self) -> None:
        for record in self._follower.poll():
            if record.value is None or (self.slot is not None and record.key != self.slot):
                continue
            beat = orjson.loads(record.value)
            lsn = int(beat["lsn"])
            if not self.beats or lsn > self.beats[-1][0]:
                self.beats.append((lsn, int(beat["ts_ms"])))

    @property
    def newest(self) -> int | None:
        return self.beats[-1][0] if self.beats else None

    def lag(self, complete: int, now: float | None = None) -> tuple[int | None, float | None, bool]:
        """For a store complete up to `complete`: bytes behind the newest heartbeat, seconds since
        the first heartbeat past it (it was written right after the oldest change the store
        lacks), and whether that is a lower bound (older heartbeats were not read). Nones
        before the first heartbeat."""
        if not self.beats:
            return None, None, False
        now = time.time() if now is None else now
        for lsn, ts_ms in self.beats:
            if lsn > complete:
                partial = self._follower.skipped or len(self.beats) == self.kept
                return self.beats[-1][0] - complete, max(0.0, now - ts_ms / 1000), partial and self.beats[0][0] > complete
        return 0, 0.0, False

    def close(self) -> None:
        self._follower.close()
