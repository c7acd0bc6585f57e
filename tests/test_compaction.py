"""Apache Kafka's log cleaner on cdc's topics: superseded records and, after
`delete.retention.ms`, tombstones are gone, and the topic still reads as the source table."""

from __future__ import annotations

import random
import re
import string
import threading
import time
import uuid
from collections import Counter

import orjson
import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kafka.admin import KafkaAdminClient, NewTopic

from cdc.config import TopicConfig
from cdc.events.records import TRUNCATE_KEY
from cdc.kafka.reader import TopicRecord, read_topic
from cdc.kafka.topics import TopicAdmin
from cdc.naming import topic_name
from compaction.table import build
from tests.support import (
    ACCT,
    EAGER_COMPACTION,
    DaemonProcess,
    cdc,
    cdc_here,
    slot_of,
    source_table,
    start_streaming,
    wait_caught_up,
    wait_for,
    write_config,
)


def _apply_stores(config) -> None:
    """Each store's job, `--once`, in this process (the stores' live jobs)."""
    from sinks import stores
    from sinks.query import ensure_topics
    from sinks.runner import check, keep_running
    from sinks.spark import job_session

    with job_session("test-compaction-stores", config.spark) as spark:
        for store in ("cache", "search", "delta"):
            check(config, store)
            ensure_topics(config)
            keep_running(spark, config, stores.build(store, spark, config), True, lambda: False)


def test_log_cleaner_compacts_cdc_topics_to_the_source_table(
    tmp_path, db, eager_broker, topic_prefix, opensearch, monkeypatch
):
    """Superseded records, deleted rows and, after the daemon's truncate clean-up, the rows a
    truncate removed all leave the topic; tombstones go after delete.retention.ms. Every store,
    filled before the cleaner ran and rebuilt from the topic after it (`cdc search|cache|delta
    rebuild`), equals the source (`cdc verify`)."""
    from cdc.config import load
    from cdc.local.redis import LocalRedis

    monkeypatch.chdir(tmp_path)  # Spark's spark-warehouse/ lands in the cwd
    servers = eager_broker.bootstrap_servers
    topic = topic_name(topic_prefix, "public", "acct")
    admin = KafkaAdminClient(bootstrap_servers=servers)
    try:  # made ahead with eager settings; cdc accepts an existing compacted topic as it is
        admin.create_topics([NewTopic(topic, 3, 1, topic_configs=EAGER_COMPACTION)])
    finally:
        admin.close()
    db.execute(ACCT)
    config = write_config(tmp_path / "cdc.toml", db.dsn, servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)

    db.execute("INSERT INTO public.acct SELECT g, 1, 'new' FROM generate_series(0, 59) g")
    for _ in range(10):
        db.execute("UPDATE public.acct SET version = version + 1, note = md5(random()::text)")
    db.execute("DELETE FROM public.acct WHERE id < 20")
    with psycopg.connect(db.dsn, autocommit=True) as conn, conn.transaction():  # rows before and after a truncate
        conn.execute("INSERT INTO public.acct SELECT g, 1, 'gone' FROM generate_series(100, 104) g")
        conn.execute("TRUNCATE public.acct")
        conn.execute("INSERT INTO public.acct SELECT g, 1, 'again' FROM generate_series(20, 29) g")
    wait_caught_up(db.dsn, slot, daemon)
    wait_for(lambda: "truncate clean-up of public.acct: 35 tombstones" in daemon.output(), 60, "the truncate clean-up")
    redis_server = LocalRedis(tmp_path / "redis").start()  # its own: a cache rebuild swaps whole databases
    stores = load(write_config(
        tmp_path / "stores.toml", db.dsn, servers, topic_prefix, ["public.acct"],
        spark={"checkpoint_dir": str(tmp_path / "checkpoints")}, delta={"path": str(tmp_path / "warehouse")},
        search={"url": opensearch.url, "replicas": 0}, cache={"url": redis_server.url},
    ))
    _apply_stores(stores)  # before the cleaner: from the whole log
    written = 60 * 11 + 20 * 2 + 5 + 1 + 10  # inserts, updates, deletes (a d and a tombstone), the transaction
    gone = {orjson.dumps({"id": i}) for i in (*range(20), *range(30, 60), *range(100, 105))}

    def compacted() -> bool:
        # Keep writing to the live keys: segments roll only when a record arrives after segment.ms.
        db.execute("UPDATE public.acct SET version = version + 1")
        wait_caught_up(db.dsn, slot, daemon)
        records = list(read_topic(TopicConfig(bootstrap_servers=servers), topic))
        per_key = Counter(r.key for r in records)
        return not gone & per_key.keys() and len(records) < written / 4

    wait_for(compacted, 180, "the log cleaner to drop superseded records, deleted and truncated rows", poll=1.5)
    records = list(read_topic(TopicConfig(bootstrap_servers=servers), topic))
    ends: dict[int, int] = {}
    for r in records:
        ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
    assert sum(ends.values()) >= written  # offsets keep counting: compaction leaves gaps behind
    assert all(r.value is not None for r in records)  # no tombstone left: their retention passed
    assert sorted(orjson.loads(r.key) for r in records if r.key == TRUNCATE_KEY) == ["__truncate__"]  # the newest
    table = build(records)
    assert table.order_violations() == []
    assert table.state() == source_table(db.dsn, "SELECT id, version, note FROM public.acct")
    assert len(table.state()) == 10

    # every store rebuilt from the compacted topic, its live job going on after; then verify
    stores_path = str(tmp_path / "stores.toml")
    try:
        for store in ("search", "cache", "delta"):
            done = cdc_here(store, "rebuild", "--config", stores_path)
            assert done.returncode == 0, done.stderr[-3000:]
        _apply_stores(stores)
        result = cdc_here("verify", "--config", stores_path)
    finally:
        redis_server.stop()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert [line.split()[0] for line in result.stdout.splitlines()[1:-1]] == [
        "public.acct:", "topic", "delta", "search", "cache"]
    assert daemon.stop() == 0


