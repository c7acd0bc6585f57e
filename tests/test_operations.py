"""docs/operations.md, where a command does them: the slot's lifecycle (WAL kept while
the daemon is down, `cdc slot drop`, the re-snapshot that follows), a table removed from the
capture, and scaling past one slot (daemons on disjoint table sets). The least-privilege
capture role runs the end-to-end tier of tests/test_operator_face.py; adding a table is
tests/test_snapshot.py's, restarts without loss tests/test_durability.py's."""

from __future__ import annotations

import json

import pytest

from tests.support import (
    cdc,
    slot_of,
    start_streaming,
    topic_records,
    topic_table,
    wait_caught_up,
    write_config,
)


def _status(config) -> dict:
    result = cdc("status", "--json", "--config", str(config))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_slot_lifecycle_wal_kept_while_down_then_drop_and_resnapshot(tmp_path, db, broker_servers, topic_prefix):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.t SELECT g, 'first' FROM generate_series(1, 10) g")
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.t"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    try:
        wait_caught_up(db.dsn, slot, daemon)
        refused = cdc("slot", "drop", "--config", str(config), env={"CDC_SOURCE_SLOT_WAIT_S": "0"})
        assert refused.returncode == 1 and refused.stderr.startswith(f"error: slot {slot} is in use by PID ")
    finally:
        assert daemon.stop() == 0
    # the daemon is down: the slot keeps every byte of WAL written since, and says so
    before = _status(config)["slot"]["retained_wal_bytes"]
    db.execute("INSERT INTO public.t SELECT g, repeat('x', 1000) FROM generate_series(11, 3000) g")
    status = _status(config)["slot"]
    assert status["active"] is False and status["retained_wal_bytes"] > before + 3_000_000, status
    db.execute("DELETE FROM public.t WHERE id <= 5")  # deleted while the slot will be gone
    dropped = cdc("slot", "drop", "--config", str(config))
    assert dropped.returncode == 0, dropped.stderr
    assert dropped.stdout.startswith(f"dropped slot {slot} (it held back ")
    assert 'run cdc run with [snapshot] mode = "when_needed"' in dropped.stdout
    assert db.fetchall("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == [(0,)]
    assert cdc("slot", "drop", "--config", str(config)).stdout.strip() == f"slot {slot} does not exist: nothing to drop"
    # the default mode refuses a slot gone under a snapshot; when_needed takes a new one
    again = cdc("run", "--config", str(config))
    assert again.returncode == 1 and f"slot {slot} is gone but the topics hold a snapshot" in again.stderr
    daemon = start_streaming(config, tmp_path / "daemon2.log", db.dsn, slot, env={"CDC_SNAPSHOT_MODE": "when_needed"})
    try:
        db.execute("UPDATE public.t SET v = 'after' WHERE id = 6")
        wait_caught_up(db.dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0
    rows = topic_table(broker_servers, topic_prefix, "public", "t").state()
    assert sorted(k for k in rows) == sorted(json.dumps({"id": i}, separators=(",", ":")).encode() for i in range(6, 3001))
    assert rows[b'{"id":6}']["v"] == "after"  # and the rows deleted while the slot was gone are gone


def test_a_table_removed_from_the_capture_gets_no_more_events(tmp_path, db, broker_servers, topic_prefix):
    db.execute("CREATE TABLE public.kept (id int PRIMARY KEY); CREATE TABLE public.dropped (id int PRIMARY KEY)")
    slot = slot_of(topic_prefix)
    both = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.kept", "public.dropped"])
    daemon = start_streaming(both, tmp_path / "daemon.log", db.dsn, slot)
    try:
        db.execute("INSERT INTO public.kept VALUES (1); INSERT INTO public.dropped VALUES (1)")
        wait_caught_up(db.dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0
    one = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.kept"])
    daemon = start_streaming(one, tmp_path / "daemon.log", db.dsn, slot)
    try:
        db.execute("INSERT INTO public.kept VALUES (2); INSERT INTO public.dropped VALUES (2)")
        wait_caught_up(db.dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0
    assert [k for k, _ in topic_records(broker_servers, topic_prefix, "public", "kept")] in (
        [b'{"id":1}', b'{"id":2}'], [b'{"id":2}', b'{"id":1}'])
    assert [k for k, _ in topic_records(broker_servers, topic_prefix, "public", "dropped")] == [b'{"id":1}']
    # the publication still decodes it until its owner drops it there (docs/operations.md says how)
    assert db.fetchall(
        "SELECT tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1", ("p_" + topic_prefix.lower(),)
    ) == [("dropped",), ("kept",)]


@pytest.mark.fast
def test_two_daemons_on_disjoint_table_sets(tmp_path, db, broker_servers, topic_prefix):
    """Scaling past one slot: each daemon its own slot, publication and topic prefix."""
    db.execute("CREATE TABLE public.a (id int PRIMARY KEY); CREATE TABLE public.b (id int PRIMARY KEY)")
    daemons, configs = [], []
    for part, table in (("1", "public.a"), ("2", "public.b")):
        prefix = f"{topic_prefix}{part}"
        configs.append(write_config(tmp_path / f"cdc{part}.toml", db.dsn, broker_servers, prefix, [table]))
        daemons.append(start_streaming(configs[-1], tmp_path / f"daemon{part}.log", db.dsn, slot_of(prefix)))
    try:
        db.execute("INSERT INTO public.a SELECT generate_series(1, 500); INSERT INTO public.b SELECT generate_series(1, 300)")
        for part, daemon in zip("12", daemons, strict=True):
            wait_caught_up(db.dsn, slot_of(f"{topic_prefix}{part}"), daemon)
        statuses = [_status(config) for config in configs]
    finally:
        for daemon in daemons:
            assert daemon.stop() == 0
    assert len(topic_table(broker_servers, f"{topic_prefix}1", "public", "a").state()) == 500
    assert len(topic_table(broker_servers, f"{topic_prefix}2", "public", "b").state()) == 300
    assert [sorted(s["topics"]) for s in statuses] == [
        sorted(f"{topic_prefix}1.{t}" for t in ("public.a", "__cdc_heartbeat", "__cdc_metrics", "__cdc_schemas",
                                                 "__cdc_state")),
        sorted(f"{topic_prefix}2.{t}" for t in ("public.b", "__cdc_heartbeat", "__cdc_metrics", "__cdc_schemas",
                                                 "__cdc_state")),
    ]
    assert [s["slot"]["name"] for s in statuses] == [slot_of(f"{topic_prefix}1"), slot_of(f"{topic_prefix}2")]
