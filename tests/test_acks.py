"""The acknowledgement core (cdc.kafka.acks) without servers: a fake producer acknowledges and
fails records the way Kafka clients report them (in send order per partition), and the
confirmed LSN must never pass a record the broker did not acknowledge."""

from __future__ import annotations

import gc
from collections import deque
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cdc import config as cdc_config
from cdc.daemon import Daemon
from cdc.events.records import Record
from cdc.kafka.acks import Acks, WaitStopped
from cdc.kafka.heartbeat import heartbeat_topic
from cdc.kafka.history import metrics_topic
from cdc.kafka.producer import (
    RECORD_OVERHEAD,
    ConfluentProducer,
    Mark,
    ProducerError,
    RecordTooLarge,
)
from cdc.source.replication import ReplicationLost
from tests.support import write_config

TOPIC = "p.public.t"


class FakeProducer:
    """Counts per (topic, partition) like cdc.kafka.producer's clients; the test decides which records
    complete. A failed record counts as done but poisons every later `reached`, as
    kafka-python reports it (confluent-kafka does not count it: stricter still)."""

    def __init__(self, partitions: int = 3, ack_on_poll: int = 0) -> None:
        self.partitions = partitions
        self.ack_on_poll = ack_on_poll  # records acknowledged per poll(), oldest partition first
        self.sent: dict[tuple[str, int], int] = {}
        self.touched: set[tuple[str, int]] = set()
        self.done: dict[tuple[str, int], int] = {}
        self.failure: str | None = None
        self.closed = False
        self.flushed: list[float] = []
        self.polls = 0
        self.log: list[tuple[str, bytes, bytes | None]] = []

    def partition(self, key: bytes) -> int:
        return key[0] % self.partitions

    def send(self, topic: str, key: bytes, value: bytes | None) -> None:
        tp = (topic, self.partition(key))
        self.sent[tp] = self.sent.get(tp, 0) + 1
        self.touched.add(tp)
        self.log.append((topic, key, value))

    def mark(self) -> Mark:
        """Only the partitions written since the previous mark, as the real clients do: a
        mark alone says nothing about earlier commits, so they must be confirmed in order."""
        mark = {tp: self.sent[tp] for tp in self.touched}
        self.touched.clear()
        return mark

    def reached(self, mark: Mark) -> bool:
        if self.failure is not None:
            raise ProducerError(self.failure)
        return all(self.done.get(tp, 0) >= n for tp, n in mark.items())

    def in_flight(self) -> int:
        return sum(self.sent.values()) - sum(self.done.values())

    def poll(self) -> None:
        self.polls += 1
        assert self.polls < 10_000, "waiting for acknowledgements that never come"
        for _ in range(self.ack_on_poll):
            waiting = [tp for tp in self.sent if self.done.get(tp, 0) < self.sent[tp]]
            if waiting:
                self.complete(waiting[0][1])

    def flush(self, timeout_s: float) -> bool:
        self.flushed.append(timeout_s)
        return True

    def close(self) -> None:
        self.closed = True

    # -- the test's controls
    def unacked(self, partition: int) -> int:
        tp = (TOPIC, partition)
        return self.sent.get(tp, 0) - self.done.get(tp, 0)

    def complete(self, partition: int, failed: bool = False) -> None:
        """The oldest unfinished record of the partition is acknowledged (or failed)."""
        tp = (TOPIC, partition)
        assert self.unacked(partition) > 0
        self.done[tp] = self.done.get(tp, 0) + 1
        if failed and self.failure is None:
            self.failure = f"record {self.done[tp]} of partition {partition} failed"


def record(partition: int, value: bytes | None = b"v", table: str = "public.t") -> tuple:
    return (TOPIC, bytes([partition]), value, table)


def make_acks(producer: FakeProducer | None = None, **kwargs) -> Acks:
    kwargs.setdefault("max_pending", 1000)
    kwargs.setdefault("limits", {TOPIC: 1 << 20})
    return Acks(producer=producer if producer is not None else FakeProducer(), **kwargs)


