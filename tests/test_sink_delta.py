"""`cdc sink delta` end to end: PostgreSQL -> `cdc run` -> topics -> the Delta warehouse.

Real PostgreSQL, Kafka and Spark: the sink runs as the user runs it (`cdc sink delta`, a
separate process, `--once`); the test reads the warehouse with its own `local[2]`
session, with delta-rs and with DuckDB, and compares with the source tables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession

from cdc.config import TopicConfig
from compaction.reader import read_topic
from tests.support import cdc, wait_caught_up, write_config

SINK_TIMEOUT_S = 900
ROOT = Path(__file__).resolve().parent.parent

WIDE = """
CREATE TYPE public.mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE public.wide (
    id int PRIMARY KEY,
    b bool, i2 int2, i8 int8, f4 float4, f8 float8,
    n numeric(10, 2), nu numeric, m money,
    t text, vc varchar(20), bp char(3), u uuid, j jsonb,
    d date, tm time, ts timestamp, ts3 timestamp(3), tsz timestamptz, iv interval,
    by bytea, bits bit(3), bit1 bit(1), ia int[], ta text[], pt point, ip inet, e public.mood
);
CREATE TABLE public."Odd Name" ("Key" text PRIMARY KEY, "a b" int, "ü" text);
"""

ROW_1 = """INSERT INTO public.wide VALUES (1, true, 12, 9000000000, 1.5, 2.25, 1234.56, 3.14159265358979, 12.5,
    'text é', 'vc', 'ab', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"k": [1, 2]}',
    '2024-02-29', '13:14:15.123456', '2024-01-02 03:04:05.678901', '2024-01-02 03:04:05.678',
    '2024-01-02 03:04:05.678901+02', '1 day 02:03:04.5', '\\x00ff', B'101', B'1', '{1,NULL,3}',
    '{"a",NULL,"c d"}', '(1.5,-2)', '10.0.0.1/8', 'happy')"""
ROW_2 = """INSERT INTO public.wide (id, t, d, ts, tsz, f8, n) VALUES
    (2, 'two', '-infinity', 'infinity', 'infinity', 'NaN', 0.01)"""

# What a user checks of every column: PostgreSQL and Delta projected to the same Python values.
PG_VIEW = """
SELECT id, b, i2, i8, f4, f8::text, n, nu::text, m::numeric::text, t, vc, bp, u::text, j::text,
       CASE WHEN d = '-infinity' THEN 'min' ELSE d::text END,
       (extract(epoch FROM tm) * 1000000)::bigint,
       CASE WHEN ts = 'infinity' THEN 'max' ELSE ((extract(epoch FROM ts) * 1000000)::bigint)::text END,
       (extract(epoch FROM ts3) * 1000000)::bigint,
       CASE WHEN tsz = 'infinity' THEN 'max' ELSE ((extract(epoch FROM tsz) * 1000000)::bigint)::text END,
       (extract(epoch FROM iv) * 1000000)::bigint, by, bits::text, bit1::text = '1', ia, ta,
       CASE WHEN pt IS NULL THEN NULL ELSE array[pt[0], pt[1]] END, ip::text, e::text
FROM public.wide ORDER BY id
"""
DELTA_VIEW = """
SELECT id, b, i2, i8, f4, CASE WHEN isnan(f8) THEN 'NaN' ELSE CAST(f8 AS STRING) END, n, nu, m, t, vc, bp, u, j,
       CASE WHEN d < DATE'0001-01-01' THEN 'min' ELSE CAST(d AS STRING) END, tm,
       CASE WHEN year(ts) > 9999 THEN 'max' ELSE CAST(unix_micros(CAST(ts AS TIMESTAMP)) AS STRING) END,
       unix_micros(CAST(ts3 AS TIMESTAMP)),
       CASE WHEN year(tsz) > 9999 THEN 'max' ELSE CAST(unix_micros(tsz) AS STRING) END,
       iv, by, bits, bit1, ia, ta, CASE WHEN pt IS NULL THEN NULL ELSE array(pt.x, pt.y) END, ip, e
