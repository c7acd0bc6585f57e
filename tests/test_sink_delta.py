"""`cdc sink delta` end to end: PostgreSQL -> `cdc run` -> topics -> the Delta warehouse.

Real PostgreSQL, Kafka and Spark: the sink runs as the user runs it (`cdc sink delta`, a
separate process, `--once`); the test reads the warehouse with its own `local[2]`
session, with delta-rs and with DuckDB, and compares with the source tables.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from pyspark.sql import SparkSession

from cdc.config import TopicConfig
from cdc.kafka.heartbeat import newest_heartbeat
from cdc.kafka.reader import read_topic
from sinks.progress import read_progress
from tests.support import (
    SINK_TIMEOUT_S,
    Sink,
    cdc,
    cdc_here,
    current_lsn,
    wait_caught_up,
    wait_for,
    write_config,
)

# delta-rs and DuckDB in a child: a process that read with delta-rs may abort at exit
_OTHER_READERS = """
import json, os, sys
import duckdb
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
plain = DeltaTable(sys.argv[1]).to_pyarrow_table(columns=["id", "t", "n"])
mapped = pa.table(QueryBuilder().register("odd", DeltaTable(sys.argv[2])).execute('SELECT * FROM odd').read_all())
out = {
    "deltalake": sorted([r["id"], r["t"], str(r["n"])] for r in plain.to_pylist()),
    "duckdb": [list(r) for r in duckdb.sql("SELECT id, t, CAST(n AS VARCHAR) FROM plain ORDER BY id").fetchall()],
    "column_mapping": sorted([r["Key"], r["a b"], r["\u00fc"]] for r in mapped.to_pylist()),
}
sys.stdout.write(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""
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

SEED = (WIDE, ROW_1, ROW_2, """INSERT INTO public."Odd Name" VALUES ('k1', 1, 'ä'), ('k2', 2, 'ö')""")
# streaming: updates, a delete, a key change, ADD COLUMN, a truncate
CHANGES = (
    "UPDATE public.wide SET t = 'one', n = 99.99, ia = '{7}' WHERE id = 1",
    "INSERT INTO public.wide (id, t) VALUES (3, 'three'), (4, 'four')",
    "DELETE FROM public.wide WHERE id = 2",
    "UPDATE public.wide SET id = 40 WHERE id = 4",
    "ALTER TABLE public.wide ADD COLUMN extra numeric(6, 1)",
    "INSERT INTO public.wide (id, t, extra) VALUES (5, 'five', 12.5)",
    "UPDATE public.wide SET extra = 1.5 WHERE id = 1",
    """UPDATE public."Odd Name" SET "a b" = 20 WHERE "Key" = 'k2'""",
    """TRUNCATE public."Odd Name" """,
    """INSERT INTO public."Odd Name" VALUES ('k3', 3, 'ß')""",
)
K1_AGAIN = """INSERT INTO public."Odd Name" VALUES ('k1', 10, 'å')"""  # a key back after the truncate

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


def _config(tmp_path: Path, db: Any, servers: str, prefix: str, **extra: dict) -> Path:
    return write_config(
        tmp_path / "cdc.toml", db.dsn, servers, prefix, ["public.*"],
        delta={"path": str(tmp_path / "warehouse"), **extra.pop("delta", {})},
        spark={"checkpoint_dir": str(tmp_path / "checkpoints"), **extra.pop("spark", {})},
        **extra,
    )


def _table(spark: SparkSession, warehouse: Path, kind: str, table: str = "wide") -> Any:
    return spark.read.format("delta").load(str(warehouse / kind / "public" / table))


def _partition_columns(spark: SparkSession, path: str) -> list[str]:
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").first()
    assert detail is not None
    return list(detail["partitionColumns"])


def _changes(spark: SparkSession, warehouse: Path, topic: str) -> Any:
    """One table's records in the warehouse's change log (one Delta table for the prefix)."""
    return spark.read.format("delta").load(str(warehouse / "changes")).where(f"_cdc_topic = '{topic}'")


_TSZ_LINES = (
    "       CASE WHEN year(tsz) > 9999 THEN 'max' ELSE CAST(unix_micros(tsz) AS STRING) END,\n",
    "       CASE WHEN tsz = 'infinity' THEN 'max' ELSE ((extract(epoch FROM tsz) * 1000000)::bigint)::text END,\n",
)


def _without_tsz(view: str, zoned: bool) -> tuple[str, int]:
    """The view, without the wide table's `tsz` column when it has none; how far the later
    columns moved."""
    if zoned:
        return view, 0
    for line in _TSZ_LINES:
        view = view.replace(line, "")
    return view, 1


def _current_view(spark: SparkSession, warehouse: Path, zoned: bool = True) -> list[tuple]:
    _table(spark, warehouse, "current").createOrReplaceTempView("current")
    view, moved = _without_tsz(DELTA_VIEW, zoned)
    rows = []
    for row in spark.sql(view).collect():
        values = list(row)
        values[20 - moved] = bytes(values[20 - moved]) if values[20 - moved] is not None else None
        values[21 - moved] = _bits_text(values[21 - moved])
        rows.append(tuple(values))
    return rows


def _source_view(db: Any, zoned: bool = True) -> list[tuple]:
    view, moved = _without_tsz(PG_VIEW, zoned)
    rows = []
    for row in db.fetchall(view):
        values = list(row)
        values[4] = float(values[4]) if values[4] is not None else None
        values[20 - moved] = bytes(values[20 - moved]) if values[20 - moved] is not None else None
        values[25 - moved] = [float(v) for v in values[25 - moved]] if values[25 - moved] is not None else None
        rows.append(tuple(values))
    return rows


def test_current_changes_and_history_follow_the_source(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    for sql in SEED:
        db.execute(sql)
    daemon, slot = run_daemon(["public.*"])
    config = _config(tmp_path, db, broker_servers, topic_prefix)
    sink = Sink(config, tmp_path / "sink.log")
    warehouse = tmp_path / "warehouse"

    # the snapshot
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    assert _current_view(spark, warehouse) == _source_view(db)

    # streaming: updates, a delete, a key change, a truncate, ADD and DROP COLUMN
    for sql in (*CHANGES, K1_AGAIN):
        db.execute(sql)
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    db.execute("ALTER TABLE public.wide DROP COLUMN vc")
    db.execute("INSERT INTO public.wide (id, t) VALUES (6, 'six')")
    wait_caught_up(db.dsn, slot, daemon)
    written = current_lsn(db.dsn)
    beats = TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix)
    wait_for(lambda: newest_heartbeat(beats) >= written, 60, f"a heartbeat at LSN {written}")
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
    assert sorted((r["Key"], r["a b"], r["ü"]) for r in odd.collect()) == [("k1", 10, "å"), ("k3", 3, "ß")]

    # changes: one row per record of the topic, once
    topic = f"{topic_prefix}.public.wide"
    records = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), topic))
    changes = _changes(spark, warehouse, topic)
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
    # the current versions apart from the ended ones: the MERGE that ends versions reads only those
    assert _partition_columns(spark, str(warehouse / "history/public/wide")) == ["_cdc_is_current"]
    # the same tables through delta-rs and DuckDB (DuckDB over delta-rs's Arrow table)
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_READERS, str(warehouse / "current/public/wide"),
         str(warehouse / "current/public/Odd-20Name")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    others = json.loads(done.stdout)
    spark_rows = sorted([r["id"], r["t"], str(r["n"])] for r in current.collect())
    assert others["deltalake"] == spark_rows
    assert others["duckdb"] == [[i, t, None if n == "None" else n] for i, t, n in spark_rows]
    assert others["column_mapping"] == [["k1", 10, "å"], ["k3", 3, "ß"]]

    # cdc status: the sink's progress next to the slot, in LSNs
    status = json.loads(cdc("status", "--json", "--config", str(config)).stdout)
    sink_status = status["sinks"]["delta"]
    assert set(sink_status["tables"]) == {topic, f"{topic_prefix}.public.Odd-20Name"}
    assert sink_status["dead_letters"] == 0
    high, low = (int(part, 16) for part in sink_status["complete_lsn"].split("/"))
    # the --once run read the heartbeat past the last write and nothing came after it: complete
    assert high << 32 | low >= written and sink_status["lag_bytes"] >= 0
    # the history query read the whole change log after the warehouse job's last run: as complete as it
    assert status["sinks"]["delta-history"]["complete_lsn"] == sink_status["complete_lsn"]

    # the truncate ends k1's first version, deleted, though k1's first change in that batch is its insert after
    odd_history = _table(spark, warehouse, "history", "Odd-20Name").collect()
    assert sorted((r["Key"], r["_cdc_is_current"], r["_cdc_deleted"]) for r in odd_history) == [
        ("k1", False, True), ("k1", True, False), ("k2", False, False), ("k2", False, True), ("k3", True, False)
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
    assert done.stderr.strip() == "error: unknown sink 'warehouse': use one of delta, search, cache, postgres"


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

    # a type change Delta cannot take stops the job, in one line naming the table and the column
    db.execute("ALTER TABLE public.acct ALTER COLUMN note TYPE int USING length(note)")
    db.execute("INSERT INTO public.acct VALUES (4, 7)")
    wait_caught_up(db.dsn, slot, daemon)
    err = Sink(config, tmp_path / "sink.log").once(exit_code=1)
    warehouse = tmp_path / "warehouse"
    assert (
        f"error: table public.acct column note changed from string to int, which the Delta table "
        f"{warehouse}/current/public/acct cannot take: rebuild it (delete the table and the sink's checkpoint) "
        "or cast the column back in PostgreSQL"
    ) in err.splitlines()
    rows = _table(spark, warehouse, "current", "acct").collect()
    assert sorted((r["id"], r["note"]) for r in rows) == [(1, "a"), (2, "b"), (3, "c")]  # nothing half-applied
    daemon.stop()


def test_envelopes_become_change_rows_with_their_positions_or_the_reason_they_cannot(spark: SparkSession) -> None:
    """What every sink reads of a Kafka record: the commit and change LSN from
    `source.sequence` (Debezium's JSON array of two strings, the first null before any
    commit), spacing and schema blocks allowed; anything else names the reason."""
    from sinks.envelope import change_rows

    def record(sequence: str | None, op: str = "c", schema: bool = False) -> str:
        source = {"ts_ms": 1, "lsn": 20, **({"sequence": sequence} if sequence is not None else {})}
        event = {"before": None, "after": {"id": 1}, "source": source, "op": op, "ts_ms": 2}
        return json.dumps({"schema": {"type": "struct"}, "payload": event} if schema else event)

    values = [
        record('["10","20"]'), record('[null,"20"]'), record(' [ "10" , "20" ] '), record('["10","20"]', schema=True),
        record('["10","20","30"]'), record('[10,20]'), record('["10"]'), record("[]"), record('"x"'),
        record('{"a":1}'), record('["a","20"]'), record(None), record('["10","20"]', op="x"),
        '{"op":"c","after":{"id":8}}', "not json at all", None,
    ]
    records = spark.createDataFrame(
        [("p.public.t", 0, offset, b'{"id":1}', None if v is None else v.encode()) for offset, v in enumerate(values)],
        "topic string, partition int, offset bigint, key binary, value binary",
    )
    got = [(r["_cdc_offset"], r["_cdc_op"], r["_cdc_lsn"], r["_cdc_seq"], r["_cdc_tombstone"], r["_cdc_error"])
           for r in change_rows(records).orderBy("_cdc_offset").collect()]
    bad_sequence = "source.sequence is not [commit LSN, change LSN]"
    assert got == [
        (0, "c", 10, 20, False, None),
        (1, "c", None, 20, False, bad_sequence),
        (2, "c", 10, 20, False, None),
        (3, "c", 10, 20, False, None),
        (4, "c", 10, 20, False, None),
        (5, "c", 10, 20, False, None),
        (6, "c", 10, None, False, bad_sequence),
        (7, "c", None, None, False, bad_sequence),
        (8, "c", None, None, False, bad_sequence),
        (9, "c", None, None, False, bad_sequence),
        (10, "c", None, 20, False, bad_sequence),
        (11, "c", None, None, False, bad_sequence),
        (12, "x", 10, 20, False, "unknown op x"),
        (13, "c", None, None, False, bad_sequence),
        (14, None, None, None, False, "value is not a Debezium change event (JSON object with op)"),
        (15, None, None, None, True, None),
    ]


def test_decoding_names_each_bad_value_and_sets_unchanged_toast_apart(spark: SparkSession) -> None:
    """What the job and history's query make of each event of a table version: the typed row,
    the reason a dead letter gets (every value that does not fit, or columns that are not the
    version's, also as many of them under another name), the columns an update did not send."""
    from sinks.batch import UNAVAILABLE, decode_table
    from sinks.envelope import CHANGE_COLUMNS
    from sinks.versions import TOAST_PLACEHOLDER, ColumnShape, Registry, Version

    topic = "p.public.t"
    shape = (
        ColumnShape("id", "int4", -1, True, {"type": "int32"}),
        ColumnShape("note", "text", -1, False, {"type": "string"}),
        ColumnShape("n", "numeric", ((5 << 16) | 2) + 4, False, {"type": "string"}),
        ColumnShape("at", "timestamptz", -1, False, {"type": "string", "name": "io.debezium.time.ZonedTimestamp"}),
    )
    registry = Registry([Version("public", "t", topic, 1, shape)])
    at = '"2026-11-27T10:00:00Z"'
    afters = [
        ("c", f'{{"id":1,"note":"a","n":"1.50","at":{at}}}'),
        ("u", '{"id":2,"note":"b","n":"NaN","at":"yesterday"}'),
        ("c", '{"id":3,"note":"c"}'),
        ("c", f'{{"id":4,"note":"d","n":"1","other":{at}}}'),
        ("u", f'{{"id":5,"note":"{TOAST_PLACEHOLDER}","n":"2.00","at":{at}}}'),
        ("d", None),
    ]
    rows = spark.createDataFrame(
        [(topic, 0, offset, f'{{"id":{offset}}}', op, 10 + offset, 10 + offset, None, 7, None, False, None, after,
          None, after) for offset, (op, after) in enumerate(afters, 1)],
        "_cdc_topic string, _cdc_partition int, _cdc_offset bigint, _cdc_key string, _cdc_op string, _cdc_lsn bigint, "
        "_cdc_seq bigint, _cdc_ts timestamp, _cdc_tx_id bigint, _cdc_snapshot string, _cdc_tombstone boolean, "
        "before string, after string, _cdc_error string, _value string",
    )
    decoded, columns = decode_table(rows, registry, topic, 11, 16)
    assert list(decoded.columns) == [*CHANGE_COLUMNS, "id", "note", "n", "at", UNAVAILABLE, "_cdc_error", "_value"]
    got = [
        (r["_cdc_offset"], r["id"], r["note"], r["n"], r[UNAVAILABLE], r["_cdc_error"])
        for r in decoded.orderBy("_cdc_offset").collect()
    ]
    mismatch = "the event's columns are not those of table version public.t from LSN 1"
    assert got == [
        (1, 1, "a", Decimal("1.50"), [], None),
        (2, 2, "b", None, [], "n: value does not fit decimal(5,2); at: value does not fit timestamp"),
        (3, 3, "c", None, [], mismatch),
        (4, 4, "d", Decimal("1.00"), [], mismatch),
        (5, 5, None, Decimal("2.00"), ["note"], None),
        (6, None, None, None, None, None),
    ]


# --------------------------------------------------------------------------- crashes and replays


def _acct_state(spark: SparkSession, warehouse: Path) -> dict[int, tuple[int, str]]:
    rows = _table(spark, warehouse, "current", "acct").select("id", "version", "note").collect()
    return {r["id"]: (r["version"], r["note"]) for r in rows}


def _check_exactly_once(spark: SparkSession, warehouse: Path, db: Any, servers: str, prefix: str) -> None:
    """current = the source; changes = every record once; history = one version per change."""
    source = {r[0]: (r[1], r[2]) for r in db.fetchall("SELECT id, version, note FROM public.acct")}
    assert _acct_state(spark, warehouse) == source
    records = list(read_topic(TopicConfig(bootstrap_servers=servers), f"{prefix}.public.acct"))
    changes = _changes(spark, warehouse, f"{prefix}.public.acct").select("_cdc_partition", "_cdc_offset").collect()
    assert sorted(tuple(r) for r in changes) == sorted((r.partition, r.offset) for r in records)
    versions = sorted(
        (r.partition, r.offset) for r in records
        if r.value is not None and orjson.loads(r.value)["op"] in ("r", "c", "u")
    )
    history = _table(spark, warehouse, "history", "acct").select("_cdc_partition", "_cdc_offset").collect()
    assert sorted(tuple(r) for r in history) == versions
    current = _table(spark, warehouse, "history", "acct").where("_cdc_is_current").select("id", "version").collect()
    assert dict(tuple(r) for r in current) == {k: v[0] for k, v in source.items()}


#: steps of a warehouse batch that its job logs at DEBUG (`public.acct`'s), each once it is done:
#: decoded (nothing written yet); `current` MERGEd (its commit made, the change log's not);
#: the change log appended (the job's checkpoint not committed); a history MERGE (its query's
#: checkpoint not committed)
STEPS = {
    "decoded": ".public.acct: decoded in ",  # after the topic's prefix
    "current": "DEBUG sinks.stores.delta.store: public.acct: current ",
    "changes": "DEBUG sinks.stores.delta.store: changes: ",
    "history": "DEBUG sinks.stores.delta.store: public.acct: history ",
}
# between a batch's commits: the change log committed, not the checkpoint; a history MERGE
# committed, not its query's checkpoint, each after a completed batch (tests/test_every_store.py
# kills a job in its first batch after these steps and after `current`, under load)
KILL_POINTS = {step: STEPS[step] for step in ("changes", "history")}


@pytest.mark.parametrize("after", list(KILL_POINTS))
def test_kill_9_between_two_commits_of_a_batch_then_replay_from_a_deleted_checkpoint(
    after: str, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    from tests.support import ACCT, Writers

    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 500) g")
    daemon, slot = run_daemon(["public.acct"])
    config = _config(tmp_path, db, broker_servers, topic_prefix, spark={"max_offsets_per_trigger": 200},
                     delta={"history_interval_s": 5})
    warehouse = tmp_path / "warehouse"
    sink = Sink(config, tmp_path / "sink.log")
    with Writers(db.dsn, keys=1000, pause_s=0.05):
        sink.kill9_after((KILL_POINTS[after],))
        # streaming, then SIGTERM: a clean stop after the running batch
        sink.start()
        sink.next_batch()
        assert sink.stop() == 0
    wait_caught_up(db.dsn, slot, daemon)
    big_batches = {"CDC_SPARK_MAX_OFFSETS_PER_TRIGGER": "1000000"}  # the small ones were for the kills
    out = sink.once(env=big_batches)
    assert "0 dead letters" in out
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)

    # replay: a deleted checkpoint reads the topics from the earliest offsets again
    shutil.rmtree(tmp_path / "checkpoints")
    sink.once(env=big_batches)
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)
    daemon.stop()


