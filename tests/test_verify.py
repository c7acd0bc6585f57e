"""`cdc verify` on the real services: PostgreSQL, the topics, and the Delta, search and cache
stores filled by their sink jobs. One stack and one Spark session serve the module: the
report when every side agrees, while writers keep writing, after each side was tampered with,
and the tombstone horizon of the stopped sinks. PostgreSQL's SQL rendering is checked against
cdc's own renderer on a table wide over types first."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from click.testing import CliRunner

from cdc.cli import main
from cdc.config import Config, load
from cdc.kafka.heartbeat import newest_heartbeat
from cdc.kafka.producer import make_producer
from cdc.kafka.reader import read_topic
from cdc.naming import topic_name
from cdc.source.preflight import connect_catalog
from cdc.verify.postgres import SourceSide
from compaction.table import payload_of, position_of
from snapshot.state import deliver
from tests.support import (
    ACCT,
    DaemonProcess,
    Writers,
    cdc,
    current_lsn,
    slot_of,
    start_streaming,
    wait_caught_up,
    wait_for,
    write_config,
)

ROOT = Path(__file__).resolve().parent.parent
ROWS = 500
#: every store the product ships, each kept by its job in the module's stack
STORES = ("cache", "search", "delta", "postgres")
#: the sides of a report, in its order, as it names them (the read model's: PostgreSQL is the source's name)
SIDES = ("topic", "delta", "search", "cache", "read-model")
W = max(len(s) for s in SIDES)  # the report's column of side names
WIDE = """
CREATE TABLE public.wide (
  id int PRIMARY KEY, b bool, i8 int8, f4 float4, f8 float8, n numeric, n2 numeric(12,2), m money, t text,
  ch char(5), u uuid, by bytea, d date, tm time, tm3 time(3), ts timestamp, ts3 timestamp(3), tz timestamptz,
  iv interval, ia int[], ta text[], na numeric[], ip inet, r int4range, ia2 int[][]
)"""
WIDE_ROWS = r"""
INSERT INTO public.wide VALUES
 (1, true, 9223372036854775807, 1.1, 1e300, 'NaN', 123.40, '-1234.56', E'a"b\\c\n\u0001é€😀', 'ab',
  '6f1d7a2c-4f0e-4b5e-9d3a-2b1c0d9e8f7a', '\x00ff10', '2024-02-29', '24:00:00', '01:02:03.456',
  '2024-01-02 03:04:05.678901', '2024-01-02 03:04:05.678', '2024-01-02 03:04:05.12+05:30',
  '1 year 2 mons 3 days 04:05:06.5', '{1,NULL,3}', '{"a b","c,d",NULL,"e\"f"}', '{1.50,NaN}', '10.0.0.1/8', '[1,5)',
  '{{1,2},{3,4}}'),
 (2, false, -1, -0.0, 100, '0.00000001', -0.5, 0, '', '', NULL, '', '1969-12-31', '00:00:00', '23:59:59.999',
  '1900-03-15 12:00:00', '1970-01-01 00:00:00.001', '1999-12-31 23:59:59.999999+00', '-1 mon -2 days -00:00:01.25',
  '{}', '{}', '{}', NULL, 'empty', NULL),
 (3, NULL, NULL, 'NaN', '-Infinity', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)