FROM current ORDER BY id
"""


def _bits_text(value: Any) -> Any:
    """bit(3) arrives as Debezium's little-endian bytes: back to PostgreSQL's text."""
    if value is None:
        return None
    number = int.from_bytes(bytes(value), "little")
    return format(number, "03b")


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    from sinks.spark import build_session

    os.chdir(tmp_path_factory.mktemp("spark-cwd"))  # Spark drops spark-warehouse/ in the cwd
    session = build_session("test-sink-delta-reader")
    yield session
    session.stop()
    os.chdir(ROOT)


class Sink:
    """`cdc sink delta` for one test's config: `--once` runs, or a streaming process."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config, self.log = config, log
        self.proc: subprocess.Popen | None = None

    def once(self) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "cdc", "sink", "delta", "--once", "--config", str(self.config)],
            capture_output=True, text=True, timeout=SINK_TIMEOUT_S, cwd=self.config.parent,
        )
        with open(self.log, "a", encoding="utf-8") as out:
            out.write(done.stdout + done.stderr)
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        return done.stdout

    def start(self) -> None:
        self._out = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc", "sink", "delta", "--config", str(self.config)],
            stdout=self._out, stderr=subprocess.STDOUT, cwd=self.config.parent, start_new_session=True,
        )

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)  # the driver and its JVM
        self.proc.wait(30)
        self._out.close()


def _config(tmp_path: Path, db: Any, servers: str, prefix: str, **extra: dict) -> Path:
    return write_config(
        tmp_path / "cdc.toml", db.dsn, servers, prefix, ["public.*"],
        delta={"path": str(tmp_path / "warehouse")},
        spark={"checkpoint_dir": str(tmp_path / "checkpoints"), **extra.pop("spark", {})},
        **extra,
    )


def _table(spark: SparkSession, warehouse: Path, kind: str, table: str = "wide") -> Any:
    return spark.read.format("delta").load(str(warehouse / kind / "public" / table))


def _current_view(spark: SparkSession, warehouse: Path) -> list[tuple]:
    _table(spark, warehouse, "current").createOrReplaceTempView("current")
    rows = []
    for row in spark.sql(DELTA_VIEW).collect():
        values = list(row)
        values[20] = bytes(values[20]) if values[20] is not None else None
        values[21] = _bits_text(values[21])
        rows.append(tuple(values))
    return rows


def _source_view(db: Any) -> list[tuple]:
    rows = []
    for row in db.fetchall(PG_VIEW):
        values = list(row)
        values[4] = float(values[4]) if values[4] is not None else None
        values[20] = bytes(values[20]) if values[20] is not None else None
        values[25] = [float(v) for v in values[25]] if values[25] is not None else None
        rows.append(tuple(values))
    return rows


