"""Snapshots end to end: real PostgreSQL, real broker, `cdc run` / `cdc snapshot` as processes.

What a user checks: the topic read as a table equals the source table, no key's last
record is older than another record of it, and every row's history in the topic is
contiguous (the snapshot and the stream meet exactly: no change lost, none applied twice).
"""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

import psycopg

from cdc import config as cdc_config
from cdc.config import TopicConfig
from cdc.events import TRUNCATE_KEY
from cdc.naming import topic_name
from cdc.replication import parse_lsn
from compaction.reader import TopicRecord
from compaction.table import TopicTable, build, payload_of, position_of
from snapshot.state import SnapshotState, load_state
from tests.support import (
    DaemonProcess,
    cdc,
    slot_active,
    slot_of,
    source_table,
    wait_caught_up,
    wait_for,
    write_config,
)

ACCT = "CREATE TABLE public.acct (id int PRIMARY KEY, version int NOT NULL, note text)"


# -- helpers ------------------------------------------------------------------------------------
class Writers:
    """Concurrent inserts, updates and deletes on public.acct until stopped. Every update
    raises `version` by one; an insert starts a row at version 1."""

    def __init__(self, dsn: str, threads: int = 2, keys: int = 1000, hot: int = 200, pause_s: float = 0.002) -> None:
        self.dsn, self.keys, self.hot, self.pause_s = dsn, keys, hot, pause_s
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.commits = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not self.errors, self.errors

    def _key(self, rng: random.Random) -> int:
        return rng.randrange(self.hot) if rng.random() < 0.6 else rng.randrange(self.keys)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    key = self._key(rng)
                    roll = rng.random()
                    with conn.transaction():
                        if roll < 0.4:
                            conn.execute(
                                "INSERT INTO public.acct VALUES (%s, 1, %s) ON CONFLICT (id) "
                                "DO UPDATE SET version = acct.version + 1, note = excluded.note",
                                (key, f"w{seed}-{rng.random()}"),
                            )
                        elif roll < 0.88:
                            conn.execute(
                                "UPDATE public.acct SET version = version + 1, note = %s WHERE id = %s",
                                (f"u{seed}-{rng.random()}", key),
                            )
                        else:
                            conn.execute("DELETE FROM public.acct WHERE id = %s", (key,))
                        if rng.random() < 0.2:  # some multi-row transactions
                            conn.execute(
                                "UPDATE public.acct SET version = version + 1 WHERE id = %s", (self._key(rng),)
                            )
                    self.commits += 1
                    time.sleep(self.pause_s)
        except BaseException as exc:  # noqa: BLE001 (reported by __exit__)
            self.errors.append(exc)


def populate(db, rows: int) -> None:
    db.execute(ACCT)
    db.execute(
        "INSERT INTO public.acct SELECT g, 1, 'seed ' || g FROM generate_series(0, %s) g", (rows - 1,)
    )
    db.execute("ANALYZE public.acct")