"""


class Stack:
    """The module's pipeline: a database, its daemon, and the three stores' jobs in this process."""

    def __init__(self, dsn: str, config: Path, spark: Any) -> None:
        self.dsn, self.config_path, self.spark = dsn, config, spark
        self.config: Config = load(config)
        self.acct = topic_name(self.config.topic.prefix, "public", "acct")

    def apply(self, store: str, until: Callable[[], bool] | None = None) -> None:
        """The store's job on the module's Spark session: `--once`, or streaming until `until()`."""
        from sinks import stores
        from sinks.query import ensure_topics
        from sinks.runner import check, keep_running

        check(self.config, store)
        ensure_topics(self.config)
        keep_running(self.spark, self.config, stores.build(store, self.spark, self.config), until is None,
                     until or (lambda: False))

    def verify(self, *args: str, env: dict[str, str] | None = None) -> Any:
        """`cdc verify` in this process (its Delta side on the module's Spark session, if it needs one)."""
        return CliRunner().invoke(main, ["verify", "--config", str(self.config_path), *args], env=env,
                                  catch_exceptions=False)


@pytest.fixture(scope="module")
def stack(pg, broker_servers, opensearch, redis_server, spark, tmp_path_factory) -> Iterator[Stack]:
    name = f"t_verify_{uuid.uuid4().hex[:8]}"
    dsn = pg.create_database(name)
    read_model = pg.create_database(f"{name}_read_model")
    tmp = tmp_path_factory.mktemp("verify")
    prefix = "t" + uuid.uuid4().hex[:12]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ACCT)
        conn.execute(f"INSERT INTO public.acct SELECT g, 1, 'n' || g FROM generate_series(1, {ROWS}) g")
        conn.execute(WIDE)
        conn.execute(WIDE_ROWS)
    config = write_config(
        tmp / "cdc.toml", dsn, broker_servers, prefix, ["public.acct", "public.wide"],
        spark={"checkpoint_dir": str(tmp / "checkpoints")}, delta={"path": str(tmp / "warehouse")},
        search={"url": opensearch.url, "replicas": 0}, cache={"url": redis_server.url}, postgres={"dsn": read_model},
    )
    slot = slot_of(prefix)
    daemon = start_streaming(config, tmp / "daemon.log", dsn, slot)
    DaemonProcess.started.remove(daemon)  # the module's, not one test's (conftest kills those after each test)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE public.acct SET version = 2, note = 'u' WHERE id % 5 = 0")
            conn.execute("DELETE FROM public.acct WHERE id % 7 = 0")
            conn.execute(f"INSERT INTO public.acct SELECT g, 1, 'late' FROM generate_series({ROWS + 1}, {ROWS + 50}) g")
        wait_caught_up(dsn, slot, daemon)
        found = Stack(dsn, config, spark)
        for store in STORES:
            found.apply(store)
        yield found
    finally:
        daemon.stop()
        pg.drop_database(name)
        pg.drop_database(f"{name}_read_model")


def _report(result: Any) -> list[str]:
    """The report's lines, without the timing of its last line."""
    lines = result.output.strip().splitlines()
    return [line.split(" (")[0] if line.startswith("verify: ") else line for line in lines]


def test_postgres_sql_renders_every_type_as_cdc_does(stack: Stack) -> None:
    """The SQL that hashes PostgreSQL's rows where they are gives the canonical form of cdc's own
    renderer (the path a table takes when SQL cannot), on edge values of every type it handles."""
    catalog = connect_catalog(stack.config)
    side = SourceSide(stack.config, catalog)
    try:
        side.snapshot()
        table = side.describe(catalog.resolve(["public.wide"])[0][0])
        assert table.why_python is None
        in_python = replace(table, key_sql=None, row_sql=None)
        keys = [b'{"id":1}', b'{"id":2}', b'{"id":3}']
        assert {k: f.values for k, f in side.fetch(table, keys).items()} == dict(side._rendered(in_python))
        assert side.digest(table) == side.digest(in_python)
    finally:
        side.close()
        catalog.close()


def test_the_warehouse_hashes_in_spark_sql_as_in_python(stack: Stack) -> None:
    """The warehouse's digest as Spark expressions equals the one its executors compute in
    Python, on the wide table's columns Spark SQL renders (every type but floats, JSON and
    nested arrays)."""
    from compaction.verify import TableSpec
    from sinks.stores.delta.read_spark import DeltaSide, _merge, _Rows

    catalog = connect_catalog(stack.config)
    source = SourceSide(stack.config, catalog)
    try:
        source.snapshot()
        wide = source.describe(catalog.resolve(["public.wide"])[0][0]).spec
    finally:
        source.close()
        catalog.close()
    native = tuple(c for c in wide.columns if c.name not in ("f4", "f8", "ia2"))
    spec = TableSpec(wide.topic, wide.display, native, 4)
    side = DeltaSide(stack.spark, stack.config.delta.path)
    hashed = side._hashed(spec)
    assert hashed is not None  # every column rendered by Spark
    from pyspark.sql import functions as F

    in_spark = {int(s): (int(n), int(x)) for s, n, x in hashed.groupBy("s").agg(F.count("h"), F.bit_xor("h")).collect()}
    frame, kinds = side._frame(spec)  # type: ignore[misc]
    in_python = dict(frame.rdd.mapPartitions(_Rows(spec.columns, kinds, spec.bits)).reduceByKey(_merge).collect())
    assert in_spark == in_python and sum(n for n, _ in in_spark.values()) == 3
    assert side._hashed(wide) is None  # floats: the executors' Python
    # delta-rs reads the table Spark wrote as Spark does, on every column of the wide table
    from sinks.stores.delta.read import DeltaRs, DeltaRsSide

    frame, kinds = side._frame(wide)  # type: ignore[misc]
    spark_python = dict(frame.rdd.mapPartitions(_Rows(wide.columns, kinds, wide.bits)).reduceByKey(_merge).collect())
    reader = DeltaRs()
    try:
        direct = DeltaRsSide(reader, stack.config.delta.path)
        assert direct.digest(wide) == spark_python
        keys = [b'{"id":1}', b'{"id":2}', b'{"id":3}']
        assert direct.fetch(wide, keys) == side.fetch(wide, keys)
    finally:
        reader.close()


