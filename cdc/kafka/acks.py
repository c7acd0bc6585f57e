"""Acknowledgement bookkeeping: which source position may be confirmed, given the broker's acks.

docs/design.md's durability rule lives here and nowhere else: a commit's end LSN becomes
`confirmed` only once the broker acknowledged every record sent before the commit, commits
are confirmed in their order, and after a producer failure everything unconfirmed is
forgotten so the caller resends from `confirmed` (duplicates are harmless, reordering is not).
The same class refuses records a topic can never accept and holds the sender back when too
many records are unacknowledged, for the streaming daemon and the snapshot readers alike.
It knows neither PostgreSQL nor the daemon, so tests drive it with a fake producer.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from cdc.kafka.producer import RECORD_OVERHEAD, Mark, Producer, RecordTooLarge

log = logging.getLogger(__name__)

NO_LIMIT = 1 << 62  # a topic without a known max.message.bytes
# (topic, key, value, table): cdc.events.records.Record, or a plain tuple from the C renderer
Outgoing = tuple[str, bytes, bytes | None, str]
WAIT_LOG_S = 5.0  # a wait for room longer than this is an outage or a slow broker: logged


def _nothing() -> None:
    pass


def _never() -> bool:
    return False


class WaitStopped(Exception):
    """`make_room` gave up waiting because the caller is stopping (`stopping()` turned true)."""


class Waiting:
    """The commits waiting for acknowledgements, oldest first: each one's producer mark, end
    LSN and commit time (µs), in three deques rather than one deque of tuples. A slow broker
    or a wide schema keeps up to [daemon] max_pending_records of them waiting, and a tuple that
    holds a dict stays tracked by Python's garbage collector, whose full passes then walked
    every waiting commit again and again: at 1,000 tables about a tenth of the daemon's CPU
    (docs/benchmarks.md). A dict of ints, an int and a deque's slots are not tracked."""

    __slots__ = ("marks", "lsns", "times")

    def __init__(self) -> None:
        self.marks: deque[Mark] = deque()
        self.lsns: deque[int] = deque()
        self.times: deque[int] = deque()

    def __len__(self) -> int:
        return len(self.lsns)

    def append(self, mark: Mark, end_lsn: int, commit_ts_us: int) -> None:
        self.marks.append(mark)
        self.lsns.append(end_lsn)
        self.times.append(commit_ts_us)

    def popleft(self) -> int:
        """The oldest commit's end LSN, no longer waiting."""
        self.marks.popleft()
        self.times.popleft()
        return self.lsns.popleft()

    def clear(self) -> None:
        self.marks.clear()
        self.lsns.clear()
        self.times.clear()


