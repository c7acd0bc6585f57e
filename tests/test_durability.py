"""Crashes, broker restarts and producer errors: the topic read as a table still equals the source.

Each test compares what a user would: the latest value per key in the topic (tombstones
delete) against the rows in PostgreSQL, and that no key's last record is older than
another record of it (compaction would keep stale data).
"""

from __future__ import annotations

import random
import threading
import time

import psycopg
import pytest

from cdc import config as cdc_config
from cdc.daemon import Daemon
from cdc.kafka.producer import ProducerError, make_producer
from tests.support import (
    ACCT,
    DaemonProcess,
    Writers,
    slot_active,
    slot_of,
    source_table,
    start_streaming,
    topic_table,
    wait_caught_up,
    wait_for,
    write_config,
)


def assert_topic_equals_source(db, servers: str, prefix: str) -> None:
    table = topic_table(servers, prefix, "public", "acct")
    assert table.order_violations() == []
    expected = source_table(db.dsn, "SELECT id, version, note FROM public.acct")
    got = table.state()
    missing = set(expected) - set(got)
    extra = set(got) - set(expected)
    assert not missing and not extra, f"missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
    assert got == expected


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_nothing(tmp_path, db, broker_servers, topic_prefix):
    db.execute(ACCT)
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    rng = random.Random(7)
    log = tmp_path / "daemon.log"
    first = start_streaming(config, log, db.dsn, slot)
    with Writers(db.dsn, threads=3, keys=300, hot=300) as writers:
        daemon = first
        for _ in range(4):
            time.sleep(rng.uniform(1.0, 3.0))
            assert daemon.alive(), daemon.output()[-3000:]
            daemon.kill9()
            time.sleep(rng.uniform(0.0, 1.0))
            daemon = DaemonProcess(config, log).start()
        time.sleep(2)
        assert writers.commits > 100
    wait_caught_up(db.dsn, slot, daemon, timeout=120)
    assert daemon.stop() == 0
    assert_topic_equals_source(db, broker_servers, topic_prefix)


@pytest.mark.slow
@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_broker_kill_9_under_load_fills_the_window_and_the_daemon_rides_it_out(
    tmp_path, db, local_broker, topic_prefix, client
):
    """Apache Kafka is killed -9 twice under a sustained write load, long enough for the
    unacknowledged records to fill the daemon's window while a metrics sample and heartbeats
    are due (the RecursionError of issue 36). The daemon keeps streaming, and the topic read
    as a table equals the source with every key's records in position order."""
    db.execute(ACCT)
    servers = local_broker.bootstrap_servers
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, servers, topic_prefix, ["public.acct"],
        topic={"client": client}, daemon={"max_pending_records": 300, "metrics_interval_s": 0.2},
    )
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    with Writers(db.dsn, threads=3, keys=300, hot=300) as writers:
        for outage in range(2):
            time.sleep(2)
            paused = daemon.output().count("reading paused")
            local_broker.kill9()
            wait_for(lambda n=paused: daemon.output().count("reading paused") > n, 30, "the window to fill")
            time.sleep(outage * 6)  # the second outage outlasts the first by six seconds
            local_broker.start()  # same ports, same log dirs
            wait_for(lambda n=outage: daemon.output().count("reading resumed") > n or not daemon.alive(), 90,
                     "the daemon to resume reading")
            assert daemon.alive(), daemon.output()[-3000:]
        time.sleep(2)
        assert writers.commits > 100
    wait_caught_up(db.dsn, slot, daemon, timeout=180)
    assert daemon.alive(), daemon.output()[-3000:]
    assert daemon.stop() == 0
    output = daemon.output()
    assert "RecursionError" not in output and "Traceback" not in output, output[-3000:]
    assert_topic_equals_source(db, servers, topic_prefix)