@pytest.mark.integration
def test_a_snapshot_sees_every_commit_at_or_below_its_visible_lsn(tmp_path: Path) -> None:
    """PostgreSQL writes a commit's WAL record before the commit becomes visible. Held in
    between (by a synchronous standby that never answers), a delete is below the WAL's position
    but unseen: the snapshot waits for it, and says so when it never comes. (A store that
    applied that delete, judged against a snapshot blind to it, was a false `missing`.)"""
    from cdc.local.postgres import LocalPostgres
    from cdc.verify.postgres import take_snapshot

    cluster = LocalPostgres(tmp_path).start()
    try:
        dsn = cluster.dsn()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("CREATE TABLE t (id int PRIMARY KEY)")
            admin.execute("INSERT INTO t VALUES (1), (2)")

            def hold(on: bool) -> None:
                admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{'nobody' if on else ''}'")
                admin.execute("SELECT pg_reload_conf()")

            def delete(row: int) -> None:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("DELETE FROM t WHERE id = %s", (row,))

            def held(count: int) -> bool:
                row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'").fetchone()
                return row is not None and row[0] == count

            hold(True)
            writer = threading.Thread(target=delete, args=(1,))
            writer.start()
            wait_for(lambda: held(1), 30, "the delete held after its commit record")
            threading.Timer(1.0, hold, args=(False,)).start()
            with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as now:
                taken = take_snapshot(conn, now)
                seen = conn.execute("SELECT array_agg(id ORDER BY id) FROM t").fetchone()[0]  # type: ignore[index]
            writer.join(30)
            assert (seen, taken.visible <= taken.lsn) == ([2], True)

            hold(True)  # never answered: the snapshot says why it cannot see every commit
            writer = threading.Thread(target=delete, args=(2,))
            writer.start()
            wait_for(lambda: held(1), 30, "the second delete held")
            with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as now:
                with pytest.raises(TimeoutError, match=r"^transaction \d+ committed but is not visible after 1 s: "
                                   r"a synchronous standby holds it back \(see pg_stat_replication\); verify again "
                                   r"once it answers$"):
                    take_snapshot(conn, now, settle_s=1.0)
            hold(False)
            writer.join(30)
    finally:
        cluster.close()


@pytest.mark.fast
def test_clean_every_side_agrees(stack: Stack) -> None:
    result = stack.verify()
    assert result.exit_code == 0, result.output
    rows = ROWS + 50 - ROWS // 7
    assert _report(result)[1:] == [
        f"public.acct: postgres {rows:,} rows",
        *(f"  {side:<{W}}  {rows} rows  ok" for side in SIDES),
        "public.wide: postgres 3 rows",
        *(f"  {side:<{W}}  3 rows  ok" for side in SIDES),
        "verify: every side agrees with PostgreSQL",
    ]
    as_json = json.loads(stack.verify("--json", "--tables", "public.wide", "--stores", "cache").output)
    assert as_json["ok"] is True, json.dumps(as_json)
    assert as_json["sides"] == ["topic", "cache"]
    assert [(t["table"], [s["side"] for s in t["sides"]]) for t in as_json["tables"]] == [("public.wide", ["topic", "cache"])]
    assert as_json["tables"][0]["sides"][1]["rows"] == {"postgres": 3, "cache": 3}