# -- ordering ----------------------------------------------------------------------------
def test_commits_are_confirmed_in_order_once_all_their_records_are_acknowledged() -> None:
    producer = FakeProducer()
    acks = make_acks(producer, confirmed=100)
    acks.send([record(0), record(1)])
    acks.commit(200, 1)
    acks.send([record(2)])
    acks.commit(300, 2)

    producer.complete(2)  # the later commit's only record first
    producer.complete(0)
    acks.advance()
    assert acks.confirmed == 100  # record 1 of the first commit is still out

    producer.complete(1)
    acks.advance()
    assert acks.confirmed == 300 and not acks.pending and acks.settled()


def test_on_commit_runs_once_per_confirmed_commit() -> None:
    confirmed: list[int] = []
    producer = FakeProducer()
    acks = make_acks(producer)
    acks.on_commit = lambda: confirmed.append(acks.confirmed)
    for lsn in (10, 20, 30):
        acks.send([record(0)])
        acks.commit(lsn, lsn)
    producer.complete(0)
    producer.complete(0)
    acks.advance()
    assert confirmed == [10, 20] and acks.oldest_commit_ts_us() == 30


def test_an_empty_commit_is_confirmed_with_the_records_before_it() -> None:
    producer = FakeProducer()
    acks = make_acks(producer)
    acks.send([record(0)])
    acks.commit(10, 1)
    acks.commit(20, 2)  # no records of its own (a transaction on tables not captured)
    acks.advance()
    assert acks.confirmed == 0
    producer.complete(0)
    acks.advance()
    assert acks.confirmed == 20


def test_caught_up_moves_an_idle_position_only_with_nothing_pending() -> None:
    producer = FakeProducer()
    acks = make_acks(producer, confirmed=50)
    acks.caught_up(40)
    assert acks.confirmed == 50  # never backwards
    acks.send([record(0)])
    acks.commit(60, 1)
    acks.caught_up(90)
    assert acks.confirmed == 50  # a commit still waits for its acknowledgement
    producer.complete(0)
    acks.advance()
    acks.caught_up(90)
    assert acks.confirmed == 90
    acks.commit(80, 3)  # below the idle position: the stream never does this, the class holds anyway
    acks.advance()
    assert acks.confirmed == 90


# -- failures ------------------------------------------------------------------------------
def test_a_failure_stops_confirmation_and_rewind_drops_everything_unconfirmed() -> None:
    producer = FakeProducer()
    acks = make_acks(producer, confirmed=5)
    acks.send([record(0)])
    acks.commit(10, 1)
    acks.send([record(1)])
    acks.commit(20, 2)
    producer.complete(0)
    acks.advance()
    assert acks.confirmed == 10
    acks.send([record(2)])
    producer.complete(2)
    producer.complete(1, failed=True)
    with pytest.raises(ProducerError, match="partition 1 failed"):
        acks.advance()
    assert acks.confirmed == 10  # nothing after a failure counts, not even acknowledged records

    acks.rewind()
    assert producer.closed and acks.producer is None and not acks.pending
    assert acks.confirmed == 10  # the caller resends from here
    acks.advance()  # nothing to do without a producer
    acks.drain(1.0)
    assert acks.in_flight() == 0 and acks.settled()


def test_a_failure_surfaces_with_no_commit_waiting() -> None:
    producer = FakeProducer()
    acks = make_acks(producer)
    acks.send([record(0)])  # e.g. a snapshot row or the state record: no commit follows
    producer.complete(0, failed=True)
    with pytest.raises(ProducerError):
        acks.advance()


def test_drain_flushes_then_confirms() -> None:
    producer = FakeProducer()
    acks = make_acks(producer)
    acks.send([record(0)])
    acks.commit(10, 1)
    producer.complete(0)
    acks.drain(7.0)
    assert producer.flushed == [7.0] and acks.confirmed == 10


# -- backpressure --------------------------------------------------------------------------
def test_send_makes_room_below_80_percent_answering_while_it_waits() -> None:
    producer = FakeProducer(ack_on_poll=1)
    waited: list[int] = []
    acks = make_acks(producer, max_pending=10)
    acks.while_waiting = lambda: waited.append(producer.in_flight())
    acks.send([record(i % 3) for i in range(9)])
    assert producer.in_flight() == 9 and not waited  # below the limit: no wait
    acks.commit(10, 1)
    acks.send([record(0)])  # the tenth: wait until at most 8 are in flight
    assert producer.in_flight() == 8
    assert waited == [9]  # one poll acknowledged one record, then one more was needed
    acks.send([record(1)])
    assert producer.in_flight() == 9