def test_current_changes_and_history_follow_the_source(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    db.execute(WIDE)
    db.execute(ROW_1)
    db.execute(ROW_2)
    db.execute("""INSERT INTO public."Odd Name" VALUES ('k1', 1, 'ä'), ('k2', 2, 'ö')""")
    daemon, slot = run_daemon(["public.*"])
    config = _config(tmp_path, db, broker_servers, topic_prefix)
    sink = Sink(config, tmp_path / "sink.log")
    warehouse = tmp_path / "warehouse"

    # the snapshot
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    assert _current_view(spark, warehouse) == _source_view(db)

    # streaming: updates, a delete, a key change, a truncate, ADD and DROP COLUMN
    db.execute("UPDATE public.wide SET t = 'one', n = 99.99, ia = '{7}' WHERE id = 1")
    db.execute("INSERT INTO public.wide (id, t) VALUES (3, 'three'), (4, 'four')")
    db.execute("DELETE FROM public.wide WHERE id = 2")
    db.execute("UPDATE public.wide SET id = 40 WHERE id = 4")
    db.execute("ALTER TABLE public.wide ADD COLUMN extra numeric(6, 1)")
    db.execute("INSERT INTO public.wide (id, t, extra) VALUES (5, 'five', 12.5)")
    db.execute("UPDATE public.wide SET extra = 1.5 WHERE id = 1")
    db.execute("""UPDATE public."Odd Name" SET "a b" = 20 WHERE "Key" = 'k2'""")
    db.execute("""TRUNCATE public."Odd Name" """)
    db.execute("""INSERT INTO public."Odd Name" VALUES ('k3', 3, 'ß')""")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    db.execute("ALTER TABLE public.wide DROP COLUMN vc")
    db.execute("INSERT INTO public.wide (id, t) VALUES (6, 'six')")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()

    current = _table(spark, warehouse, "current")
    assert "vc" in current.columns and "extra" in current.columns  # a dropped column stays
    got = {r["id"]: (r["t"], r["extra"], r["vc"]) for r in current.collect()}
    assert got == {
        1: ("one", Decimal("1.5"), "vc"), 3: ("three", None, None), 40: ("four", None, None),
        5: ("five", Decimal("12.5"), None), 6: ("six", None, None),
    }
    source = {r[0]: r[1] for r in db.fetchall("SELECT id, t FROM public.wide")}
    assert {k: v[0] for k, v in got.items()} == source
    odd = _table(spark, warehouse, "current", "Odd-20Name")  # the topic's escaped table name
    assert sorted((r["Key"], r["a b"], r["ü"]) for r in odd.collect()) == [("k3", 3, "ß")]

    # changes: one row per record of the topic, once
    topic = f"{topic_prefix}.public.wide"
    records = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), topic))
    changes = _table(spark, warehouse, "changes")
    coords = sorted((r["_cdc_partition"], r["_cdc_offset"]) for r in changes.collect())
    assert coords == sorted((r.partition, r.offset) for r in records)

    # history: one version per insert, update and snapshot read, closed by the next change
    events = [orjson.loads(r.value) for r in records if r.value is not None]
    versions = [e for e in events if e["op"] in ("r", "c", "u")]
    history = _table(spark, warehouse, "history").select(  # d, ts, tsz hold values Python's datetime cannot
        "id", "t", "_cdc_valid_from_lsn", "_cdc_valid_from_seq", "_cdc_is_current", "_cdc_deleted"
    ).collect()
    assert len(history) == len(versions)
    by_id: dict[int, list[Any]] = {}
    for row in sorted(history, key=lambda r: (r["_cdc_valid_from_lsn"], r["_cdc_valid_from_seq"])):
        by_id.setdefault(row["id"], []).append(row)
    assert [(r["t"], r["_cdc_is_current"], r["_cdc_deleted"]) for r in by_id[1]] == [
        ("text é", False, False), ("one", False, False), ("one", True, False)
    ]
    assert [(r["_cdc_is_current"], r["_cdc_deleted"]) for r in by_id[2]] == [(False, True)]
    assert [(r["_cdc_is_current"], r["_cdc_deleted"]) for r in by_id[4]] == [(False, True)]  # the key change
    assert [r["_cdc_is_current"] for r in by_id[40]] == [True]
    odd_history = _table(spark, warehouse, "history", "Odd-20Name").collect()
    assert sorted((r["Key"], r["_cdc_is_current"], r["_cdc_deleted"]) for r in odd_history) == [
        ("k1", False, True), ("k2", False, False), ("k2", False, True), ("k3", True, False)
    ]
    daemon.stop()


# --------------------------------------------------------------------------- bad input


def test_a_missing_delta_path_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "cdc.toml"
    config.write_text('[topic]\nbootstrap_servers = "127.0.0.1:1"\n')
    done = cdc("sink", "delta", "--once", "--config", str(config))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: [delta] path is not set: set it (or CDC_DELTA_PATH) to the warehouse folder or URI"
    )


def test_an_unreachable_master_is_one_line(tmp_path: Path) -> None:
    from cdc.local.process import free_port

    port = free_port()
    config = tmp_path / "cdc.toml"
    config.write_text(
        f'[spark]\nmaster = "spark://127.0.0.1:{port}"\n[delta]\npath = "{tmp_path / "w"}"\n'
    )
    done = cdc("sink", "delta", "--once", "--config", str(config))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"error: cannot reach the Spark master spark://127.0.0.1:{port} (Connection refused): start it, or fix "
        "[spark] master"
    )


def test_an_unknown_sink_is_one_line(tmp_path: Path) -> None:
    done = cdc("sink", "warehouse", "--once")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: unknown sink 'warehouse': use one of delta"