class Acks:
    """Sends records through one producer and turns its acknowledgements into a confirmed LSN.

    `producer` is None between a failure and the caller's next producer; `pending` holds
    the commits still waiting for acknowledgements (`Waiting`), oldest first. `on_commit`
    runs once per commit confirmed (a metric); `while_waiting` runs between polls while
    `make_room` waits, so the caller can keep other peers (the walsender) answered during
    backpressure. It must not send: a send there could wait for room again, inside the wait
    (a broker outage under load would recurse until the stack ran out), so `send` refuses to
    be called from it.
    """

    def __init__(
        self,
        max_pending: int,
        limits: Mapping[str, int],
        default_limit: int = NO_LIMIT,
        producer: Producer | None = None,
        confirmed: int = 0,
        on_commit: Callable[[], object] = _nothing,
        while_waiting: Callable[[], object] = _nothing,
        stopping: Callable[[], bool] = _never,
    ) -> None:
        self.max_pending = max_pending
        self.limits = limits  # topic -> max.message.bytes; the caller's dict, so new topics show up
        self.default_limit = default_limit
        self.producer = producer
        self.confirmed = confirmed  # highest commit end LSN whose records the broker acknowledged
        self.pending = Waiting()
        self.on_commit = on_commit
        self.while_waiting = while_waiting
        self.waiting = False  # inside make_room: `send` is refused
        self.stopping = stopping  # a stop ends a wait for room (WaitStopped) instead of an outage's length

    def send(self, records: Iterable[Outgoing]) -> int:
        """Send (topic, key, value, table) records in order; returns their key and value bytes.

        A record above its topic's limit raises RecordTooLarge before it is sent: the broker
        would refuse it on every retry. Too many unacknowledged records wait in `make_room`."""
        producer = self.producer
        assert producer is not None, "send after a failure without a new producer"
        if self.waiting:
            raise RuntimeError("Acks.send called while waiting for room (from while_waiting): it must not send")
        send, limits, default = producer.send, self.limits, self.default_limit
        sent_bytes = 0
        for topic, key, value, table in records:
            size = len(key) + (len(value) if value is not None else 0)
            limit = limits.get(topic, default)
            if size + RECORD_OVERHEAD > limit:
                raise RecordTooLarge.of(table, key, size, topic, limit)
            send(topic, key, value)
            sent_bytes += size
        if producer.in_flight() >= self.max_pending:
            self.make_room()
        return sent_bytes

    def commit(self, end_lsn: int, commit_ts_us: int) -> None:
        """Everything sent so far belongs to commits up to `end_lsn`: confirm it once acknowledged."""
        assert self.producer is not None
        self.pending.append(self.producer.mark(), end_lsn, commit_ts_us)

    def advance(self) -> None:
        """Confirm every commit whose records are all acknowledged, in commit order.

        Raises ProducerError once any record failed, whether or not a commit waits for it."""
        producer = self.producer
        if producer is None:
            return
        producer.poll()
        pending = self.pending
        marks = pending.marks
        while marks and producer.reached(marks[0]):
            self.confirmed = max(self.confirmed, pending.popleft())
            self.on_commit()
        if not pending:
            producer.reached({})  # surfaces a failure even with no commit waiting

    def caught_up(self, lsn: int) -> None:
        """The caller vouches that every commit below `lsn` was received: with none waiting
        for acknowledgements, `lsn` may be confirmed (an idle slot still moves on)."""
        if not self.pending and lsn > self.confirmed:
            self.confirmed = lsn

    def make_room(self) -> None:
        """Backpressure: wait until at most 80% of `max_pending` records are unacknowledged.
        A wait of more than WAIT_LOG_S says so once in the log, with how long it took."""
        low = self.max_pending * 0.8
        started = time.monotonic()
        logged = False
        self.waiting = True
        try:
            while True:
                self.advance()
                if self.in_flight() <= low:
                    break
                if self.stopping():
                    raise WaitStopped()
                self.while_waiting()
                if not logged and time.monotonic() - started >= WAIT_LOG_S:
                    log.warning(
                        "%d records unacknowledged: reading paused until the broker acknowledges them",
                        self.in_flight(),
                    )
                    logged = True
                time.sleep(0.002)
        finally:
            self.waiting = False
        if logged:
            log.info("reading resumed after %.1f s of backpressure", time.monotonic() - started)

    def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every sent record's fate, then confirm what was acknowledged."""
        if self.producer is None:
            return
        self.producer.flush(timeout_s)
        self.advance()

    def rewind(self) -> None:
        """After a failure: drop the producer and every unconfirmed commit. The caller resends
        from `confirmed` with a new producer; no retry of the old one can land after that."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self.pending.clear()

    def in_flight(self) -> int:
        return self.producer.in_flight() if self.producer is not None else 0

    def settled(self) -> bool:
        """No commit waits and no record is in flight."""
        return not self.pending and self.in_flight() == 0

    def oldest_commit_ts_us(self) -> int | None:
        """Commit time of the oldest commit not yet confirmed (the lag a user feels)."""
        return self.pending.times[0] if self.pending else None
