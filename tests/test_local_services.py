"""The throwaway services themselves: if these fail, every end-to-end test would mislead."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from cdc.local.kafka import LocalKafka
from cdc.local.opensearch import LocalOpenSearch
from cdc.local.postgres import LocalPostgres
from cdc.local.process import QUICK_JIT, GroupProcess, ServerProcess

# --------------------------------------------------------------------------- PostgreSQL


def test_cluster_is_logical_and_accepts_replication_connections(pg: LocalPostgres, db) -> None:
    settings = dict(
        db.fetchall(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('wal_level', 'max_replication_slots', 'max_wal_senders', 'listen_addresses')"
        )
    )
    assert settings == {
        "wal_level": "logical",
        "max_replication_slots": "20",
        "max_wal_senders": "20",
        "listen_addresses": "127.0.0.1",
    }
    with psycopg.connect(db.dsn + " replication=database", autocommit=True) as conn:
        system_id, timeline, xlogpos, dbname = conn.execute("IDENTIFY_SYSTEM").fetchone()
        assert dbname == db.name and timeline == 1 and "/" in xlogpos
        slot = conn.execute(
            "CREATE_REPLICATION_SLOT s_check TEMPORARY LOGICAL pgoutput (SNAPSHOT 'nothing')"
        ).fetchone()
        assert slot[0] == "s_check" and slot[3] == "pgoutput"


def test_drop_database_frees_a_slot_held_by_a_live_walsender(pg: LocalPostgres) -> None:
    """The `db` fixture's teardown: a test may end while its walsender still streams."""
    name = "t_drop_" + uuid.uuid4().hex[:8]
    dsn = pg.create_database(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION p FOR ALL TABLES")
    repl = psycopg.connect(dsn + " replication=database", autocommit=True)
    _, lsn, _, _ = repl.execute("CREATE_REPLICATION_SLOT s LOGICAL pgoutput").fetchone()
    repl.pgconn.send_query(
        f"START_REPLICATION SLOT s LOGICAL {lsn} (proto_version '1', publication_names 'p')".encode()
    )
    result = repl.pgconn.get_result()
    assert result is not None and result.status == psycopg.pq.ExecStatus.COPY_BOTH
    # Streaming now; nothing reads it. (Not a thread blocked in get_copy_data(0):
    # psycopg's binary libpq wrapper holds the GIL while it blocks.)

    try:
        active = pg_rows(pg, "SELECT active FROM pg_replication_slots WHERE slot_name = 's'")
        assert active == [(True,)]
        pg.drop_database(name)
        assert pg_rows(pg, "SELECT 1 FROM pg_replication_slots WHERE slot_name = 's'") == []
        assert pg_rows(pg, "SELECT 1 FROM pg_database WHERE datname = %s", (name,)) == []
    finally:
        repl.close()


def pg_rows(pg: LocalPostgres, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


@pytest.mark.integration
def test_dedicated_cluster_restarts_with_its_data_and_settings(tmp_path: Path) -> None:
    cluster = LocalPostgres(tmp_path / "pg", settings={"fsync": "on", "max_wal_senders": "7"})
    try:
        assert cluster.start() is cluster and cluster.running
        dsn = cluster.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)")
        port = cluster.port
        cluster.restart()
        assert cluster.port == port
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (2,)
            assert conn.execute("SHOW fsync").fetchone() == ("on",)
            assert conn.execute("SHOW max_wal_senders").fetchone() == ("7",)
            assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        cluster.stop()
        cluster.stop()  # idempotent
        assert not cluster.running
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn, connect_timeout=2)
        assert (tmp_path / "pg" / "postgres.log").stat().st_size > 0
    finally:
        cluster.close()


# --------------------------------------------------------------------------- Kafka broker


def test_broker_is_apache_kafka_with_the_log_cleaner_on(broker: LocalKafka | None, broker_servers: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=broker_servers)
    try:
        cluster = admin.describe_cluster()
        (node,) = cluster["brokers"]
        described = admin.describe_configs(
            [ConfigResource(ConfigResourceType.BROKER, str(node["broker_id"]))], config_filter="all"
        )
    finally:
        admin.close()
    configs = {k: v["value"] for k, v in described["broker"][str(node["broker_id"])].items()}
    assert configs["log.cleaner.enable"] == "true"
    assert configs["process.roles"] == "broker,controller"  # KRaft: no ZooKeeper
    if broker is not None:
        assert broker.running and "Kafka Server started" in broker.log_path.read_text()