def test_make_room_confirms_what_it_waits_for() -> None:
    producer = FakeProducer(ack_on_poll=5)
    acks = make_acks(producer, max_pending=5)
    acks.send([record(0)] * 4)
    acks.commit(10, 1)
    acks.send([record(0)])
    assert acks.confirmed == 10  # the walsender may learn of it while the sender waits


def test_make_room_raises_a_failure_instead_of_waiting_forever() -> None:
    producer = FakeProducer()
    acks = make_acks(producer, max_pending=2)
    acks.send([record(0)])
    producer.complete(0, failed=True)
    with pytest.raises(ProducerError):
        acks.send([record(0), record(0)])


def test_a_send_from_while_waiting_is_refused_rather_than_waiting_inside_the_wait() -> None:
    producer = FakeProducer()
    acks = make_acks(producer, max_pending=2)
    acks.while_waiting = lambda: acks.send([record(1)])
    with pytest.raises(RuntimeError, match="while waiting for room"):
        acks.send([record(0), record(0)])
    assert not acks.waiting  # the next send after the failure is not refused
    assert len(producer.log) == 2


class _OutageThenBack(FakeProducer):
    """A broker away for `polls` polls, then acknowledging everything at once."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.away = polls

    def poll(self) -> None:
        super().poll()
        if self.polls >= self.away:
            self.done = dict(self.sent)


def test_the_daemon_waiting_for_room_answers_the_walsender_and_reports_after_the_wait(tmp_path) -> None:
    """The regression of a broker outage under load: the window full, a metrics sample and a
    heartbeat due. While it waits the daemon keeps the walsender answered and sends nothing;
    once the broker is back the stream loop sends the sample and the heartbeat."""
    path = write_config(
        tmp_path / "cdc.toml", "postgresql://u@127.0.0.1:1/db", "127.0.0.1:1", "t", ["public.t"],
        daemon={"max_pending_records": 10, "metrics_interval_s": 0.001},
    )
    daemon = Daemon(cdc_config.load(path, environ={}))
    statuses: list[int] = []
    daemon.repl = SimpleNamespace(send_status=statuses.append)  # type: ignore[assignment]
    daemon.incremental = SimpleNamespace(progress=deque())  # type: ignore[assignment]
    producer = _OutageThenBack(polls=300)
    daemon.acks.producer = producer
    daemon.acks.commit(5, 1)

    daemon._send([Record(TOPIC, bytes([i]), b"{}", "public.t") for i in range(10)])  # the window is full: waits
    assert len(statuses) >= 2  # answered at most every 0.1 s through a 0.6 s wait
    assert {topic for topic, _, _ in producer.log} == {TOPIC}  # no sample, no heartbeat inside the wait

    daemon._send_status(force=True)
    sent = [topic for topic, _, _ in producer.log]
    assert sent.count(metrics_topic("t")) == 1 and sent.count(heartbeat_topic("t")) == 1
    assert daemon.metrics.registry.get_sample_value("cdc_events_total", {"table": "public.t"}) == 10


def test_a_stop_ends_a_wait_for_room_that_no_acknowledgement_would_end() -> None:
    producer = FakeProducer()
    stop = []
    acks = make_acks(producer, max_pending=2, stopping=lambda: bool(stop))
    acks.while_waiting = lambda: stop.append(True)  # SIGTERM arrives during the wait
    with pytest.raises(WaitStopped):
        acks.send([record(0), record(0)])
    assert not acks.waiting and producer.polls == 2


def _daemon(tmp_path, **daemon_settings) -> Daemon:
    path = write_config(
        tmp_path / "cdc.toml", "postgresql://u@127.0.0.1:1/db", "127.0.0.1:1", "t", ["public.t"],
        daemon=daemon_settings,
    )
    daemon = Daemon(cdc_config.load(path, environ={}))
    daemon.incremental = SimpleNamespace(progress=deque(), close=lambda: None)  # type: ignore[assignment]
    daemon.cleanups = SimpleNamespace(rewind=lambda: None, close=lambda: None)  # type: ignore[assignment]
    daemon.plan = SimpleNamespace(stop_when_done=False)  # type: ignore[assignment]
    return daemon


def test_a_broker_failure_while_recovering_from_a_lost_replication_connection_rewinds(tmp_path) -> None:
    """PostgreSQL and the broker fail together: the drain before reconnecting raises the
    producer's error. It is a producer failure like any other (a rewind), not a crash."""
    daemon = _daemon(tmp_path)
    failing = FakeProducer()
    failing.failure = "broker gone"
    fresh = FakeProducer()
    producers = [fresh]
    daemon._producer = lambda: setattr(daemon.acks, "producer", producers.pop())  # type: ignore[method-assign]
    daemon._reclaim_slot = daemon._start_replication = lambda: None  # type: ignore[method-assign]
    streams = [ReplicationLost("the connection broke")]

    def stream() -> None:
        if streams:
            raise streams.pop()
        daemon.stopping = True

    daemon._stream = stream  # type: ignore[method-assign]
    daemon._sleep = lambda seconds: None  # type: ignore[method-assign]
    daemon.acks.producer = failing
    daemon._stream_until_stopped()
    errors = daemon.metrics.registry.get_sample_value
    assert errors("cdc_errors_total", {"kind": "replication"}) == 1
    assert errors("cdc_errors_total", {"kind": "producer"}) == 1
    assert failing.closed and daemon.acks.producer is fresh  # rewound, and the next loop made a new one


