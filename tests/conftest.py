"""Shared fixtures: one throwaway PostgreSQL cluster and one Apache Kafka broker per session.

Tests stay independent while sharing them: each gets its own database (slots and
all are dropped afterwards) and its own topic prefix. Set
``CDC_TEST_BOOTSTRAP_SERVERS`` to run against an external Kafka instead of the local
one; tests that restart or kill a broker always get a dedicated local one.
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.local.kafka import LocalKafka
from cdc.local.opensearch import LocalOpenSearch
from cdc.local.postgres import LocalPostgres
from cdc.local.redis import LocalRedis
from cdc.local.spark import LocalSparkCluster
from tests import memory_guard, spark_warmup

EXTERNAL_KAFKA_ENV = "CDC_TEST_BOOTSTRAP_SERVERS"

#: Fixtures that start (or reach) a server: a test using any of them, directly or through
#: another fixture, is an integration test. Tests that start servers themselves say so
#: with `@pytest.mark.integration`.
SERVER_FIXTURES = frozenset({"pg", "db", "read_model", "broker", "broker_servers", "local_broker", "eager_broker", "spark_cluster"})


def pytest_configure(config: pytest.Config) -> None:
    # kafka-python 3.0 loads its protocol schemas with importlib.resources APIs that
    # Python 3.11 deprecates: hundreds of warnings per run that are not ours to fix.
    config.addinivalue_line(
        "filterwarnings", "ignore::DeprecationWarning:kafka.protocol.schemas.load_json"
    )
    config.addinivalue_line("filterwarnings", "ignore:open_text is deprecated:DeprecationWarning")
    # every Spark driver of the session, in-process or a process, shares one warm-up (unless
    # the caller chose the drivers' options)
    if spark_warmup.ENV not in os.environ:
        os.environ[spark_warmup.ENV] = spark_warmup.driver_options(spark_warmup.ensure_archive())
    memory_guard.start()  # in each worker too: pytest_configure runs there


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Each test's growth of this process, for the memory guard's report."""
    before = memory_guard.resident_bytes()
    yield
    memory_guard.record(item.nodeid, before, memory_guard.resident_bytes())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tiers by fixture use, so a new test lands in the right one without a marker:
    integration if it needs a server (slow and container tests always do), unit otherwise.
    Unit tests are all in the fast tier; an integration test is there when marked `fast`."""
    for item in items:
        if any(item.get_closest_marker(m) for m in ("integration", "slow", "containers")):
            item.add_marker(pytest.mark.integration)
        elif SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("unit"):
            item.add_marker(pytest.mark.fast)  # the fast tier: every unit test, and the tests marked fast


def _no_server_in_a_unit_test(*_: object, **__: object) -> None:
    raise AssertionError("a unit test started a server: use the pg/db/broker fixtures or mark it integration")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps `pytest -m unit` honest: a server started in-process by a unit test fails it."""
    if request.node.get_closest_marker("unit"):
        monkeypatch.setattr(LocalPostgres, "start", _no_server_in_a_unit_test)
        monkeypatch.setattr(LocalKafka, "start", _no_server_in_a_unit_test)