@pytest.mark.fast
def test_truncate_clean_up_never_deletes_a_row_written_again_meanwhile(tmp_path, db, broker_servers, topic_prefix):
    """Writers insert the truncated keys again while the daemon reads the topic for its clean-up
    and sends the tombstones: a tombstone landing after a newer record of its key would delete a
    live row. The topic read as a table still equals the source, and every other truncated key
    got its tombstone; `cdc topics clean-truncated` afterwards (asked through the daemon) finds
    nothing left to do."""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(0, 5999) g")
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    stop = threading.Event()

    def rewrite(seed: int) -> None:  # the truncated keys, inserted again one by one
        rng = random.Random(seed)
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(
                    "INSERT INTO public.acct VALUES (%s, 1, 'again') ON CONFLICT (id) DO UPDATE SET version = acct.version + 1",
                    (rng.randrange(6000),),
                )

    writers = [threading.Thread(target=rewrite, args=(i,)) for i in range(2)]
    for w in writers:
        w.start()
    try:
        time.sleep(0.5)
        db.execute("TRUNCATE public.acct")
        wait_for(lambda: "truncate clean-up of public.acct:" in daemon.output(), 60, "the truncate clean-up")
        time.sleep(0.5)
    finally:
        stop.set()
        for w in writers:
            w.join(30)
    wait_caught_up(db.dsn, slot, daemon)
    found = re.search(r"truncate clean-up of public\.acct: (\d+) tombstones", daemon.output())
    records = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), topic_name(topic_prefix, "public", "acct")))
    source = source_table(db.dsn, "SELECT id, version, note FROM public.acct")
    with build(records) as table:
        assert table.state() == source  # no live row lost to a tombstone
        assert table.order_violations() == []
        assert list(table.keys_older_than_truncate()) == []  # every truncated row has its tombstone
    assert found is not None and 0 < int(found[1]) < 6000  # some keys were written again before their tombstone
    assert "requested a truncate clean-up of public.acct" in cdc("topics", "clean-truncated", "--config", str(config)).stdout
    wait_for(lambda: daemon.output().count("truncate clean-up of public.acct:") == 2, 60, "the requested clean-up")
    assert "truncate clean-up of public.acct: 0 tombstones" in daemon.output()
    assert daemon.stop() == 0


# -- compaction safety, as a property: cdc's real records, Kafka's compaction rule -----------

