"""The job around a store, in this process (one Spark session for the module) on the real
Kafka and Redis: what it retries and what stops it, what it sends once, what it says after
it cleared a store. The stores are the cache's own, some with a fault put in on purpose
(a store that goes down, a bug): the failures a job must survive or stop on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from pyspark.sql import SparkSession

from cdc.config import TopicConfig, load
from cdc.kafka.reader import read_topic
from cdc.kafka.topics import TopicAdmin
from cdc.local.redis import LocalRedis
from sinks import runner
from sinks.query import ensure_topics
from sinks.store import SinkStopped, StoreUnavailable
from sinks.stores.cache.store import CacheStore
from tests.support import wait_caught_up, wait_for, write_config


def _captured(tmp_path: Path, db: Any, run_daemon: Any, servers: str, prefix: str, redis_url: str) -> Any:
    """`public.acct` (3 rows) captured by a running daemon; the job's config."""
    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, note text)")
    db.execute("INSERT INTO public.acct VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    path = write_config(tmp_path / "sink.toml", db.dsn, servers, prefix, ["public.*"], cache={"url": redis_url},
                        spark={"checkpoint_dir": str(tmp_path / "checkpoints")})
    config = load(path)
    ensure_topics(config)
    return config


def _cached(url: str, prefix: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    return {k.decode(): orjson.loads(client.get(k)) for k in client.scan_iter(match=f"{prefix}.*", count=1000)}


class _Warnings(logging.Handler):
    """The runner's warnings, as they come; `react` runs in the runner's thread."""

    def __init__(self, react: Any = None) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.react = react

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if self.react is not None:
            self.react(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[_Warnings]:
    handler = _Warnings()
    logger = logging.getLogger("sinks")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_a_bug_stops_the_job_with_its_traceback_instead_of_a_retry_loop(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession, caplog: pytest.LogCaptureFixture,
) -> None:
    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)

    class Buggy(CacheStore):
        def prepare(self, topics: list[str], registry: Any) -> None:
            raise KeyError("a column the code expected")  # a programming error on the driver

    with pytest.raises(SinkStopped) as stopped:
        runner.keep_running(spark, config, Buggy(config.cache, topic_prefix), False, lambda: False)
    assert str(stopped.value) == (
        "the cache sink stopped: 'a column the code expected' (its log has the traceback)"
    )
    failed = [r for r in caplog.records if "a retry cannot cure" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None and failed[0].exc_info[0] is KeyError
    assert not [r for r in caplog.records if "again from the checkpoint" in r.getMessage()]  # never retried


def test_transient_failures_are_retried_with_a_backoff_that_starts_over_after_a_good_batch(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis down three times in a row, then up for a good batch, then down again: the delays
    grow, then start over; every attempt reuses the job's Kafka clients (none leaks per retry)."""
    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    delays: list[float] = []

    def back_off(seconds: float, stop: Any) -> None:
        delays.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(runner, "_back_off", back_off)
    monkeypatch.setattr(runner, "FIRST_DELAY_S", 0.2)
    broker_port = int(broker_servers.rsplit(":", 1)[1])
    stop = threading.Event()
    opens: list[int] = []

    class Flaky(CacheStore):
        good = 0

        def open(self, resumed: bool) -> None:
            opens.append(_sockets_to(broker_port))
            if len(opens) in (1, 2, 3, 5):
                raise StoreUnavailable("Redis at the test's URL: Connection refused")
            super().open(resumed)
            if len(opens) == 6:
                stop.set()

        def save(self, record: dict[str, Any]) -> None:
            if len(opens) == 4 and record["batch"] >= 0:
                self.good += 1
                if self.good == 2:  # the attempt's second batch: one after a good one
                    raise StoreUnavailable("Redis went away")
            super().save(record)

    def write() -> None:  # batches keep coming (each commit moves the daemon's heartbeat)
        n = 100
        while not stop.wait(0.3):
            n += 1
            db.execute("INSERT INTO public.acct VALUES (%s, 'w')", (n,))

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        progress = runner.keep_running(spark, config, Flaky(config.cache, topic_prefix), False, stop.is_set)
    finally:
        stop.set()
        writer.join(10)
    assert delays == [0.2, 0.4, 0.8, 0.2, 0.4]
    assert opens[0] == opens[1] == opens[2] and opens[4] == opens[5], opens  # the same clients each attempt
    assert progress.batches >= 1  # the good one


def test_a_stop_during_a_long_back_off_ends_the_job_at_once(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch, warnings: _Warnings,
) -> None:
    """A store that stays down: the job backs off for a minute and more between attempts.
    SIGTERM (the stop request) in the middle of one ends the job then, not after it."""
    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    monkeypatch.setattr(runner, "FIRST_DELAY_S", 3600.0)
    stop = threading.Event()
    warnings.react = lambda line: stop.set() if "again from the checkpoint in 3600 s" in line else None

    class Down(CacheStore):
        def open(self, resumed: bool) -> None:
            raise StoreUnavailable("Redis at the test's URL: Connection refused")

    ended: list[BaseException] = []

    def job() -> None:
        try:
            runner.keep_running(spark, config, Down(config.cache, topic_prefix), False, stop.is_set)
        except SinkStopped as exc:
            ended.append(exc)

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    thread.join(120)  # the back-off alone would take an hour
    assert not thread.is_alive()
    assert [str(e) for e in ended] == ["the cache sink failed 2 times, last: Redis at the test's URL: Connection refused"]


def _sockets_to(port: int) -> int:
    """This process's established TCP connections to `port` (kafka-python's clients live here;
    Spark's JVM, a process of its own, does not count)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and fields[9] in inodes and int(fields[2].rsplit(":", 1)[1], 16) == port:
                found += 1
    return found


def test_a_version_not_there_yet_fails_the_batch_once_instead_of_dead_letters(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession, warnings: _Warnings,
) -> None:
    """The daemon sends a table's version to another topic than its events, without waiting:
    a job may read an event before its version. It reads the batch again first."""
    from kafka import KafkaProducer

    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    topics = TopicConfig(bootstrap_servers=broker_servers)
    schemas = f"{topic_prefix}.__cdc_schemas"
    (version,) = [r for r in read_topic(topics, schemas) if r.value is not None]
    event = next(r for r in read_topic(topics, f"{topic_prefix}.public.acct") if r.value is not None)
    late = f"{topic_prefix}.public.late"
    admin = TopicAdmin(config.topic)  # the late table's topic, as the daemon creates it
    admin.ensure([late], 3)
    admin.close()
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    producer.send(late, key=event.key, value=event.value)
    producer.flush()

    def publish_the_version(line: str) -> None:
        if "no table version for" in line:
            shape = {**orjson.loads(version.value), "topic": late, "table": "late"}
            producer.send(schemas, key=orjson.dumps({"topic": late, "from": shape["from"]}), value=orjson.dumps(shape))
            producer.flush()

    warnings.react = publish_the_version
    progress = runner.keep_running(spark, config, CacheStore(config.cache, topic_prefix), True, lambda: False)
    producer.close()
    assert [line for line in warnings.lines if "no table version" in line] == [
        f"sink cache: batch failed (no table version for {late} in {schemas} yet: the batch is read again); again "
        "from the checkpoint in 1 s"
    ]
    assert progress.dead_letters == 0
    cached = _cached(redis_server.url, topic_prefix)
    assert cached[f"{late}:{event.key.decode()}"] == orjson.loads(event.value)["after"]


def test_dead_letters_go_out_once_when_their_batch_is_read_again(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession,
) -> None:
    from kafka import KafkaProducer

    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    producer.send(f"{topic_prefix}.public.acct", key=b'{"id":9}', value=b"not json at all")
    producer.flush()
    producer.close()
    failed = []

    class LosesTheBatch(CacheStore):
        """The batch's bookkeeping cannot be written once, after its dead letters went out."""

        def save(self, record: dict[str, Any]) -> None:
            if record["letters"] >= 0 and record["batch"] == record["letters"] and not failed:
                failed.append(record["batch"])
                raise StoreUnavailable("Redis did not answer")
            super().save(record)

    progress = runner.keep_running(spark, config, LosesTheBatch(config.cache, topic_prefix), True, lambda: False)
    letters = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), f"{topic_prefix}.__cdc_dlq"))
    assert failed and [r.key for r in letters] == [b'{"id":9}']
    assert progress.dead_letters == 1