def read_records(servers: str, prefix: str, schema: str, table: str) -> list[TopicRecord]:
    """Every record of the table's topic, each partition in offset order.

    Not compaction.reader.read_topic: it fetches all partitions at once, and noida-db answers
    a fetch with everything up to the end, ignoring fetch_max_bytes; past kafka-python's
    100 MB frame limit (~190k snapshot events) that fails with "Invalid frame length". So
    this reads one partition at a time and accepts large frames."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    topic = topic_name(prefix, schema, table)
    consumer = KafkaConsumer(
        bootstrap_servers=servers.split(","), group_id=None, enable_auto_commit=False,
        receive_message_max_bytes=1_000_000_000,
    )
    out: list[TopicRecord] = []
    try:
        partitions = consumer.partitions_for_topic(topic)
        assert partitions, f"topic {topic} does not exist"
        for p in sorted(partitions):
            tp = TopicPartition(topic, p)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            end = consumer.end_offsets([tp])[tp]
            deadline = time.monotonic() + 120
            while consumer.position(tp) < end:
                assert time.monotonic() < deadline, f"no progress reading {topic}[{p}]"
                for records in consumer.poll(timeout_ms=1000).values():
                    out.extend(TopicRecord(topic, p, r.offset, r.key, r.value) for r in records if r.offset < end)
    finally:
        consumer.close()
    return out


def events(records: list[TopicRecord]) -> list[tuple[bytes, dict | None]]:
    return [(r.key, None if r.value is None else payload_of(r.value)) for r in records]


def by_key(records: list[TopicRecord]) -> dict[bytes, list[dict | None]]:
    out: dict[bytes, list[dict | None]] = {}
    for key, event in events(records):
        out.setdefault(key, []).append(event)
    return out


def assert_equals_source(table: TopicTable, dsn: str, sql: str, key: str = "id") -> None:
    """The topic read as a table equals the source rows, and compaction keeps no stale record."""
    assert table.order_violations() == []
    expected = source_table(dsn, sql, key)
    got = table.state()
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    assert not missing and not extra, f"missing {len(missing)} keys {missing[:5]}, extra {len(extra)} {extra[:5]}"
    wrong = sorted(k for k in expected if got[k] != expected[k])
    assert not wrong, f"{len(wrong)} rows differ, e.g. {wrong[0]!r}: topic {got[wrong[0]]} != source {expected[wrong[0]]}"


def history_problems(records: list[TopicRecord]) -> list[str]:
    """Per key, in offset order: a row's life starts with an `r` or `c` event at any version,
    every update is exactly one version above the previous event, a delete ends the life.
    Anything else is a change lost or applied twice where the snapshot meets the stream."""
    problems: list[str] = []
    alive: dict[bytes, int | None] = {}
    for key, event in events(records):
        if key == TRUNCATE_KEY:
            problems.append("unexpected truncate event")
            continue
        if event is None:  # tombstone after a delete
            if alive.get(key) is not None:
                problems.append(f"{key!r}: tombstone without a delete before it")
            alive[key] = None
            continue
        op, prev = event["op"], alive.get(key)
        if op == "d":
            if prev is None:
                problems.append(f"{key!r}: delete of a row the topic does not hold")
            alive[key] = None
            continue
        version = event["after"]["version"]
        if op in ("r", "c"):
            if prev is not None:
                problems.append(f"{key!r}: {op} at version {version} while the row exists at version {prev}")
        elif op == "u":
            if prev is None:
                problems.append(f"{key!r}: update to version {version} of a row the topic does not hold")
            elif version != prev + 1:
                problems.append(f"{key!r}: version {prev} followed by {version}")
        else:
            problems.append(f"{key!r}: unexpected op {op}")
        alive[key] = version
    return problems


def position_regressions(records: list[TopicRecord]) -> list[bytes]:
    """Keys with an event at a lower position than an earlier event of theirs (offset order)."""
    last: dict[bytes, tuple[int, int]] = {}
    bad: list[bytes] = []
    for key, event in events(records):
        if event is None:
            continue
        pos = position_of(event)
        if pos < last.get(key, (-1, -1)):
            bad.append(key)
        last[key] = pos
    return bad


def state_of(config: Path, **env: str) -> SnapshotState | None:
    return load_state(cdc_config.load(config, environ=env))


def created_at(daemon: DaemonProcess, slot: str) -> int:
    """The slot's consistent point, from the daemon's log line."""
    found = re.search(rf"created slot {re.escape(slot)} at ([0-9A-F]+/[0-9A-F]+)", daemon.output())
    assert found, daemon.output()[-3000:]
    return parse_lsn(found.group(1))


def wait_streaming(daemon: DaemonProcess, dsn: str, slot: str, timeout: float = 120) -> None:
    def streaming() -> bool:
        assert daemon.alive(), daemon.output()[-3000:]
        return slot_active(dsn, slot) and "streaming from" in daemon.output()

    wait_for(streaming, timeout, "the daemon to stream")


# -- 1. the aligned initial snapshot -------------------------------------------------------------
def test_aligned_snapshot_under_concurrent_writes(tmp_path, db, broker_servers, topic_prefix):
    populate(db, 20000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"],
        snapshot={"parallelism": 2, "split_rows": 4000},
    )
    slot = slot_of(topic_prefix)
    with Writers(db.dsn, keys=21000, hot=300) as writers:
        held = psycopg.connect(db.dsn)  # a write transaction open across the slot's creation
        held.execute("INSERT INTO public.acct VALUES (-1, 1, 'held open')")
        held.execute("UPDATE public.acct SET version = version + 1, note = 'held' WHERE id = 19999")
        daemon = DaemonProcess(config, tmp_path / "daemon.log").start()
        time.sleep(3)
        # CREATE_REPLICATION_SLOT waits for every open write transaction
        assert daemon.alive() and "created slot" not in daemon.output(), daemon.output()[-3000:]
        held.commit()
        held.close()
        wait_streaming(daemon, db.dsn, slot)
        time.sleep(2)  # streaming under the writers, too
        assert writers.commits > 200
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    consistent_point = created_at(daemon, slot)

    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    assert history_problems(records) == []
    assert position_regressions(records) == []
    reads = [e for _, e in events(records) if e is not None and e["op"] == "r"]
    # the held transaction committed before the consistent point: its rows are snapshot reads
    held_reads = {e["after"]["id"]: e["after"] for e in reads if e["after"]["id"] in (-1, 19999)}
    assert held_reads == {
        -1: {"id": -1, "version": 1, "note": "held open"}, 19999: {"id": 19999, "version": 2, "note": "held"},
    }
    assert len(reads) >= 20000 - 300  # the writers delete a few rows before the snapshot
    assert {position_of(e) for e in reads} == {(consistent_point, 0)}
    streamed = [e for _, e in events(records) if e is not None and e["op"] != "r"]
    assert streamed and min(position_of(e) for e in streamed) > (consistent_point, 0)
    state = state_of(config)
    assert state is not None and (state.initial, state.done) == ("done", ["public.acct"])


def topic_size(servers: str, prefix: str, schema: str, table: str) -> int:
    """Records in the table's topic so far (sum of the partitions' end offsets)."""
    from cdc.topics import TopicAdmin

    admin = TopicAdmin(TopicConfig(bootstrap_servers=servers))
    try:
        return sum(admin.end_offsets([topic_name(prefix, schema, table)]).get(topic_name(prefix, schema, table), {}).values())
    finally:
        admin.close()


def children_of(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        found = re.search(r"^PPid:\s+(\d+)$", text, re.M)
        if found and int(found.group(1)) == pid:
            out.append(int(status.parent.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in text


# -- 2. kill -9 in the middle of the initial snapshot ------------------------------------------
def test_kill_9_during_initial_snapshot_then_restart(tmp_path, db, broker_servers, topic_prefix):
    populate(db, 200000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"],
        topic={"linger_ms": 1}, snapshot={"parallelism": 2, "split_rows": 25000, "chunk_size": 5000},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    with Writers(db.dsn, keys=200000, hot=500, pause_s=0.005) as writers:
        daemon = DaemonProcess(config, log).start()

        def snapshot_under_way() -> bool:
            assert daemon.alive(), daemon.output()[-3000:]
            return "created slot" in daemon.output() and topic_size(broker_servers, topic_prefix, "public", "acct") > 30000

        wait_for(snapshot_under_way, 120, "the initial snapshot to be under way")
        readers = children_of(daemon.proc.pid)
        daemon.kill9()
        # its reader processes go with it: none may write snapshot rows while the next one streams
        wait_for(lambda: not any(pid_alive(pid) for pid in readers), 15, "the killed daemon's readers to exit")
        assert "snapshot read" not in daemon.output()  # killed in the middle, not after
        state = state_of(config)
        assert state is not None and state.initial == "running" and state.done == []
        daemon = DaemonProcess(config, log).start()
        wait_streaming(daemon, db.dsn, slot)

        def snapshot_complete() -> bool:
            assert daemon.alive(), daemon.output()[-3000:]
            state = state_of(config)
            return state is not None and "public.acct" in state.done and state.incremental is None

        wait_for(snapshot_complete, 180, "the interrupted snapshot to complete", poll=1)
        assert writers.commits > 200
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")


# -- 3. an incremental snapshot under writes, kill -9 in the middle ------------------------------
def test_incremental_snapshot_with_kill_9_in_the_middle(tmp_path, db, broker_servers, topic_prefix):
    populate(db, 200000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"],
        snapshot={"mode": "never", "chunk_size": 4000},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    daemon = DaemonProcess(config, log).start()
    wait_streaming(daemon, db.dsn, slot)
    with Writers(db.dsn, keys=200000, hot=500, pause_s=0.005) as writers:
        time.sleep(1)
        result = cdc("snapshot", "--incremental", "--tables", "public.acct", "--config", str(config))
        assert result.returncode == 0, result.stderr
        assert f"requested an incremental snapshot of public.acct from the daemon streaming from slot {slot}" in result.stdout

        def chunks_done(n: int):
            def check() -> bool:
                assert daemon.alive(), daemon.output()[-3000:]
                state = state_of(config)
                return state is not None and state.incremental is not None and state.incremental.chunks >= n
            return check

        wait_for(chunks_done(8), 120, "some chunks of the incremental snapshot", poll=0.5)
        daemon.kill9()
        progress = state_of(config)
        assert progress is not None and progress.incremental is not None
        assert progress.incremental.tables == ["public.acct"] and progress.incremental.rows < 200000
        daemon = DaemonProcess(config, log).start()
        wait_streaming(daemon, db.dsn, slot)

        def complete() -> bool:
            assert daemon.alive(), daemon.output()[-3000:]
            state = state_of(config)
            return state is not None and "public.acct" in state.done and state.incremental is None

        wait_for(complete, 180, "the incremental snapshot to complete", poll=1)
        assert writers.commits > 200
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    reads = [e for _, e in events(records) if e is not None and e["op"] == "r"]
    assert reads and {e["source"]["snapshot"] for e in reads} == {"incremental"}
    assert "incremental snapshot of public.acct complete" in daemon.output()