BIG = 4000  # characters of an incompressible text column stored out of line (TOAST)
TABLE_DDL = """
CREATE TABLE public.{name} (id int PRIMARY KEY, v int NOT NULL, big text, note text);
ALTER TABLE public.{name} ALTER COLUMN big SET STORAGE EXTERNAL;
ALTER TABLE public.{name} REPLICA IDENTITY {identity};
"""
IDENTITIES = {"toast_default": "DEFAULT", "toast_full": "FULL"}


def kafka_compaction(records: list[TopicRecord], cleaned: float) -> list[TopicRecord]:
    """Kafka's cleaner over the first `cleaned` share of each partition (the segments it reached;
    the active segment is never cleaned): there only the highest offset of each key stays, and
    a tombstone left last goes too once delete.retention.ms passed (here: all of them)."""
    out: list[TopicRecord] = []
    for partition in sorted({r.partition for r in records}):
        ordered = sorted((r for r in records if r.partition == partition), key=lambda r: r.offset)
        cut = int(len(ordered) * cleaned)
        head, tail = ordered[:cut], ordered[cut:]
        last = {r.key: r.offset for r in head}
        out += [r for r in head if last[r.key] == r.offset and r.value is not None] + tail
    return out


@pytest.fixture(scope="module")
def toast_pipeline(pg, broker_servers, tmp_path_factory):
    """One database, one daemon, two tables (REPLICA IDENTITY DEFAULT and FULL), shared by the
    property's examples; each example starts with a truncate of both."""
    name = f"t_compaction_property_{uuid.uuid4().hex[:8]}"
    dsn = pg.create_database(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table, identity in IDENTITIES.items():
            conn.execute(TABLE_DDL.format(name=table, identity=identity))
    prefix = "t" + uuid.uuid4().hex[:12]
    tmp = tmp_path_factory.mktemp("toast")
    config = write_config(tmp / "cdc.toml", dsn, broker_servers, prefix, ["public.toast_default", "public.toast_full"])
    daemon = start_streaming(config, tmp / "daemon.log", dsn, slot_of(prefix))
    DaemonProcess.started.remove(daemon)  # the module's, not one test's (conftest kills those after each test)
    try:
        yield dsn, prefix, daemon, broker_servers
    finally:
        daemon.stop()
        pg.drop_database(name)


KEYS = st.integers(0, 7)
OPS = st.one_of(
    st.tuples(st.just("insert"), KEYS, st.booleans()),  # with a TOASTed value or a NULL one
    st.tuples(st.just("update"), KEYS),  # leaves the TOASTed value unchanged
    st.tuples(st.just("rewrite"), KEYS),  # a new TOASTed value
    st.tuples(st.just("delete"), KEYS),
    st.tuples(st.just("rekey"), KEYS, KEYS),  # a primary-key change
    st.tuples(st.just("truncate")),
    st.tuples(st.just("truncate_in_txn"), KEYS, KEYS),  # BEGIN; INSERT; TRUNCATE; INSERT; COMMIT
)


def _big(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=BIG))


def _apply(conn: psycopg.Connection, table: str, op: tuple, rng: random.Random) -> None:
    kind, *args = op
    t = f"public.{table}"
    if kind == "insert":
        conn.execute(f"INSERT INTO {t} VALUES (%s, 0, %s, 'i') ON CONFLICT DO NOTHING", (args[0], _big(rng) if args[1] else None))
    elif kind == "update":
        conn.execute(f"UPDATE {t} SET v = v + 1, note = 'u' || v WHERE id = %s", (args[0],))
    elif kind == "rewrite":
        conn.execute(f"UPDATE {t} SET big = %s WHERE id = %s", (_big(rng), args[0]))
    elif kind == "delete":
        conn.execute(f"DELETE FROM {t} WHERE id = %s", (args[0],))
    elif kind == "rekey":
        conn.execute(f"UPDATE {t} SET id = %s WHERE id = %s AND NOT EXISTS (SELECT 1 FROM {t} WHERE id = %s)",
                     (args[1] + 100, args[0], args[1] + 100))
    elif kind == "truncate":
        conn.execute(f"TRUNCATE {t}")
    else:
        with conn.transaction():
            conn.execute(f"INSERT INTO {t} VALUES (%s, 0, %s, 'x') ON CONFLICT DO NOTHING", (args[0], _big(rng)))
            conn.execute(f"TRUNCATE {t}")
            conn.execute(f"INSERT INTO {t} VALUES (%s, 0, %s, 'y')", (args[1], _big(rng)))