def test_a_shutdown_after_a_failed_drain_answers_the_walsender_and_sends_nothing(tmp_path, caplog) -> None:
    daemon = _daemon(tmp_path, max_pending_records=2, metrics_interval_s=0.001)
    statuses: list[int] = []
    daemon.repl = SimpleNamespace(send_status=statuses.append, close=lambda: None)  # type: ignore[assignment]
    producer = FakeProducer()
    daemon.acks.producer = producer
    daemon.acks.send([record(0)])
    daemon.acks.commit(10, 1)
    producer.complete(0, failed=True)
    caplog.set_level("INFO", logger="cdc.daemon")
    daemon._finish(1)
    assert statuses == [0]  # the walsender hears the unchanged confirmed LSN
    assert [topic for topic, _, _ in producer.log] == [TOPIC]  # no heartbeat, no sample after the failure
    assert "records not acknowledged at shutdown (record 1 of partition 0 failed)" in caplog.text
    assert "stopped at confirmed LSN 0/0" in caplog.text


def test_commits_waiting_for_acknowledgements_hold_no_object_the_garbage_collector_walks() -> None:
    """A slow broker or a wide schema keeps up to [daemon] max_pending_records commits waiting;
    each one the collector tracked would be walked by its every full pass (at 1,000 tables a
    tenth of the daemon's CPU, docs/benchmarks.md). The real client's marks, its broker unreachable."""
    producer = ConfluentProducer(cdc_config.TopicConfig(bootstrap_servers="127.0.0.1:9"), {TOPIC: 3})
    try:
        acks = Acks(max_pending=1_000_000, limits={}, producer=producer)
        gc.collect()  # the client's own objects settled, its (topic, partition) keys among them
        before = len(gc.get_objects())
        for n in range(1000):
            acks.send([(TOPIC, b"k%d" % n, b"v", "public.t")])
            acks.commit(100 + n, n)
        assert len(acks.pending) == 1000 and acks.oldest_commit_ts_us() == 0
        assert len(gc.get_objects()) - before < 50
    finally:
        producer.close()


# -- record size ---------------------------------------------------------------------------
def test_a_record_above_the_topic_limit_is_refused_before_it_is_sent() -> None:
    producer = FakeProducer()
    limit = 200
    acks = make_acks(producer, limits={TOPIC: limit})
    fits = b"x" * (limit - RECORD_OVERHEAD - 1)  # key is one byte: exactly at the limit
    assert acks.send([record(0, fits)]) == limit - RECORD_OVERHEAD
    with pytest.raises(RecordTooLarge) as refused:
        acks.send([record(0), record(1, fits + b"x", table="public.big")])
    message = str(refused.value)
    assert "table public.big" in message and f"{TOPIC}'s max.message.bytes={limit}" in message
    assert "is 73 bytes" in message
    assert [len(v or b"") for _, _, v in producer.log] == [len(fits), 1]  # the big one never went out