def test_while_writers_keep_writing_every_side_still_agrees(stack: Stack) -> None:
    """Writers change `public.acct` while the cache and search jobs stream and verify runs: the
    changes in flight are told from mismatches. (The warehouse's job is left out here: its
    batches take 15-30 s on two cores, and each round would wait that long for it.)"""
    stop = threading.Event()
    jobs = [threading.Thread(target=stack.apply, args=(s, stop.is_set)) for s in ("cache", "search")]
    with Writers(stack.dsn, keys=ROWS + 100, pause_s=0.05):
        for job in jobs:
            job.start()
        try:
            time.sleep(5)
            result = stack.verify("--stores", "cache,search")
        finally:
            stop.set()
            for job in jobs:
                job.join(300)
            stuck = [job.name for job in jobs if job.is_alive()]
            if stuck:  # a job that does not stop would stream on into the module's later tests
                for query in stack.spark.streams.active:
                    query.stop()
                for job in jobs:
                    job.join(60)
    assert not stuck, f"streaming jobs still running 300 s after their stop was asked: {stuck}"
    assert result.exit_code == 0, result.output
    assert _report(result)[-1] == "verify: every side agrees with PostgreSQL"
    # each side was counted after PostgreSQL's snapshot: a count that differs from PostgreSQL's
    # says so, naming the snapshot, the keys that changed meanwhile and where they were checked again
    lines = _report(result)
    snapshot = lines[0].split(" at LSN ")[1].split()[0]
    postgres = int(lines[1].removeprefix("public.acct: postgres ").split()[0].replace(",", ""))
    sides = lines[2:lines.index(next(line for line in lines if line.startswith("public.wide:")))]
    counted = [line for line in sides if line.startswith("  ") and not line.startswith("    ")]
    assert [line.split()[0] for line in counted] == ["topic", "cache", "search"], result.output
    why = f"; counted after the snapshot at LSN {snapshot}: "
    for line in counted:
        assert int(line.split()[1].replace(",", "")) == postgres or why in line, result.output
    assert any(why in line and " changed in between" in line and "equal to PostgreSQL when checked again (up to LSN 0/"
               in line for line in counted), result.output


def _tamper_topic(stack: Stack, key: bytes, note: str) -> None:
    """A record written by hand over the key's latest one, one position higher."""
    records = [r for r in read_topic(stack.config.topic, stack.acct) if r.key == key]
    event = payload_of(records[-1].value)  # type: ignore[arg-type]
    commit, change = position_of(event)
    event["after"] = {**event["after"], "note": note}
    event["source"]["sequence"] = orjson.dumps([str(commit), str(change + 1)]).decode()
    producer = make_producer(stack.config.topic, {stack.acct: stack.config.topic.partitions})
    producer.send(stack.acct, key, orjson.dumps(event))
    deliver(producer, 30)
    producer.close()


