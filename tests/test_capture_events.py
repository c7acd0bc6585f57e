"""End to end: real PostgreSQL, real broker, `cdc run` as a process; the events a user reads."""

from __future__ import annotations

import json
import re
import urllib.request

import orjson
import pytest

from cdc.events.records import TRUNCATE_KEY
from cdc.naming import topic_name
from compaction.table import position_of
from tests.support import (
    ENVELOPE_KEYS,
    SOURCE_KEYS,
    cdc,
    current_lsn,
    start_streaming,
    topic_records,
    wait_caught_up,
    wait_for,
)


def by_key(records):
    out: dict[bytes, list] = {}
    for key, value in records:
        out.setdefault(key, []).append(value)
    return out


@pytest.mark.fast
def test_every_op_has_the_exact_envelope(db, broker_servers, topic_prefix, run_daemon):
    db.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, qty int)")
    daemon, slot = run_daemon(["public.items"])
    db.execute("INSERT INTO public.items VALUES (1, 'apple', 1)")
    db.execute("UPDATE public.items SET qty = 2 WHERE id = 1")
    db.execute("DELETE FROM public.items WHERE id = 1")
    db.execute("INSERT INTO public.items VALUES (2, 'pear', 5)")
    db.execute("UPDATE public.items SET id = 3 WHERE id = 2")
    db.execute("TRUNCATE public.items")
    wait_caught_up(db.dsn, slot, daemon)
    k1, k2, k3 = (orjson.dumps({"id": i}) for i in (1, 2, 3))
    # the truncate clean-up's tombstone follows once the slot is confirmed past the truncate
    wait_for(lambda: by_key(topic_records(broker_servers, topic_prefix, "public", "items")).get(k3, [])[-1:] == [None],
             60, "the truncate clean-up's tombstone for id 3")
    assert daemon.stop() == 0

    records = topic_records(broker_servers, topic_prefix, "public", "items")
    keys = by_key(records)
    assert set(keys) == {k1, k2, k3, TRUNCATE_KEY}
    assert [v and v["op"] for v in keys[k1]] == ["c", "u", "d", None]
    assert [v and v["op"] for v in keys[k2]] == ["c", "d", None]  # the key change: d + tombstone on the old key
    # ... then c on the new key, and the truncate clean-up's tombstone for it
    assert [v and v["op"] for v in keys[k3]] == ["c", None]
    assert [v["op"] for v in keys[TRUNCATE_KEY]] == ["t"]

    create, update, delete, _ = keys[k1]
    for event in (create, update, delete):
        assert list(event) == ENVELOPE_KEYS
        assert list(event["source"]) == SOURCE_KEYS
        source = event["source"]
        assert source["version"].startswith("cdc-")
        assert (source["connector"], source["name"], source["db"]) == ("postgresql", topic_prefix, db.name)
        assert (source["schema"], source["table"], source["snapshot"], source["xmin"]) == ("public", "items", "false", None)
        commit, change = orjson.loads(source["sequence"])
        assert int(change) == source["lsn"] and int(commit) >= int(change)
        assert isinstance(source["txId"], int) and source["ts_us"] // 1000 == source["ts_ms"]
        assert event["transaction"] is None
    assert (create["before"], create["after"]) == (None, {"id": 1, "name": "apple", "qty": 1})
    assert (update["before"], update["after"]) == (None, {"id": 1, "name": "apple", "qty": 2})
    assert (delete["before"], delete["after"]) == ({"id": 1, "name": None, "qty": None}, None)
    old_key_delete = keys[k2][1]
    assert old_key_delete["before"] == {"id": 2, "name": None, "qty": None}
    assert keys[k3][0]["after"] == {"id": 3, "name": "pear", "qty": 5}
    assert old_key_delete["source"]["sequence"] == keys[k3][0]["source"]["sequence"]  # one UPDATE, one position
    truncate = keys[TRUNCATE_KEY][0]
    assert (truncate["before"], truncate["after"], truncate["source"]["table"]) == (None, None, "items")
    # positions rise along the transactions
    positions = [position_of(v) for v in (create, update, delete, keys[k2][0], keys[k3][0], truncate)]
    assert positions == sorted(positions)


