"""The tombstone horizon: how far behind each sink is, in time, against `delete.retention.ms`.

The log cleaner may drop a tombstone `delete.retention.ms` after it was written (at the
earliest: that clock starts when the cleaner's pass reaches it). A sink that has not read it by
then never applies the delete, and its store keeps the row for good. So what matters is the
age of the oldest change a sink has not applied. A sink's progress says, in LSN terms, up to
where its store is complete (`complete_lsn`, sinks.progress): every change with a higher commit
LSN is still to apply. In each partition of a table topic the records follow commit order, so a
binary search over offsets finds the first one above `complete_lsn`, and its timestamp (when the
broker got it) is when the sink fell behind: a few dozen fetches per busy partition, one per
idle one, never a full read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from cdc.config import TopicConfig
from cdc.kafka.clients import consumer
from cdc.kafka.policy import duration

WARN_AT = 0.5  # of delete.retention.ms: `cdc status` warns from here on


@dataclass(frozen=True)
class Change:
    offset: int
    commit_lsn: int
    time_ms: int  # when the broker got it (the record's timestamp)


def _commit_lsn(value: bytes) -> int | None:
    try:
        event = orjson.loads(value)
        if "payload" in event and "schema" in event:
            event = event["payload"]
        return int(orjson.loads(event["source"]["sequence"])[0])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


class Partition:
    """One partition of a table topic, searched by commit LSN."""

    def __init__(self, client: Any, tp: Any) -> None:
        self.client, self.tp = client, tp
        client.assign([tp])
        self.begin = client.beginning_offsets([tp])[tp]
        self.end = client.end_offsets([tp])[tp]

    def at(self, offset: int) -> Change | None:
        """The first change at or after `offset` (tombstones carry no position), None past the end."""
        self.client.seek(self.tp, offset)
        while self.client.position(self.tp) < self.end:
            for records in self.client.poll(timeout_ms=5000).values():
                for r in records:
                    if r.offset >= self.end:
                        return None
                    lsn = None if r.value is None else _commit_lsn(r.value)
                    if lsn is not None:
                        return Change(r.offset, lsn, r.timestamp)
        return None

    def last(self) -> Change | None:
        """The newest change (a few records back from the end: the last ones may be tombstones)."""
        hi = self.end
        while hi > self.begin:
            lo = max(self.begin, hi - 20)
            found, offset = None, lo
            while (change := self.at(offset)) is not None and change.offset < hi:
                found, offset = change, change.offset + 1
            if found is not None:
                return found
            hi = lo
        return None

    def first_after(self, lsn: int) -> Change | None:
        """The first change with a commit LSN above `lsn`."""
        lo, hi = self.begin, self.end
        while lo < hi:
            mid = (lo + hi) // 2
            change = self.at(mid)
            if change is None or change.commit_lsn > lsn:
                hi = mid
            else:
                lo = change.offset + 1
        return self.at(lo) if lo < self.end else None


def newest_commit(client: Any, topic: str, partitions: int) -> int:
    """The highest commit LSN of the changes a table topic ends with (0: none), from the last
    records of its partitions only."""
    from kafka.structs import TopicPartition

    lasts = (Partition(client, TopicPartition(topic, p)).last() for p in range(partitions))
    return max((c.commit_lsn for c in lasts if c is not None), default=0)


def oldest_unapplied(config: TopicConfig, topics: dict[str, int], complete: dict[str, int]) -> dict[str, int | None]:
    """Per sink (name -> its complete_lsn), when the oldest change it has not applied reached the
    broker (ms; None: it has applied every change the table topics hold). `topics`: name -> partitions."""
    from kafka.structs import TopicPartition

    client = consumer(config, "cdc-status", max_poll_records=20, fetch_max_wait_ms=10)
    out: dict[str, int | None] = {job: None for job in complete}
    try:
        for topic, count in sorted(topics.items()):
            for p in range(count):
                partition = Partition(client, TopicPartition(topic, p))
                last = partition.last()
                for job, lsn in complete.items():
                    if last is None or last.commit_lsn <= lsn:
                        continue
                    first = partition.first_after(lsn)
                    if first is not None and (out[job] is None or first.time_ms < out[job]):  # type: ignore[operator]
                        out[job] = first.time_ms
    finally:
        client.close()
    return out


@dataclass(frozen=True)
class SinkLag:
    """How far behind one sink is: `since_ms`, when the oldest change it has not applied was
    written (None: none); `lag_ms`, how long ago that was."""

    job: str
    complete_lsn: int
    since_ms: int | None
    lag_ms: int


def sink_lags(
    config: TopicConfig, progress: dict[str, dict[str, Any]], topics: dict[str, int], now_ms: int | None = None,
) -> dict[str, SinkLag]:
    """Each sink job's lag in time, from its progress record and the table topics."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    complete = {job: int(record.get("complete_lsn", 0)) for job, record in progress.items()}
    since = oldest_unapplied(config, topics, complete) if complete else {}
    return {
        job: SinkLag(job, complete[job], since[job], 0 if since[job] is None else max(0, now - since[job]))  # type: ignore[operator]
        for job in complete
    }


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
        job, behind = self.lag.job, duration(self.lag.lag_ms)
        retention = f"delete.retention.ms of {self.topic} = {duration(self.retention_ms)}"
        if self.state == "past":
            return (
                f"sink {job} is {behind} behind, past the tombstone horizon ({retention}): deletes it has not "
                f"applied may be gone from the topics and their rows stay in its store; rebuild the store from the "
                f"topics (docs/operations.md: Rebuilding a store) and keep the job running"
            )
        if self.state == "warning":
            left = duration(self.retention_ms - self.lag.lag_ms)
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