def test_a_cleared_store_is_complete_up_to_nothing_until_the_replay_says_more(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession,
) -> None:
    from sinks.topics import ProgressLog

    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    store = CacheStore(config.cache, topic_prefix)
    runner.keep_running(spark, config, store, True, lambda: False)
    redis.Redis.from_url(redis_server.url).flushdb()  # a Redis that restarted without its data

    said: list[int] = []
    send = ProgressLog.send

    def record(self: ProgressLog, progress: dict[str, Any]) -> None:
        said.append(int(progress["complete_lsn"]))
        send(self, progress)

    ProgressLog.send = record  # type: ignore[method-assign]
    try:
        runner.keep_running(spark, config, store, True, lambda: False)
    finally:
        ProgressLog.send = send  # type: ignore[method-assign]
    assert said[0] == 0  # what `cdc status` reads while the cache is refilled
    assert {row["id"] for row in _cached(redis_server.url, topic_prefix).values()} == {1, 2, 3}


def test_a_table_that_fails_leaves_the_other_tables_rows_to_their_threads(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, spark: SparkSession,
) -> None:
    """Tables are written in parallel threads; the batch's stored rows are freed only after
    every thread is done with them, also when one table failed early."""
    from sinks.stores.delta.store import DeltaStore

    db.execute("CREATE TABLE public.a (id int PRIMARY KEY)")
    db.execute("CREATE TABLE public.b (id int PRIMARY KEY)")
    db.execute("INSERT INTO public.a SELECT generate_series(1, 10)")
    db.execute("INSERT INTO public.b SELECT generate_series(1, 500)")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    path = write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                        delta={"path": str(tmp_path / "warehouse")},
                        spark={"checkpoint_dir": str(tmp_path / "checkpoints")})
    config = load(path)
    ensure_topics(config)
    read: dict[str, Any] = {}

    class OneTableFails(DeltaStore):
        def steps(self) -> tuple[Any, ...]:
            def step(batch: Any) -> None:
                if batch.table == "a":
                    raise RuntimeError("table a failed")  # at once: b's thread is still at work
                time.sleep(3)
                try:
                    read[batch.table] = batch.rows.count()
                except Exception as exc:  # noqa: BLE001 (what the thread met is the assertion)
                    read[batch.table] = str(exc).splitlines()[0]

            return (step,)

    with pytest.raises(SinkStopped, match="table a failed"):
        runner.keep_running(spark, config, OneTableFails(spark, str(tmp_path / "warehouse")), True, lambda: False)
    assert read == {"b": 500}