def test_maintenance_optimizes_rebuilds_history_and_moves_an_old_warehouse_to_the_one_change_log(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    from tests.support import ACCT

    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 60) g")
    daemon, slot = run_daemon(["public.acct"])
    config = _config(tmp_path, db, broker_servers, topic_prefix)
    warehouse = tmp_path / "warehouse"
    sink = Sink(config, tmp_path / "sink.log")
    for step in range(3):  # a few batches: small files to compact, keys with several versions in history
        db.execute(f"UPDATE public.acct SET version = version + 1, note = 'step {step}' WHERE id % 3 <> {step}")
        db.execute(f"DELETE FROM public.acct WHERE id = {10 * (step + 1)}")
        wait_caught_up(db.dsn, slot, daemon)
        sink.once()
    daemon.stop()
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)

    # compaction of the micro-batches' small files, and history from changes
    history_columns = ("_cdc_key", "_cdc_offset", "_cdc_valid_to_lsn", "_cdc_is_current", "_cdc_deleted", "version")
    history = sorted(tuple(r) for r in _table(spark, warehouse, "history", "acct").select(*history_columns).collect())
    done = cdc_here("delta", "optimize", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    # every table is optimized (the job's own compaction may have left nothing to do: "0 files compacted into 0")
    for table in ("current/public/acct", "changes", "history/public/acct"):
        assert re.search(rf"{re.escape(str(warehouse))}/{table}: \d+ files compacted into \d+", done.stdout)
    # a history written by cdc before it was partitioned by `_cdc_is_current` gets that layout
    history_path = str(warehouse / "history/public/acct")
    _table(spark, warehouse, "history", "acct").localCheckpoint().write.format("delta").mode("overwrite").option(
        "overwriteSchema", "true").save(history_path)
    assert _partition_columns(spark, history_path) == []
    done = cdc_here("delta", "rebuild-history", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"public.acct: {len(history)} versions" in done.stdout
    rebuilt = sorted(tuple(r) for r in _table(spark, warehouse, "history", "acct").select(*history_columns).collect())
    assert rebuilt == history
    assert _partition_columns(spark, history_path) == ["_cdc_is_current"]
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)

    # a warehouse written by cdc before the one change log: the job stops and says how to move it
    moved = _as_per_table_changes(spark, warehouse, tmp_path / "checkpoints")
    err = sink.once(exit_code=1)
    assert (
        f"error: the Delta warehouse at {warehouse} keeps changes/ per table (cdc before the one change log): stop "
        "the delta sink and run `cdc delta migrate --config <file>` once, which moves it to the one change log"
    ) in err.splitlines()
    done = cdc_here("delta", "migrate", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        f"changes/public/acct: {moved} rows moved into {warehouse}/changes", "delta migrate: 1 change tables moved"
    ]
    assert not (warehouse / "_cdc" / "changes-per-table").exists()
    sink.once()  # the history query reads the whole log again: its watermarks skip what it has
    _check_exactly_once(spark, warehouse, db, broker_servers, topic_prefix)
    done = cdc_here("delta", "migrate", "--config", str(config))
    assert done.stdout.strip() == f"delta migrate: nothing to move, {warehouse}/changes is the change log already"


def _as_per_table_changes(spark: SparkSession, warehouse: Path, checkpoints: Path) -> int:
    """The layout of cdc before the one change log: a Delta table per table under
    `changes/<schema>/<table>`, and no history query's record or checkpoint; the rows moved."""
    from sinks.envelope import CHANGE_COLUMNS

    log = spark.read.format("delta").load(str(warehouse / "changes"))
    topics = [r[0] for r in log.select("_cdc_topic").distinct().collect()]
    count = 0
    for topic in topics:
        table = topic.rsplit(".", 1)[-1]
        rows = log.where(f"_cdc_topic = '{topic}'").select(*CHANGE_COLUMNS)
        rows.write.format("delta").save(str(warehouse / "per-table" / "public" / table))
        count += rows.count()
    shutil.rmtree(warehouse / "changes")
    (warehouse / "per-table").rename(warehouse / "changes")
    (warehouse / "_cdc" / "delta-history.json").unlink()
    shutil.rmtree(checkpoints / "delta-history")
    return count


# --------------------------------------------------------------------------- commits per batch


def _commits(table: Path) -> int:
    """The commits in a Delta table's log (`_delta_log/<version>.json`; none: 0)."""
    return len(list((table / "_delta_log").glob("[0-9]*.json")))


def test_a_batch_commits_once_per_table_it_touches_and_history_follows_by_its_own_query(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    tables = [f"t{i}" for i in range(5)]
    for table in tables:
        db.execute(f"CREATE TABLE public.{table} (id int PRIMARY KEY, v int NOT NULL)")
        db.execute(f"INSERT INTO public.{table} SELECT g, 0 FROM generate_series(1, 20) g")
    daemon, slot = run_daemon(["public.*"])
    warehouse = tmp_path / "warehouse"
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
        delta={"path": str(warehouse), "history_interval_s": 3600},  # streaming: one history batch, at the start
        spark={"checkpoint_dir": str(tmp_path / "checkpoints"), "max_offsets_per_trigger": 1000000},
    )
    sink = Sink(config, tmp_path / "sink.log")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()

    def commits() -> dict[str, int]:
        counts = {"changes": _commits(warehouse / "changes")}
        for table in tables:
            for kind in ("current", "history"):
                counts[f"{kind}/{table}"] = _commits(warehouse / kind / "public" / table)
        return counts

    # a table's first batch makes it, rows and all, in one commit (the change log: made empty
    # when the job starts, then one append)
    before = commits()
    assert before == {"changes": 2, **{f"{kind}/{t}": 1 for t in tables for kind in ("current", "history")}}
    # two of the five tables change, in several transactions: one batch of the job commits
    # once per table it touched and once to the change log; history once per table it touched
    for i in range(1, 6):
        db.execute(f"UPDATE public.t1 SET v = {i} WHERE id <= {4 * i}")
        db.execute(f"UPDATE public.t3 SET v = {i} WHERE id > {4 * i}")
    db.execute("DELETE FROM public.t3 WHERE id = 20")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    after = commits()
    grown = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    assert grown == {"changes": 1, "current/t1": 1, "current/t3": 1, "history/t1": 1, "history/t3": 1}
    assert "records of 2 tables" in (tmp_path / "sink.log").read_text()

    # streaming: `current` follows at once, `history` waits for its own query's next batch
    # ([delta] history_interval_s); the change log holds the records meanwhile
    sink.start()
    sink.next_batch()
    # nothing new for history's query, which read the whole log: as complete as the warehouse job
    beats = TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix)

    def history_as_complete() -> bool:
        progress = read_progress(beats)
        return int(progress["delta-history"]["complete_lsn"]) == int(progress["delta"]["complete_lsn"]) > 0

    wait_for(history_as_complete, SINK_TIMEOUT_S, "the history query to be as complete as the warehouse job")
    db.execute("UPDATE public.t2 SET v = 7 WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    topic = f"{topic_prefix}.public.t2"

    def current_v() -> Any:
        rows = _table(spark, warehouse, "current", "t2").where("id = 1").collect()
        return rows[0]["v"] == 7

    wait_for(current_v, SINK_TIMEOUT_S, "the update in current/")
    # the batch appends to the change log after its current MERGEs
    wait_for(lambda: _changes(spark, warehouse, topic).where("_cdc_op = 'u'").count() == 1, SINK_TIMEOUT_S,
             "the update in the change log")
    assert _table(spark, warehouse, "history", "t2").where("v = 7").count() == 0
    assert sink.stop() == 0
    sink.once()  # the history query to the end of the log
    history = _table(spark, warehouse, "history", "t2").where("id = 1").orderBy("_cdc_valid_from_lsn").collect()
    assert [(r["v"], r["_cdc_is_current"]) for r in history] == [(0, False), (7, True)]
    assert (tmp_path / "checkpoints" / "delta-history" / "commits").is_dir()
    daemon.stop()


def _writers(table: Path) -> list[str]:
    """Who wrote each commit of a Delta table, oldest first: "spark" or "delta-rs"."""
    writers = []
    for commit in sorted((table / "_delta_log").glob("[0-9]*.json")):
        for line in commit.read_text().splitlines():
            info = orjson.loads(line).get("commitInfo")
            if info is not None:
                engine = info.get("engineInfo") or info.get("clientVersion") or ""
                writers.append("delta-rs" if engine.startswith("delta-rs") else
                               "spark" if engine.startswith("Apache-Spark") else engine)
    return writers


def test_small_batches_are_merged_by_delta_rs_with_spark_for_what_it_does_not_write(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession
) -> None:
    for sql in SEED:
        db.execute(sql)
    # every type of the wide table, timestamps at the ends of their range beside the rows the
    # batches rewrite, and a value kept out of line (TOAST) that the updates leave unchanged
    db.execute("INSERT INTO public.wide (id, t, ts, tsz) VALUES (7, 'first', '0001-01-01 00:00:00', "
               "'0001-01-01 00:00:00+00'), (8, 'last', '9999-12-31 23:59:59.999999', "
               "'9999-12-31 23:59:59.999999+00'), (9, 'endless', 'infinity', 'infinity')")
    db.execute("ALTER TABLE public.wide ADD COLUMN big text")
    db.execute("ALTER TABLE public.wide ALTER COLUMN big SET STORAGE EXTERNAL")
    db.execute("UPDATE public.wide SET big = repeat(md5(id::text), 200)")
    db.execute("CREATE TABLE public.zoned (id int PRIMARY KEY, at timestamptz)")
    db.execute("INSERT INTO public.zoned VALUES (1, '2024-01-02 03:04:05+02'), (2, 'infinity')")
    daemon, slot = run_daemon(["public.*"])
    config = _config(tmp_path, db, broker_servers, topic_prefix)
    sink = Sink(config, tmp_path / "sink.log")
    warehouse = tmp_path / "warehouse"
    current = warehouse / "current" / "public"
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()  # the snapshot makes each table in one write (Spark)
    # `zoned` as a warehouse written before the job's Spark wrote timestamps as INT64 µs: INT96,
    # which delta-rs would read as nanoseconds
    spark.conf.set("spark.sql.parquet.outputTimestampType", "INT96")
    try:
        old = spark.read.format("delta").load(str(current / "zoned")).localCheckpoint()
        old.write.format("delta").mode("overwrite").save(str(current / "zoned"))
    finally:
        spark.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")

    for sql in CHANGES:
        db.execute(sql)
    db.execute("UPDATE public.zoned SET at = at + interval '1 hour' WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    db.execute("INSERT INTO public.wide (id, t) VALUES (6, 'six')")
    db.execute("UPDATE public.wide SET vc = 'again' WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()

    def big() -> dict[int, Any]:
        return {r["id"]: r["big"] for r in _table(spark, warehouse, "current").select("id", "big").collect()}

    assert _current_view(spark, warehouse) == _source_view(db)
    assert big() == dict(db.fetchall("SELECT id, big FROM public.wide"))
    zoned = _table(spark, warehouse, "current", "zoned").selectExpr("id", "unix_micros(at) AS at").collect()
    assert sorted(tuple(r) for r in zoned) == db.fetchall(  # 'infinity' as Debezium's largest instant
        "SELECT id, CASE WHEN at = 'infinity' THEN 9223372036825200000 ELSE (extract(epoch FROM at) * 1000000)::bigint "
        "END FROM public.zoned ORDER BY id")
    # delta-rs merged the small batches, timestamps at the ends of their range included; Spark made
    # the tables and merges what delta-rs does not write right: column mapping, INT96 timestamps
    assert _writers(current / "wide") == ["spark", "spark", "delta-rs", "delta-rs"]  # made, ADD COLUMN, 2 batches
    assert _writers(current / "zoned") == ["spark", "spark", "spark"]  # made, made old, merged
    assert _writers(current / "Odd-20Name")[1:] == ["spark"] * (len(_writers(current / "Odd-20Name")) - 1)
    # history too: each batch's versions, the ended ones and the open ones, one per event
    history = warehouse / "history" / "public"
    assert _writers(history / "zoned") == ["spark", "delta-rs"]
    zoned_versions = _table(spark, warehouse, "history", "zoned").select("id", "_cdc_is_current").collect()
    assert sorted(tuple(r) for r in zoned_versions) == [(1, False), (1, True), (2, True)]
    # the batch that ends the version holding date -infinity (Debezium's extreme day number, beyond
    # what delta-rs computes with): delta-rs fails before it commits, and Spark merges it. The next
    # run (a job of its own) tries delta-rs again: its MERGE reads only the open versions
    assert _writers(history / "wide") == ["spark", "spark", "spark", "delta-rs"]  # made, ADD COLUMN, 2 batches
    events = [orjson.loads(r.value) for r in read_topic(TopicConfig(bootstrap_servers=broker_servers),
                                                          f"{topic_prefix}.public.wide") if r.value is not None]
    versions = _table(spark, warehouse, "history").select("id", "t", "_cdc_is_current").collect()
    assert len(versions) == len([e for e in events if e["op"] in ("r", "c", "u")])
    assert sorted((r["id"], r["t"]) for r in versions if r["_cdc_is_current"]) == sorted(
        db.fetchall("SELECT id, t FROM public.wide"))
    log = (tmp_path / "sink.log").read_text()
    assert re.search(r"history/public/wide: delta-rs failed to merge a batch \(.*overflowed.*\); Spark merges it", log)
    assert "Spark merges its batches: table features delta-rs does not write: columnMapping" in log
    assert ("zoned: Spark merges its batches: column at has data files with Spark's INT96 timestamps, which "
            "delta-rs rewrites wrong beyond years 1677-2262 (until the table's next compaction rewrites them)") in log

    # a batch of more records than [delta] small_merge_rows: Spark's MERGE, on the executors
    config = _config(tmp_path, db, broker_servers, topic_prefix, delta={"small_merge_rows": 2})
    db.execute("UPDATE public.wide SET t = t || '!'")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    assert _writers(current / "wide")[-1] == "spark"
    assert _current_view(spark, warehouse) == _source_view(db)
    assert big() == dict(db.fetchall("SELECT id, big FROM public.wide"))
    daemon.stop()


# --------------------------------------------------------------------------- on a cluster


def test_the_same_job_on_a_standalone_cluster(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, spark: SparkSession,
    spark_cluster: Any,
) -> None:
    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, version int NOT NULL, note text, at timestamptz)")
    db.execute("INSERT INTO public.acct SELECT g, 1, 'n' || g, '2024-01-01' FROM generate_series(1, 500) g")
    daemon, slot = run_daemon(["public.*"])
    db.execute("UPDATE public.acct SET version = 2, note = 'u' WHERE id % 5 = 0")
    db.execute("DELETE FROM public.acct WHERE id % 7 = 0")
    db.execute("ALTER TABLE public.acct ADD COLUMN tag text")
    db.execute("INSERT INTO public.acct VALUES (1000, 1, 'new', now(), 'tagged')")
    wait_caught_up(db.dsn, slot, daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix, spark={"master": spark_cluster.master_url})
    out = Sink(config, tmp_path / "sink.log").once()
    assert "0 dead letters" in out
    warehouse = tmp_path / "warehouse"
    current = _table(spark, warehouse, "current", "acct").select("id", "version", "note", "tag").collect()
    source = db.fetchall("SELECT id, version, note, tag FROM public.acct")
    assert sorted(tuple(r) for r in current) == sorted(source)
    # the driver registered with the cluster, whose executors ran the batches
    assert "Registering app cdc-sink-delta" in (spark_cluster.work_dir / "master.log").read_text()
    records = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), f"{topic_prefix}.public.acct"))
    assert _changes(spark, warehouse, f"{topic_prefix}.public.acct").count() == len(records)
    daemon.stop()