@pytest.fixture(scope="session")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPostgres]:
    """The session's cluster (wal_level=logical); see postgres.log in its base dir."""
    cluster = LocalPostgres(tmp_path_factory.mktemp("pg"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka | None]:
    """The shared local broker, or None when an external Kafka is configured."""
    if os.environ.get(EXTERNAL_KAFKA_ENV):
        yield None
        return
    with LocalKafka(tmp_path_factory.mktemp("broker")) as local:
        yield local


@pytest.fixture(scope="session")
def broker_servers(broker: LocalKafka | None) -> str:
    """bootstrap.servers of the shared broker (external Kafka or the local one)."""
    external = os.environ.get(EXTERNAL_KAFKA_ENV)
    if external:
        return external
    assert broker is not None
    return broker.bootstrap_servers


@pytest.fixture
def local_broker(tmp_path: Path) -> Iterator[LocalKafka]:
    """A dedicated local broker for this test alone: restart it, kill it, break it."""
    with LocalKafka(tmp_path / "broker") as dedicated:
        yield dedicated


@pytest.fixture(scope="session")
def eager_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A broker whose log cleaner looks for work every half second (the default is 15 s),
    shared by the session like `broker`: its tests compact topics of their own prefix, and
    none restarts or kills it (those take `local_broker`)."""
    with LocalKafka(tmp_path_factory.mktemp("eager-broker"), settings={"log.cleaner.backoff.ms": "500"}) as kafka:
        yield kafka


@pytest.fixture(scope="session")
def opensearch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalOpenSearch]:
    """The session's OpenSearch node, started by the first test that asks for it."""
    with LocalOpenSearch(tmp_path_factory.mktemp("opensearch")) as node:
        yield node


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSparkCluster]:
    """A standalone Spark Master and Worker (pyspark's launcher), shared by the session."""
    with LocalSparkCluster(tmp_path_factory.mktemp("spark-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def _spark_jvm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The session's one driver JVM: its settings, and its session stopped at the end."""
    from pyspark.sql import SparkSession

    from cdc.config import SparkConfig
    from sinks.spark import job_conf

    warehouse = tmp_path_factory.mktemp("spark-warehouse")  # not the checkout, Spark's default
    driver = job_conf(SparkConfig(driver_java_options=os.environ.get(spark_warmup.ENV, "")))
    yield {**driver, "spark.sql.warehouse.dir": str(warehouse)}
    if (session := SparkSession.getActiveSession()) is not None:
        session.stop()


@pytest.fixture(scope="module")
def spark(_spark_jvm: dict[str, str]) -> Any:
    """A local Spark session with the sinks' settings (sinks.spark) in the session's one JVM:
    the live one, or a new one where a module stopped it."""
    from sinks.spark import build_session

    return build_session("cdc-tests", conf=_spark_jvm)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """The session's Redis, started by the first test that asks for it."""
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@dataclass
class TestDatabase:
    """One test's database. Every call opens its own autocommit connection, so each
    statement sees what a new client would (e.g. after ``ALTER DATABASE ... SET``)
    and nothing is left connected to block DROP DATABASE."""

    __test__ = False  # not a test class, despite the name

    name: str
    dsn: str

    def execute(self, query: Any, params: Any = None) -> int:
        """Run one statement; returns the row count."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(query, params).rowcount

    def fetchall(self, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()


def _database_name(test_name: str) -> str:
    """A unique, valid identifier that still says which test made it."""
    base = re.sub(r"[^a-z0-9_]+", "_", test_name.lower()).strip("_")[:40] or "db"
    return f"t_{base}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def db(pg: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[TestDatabase]:
    """A fresh database for this test, dropped afterwards with its replication slots."""
    name = _database_name(request.node.name)
    database = TestDatabase(name=name, dsn=pg.create_database(name))
    try:
        yield database
    finally:
        pg.drop_database(name)


@pytest.fixture
def read_model(pg: LocalPostgres, request: pytest.FixtureRequest) -> Iterator[str]:
    """Another fresh database of the test cluster, for the PostgreSQL read model's tables: its DSN."""
    name = _database_name(f"rm_{request.node.name}")
    try:
        yield pg.create_database(name)
    finally:
        pg.drop_database(name)


@pytest.fixture
def topic_prefix() -> str:
    """A topic prefix no other test uses, so tests sharing a broker never meet."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(autouse=True)
def _sigterm_is_not_left_ignored() -> Iterator[None]:
    """An ignored SIGTERM is inherited by every process this one starts: a JVM server started
    after such a test never stops on SIGTERM, and each stop waits out its grace period."""
    yield
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        pytest.fail("the test left SIGTERM ignored in the test process: restore its handler")


@pytest.fixture(autouse=True)
def _no_daemon_outlives_its_test():
    """A test that fails half-way must not leave its `cdc run` streaming into later tests."""
    yield
    from tests.support import DaemonProcess

    for daemon in DaemonProcess.started:
        if daemon.alive():
            daemon.kill9()
    DaemonProcess.started.clear()


@pytest.fixture
def run_daemon(tmp_path: Path, db: TestDatabase, broker_servers: str, topic_prefix: str):
    """Start `cdc run` on the test's database; returns (daemon, slot). Stopped at teardown."""
    from tests.support import DaemonProcess, slot_of, start_streaming, write_config

    started: list[DaemonProcess] = []

    def start(tables: list[str], **sections: dict) -> tuple[DaemonProcess, str]:
        config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, tables, **sections)
        slot = slot_of(topic_prefix)
        started.append(start_streaming(config, tmp_path / "daemon.log", db.dsn, slot))
        return started[-1], slot

    yield start
    for daemon in started:
        if daemon.alive():
            daemon.stop()