def test_a_store_that_cannot_be_cleared_yet_is_cleared_on_a_later_attempt(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store found lost is cleared before the replay; a clear the store refuses for now (it is
    still coming back) is tried again after the backoff, not the end of the job."""
    monkeypatch.setattr(runner, "FIRST_DELAY_S", 0.2)
    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    runner.keep_running(spark, config, CacheStore(config.cache, topic_prefix), True, lambda: False)
    redis.Redis.from_url(redis_server.url).flushdb()  # a Redis that restarted without its data
    refusals = iter([True, True])

    class SlowToComeBack(CacheStore):
        def clear(self) -> None:
            if next(refusals, False):
                raise StoreUnavailable("Redis is loading the dataset in memory")
            super().clear()

    runner.keep_running(spark, config, SlowToComeBack(config.cache, topic_prefix), True, lambda: False)
    assert next(refusals, None) is None  # both refusals were met
    assert {row["id"] for row in _cached(redis_server.url, topic_prefix).values()} == {1, 2, 3}


def test_a_job_with_nothing_new_to_read_is_complete_up_to_the_newest_heartbeat_once_it_looks(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession,
) -> None:
    """A job started again after it read everything, or a `--once` run that starts right after
    the writes, reads no batch with the newest heartbeat: between batches it looks, and every
    record below that heartbeat is within the offsets its checkpoint committed, so the store
    is complete up to it (else `cdc verify` waits for a sink that already stopped, and `cdc
    status` shows it behind). A table topic that grew since keeps it where it was."""
    from kafka import KafkaProducer

    from cdc.kafka.heartbeat import heartbeat_record, newest_heartbeat
    from sinks.pipeline import SinkJob
    from sinks.progress import read_progress

    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    before = runner.keep_running(spark, config, CacheStore(config.cache, topic_prefix), True, lambda: False)
    sender = KafkaProducer(bootstrap_servers=broker_servers)

    def beat(lsn: int) -> None:
        record = heartbeat_record(topic_prefix, config.source.slot, lsn)
        sender.send(record.topic, key=record.key, value=record.value).get(30)

    newer = max(before.complete_lsn, newest_heartbeat(config.topic)) + 1000
    beat(newer)
    job = SinkJob(spark, config, CacheStore(config.cache, topic_prefix))
    try:
        job.begin(runner.checkpoint(config, "cache"))
        job.look()
        assert job.progress.complete_lsn == newer
        assert read_progress(config.topic)["cache"]["complete_lsn"] == str(newer)  # what `cdc status` reads
        sender.send(f"{topic_prefix}.public.acct", key=b'{"id":4}', value=b"{}").get(30)  # not read by the job
        beat(newer + 1000)
        job.look()
        assert job.progress.complete_lsn == newer
    finally:
        job.close()
        sender.close()


@pytest.mark.fast
def test_a_drained_job_says_how_complete_its_store_is_in_its_progress_its_metrics_and_as_it_stops(
    tmp_path: Path, db: Any, run_daemon: Any, broker_servers: str, topic_prefix: str, redis_server: LocalRedis,
    spark: SparkSession,
) -> None:
    """A source idle after its snapshot: the streaming job's first batch reads every snapshot
    row and the daemon's heartbeat, and nothing comes after. That batch's progress record,
    the job's metric and what it says as it stops (the last line of `cdc sink`) name the
    heartbeat's LSN, not 0/0; the job started again says the same before any batch."""
    from cdc.kafka.heartbeat import newest_heartbeat
    from sinks.metrics import SinkMetrics
    from sinks.pipeline import SinkJob
    from sinks.topics import ProgressLog

    config = _captured(tmp_path, db, run_daemon, broker_servers, topic_prefix, redis_server.url)
    heartbeat = wait_for(lambda: newest_heartbeat(config.topic), 60, "the daemon's first heartbeat")
    stop = threading.Event()
    said: list[int] = []
    send = ProgressLog.send

    def record(self: ProgressLog, progress: dict[str, Any]) -> None:
        said.append(int(progress["complete_lsn"]))
        send(self, progress)
        stop.set()  # SIGTERM right after the first batch

    metrics = SinkMetrics("cache", config)
    ProgressLog.send = record  # type: ignore[method-assign]
    try:
        progress = runner.keep_running(spark, config, CacheStore(config.cache, topic_prefix), False, stop.is_set,
                                       metrics)
    finally:
        ProgressLog.send = send  # type: ignore[method-assign]
    assert progress.records == 3
    assert said[0] >= heartbeat > 0
    assert progress.complete_lsn >= heartbeat
    complete = metrics.registry.get_sample_value
    assert complete("cdc_sink_complete_lsn", {"store": "cache"}) == progress.complete_lsn
    again = SinkMetrics("cache", config)
    job = SinkJob(spark, config, CacheStore(config.cache, topic_prefix), metrics=again)
    job.close()
    assert again.registry.get_sample_value("cdc_sink_complete_lsn", {"store": "cache"}) == progress.complete_lsn


def test_a_command_run_in_a_process_with_a_session_leaves_that_session_running(spark: SparkSession) -> None:
    """A sink job, a rebuild or `cdc delta ...` run where the process has its session already
    (a notebook, an embedding program, these tests) works in it and leaves it running."""
    from cdc.config import SparkConfig
    from sinks.spark import job_session

    with job_session("cdc-inside", SparkConfig()) as session:
        assert session is spark
    assert spark.range(3).count() == 3