# --------------------------------------------------------------------------- a compacted topic


def test_correct_over_compaction_gaps_and_dropped_tombstones(
    tmp_path: Path, db: Any, eager_broker: Any, topic_prefix: str, spark: SparkSession
) -> None:
    from collections import Counter

    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic

    from tests.support import ACCT, EAGER_COMPACTION, slot_of, start_streaming

    servers = eager_broker.bootstrap_servers
    topic = f"{topic_prefix}.public.acct"
    admin = KafkaAdminClient(bootstrap_servers=servers)
    # eager compaction, but tombstones kept for now: a job reads within delete.retention.ms
    admin.create_topics([NewTopic(topic, 3, 1, topic_configs={**EAGER_COMPACTION, "delete.retention.ms": "3600000"})])
    db.execute(ACCT)
    config = _config(tmp_path, db, servers, topic_prefix)
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'new' FROM generate_series(0, 59) g")
    wait_caught_up(db.dsn, slot, daemon)
    sink = Sink(config, tmp_path / "sink.log")
    sink.once()

    # while the job is away: updates, deletes and a key that comes back; the cleaner keeps the
    # last record of each key (for a deleted key its tombstone: the d event is gone too)
    for _ in range(5):
        db.execute("UPDATE public.acct SET version = version + 1, note = md5(random()::text)")
    db.execute("DELETE FROM public.acct WHERE id < 20")
    db.execute("INSERT INTO public.acct VALUES (5, 1, 'back')")
    deleted = {orjson.dumps({"id": i}) for i in range(20) if i != 5}

    def records() -> list[Any]:
        return list(read_topic(TopicConfig(bootstrap_servers=servers), topic))

    def compacted() -> bool:
        db.execute("UPDATE public.acct SET version = version + 1 WHERE id >= 50")  # segments roll on writes
        wait_caught_up(db.dsn, slot, daemon)
        found = records()
        lone = [r for r in found if r.key in deleted]
        return len(lone) == len(deleted) and all(r.value is None for r in lone) and len(found) < 150

    wait_for(compacted, 300, "the log cleaner to leave one record per key", poll=1.5)
    warehouse = tmp_path / "warehouse"
    sink.once()  # reads across the gaps; the deletes arrive as lone tombstones
    source = {r[0]: (r[1], r[2]) for r in db.fetchall("SELECT id, version, note FROM public.acct")}
    assert _acct_state(spark, warehouse) == source
    changes = _changes(spark, warehouse, topic).select("_cdc_partition", "_cdc_offset").collect()
    assert sorted(tuple(r) for r in changes) == sorted(set(tuple(r) for r in changes))

    # tombstones dropped after delete.retention.ms. The cleaner stamps a tombstone's delete
    # horizon when it first cleans it (KIP-534): those above keep their hour, so delete
    # more rows now that the topic keeps tombstones for two seconds.
    # AlterConfigs replaces a topic's whole dynamic config: give all of it again
    admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=EAGER_COMPACTION)])
    admin.close()
    stale = {r[0]: (r[1], r[2]) for r in db.fetchall("SELECT id, version, note FROM public.acct WHERE id BETWEEN 20 AND 29")}
    db.execute("DELETE FROM public.acct WHERE id BETWEEN 20 AND 29")
    dropped = {orjson.dumps({"id": i}) for i in stale}

    def tombstones_gone() -> bool:
        db.execute("UPDATE public.acct SET version = version + 1 WHERE id >= 50")
        wait_caught_up(db.dsn, slot, daemon)
        return not dropped & Counter(r.key for r in records()).keys()

    wait_for(tombstones_gone, 300, "the log cleaner to drop the tombstones", poll=1.5)
    # a new warehouse from what is left equals the source
    (tmp_path / "fresh").mkdir()
    fresh = _config(tmp_path / "fresh", db, servers, topic_prefix)
    Sink(fresh, tmp_path / "fresh" / "sink.log").once()
    source = {r[0]: (r[1], r[2]) for r in db.fetchall("SELECT id, version, note FROM public.acct")}
    assert _acct_state(spark, tmp_path / "fresh" / "warehouse") == source
    # the first job goes on over the gaps, but was away longer than delete.retention.ms:
    # it never sees those deletes, as docs/sinks/delta.md says
    sink.once()
    assert _acct_state(spark, warehouse) == {**source, **stale}
    assert daemon.stop() == 0