def test_full_identity_sends_before_and_fills_toast(db, broker_servers, topic_prefix, run_daemon):
    db.execute("CREATE TABLE public.docs (id int PRIMARY KEY, body text, n int)")
    db.execute("CREATE TABLE public.notes (id int PRIMARY KEY, body text, n int)")
    db.execute("ALTER TABLE public.docs REPLICA IDENTITY FULL")
    # 64 kB of hex that compresses badly enough to be stored out of line (TOASTed)
    big = db.fetchall("SELECT string_agg(md5(g::text), '') FROM generate_series(1, 2000) g")[0][0]
    daemon, slot = run_daemon(["public.docs", "public.notes"])
    for table in ("docs", "notes"):
        db.execute(f"INSERT INTO public.{table} VALUES (1, %s, 1)", (big,))
        db.execute(f"UPDATE public.{table} SET n = 2 WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    assert "TOASTable columns (body) under REPLICA IDENTITY DEFAULT" in daemon.output()

    docs = [v for _, v in topic_records(broker_servers, topic_prefix, "public", "docs")]
    assert docs[1]["op"] == "u"
    assert docs[1]["before"] == {"id": 1, "body": big, "n": 1}
    assert docs[1]["after"] == {"id": 1, "body": big, "n": 2}
    notes = [v for _, v in topic_records(broker_servers, topic_prefix, "public", "notes")]
    assert notes[1]["before"] is None
    assert notes[1]["after"] == {"id": 1, "body": "__debezium_unavailable_value", "n": 2}


def test_key_bytes_do_not_depend_on_session_settings(db, broker_servers, topic_prefix, run_daemon):
    """Database defaults that change text output must not change key bytes (pinned settings)."""
    db.execute(f'ALTER DATABASE "{db.name}" SET TimeZone = \'Asia/Kolkata\'')
    db.execute(f'ALTER DATABASE "{db.name}" SET DateStyle = \'SQL, DMY\'')
    db.execute(f'ALTER DATABASE "{db.name}" SET IntervalStyle = \'sql_standard\'')
    db.execute(f'ALTER DATABASE "{db.name}" SET extra_float_digits = 0')
    db.execute(
        "CREATE TABLE public.k (at timestamptz, amount numeric(8,2), span interval, ratio float8, label text, v int, "
        "PRIMARY KEY (label, at, amount, span, ratio))"
    )
    daemon, slot = run_daemon(["public.k"])
    db.execute("INSERT INTO public.k VALUES ('2024-01-02 08:34:05.25+05:30', 1.5, '1 day 02:00:00', 0.1, 'x', 1)")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    # a second session of the daemon, after a restart, renders the same row's key identically
    daemon2 = start_streaming(daemon.config, daemon.log, db.dsn, slot)
    db.execute("UPDATE public.k SET v = 2")
    wait_caught_up(db.dsn, slot, daemon2)
    assert daemon2.stop() == 0

    expected = b'{"label":"x","at":"2024-01-02T03:04:05.25Z","amount":"1.50","span":93600000000,"ratio":0.1}'
    records = topic_records(broker_servers, topic_prefix, "public", "k")
    assert [key for key, _ in records] == [expected, expected]
    assert [v["op"] for _, v in records] == ["c", "u"]


def test_per_key_order_under_concurrent_writers(db, broker_servers, topic_prefix, run_daemon):
    import threading

    import psycopg

    db.execute("CREATE TABLE public.counters (id int PRIMARY KEY, n int NOT NULL)")
    daemon, slot = run_daemon(["public.counters"])
    db.execute("INSERT INTO public.counters SELECT g, 0 FROM generate_series(1, 20) g")

    def writer() -> None:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            for i in range(150):
                conn.execute("UPDATE public.counters SET n = n + 1 WHERE id = %s", (i % 20 + 1,))

    threads = [threading.Thread(target=writer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    for key, values in by_key(topic_records(broker_servers, topic_prefix, "public", "counters")).items():
        counts = [v["after"]["n"] for v in values]
        assert counts == list(range(len(counts))), key  # every version, in order, none skipped
        positions = [position_of(v) for v in values]
        assert positions == sorted(positions)
    assert sum(1 for _ in topic_records(broker_servers, topic_prefix, "public", "counters")) == 20 + 450


def test_status_and_metrics(db, broker_servers, topic_prefix, run_daemon, tmp_path):
    from cdc.local.process import free_port

    port = free_port()
    db.execute("CREATE TABLE public.m (id int PRIMARY KEY)")
    db.execute("INSERT INTO public.m SELECT generate_series(1, 7)")
    daemon, slot = run_daemon(["public.m"], daemon={"metrics_port": port})

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    # the initial snapshot's rows count as the table's events (and bytes) before any change streams
    wait_for(lambda: 'cdc_events_total{table="public.m"} 7.0' in scrape(), 20, "the snapshot's rows counted")
    produced = re.search(r"^cdc_bytes_total (\S+)$", scrape(), re.M)
    assert produced is not None and float(produced.group(1)) > 0
    db.execute("INSERT INTO public.m SELECT generate_series(8, 17)")
    wait_caught_up(db.dsn, slot, daemon)
    metrics = scrape()
    wait_for(lambda: 'cdc_events_total{table="public.m"} 17.0' in scrape(), 20, "the events counter")
    assert "cdc_last_acknowledged_lsn" in metrics and "cdc_lag_bytes" in metrics

    result = cdc("status", "--json", "--config", str(daemon.config))
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["slot"]["name"] == slot and status["slot"]["active"] is True
    assert status["slot"]["wal_status"] == "reserved"
    # caught up: the lag is at most a few WAL records the server wrote since, never the 10 streamed rows
    assert 0 <= status["slot"]["lag_bytes"] < 64 * 1024, status["slot"]
    assert status["slot"]["lag_bytes"] <= status["slot"]["retained_wal_bytes"]
    topic = topic_name(topic_prefix, "public", "m")
    assert sum(status["topics"][topic].values()) == 17
    human = cdc("status", "--config", str(daemon.config))
    assert f"slot {slot}: active" in human.stdout and topic in human.stdout
    assert daemon.stop() == 0
    before = current_lsn(db.dsn)
    db.execute("INSERT INTO public.m SELECT generate_series(1001, 2000)")
    written = current_lsn(db.dsn) - before
    behind = json.loads(cdc("status", "--json", "--config", str(daemon.config)).stdout)["slot"]
    assert behind["active"] is False and behind["lag_bytes"] >= written > 0  # stopped: the lag shows it
    tail = cdc("tail", "public.m", "--raw", "--config", str(daemon.config))
    assert tail.returncode == 0, tail.stderr
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert sorted(line["value"]["after"]["id"] for line in lines) == list(range(1, 18))  # the snapshot's 7 and the 10 streamed