def test_a_tombstone_counts_its_key_only_and_unknown_topics_use_the_default_limit() -> None:
    producer = FakeProducer()
    acks = make_acks(producer, limits={}, default_limit=RECORD_OVERHEAD + 10)
    assert acks.send([(TOPIC, b"\x00" * 10, None, "public.t")]) == 10
    with pytest.raises(RecordTooLarge):
        acks.send([(TOPIC, b"\x00" * 11, None, "public.t")])


# -- properties ----------------------------------------------------------------------------
PARTITIONS = 3


class AcknowledgementOrder(RuleBasedStateMachine):
    """Any interleaving of sends, commits, acknowledgements and failures across partitions,
    with the daemon's reaction to a failure (rewind, new producer, resend from `confirmed`).

    The model remembers, for each commit, where its records sit in each partition; a commit
    is safe to confirm only when all of them are acknowledged without a failure."""

    @initialize()
    def start(self) -> None:
        self.acks = make_acks(confirmed=0, max_pending=1 << 30)
        self.new_producer()
        self.last_confirmed = 0
        self.next_lsn = 1
        # end LSN -> the commit's records as (partition, position) on the current producer
        self.commits: dict[int, list[tuple[int, int]]] = {}
        self.open: list[tuple[int, int]] = []  # records of the transaction not yet committed
        self.failed: set[tuple[int, int]] = set()  # failed records of the current producer

    def new_producer(self) -> None:
        self.producer = FakeProducer(PARTITIONS)
        self.acks.producer = self.producer

    @rule(partitions=st.lists(st.integers(0, PARTITIONS - 1), min_size=1, max_size=4))
    def send(self, partitions: list[int]) -> None:
        self.acks.send([record(p) for p in partitions])
        self.open += [(p, self.producer.sent[(TOPIC, p)] - partitions[i + 1:].count(p)) for i, p in enumerate(partitions)]

    @rule(gap=st.integers(1, 1000))
    def commit(self, gap: int) -> None:
        self.next_lsn += gap
        self.acks.commit(self.next_lsn, self.next_lsn)
        self.commits[self.next_lsn] = self.open
        self.open = []

    @rule(partition=st.integers(0, PARTITIONS - 1), failed=st.booleans())
    def complete(self, partition: int, failed: bool) -> None:
        if self.producer.unacked(partition):
            self.producer.complete(partition, failed)
            if failed:
                self.failed.add((partition, self.producer.done[(TOPIC, partition)]))

    @precondition(lambda self: not self.open and not self.acks.pending)
    @rule(gap=st.integers(0, 1000))
    def idle(self, gap: int) -> None:
        """A keepalive with nothing in between: every commit below it was received."""
        self.next_lsn += gap
        self.acks.caught_up(self.next_lsn)

    @rule()
    def advance(self) -> None:
        try:
            self.acks.advance()
        except ProducerError:
            assert self.failed  # only a real failure stops the stream
            self.acks.rewind()
            assert not self.acks.pending and self.acks.producer is None
            # the stream restarts at `confirmed`: later commits come again, on a new producer
            self.new_producer()
            self.commits, self.open, self.failed = {}, [], set()
            self.next_lsn = self.acks.confirmed

    @invariant()
    def confirmed_never_passes_an_unacknowledged_record(self) -> None:
        if not hasattr(self, "acks"):
            return
        confirmed = self.acks.confirmed
        assert confirmed >= self.last_confirmed, "the confirmed LSN went backwards"
        self.last_confirmed = confirmed
        done = self.producer.done
        for end_lsn, records in self.commits.items():
            if end_lsn <= confirmed:
                for partition, position in records:
                    assert done.get((TOPIC, partition), 0) >= position, f"{end_lsn} confirmed before its acks"
                    assert (partition, position) not in self.failed, f"{end_lsn} confirmed with a failed record"


AcknowledgementOrder.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_acknowledgement_order = AcknowledgementOrder.TestCase
