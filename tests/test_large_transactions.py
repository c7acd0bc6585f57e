"""Large transactions: pgoutput proto v2 streaming (spilled to disk until commit) and bounded memory."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson
import psycopg
import pytest

from cdc.config import TopicConfig
from cdc.kafka.topics import TopicAdmin
from cdc.naming import topic_name
from tests.support import (
    DaemonProcess,
    peak_rss_mb,
    slot_of,
    source_table,
    start_streaming,
    topic_records,
    topic_table,
    wait_caught_up,
    write_config,
)

# A tiny logical_decoding_work_mem makes the walsender stream any transaction above 64 kB.
STREAM_OPTIONS = " options='-c logical_decoding_work_mem=64kB'"


def start(tmp_path: Path, db, servers: str, prefix: str, **sections) -> tuple[DaemonProcess, str]:
    config = write_config(tmp_path / "cdc.toml", db.dsn + STREAM_OPTIONS, servers, prefix, ["public.big"], **sections)
    slot = slot_of(prefix)
    return start_streaming(config, tmp_path / "daemon.log", db.dsn, slot), slot


def test_streamed_transactions_commit_abort_and_savepoints(tmp_path, db, broker_servers, topic_prefix):
    db.execute("CREATE TABLE public.big (id int PRIMARY KEY, payload text NOT NULL)")
    daemon, slot = start(
        tmp_path, db, broker_servers, topic_prefix, source={"protocol_version": 2, "streaming": True}
    )
    row = "repeat(md5(g::text), 4)"
    # committed, streamed in many chunks
    db.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(1, 5000) g")
    # aborted after being streamed: nothing of it may reach the topic
    with psycopg.connect(db.dsn) as conn:
        conn.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(100001, 105000) g")
        conn.rollback()
    # a rolled-back savepoint inside a committed streamed transaction
    with psycopg.connect(db.dsn) as conn:
        conn.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(200001, 203000) g")
        conn.execute("SAVEPOINT s")
        conn.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(300001, 303000) g")
        conn.execute("ROLLBACK TO SAVEPOINT s")
        conn.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(400001, 400100) g")
        conn.execute("UPDATE public.big SET payload = 'changed' WHERE id <= 10")
        conn.execute("DELETE FROM public.big WHERE id BETWEEN 11 AND 20")
        conn.commit()

    # two streamed transactions interleaved, committed in the opposite order of their start
    first = psycopg.connect(db.dsn)
    second = psycopg.connect(db.dsn)
    first.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(500001, 502000) g")
    second.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(600001, 602000) g")
    first.execute(f"INSERT INTO public.big SELECT g, {row} FROM generate_series(502001, 504000) g")
    second.commit()
    first.commit()
    first.close()
    second.close()

    wait_caught_up(db.dsn, slot, daemon, timeout=120)
    assert daemon.stop() == 0
    assert "streamed transaction" in daemon.output()  # really took the proto v2 streaming path

    keys = {k for k, _ in topic_records(broker_servers, topic_prefix, "public", "big")}
    for rolled_back in (100001, 300001, 303000):
        assert orjson.dumps({"id": rolled_back}) not in keys
    table = topic_table(broker_servers, topic_prefix, "public", "big")
    assert table.order_violations() == []
    assert table.state() == source_table(db.dsn, "SELECT id, payload FROM public.big")
    assert not any(Path(tmp_path / "spill").rglob("*.spill"))  # nothing left behind on disk


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [1, 2])
def test_million_row_transaction_in_bounded_memory(tmp_path, db, broker_servers, topic_prefix, protocol):
    """1,000,000 rows of ~300 bytes in one transaction: ~300 MB of events pass through a
    daemon whose peak RSS (with its producer process) stays far below that (streamed to the
    broker, or spilled to disk)."""
    db.execute("CREATE TABLE public.big (id int PRIMARY KEY, payload text NOT NULL)")
    daemon, slot = start(
        tmp_path, db, broker_servers, topic_prefix,
        source={"protocol_version": protocol, "streaming": protocol == 2},
        topic={"client": "confluent"},
    )
    db.execute("INSERT INTO public.big SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 1000000) g")
    peak: list[float] = []
    watcher_stop = threading.Event()

    def watch() -> None:
        while not watcher_stop.wait(0.5):
            if daemon.alive():
                peak.append(peak_rss_mb(daemon.proc.pid))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        wait_caught_up(db.dsn, slot, daemon, timeout=600)
        peak.append(peak_rss_mb(daemon.proc.pid))
    finally:
        watcher_stop.set()
        watcher.join()
    assert daemon.stop() == 0
    assert max(peak) < 250, f"peak RSS {max(peak):.0f} MB"
    admin = TopicAdmin(TopicConfig(bootstrap_servers=broker_servers))
    try:
        ends = admin.end_offsets([topic_name(topic_prefix, "public", "big")])
    finally:
        admin.close()
    assert sum(sum(parts.values()) for parts in ends.values()) == 1_000_000  # a fresh topic: one record per row