def java_command_lines(group: int) -> list[list[str]]:
    """The command lines of the `java` processes in a process group (a server's JVMs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if stat[stat.index("(") + 1:stat.rindex(")")] == "java" and int(stat.rsplit(")", 1)[1].split()[2]) == group:
            found.append([arg.decode() for arg in argv])
    return found


def test_throwaway_jvms_run_c1_only_and_a_bench_gets_the_full_jit(
    broker: LocalKafka | None, opensearch: LocalOpenSearch, tmp_path: Path
) -> None:
    servers = [opensearch] if broker is None else [broker, opensearch]
    for server in servers:
        assert server.pid is not None
        (argv,) = java_command_lines(server.pid)
        assert all(flag in argv for flag in QUICK_JIT.split()), argv
    assert all(flag in LocalKafka(tmp_path)._java("kafka.Kafka") for flag in QUICK_JIT.split())
    assert not {"-XX:TieredStopAtLevel=1"} & set(LocalKafka(tmp_path, full_jit=True)._java("kafka.Kafka"))


def topic_config(admin: KafkaAdminClient, topic: str) -> dict[str, str]:
    """describe_configs as {name: value}, from kafka-python 3 (dicts) or 2 (responses)."""
    described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    if isinstance(described, dict):
        return {k: v["value"] for k, v in described["topic"][topic].items()}
    entries = described[0].resources[0][4]
    return {entry[0]: entry[1] for entry in entries}


def consume_all(servers: str, topic: str, partitions: int, timeout: float = 20) -> list[Any]:
    """Every record of `topic` up to its end offsets (read once, at the start)."""
    consumer = KafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        records: list[Any] = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < end[tp] for tp in tps):
            assert time.monotonic() < deadline, f"read {len(records)} records of {end}"
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def create_compacted_topic(servers: str, topic: str, partitions: int = 3) -> None:
    admin = KafkaAdminClient(bootstrap_servers=servers)
    try:
        admin.create_topics(
            [NewTopic(topic, partitions, 1, topic_configs={"cleanup.policy": "compact"})]
        )
        deadline = time.monotonic() + 20
        while topic_config(admin, topic).get("cleanup.policy") != "compact":
            assert time.monotonic() < deadline, topic_config(admin, topic)
            time.sleep(0.2)
    finally:
        admin.close()


def test_broker_round_trips_a_record_and_keeps_compact_config(
    broker_servers: str, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.public.items"
    create_compacted_topic(broker_servers, topic)
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    try:
        producer.send(topic, key=b"k1", value=b"v1", headers=[("h", b"1")], partition=1).get(30)
        producer.send(topic, key=b"k1", value=None, partition=1).get(30)  # tombstone
    finally:
        producer.close()
    records = consume_all(broker_servers, topic, 3)
    assert [(r.partition, r.key, r.value) for r in records] == [(1, b"k1", b"v1"), (1, b"k1", None)]
    assert list(records[0].headers) == [("h", b"1")]


def test_broker_kill_9_keeps_acknowledged_records_and_configs(
    local_broker: LocalKafka, topic_prefix: str
) -> None:
    servers = local_broker.bootstrap_servers
    topic = f"{topic_prefix}.public.kept"
    create_compacted_topic(servers, topic, partitions=2)
    producer = KafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=5)
    try:
        futures = [producer.send(topic, key=b"%d" % i, value=b"v%d" % i) for i in range(500)]
        producer.flush()
        assert all(f.get(30) for f in futures)
    finally:
        producer.close()
    local_broker.kill9()  # no shutdown hook: what acks=all acknowledged must survive anyway
    local_broker.start()
    assert local_broker.bootstrap_servers == servers and local_broker.running
    records = consume_all(servers, topic, 2)
    assert sorted(r.key for r in records) == sorted(b"%d" % i for i in range(500))
    admin = KafkaAdminClient(bootstrap_servers=servers)
    try:
        assert topic_config(admin, topic)["cleanup.policy"] == "compact"
    finally:
        admin.close()


def test_two_brokers_side_by_side_and_a_taken_port_fails_clearly(
    local_broker: LocalKafka, tmp_path: Path
) -> None:
    """Each broker also binds its own controller port; two must coexist."""
    with LocalKafka(tmp_path / "second") as second:
        assert second.port != local_broker.port
        admin = KafkaAdminClient(bootstrap_servers=second.bootstrap_servers)
        admin.close()
    assert not second.running
    clash = LocalKafka(tmp_path / "clash", port=local_broker.port)
    with pytest.raises(RuntimeError, match="already in use") as info:
        clash.start()
    assert "\n" not in str(info.value)
    assert local_broker.running


class _Stubborn(ServerProcess):
    """A server that ignores SIGTERM, as a JVM whose shutdown hangs does, and answers
    SIGQUIT by writing its threads to its log, as a JVM does."""

    NAME = "stubborn"
    STOP_GRACE_S = 0.5
    STOP_DUMP = signal.SIGQUIT
    SCRIPT = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGQUIT, lambda *_: print('thread dump', flush=True))\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = 0

    def _launch(self) -> GroupProcess:
        return GroupProcess([sys.executable, "-c", self.SCRIPT], self.data_dir / "stubborn.log", cwd=self.data_dir)

    def _ready(self) -> bool:
        return self._proc is not None and self._proc.logged(r"\bup\b")

    def _ports(self) -> list[int]:
        return []


def test_a_server_that_ignores_sigterm_is_killed_after_its_grace_with_why_in_its_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = _Stubborn(tmp_path).start()
    pid = server.pid
    assert pid is not None
    server.stop()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert "thread dump" in (tmp_path / "stubborn.log").read_text()
    assert [r.getMessage() for r in caplog.records] == [
        f"stubborn (pid {pid}) did not stop within 0.5 s of SIGTERM: killed; its log: {tmp_path / 'stubborn.log'}"
    ]