def test_tampered_sides_are_reported_and_exit_1(stack: Stack) -> None:
    import redis

    from sinks.stores.delta.store import table_path
    from sinks.stores.search.opensearch import path_of as _path
    from sinks.stores.search.shapes import alias_name
    from sinks.stores.search.store import Settings

    wait_caught_up(stack.dsn, slot_of(stack.config.topic.prefix))
    target = current_lsn(stack.dsn)  # a --once run is complete up to the last heartbeat it reads: one past the writes
    wait_for(lambda: newest_heartbeat(stack.config.topic) >= target, 60, "a heartbeat past the writers' last commit")
    for store in STORES:  # what the writers left, applied
        stack.apply(store)
    with psycopg.connect(stack.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT count(*) FROM public.acct").fetchone()[0]  # type: ignore[index]
        kept = conn.execute("SELECT id, version, note FROM public.acct ORDER BY id LIMIT 3").fetchall()
    (a, _, _), (b, _, _), (c, _, note_c) = kept
    gone, added, changed = (f'{{"id":{i}}}' for i in (a, 99999, b))
    # the topic: a record by hand over the key's latest
    _tamper_topic(stack, f'{{"id":{c}}}'.encode(), "tampered")
    # the cache: a row deleted, one added, one changed
    cache = redis.Redis.from_url(stack.config.cache.url)
    cache.delete(f"{stack.acct}:{gone}")
    cache.set(f"{stack.acct}:{added}", orjson.dumps({"id": 99999, "version": 1, "note": "added"}))
    cache.set(f"{stack.acct}:{changed}", orjson.dumps({"id": b, "version": -7, "note": "changed"}))
    # the index: the same, through its alias
    client = Settings.of(stack.config.search, stack.config.topic.prefix).client()
    index = alias_name(stack.acct)
    client.ok("DELETE", f"/{index}/_doc/{_path(gone)}?refresh=true")
    client.ok("PUT", f"/{index}/_doc/{_path(added)}?refresh=true", {"id": 99999, "version": 1, "note": "added"})
    client.ok("PUT", f"/{index}/_doc/{_path(changed)}?refresh=true", {"id": b, "version": -7, "note": "changed"})
    # the warehouse's current/ table
    current = f"delta.`{table_path(stack.config.delta.path, 'current', stack.acct)}`"
    stack.spark.sql(f"DELETE FROM {current} WHERE _cdc_key = '{gone}'")
    stack.spark.sql(f"INSERT INTO {current} (id, version, note, _cdc_key) VALUES (99999, 1, 'added', '{added}')")
    stack.spark.sql(f"UPDATE {current} SET version = -7, note = 'changed' WHERE _cdc_key = '{changed}'")
    # the read model's table
    with psycopg.connect(stack.config.postgres.dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM cdc_public.acct WHERE _cdc_key = %s", (gone,))
        conn.execute("INSERT INTO cdc_public.acct (_cdc_key, _cdc_lsn, _cdc_seq, _cdc_partition, _cdc_offset, id, "
                     "version, note) VALUES (%s, 1, 1, 0, 0, 99999, 1, 'added')", (added,))
        conn.execute("UPDATE cdc_public.acct SET version = -7, note = 'changed' WHERE _cdc_key = %s", (changed,))

    result = stack.verify("--tables", "public.acct")
    assert result.exit_code == 1, result.output
    store_lines = [
        "MISMATCH: 1 missing, 1 extra, 1 different",
        f"    missing {gone}",
        f"    extra {added}",
        f"    different {changed}; version: postgres {kept[1][1]}, {{side}} -7; note: postgres \"{kept[1][2]}\", {{side}} \"changed\"",
    ]
    lines = _report(result)
    assert lines[1:3] == [f"public.acct: postgres {rows:,} rows",
                          f"  {'topic':<{W}}  {rows} rows  MISMATCH: 0 missing, 0 extra, 1 different"]
    assert lines[3] == f"    different {{\"id\":{c}}}; note: postgres \"{note_c}\", topic \"tampered\""
    for i, side in enumerate(SIDES[1:]):
        at = 4 + 4 * i
        assert lines[at] == f"  {side:<{W}}  {rows} rows  {store_lines[0]}"
        expected = [line.replace("{side}", side) for line in store_lines[1:]]
        assert sorted(lines[at + 1:at + 4]) == sorted(expected)
    assert lines[-1] == "verify: 13 mismatches"
    as_json = json.loads(stack.verify("--tables", "public.acct", "--json").output)
    sides = {s["side"]: s for s in as_json["tables"][0]["sides"]}
    assert as_json["ok"] is False
    assert {n: (s["missing"], s["extra"], s["different"]) for n, s in sides.items()} == {
        "topic": (0, 0, 1), "delta": (1, 1, 1), "search": (1, 1, 1), "cache": (1, 1, 1), "read-model": (1, 1, 1),
    }
    # the warehouse's small table was read with delta-rs, in a process that starts no Spark: the same verdicts
    assert sides["delta"]["reader"] == "delta-rs"
    checks = stack.config_path.parent / "no-spark.json"
    alone = subprocess.run(
        [sys.executable, "-c", _WITHOUT_SPARK, str(checks), "verify", "--config", str(stack.config_path), "--json",
         "--tables", "public.acct", "--stores", "delta"],
        capture_output=True, text=True, timeout=600,
    )
    assert json.loads(checks.read_text()) == {"exit": 1, "spark_context": False, "java": []}, alone.stderr[-2000:]
    delta = {s["side"]: s for s in json.loads(alone.stdout)["tables"][0]["sides"]}["delta"]
    assert (delta["reader"], delta["missing"], delta["extra"], delta["different"]) == ("delta-rs", 1, 1, 1)
    assert sorted(e["key"] for e in delta["examples"]) == sorted([gone, added, changed])
    # and Spark, told to read it, names the same rows the same way
    forced = stack.verify("--tables", "public.acct", "--stores", "delta", env={"CDC_DELTA_VERIFY_READER": "spark"})
    assert forced.exit_code == 1, forced.output
    spaced = [" ".join(line.split()) for line in _report(forced)]  # (its column of side names is narrower)
    assert spaced[4] == " ".join(lines[4].split()) and sorted(spaced[5:8]) == sorted(line.strip() for line in lines[5:8])
    as_spark = json.loads(stack.verify("--tables", "public.acct", "--stores", "delta", "--json",
                                       env={"CDC_DELTA_VERIFY_READER": "spark"}).output)
    assert as_spark["tables"][0]["sides"][1]["reader"] == "spark"


# `cdc verify` in a process of its own, then whether it started Spark: a SparkContext, or a JVM
# among its descendants (Spark's driver runs in one)
_WITHOUT_SPARK = r"""
import json, os, re, sys
from pathlib import Path
from cdc.cli import main
try:
    main(sys.argv[2:], standalone_mode=False)
    code = 0
except SystemExit as exc:
    code = exc.code
def descendants(pid):
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            parent = re.search(r"^PPid:\s+(\d+)$", status.read_text(), re.M)
        except OSError:
            continue
        if parent and int(parent.group(1)) == pid:
            child = int(status.parent.name)
            out += [child, *descendants(child)]
    return out
def command(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
pyspark = sys.modules.get("pyspark")
Path(sys.argv[1]).write_text(json.dumps({
    "exit": code,
    "spark_context": pyspark is not None and pyspark.SparkContext._active_spark_context is not None,
    "java": [command(p) for p in descendants(os.getpid()) if "java" in command(p)],
}))
"""


def test_the_tombstone_horizon_of_stopped_sinks(stack: Stack) -> None:
    """With delete.retention.ms shortened to 60 s and the sinks stopped while the source keeps
    changing: fine at first, a warning past half of it, a problem past it (`--check`: 0, 1, 2).
    (60 s, not less: late in a full run `cdc status` takes seconds a call, and a warning window
    of 10 s was missed between two calls.)"""
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=stack.config.topic.bootstrap_servers)
    try:
        for table in ("acct", "wide"):
            topic = topic_name(stack.config.topic.prefix, "public", table)
            admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs={"delete.retention.ms": "60000"})],
                                incremental=True)
    finally:
        admin.close()
    seen: list[tuple[int, float]] = []  # each status call's exit code and seconds, for a failure's message

    def status() -> tuple[int, str]:
        with psycopg.connect(stack.dsn, autocommit=True) as conn:  # the source keeps changing
            # an upsert: an UPDATE of a row an earlier test's writers deleted changes nothing
            conn.execute("INSERT INTO public.acct VALUES (1, 1, 'horizon') ON CONFLICT (id) "
                         "DO UPDATE SET version = acct.version + 1")
        started = time.monotonic()
        done = cdc("status", "--check", "--config", str(stack.config_path))
        seen.append((done.returncode, round(time.monotonic() - started, 1)))
        return done.returncode, done.stdout

    code, text = status()
    assert code == 0, text
    code, text = wait_for(lambda: (lambda r: r if r[0] == 1 else None)(status()), 150, "a warning", poll=1,
                          detail=lambda: f"status calls (exit code, seconds): {seen}")
    assert "  warning: sink cache is " in text
    assert "tombstones may be dropped 1.0 min after they are written (delete.retention.ms of " in text
    assert "get it applying again (cdc sink cache) within " in text
    code, text = wait_for(lambda: (lambda r: r if r[0] == 2 else None)(status()), 150, "past the horizon", poll=1,
                          detail=lambda: f"status calls (exit code, seconds): {seen}")
    for store in ("cache", "search", "delta"):
        assert f"  problem: sink {store} is " in text
    assert "past the tombstone horizon (delete.retention.ms of " in text
    described = cdc("topics", "describe", "--config", str(stack.config_path)).stdout
    assert f"{stack.acct}" in described and "problem (loses data): delete.retention.ms=60000: shorter than the longest sink lag" in described