def test_postgres_connections_cut_mid_stream(tmp_path, db, broker_servers, topic_prefix):
    """The daemon's walsender and catalog connections are terminated twice under writes: it
    reconnects with backoff, takes its slot lock again, and nothing is missing."""
    db.execute(ACCT)
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    cut = (
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND (application_name = 'cdc-catalog' OR backend_type = 'walsender')"
    )
    with Writers(db.dsn, threads=3, keys=300, hot=300) as writers:
        for _ in range(2):
            time.sleep(1.5)
            assert db.fetchall(cut)[0][0] >= 2  # the walsender and the catalog connection
            wait_for(lambda: slot_active(db.dsn, slot), 60, "the daemon to stream again")
        time.sleep(1)
        assert writers.commits > 100
    wait_caught_up(db.dsn, slot, daemon, timeout=120)
    holders = db.fetchall(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objid = hashtext(%s)::oid", (slot,),
    )
    assert holders == [("cdc-catalog",)]  # the slot's lock was taken again on the new connection
    assert daemon.stop() == 0
    output = daemon.output()
    assert "PostgreSQL replication connection lost" in output and "PostgreSQL replication connection back" in output
    assert_topic_equals_source(db, broker_servers, topic_prefix)


class _FailOnce:
    """Loses one record handed to the client while records sent after it succeed, then
    reports it failed: the hazard docs/design.md names (a lone retry of it would land after
    newer versions of its key). Reported as a client reports it: in order on its partition,
    so no later record of that partition counts as acknowledged before the failure shows."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner, self.fail_at, self.sent, self.failed = inner, fail_at, 0, False
        self.lost_tp, self.sent_before = None, 0

    def send(self, topic, key, value):
        self.sent += 1
        if self.sent == self.fail_at:
            self.failed = True
            self.lost_tp = self.inner._place(topic, key)  # counted as sent, as the client takes it, never delivered
            self.sent_before = self.inner.sent[self.lost_tp] - 1
            return
        self.inner.send(topic, key, value)

    def _report(self) -> None:
        if self.failed and (
            self.inner.in_flight() == 1  # everything sent after it is in
            or self.inner.acked.get(self.lost_tp, 0) > self.sent_before  # a later record of its partition is
        ):
            raise ProducerError("injected failure")

    def reached(self, mark):
        self.inner.reached({})
        self._report()
        result = self.inner.reached(mark)  # kafka-python collects acknowledgements here too
        self._report()
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_producer_error_mid_batch_rewinds(tmp_path, db, broker_servers, topic_prefix, client):
    db.execute(ACCT)
    path = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"], topic={"client": client}
    )
    config = cdc_config.load(path, environ={})
    factories = []

    def factory(topic_config, partitions):
        producer = make_producer(topic_config, partitions)
        factories.append(producer)
        return _FailOnce(producer, fail_at=150) if len(factories) == 1 else producer

    daemon = Daemon(config, producer_factory=factory)
    daemon.prepare()
    slot = config.source.slot
    done = threading.Event()

    def load_then_stop() -> None:
        try:
            with Writers(db.dsn, threads=2, keys=100) as writers:
                wait_for(lambda: writers.commits > 600, 60, "writes")
            wait_caught_up(db.dsn, slot, timeout=120)
        finally:
            daemon.stopping = True
            done.set()

    thread = threading.Thread(target=load_then_stop)
    thread.start()
    daemon.run()  # returns at a clean stop; a fatal error raises FatalError
    thread.join()
    assert len(factories) == 2  # the failure dropped the first producer: a rewind, not a lone retry
    # what /metrics shows: exactly one producer error, the one injected
    assert daemon.metrics.registry.get_sample_value("cdc_errors_total", {"kind": "producer"}) == 1
    assert_topic_equals_source(db, broker_servers, topic_prefix)


def test_slot_dropped_underneath_stops_with_the_recovery_steps(tmp_path, db, broker_servers, topic_prefix):
    db.execute(ACCT)
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)

    def drop() -> bool:
        db.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        try:
            db.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        except psycopg.errors.ObjectInUse:  # the daemon reconnected first: try again
            return False
        return True

    wait_for(drop, 30, "the slot to be dropped")
    assert daemon.wait(60) == 1
    out = daemon.output()
    assert f'replication slot "{slot}" does not exist' in out
    assert "were not captured; check [source] slot and publication, then start again with a fresh snapshot" in out