def _without(rows: dict[bytes, dict], unresolved: dict[bytes, tuple[str, ...]]) -> dict[bytes, dict]:
    return {k: {c: v for c, v in row.items() if c not in unresolved.get(k, ())} for k, row in rows.items()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(  # an unchanged TOASTed value after its row's insert was cleaned away: filled, then reported
    workload=[("toast_default", ("insert", 1, True)), ("toast_default", ("update", 1)), ("toast_full", ("insert", 1, True)),
              ("toast_full", ("update", 1)), ("toast_default", ("update", 1))],
    cleaned=1.0, seed=1,
)
@example(  # a key change of a row with a TOASTed value, a truncate between inserts of one transaction
    workload=[("toast_default", ("insert", 2, True)), ("toast_default", ("rekey", 2, 3)), ("toast_full", ("insert", 2, True)),
              ("toast_full", ("rekey", 2, 3)), ("toast_full", ("truncate_in_txn", 4, 5))],
    cleaned=0.0, seed=2,
)
@given(workload=st.lists(st.tuples(st.sampled_from(sorted(IDENTITIES)), OPS), max_size=14),
       cleaned=st.sampled_from([0.0, 0.3, 0.7, 1.0]), seed=st.integers(0, 2**32))
def test_the_compacted_log_reads_as_the_source_table(toast_pipeline, workload, cleaned, seed) -> None:
    dsn, prefix, daemon, servers = toast_pipeline
    rng = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in IDENTITIES:
            conn.execute(f"TRUNCATE public.{table}")
        for table, op in workload:
            _apply(conn, table, op, rng)
    wait_caught_up(dsn, slot_of(prefix), daemon)
    for table, identity in IDENTITIES.items():
        source = source_table(dsn, f"SELECT id, v, big, note FROM public.{table}")
        records = list(read_topic(TopicConfig(bootstrap_servers=servers), topic_name(prefix, "public", table)))
        for log in (records, kafka_compaction(records, cleaned)):
            with build(log) as read:
                assert read.order_violations() == []
                got, unresolved = read.state(), read.unresolved()
                # an unchanged TOASTed value the log cannot fill is reported, never a value; under FULL there is none
                assert set(got) == set(source)
                assert all(set(columns) == {"big"} for columns in unresolved.values())
                assert identity == "DEFAULT" or unresolved == {}
                assert all(got[k]["big"] is None for k in unresolved)
                if log is records:  # every record there: only a key changed to (id >= 100) has no earlier value
                    assert all(orjson.loads(k)["id"] >= 100 for k in unresolved)
                assert _without(got, unresolved) == _without(source, unresolved)


def test_both_clients_read_a_topic_alike(db, run_daemon, broker_servers, topic_prefix) -> None:
    """The topic reader with kafka-python and with confluent-kafka: the same records, from
    offset 0 and from given offsets, and the same end offsets to go on from."""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'n' FROM generate_series(1, 300) g")
    daemon, slot = run_daemon(["public.acct"])
    db.execute("DELETE FROM public.acct WHERE id % 3 = 0")
    wait_caught_up(db.dsn, slot, daemon)
    topic = topic_name(topic_prefix, "public", "acct")
    seen = {}
    for client in ("kafka-python", "confluent"):
        config = TopicConfig(bootstrap_servers=broker_servers, client=client)
        ends: dict[int, int] = {}
        records = sorted(read_topic(config, topic, ends=ends), key=lambda r: (r.partition, r.offset))
        later = sorted(read_topic(config, topic, start={p: o // 2 for p, o in ends.items()}), key=lambda r: (r.partition, r.offset))
        seen[client] = ([(r.partition, r.offset, r.key, r.value) for r in records], ends, len(later))
    assert seen["kafka-python"] == seen["confluent"]
    assert sum(seen["confluent"][1].values()) == 300 + 100 * 2
    empty = f"{topic_prefix}.public.empty"
    admin = TopicAdmin(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix))
    admin.ensure([empty])
    admin.close()
    for client in ("kafka-python", "confluent"):  # an empty topic ends at once
        assert list(read_topic(TopicConfig(bootstrap_servers=broker_servers, client=client), empty, idle_timeout_s=5)) == []
