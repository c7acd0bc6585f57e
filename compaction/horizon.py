"""The tombstone horizon: how far behind each sink is, in time, against `delete.retention.ms`.

A tombstone may be dropped by the log cleaner `delete.retention.ms` after it was written (at
the earliest: the cleaner's pass starts that clock). A sink that has not read it by then
never applies the delete, and its store keeps the row for good. So what matters is the age
of the oldest change a sink has not applied. A sink's progress says, in LSN terms, up to
where its store is complete (`complete_lsn`, sinks.progress); the daemon's heartbeats
(cdc.kafka.heartbeat, one record a second at most while the slot moves, kept as long as
the tombstones by the topic policy) say when the topics passed each LSN. The first
heartbeat beyond a sink's `complete_lsn` was written right after the oldest change the sink
lacks: its time is when the sink fell behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from cdc.config import TopicConfig
from cdc.kafka.clients import consumer
from cdc.kafka.heartbeat import heartbeat_topic
from cdc.kafka.policy import duration

WARN_AT = 0.5  # of delete.retention.ms: `cdc status` warns from here on


@dataclass(frozen=True)
class Beat:
    offset: int
    lsn: int
    time_ms: int  # when the broker got it (the record's timestamp)


class Heartbeats:
    """The heartbeat topic as an index from LSN to time: a binary search over its offsets (its
    LSNs only grow), so a week of heartbeats costs a few dozen fetches, not a full read."""

    def __init__(self, config: TopicConfig, slot: str | None = None) -> None:
        from kafka.structs import TopicPartition

        self.slot = None if slot is None else slot.encode()
        self._consumer = consumer(config, "cdc-status", max_poll_records=50, fetch_max_wait_ms=10)
        self._tp = TopicPartition(heartbeat_topic(config.prefix), 0)
        if not self._consumer.partitions_for_topic(self._tp.topic):
            self.begin = self.end = 0
            return
        self._consumer.assign([self._tp])
        self.begin = self._consumer.beginning_offsets([self._tp])[self._tp]
        self.end = self._consumer.end_offsets([self._tp])[self._tp]

    def _at(self, offset: int) -> Beat | None:
        """The first heartbeat at or after `offset` (compaction leaves gaps), None past the end."""
        self._consumer.seek(self._tp, offset)
        while self._consumer.position(self._tp) < self.end:
            for records in self._consumer.poll(timeout_ms=5000).values():
                for r in records:
                    if r.offset >= self.end:
                        return None
                    if r.value is None or (self.slot is not None and r.key != self.slot):
                        continue
                    return Beat(r.offset, int(orjson.loads(r.value)["lsn"]), r.timestamp)
        return None

    def earliest(self) -> Beat | None:
        return self._at(self.begin) if self.end > self.begin else None

    def latest(self) -> Beat | None:
        """The newest heartbeat (a few records back from the end: the last ones may be another slot's)."""
        start = self.end
        while start > self.begin:
            start = max(self.begin, start - 50)
            found, offset = None, start
            while (beat := self._at(offset)) is not None:
                found, offset = beat, beat.offset + 1
            if found is not None:
                return found
        return None

    def first_after(self, lsn: int) -> Beat | None:
        """The first heartbeat with an LSN above `lsn` (None: the topics are not past it)."""
        lo, hi = self.begin, self.end
        while lo < hi:
            mid = (lo + hi) // 2
            beat = self._at(mid)
            if beat is None or beat.lsn > lsn:
                hi = mid
            else:
                lo = beat.offset + 1
        return self._at(lo) if lo < self.end else None

    def close(self) -> None:
        self._consumer.close()


@dataclass(frozen=True)
class SinkLag:
    """How far behind one sink is. `since_ms`: when the topics passed its `complete_lsn` (None: it
    has applied everything the heartbeats know of); `at_least`: the heartbeats of that time are
    gone, so the lag is at least `lag_ms`."""

    job: str
    complete_lsn: int
    since_ms: int | None
    lag_ms: int
    at_least: bool = False


def sink_lags(progress: dict[str, dict[str, Any]], beats: Heartbeats, now_ms: int | None = None) -> dict[str, SinkLag]:
    """Each sink job's lag in time, from its progress record and the heartbeats."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    latest = beats.latest()
    out = {}
    for job, record in progress.items():
        complete = int(record.get("complete_lsn", 0))
        if latest is None or latest.lsn <= complete:
            out[job] = SinkLag(job, complete, None, 0)
            continue
        first = beats.first_after(complete)
        assert first is not None  # the latest one is past it
        earliest = beats.earliest()
        at_least = earliest is not None and earliest.offset == first.offset and earliest.lsn > complete
        out[job] = SinkLag(job, complete, first.time_ms, max(0, now - first.time_ms), at_least)
    return out


@dataclass(frozen=True)
class Horizon:
    """One sink against the shortest delete.retention.ms of the table topics it reads."""

    lag: SinkLag
    retention_ms: int
    topic: str  # the table topic with that retention

    @property
    def state(self) -> str:
        """`ok`, `warning` (past half the horizon) or `past` (deletes may be lost)."""
        if self.lag.lag_ms >= self.retention_ms:
            return "past"
        return "warning" if self.lag.lag_ms >= self.retention_ms * WARN_AT else "ok"

    def message(self) -> str | None:
        """What to tell the user, or None when all is well."""
        job, lag = self.lag.job, self.lag
        behind = ("at least " if lag.at_least else "") + duration(lag.lag_ms)
        retention = f"delete.retention.ms of {self.topic} = {duration(self.retention_ms)}"
        if self.state == "past":
            return (
                f"sink {job} is {behind} behind, past the tombstone horizon ({retention}): deletes it has not "
                f"applied may be gone from the topics and their rows stay in its store; rebuild the store from the "
                f"topics (README, Operations: rebuilding a store) and keep the job running"
            )
        if self.state == "warning":
            left = duration(self.retention_ms - lag.lag_ms)
            return (
                f"sink {job} is {behind} behind; tombstones may be dropped {duration(self.retention_ms)} after they "
                f"are written ({retention}): get it applying again (cdc sink {job.split('-')[0]}) within {left}, "
                f"or raise delete.retention.ms on the table topics to buy time"
            )
        return None


def horizons(lags: dict[str, SinkLag], retentions: dict[str, int]) -> dict[str, Horizon]:
    """Each sink against the table topic with the shortest delete.retention.ms (topic -> ms)."""
    if not retentions:
        return {}
    topic = min(retentions, key=lambda t: (retentions[t], t))
    return {job: Horizon(lag, retentions[topic], topic) for job, lag in lags.items()}