def test_a_malformed_record_reaches_the_dead_letter_topic_and_the_job_goes_on(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    from kafka import KafkaProducer

    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, note text)")
    db.execute("INSERT INTO public.acct VALUES (1, 'a'), (2, 'b')")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    topic = f"{topic_prefix}.public.acct"
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    producer.send(topic, key=b'{"id":9}', value=b"not json at all", partition=0)
    producer.send(topic, key=b'{"id":8}', value=b'{"op":"c","after":{"id":8}}', partition=0)
    producer.flush()
    producer.close()
    db.execute("INSERT INTO public.acct VALUES (3, 'c')")
    wait_caught_up(db.dsn, slot, daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix)
    out = Sink(config, tmp_path / "sink.log").once()
    assert "2 dead letters" in out

    rows = _table(spark, tmp_path / "warehouse", "current", "acct").collect()
    assert sorted((r["id"], r["note"]) for r in rows) == [(1, "a"), (2, "b"), (3, "c")]
    letters = [
        (r.key, orjson.loads(r.value))
        for r in read_topic(TopicConfig(bootstrap_servers=broker_servers), f"{topic_prefix}.__cdc_dlq")
    ]
    assert [(key, {k: v for k, v in letter.items() if k != "offset"}) for key, letter in letters] == [
        (b'{"id":9}', {
            "reason": "value is not a Debezium change event (JSON object with op)", "topic": topic,
            "partition": 0, "value": "not json at all",
        }),
        (b'{"id":8}', {
            "reason": "source.sequence is not [commit LSN, change LSN]", "topic": topic,
            "partition": 0, "value": '{"op":"c","after":{"id":8}}',
        }),
    ]
    daemon.stop()


# --------------------------------------------------------------------------- crashes and replays


def _acct_state(spark: SparkSession, warehouse: Path) -> dict[int, tuple[int, str]]:
    rows = _table(spark, warehouse, "current", "acct").select("id", "version", "note").collect()
    return {r["id"]: (r["version"], r["note"]) for r in rows}


def _check_exactly_once(spark: SparkSession, warehouse: Path, db: Any, servers: str, prefix: str) -> None:
    """current = the source; changes = every record once; history = one version per change."""
    source = {r[0]: (r[1], r[2]) for r in db.fetchall("SELECT id, version, note FROM public.acct")}
    assert _acct_state(spark, warehouse) == source
    records = list(read_topic(TopicConfig(bootstrap_servers=servers), f"{prefix}.public.acct"))
    changes = _table(spark, warehouse, "changes", "acct").select("_cdc_partition", "_cdc_offset").collect()
    assert sorted(tuple(r) for r in changes) == sorted((r.partition, r.offset) for r in records)
    versions = sorted(
        (r.partition, r.offset) for r in records
        if r.value is not None and orjson.loads(r.value)["op"] in ("r", "c", "u")
    )
    history = _table(spark, warehouse, "history", "acct").select("_cdc_partition", "_cdc_offset").collect()
    assert sorted(tuple(r) for r in history) == versions
    current = _table(spark, warehouse, "history", "acct").where("_cdc_is_current").select("id", "version").collect()
    assert dict(tuple(r) for r in current) == {k: v[0] for k, v in source.items()}


def test_kill_9_mid_batch_then_replay_from_a_deleted_checkpoint(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    from tests.support import ACCT, Writers

    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 2000) g")
    daemon, slot = run_daemon(["public.acct"])
    config = _config(tmp_path, db, broker_servers, topic_prefix, spark={"max_offsets_per_trigger": 700})
    warehouse = tmp_path / "warehouse"
    sink = Sink(config, tmp_path / "sink.log")
    with Writers(db.dsn, keys=3000, pause_s=0.01):
        for kill_after_s in (25, 35, 45):  # a session start takes ~15 s: each kill lands in a batch
            sink.start()
            time.sleep(kill_after_s)
            sink.kill9()
    wait_caught_up(db.dsn, slot, daemon)
    out = sink.once()
    assert "0 dead letters" in out
    batches = Path(sink.log).read_text().count("INFO sinks.job: batch ")
    assert batches >= 3, "the kills should land after some batches were applied"
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)

    # replay: a deleted checkpoint reads the topics from the earliest offsets again
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")
    sink.once()
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)
    daemon.stop()
