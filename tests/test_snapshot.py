"""Snapshots end to end: real PostgreSQL, real broker, `cdc run` / `cdc snapshot` as processes.

What a user checks: the topic read as a table equals the source table, no key's last
record is older than another record of it, and every row's history in the topic is
contiguous (the snapshot and the stream meet exactly: no change lost, none applied twice).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import orjson
import psycopg
import pytest

from cdc import config as cdc_config
from cdc.config import TopicConfig
from cdc.events.records import TRUNCATE_KEY
from cdc.kafka.reader import TopicRecord, read_topic
from cdc.naming import topic_name
from cdc.source.replication import parse_lsn
from compaction.table import TopicTable, build, payload_of, position_of
from snapshot.state import SnapshotState, load_state, state_topic
from tests.support import (
    ACCT,
    ENVELOPE_KEYS,
    SOURCE_KEYS,
    DaemonProcess,
    Writers,
    cdc,
    children_of,
    slot_active,
    slot_of,
    wait_caught_up,
    wait_for,
    write_config,
)


# -- helpers ------------------------------------------------------------------------------------
def populate(db, rows: int) -> None:
    db.execute(ACCT)
    db.execute(
        "INSERT INTO public.acct SELECT g, 1, 'seed ' || g FROM generate_series(0, %s) g", (rows - 1,)
    )
    db.execute("ANALYZE public.acct")


def read_records(servers: str, prefix: str, schema: str, table: str) -> list[TopicRecord]:
    """Every record of the table's topic, each partition in offset order."""
    return list(read_topic(TopicConfig(bootstrap_servers=servers), topic_name(prefix, schema, table)))


def events(records: list[TopicRecord]) -> list[tuple[bytes, dict | None]]:
    return [(r.key, None if r.value is None else payload_of(r.value)) for r in records]


def source_rows(dsn: str, sql: str, key: tuple[str, ...] = ("id",)) -> dict[bytes, dict]:
    """Rows of a query keyed like the topic: canonical JSON of the key columns -> row dict."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(sql)
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return {orjson.dumps({k: row[k] for k in key}): row for row in rows}


def assert_equals_source(table: TopicTable, dsn: str, sql: str, key: tuple[str, ...] = ("id",)) -> None:
    """The topic read as a table equals the source rows, and compaction keeps no stale record."""
    assert table.order_violations() == []
    expected = source_rows(dsn, sql, key)
    got = table.state()
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    assert not missing and not extra, f"missing {len(missing)} keys {missing[:5]}, extra {len(extra)} {extra[:5]}"
    wrong = sorted(k for k in expected if got[k] != expected[k])
    assert not wrong, f"{len(wrong)} rows differ, e.g. {wrong[0]!r}: topic {got[wrong[0]]} != source {expected[wrong[0]]}"


_ABSENT = object()  # a key the topic has not shown yet


def history_problems(records: list[TopicRecord], snapshot_first: bool = True, crashed: bool = False) -> list[str]:
    """Per key, in offset order, the row's version history must be contiguous: every update is
    exactly one version above the previous event, an insert (`c`) only comes when the row is
    not in the topic, a delete only when it is, an incremental snapshot read carries exactly
    the version the stream left the row at (never one after its delete), an initial
    snapshot read is the key's first event. Anything else is a change lost or applied twice
    where a snapshot meets the stream.

    `snapshot_first`: an aligned initial snapshot covered every row, so a key's first event
    is a read or an insert. `crashed`: an event at a position the key already had is a
    resend after the crash (harmless: same position) and is skipped, with its tombstone."""
    problems: list[str] = []
    state: dict[bytes, object] = {}
    seen: set[tuple[bytes, tuple[int, int], str]] = set()
    skip_tombstone: set[bytes] = set()
    for key, event in events(records):
        if key == TRUNCATE_KEY:
            problems.append("unexpected truncate event")
            continue
        prev = state.get(key, _ABSENT)
        if event is None:  # the tombstone after a delete
            if key in skip_tombstone:
                skip_tombstone.discard(key)
            elif prev is not None:
                problems.append(f"{key!r}: tombstone without a delete before it")
            continue
        op, position = event["op"], position_of(event)
        if crashed and (key, position, op) in seen:
            if op == "d":
                skip_tombstone.add(key)
            continue
        seen.add((key, position, op))
        if op == "d":
            if prev is None or (prev is _ABSENT and snapshot_first):
                problems.append(f"{key!r}: delete of a row the topic does not hold")
            state[key] = None
            continue
        version = event["after"]["version"]
        first = prev is _ABSENT
        if op == "c" and not (prev is None or first):
            problems.append(f"{key!r}: insert at version {version} while the row is at version {prev}")
        elif op == "u" and not ((first and not snapshot_first) or (isinstance(prev, int) and version == prev + 1)):
            problems.append(f"{key!r}: update to version {version} after {'nothing' if first else prev}")
        elif op == "r" and event["source"]["snapshot"] == "incremental":
            if not (first or version == prev):
                problems.append(f"{key!r}: incremental read at version {version} after {prev}")
        elif op == "r" and not first:
            problems.append(f"{key!r}: initial snapshot read at version {version} after {prev}")
        elif op not in ("r", "c", "u"):
            problems.append(f"{key!r}: unexpected op {op}")
        state[key] = version
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
    """Until this daemon (not an earlier one logging to the same file) streams from the slot."""
    def streaming() -> bool:
        assert daemon.alive(), daemon.output()[-3000:]
        return daemon.output().count("streaming from") > daemon.streamed_before and slot_active(dsn, slot)

    wait_for(streaming, timeout, "the daemon to stream")


@pytest.fixture
def launch():
    """Start `cdc run` as a process (a log file may be shared by successive daemons); every
    daemon still running at the end of the test is stopped."""
    started: list[DaemonProcess] = []

    def start(config: Path, log: Path, env: dict[str, str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess(config, log, env)
        daemon.streamed_before = log.read_text(encoding="utf-8").count("streaming from") if log.exists() else 0
        started.append(daemon.start())
        return daemon

    yield start
    for daemon in started:
        if daemon.alive():
            try:
                daemon.stop(30)
            except Exception:  # noqa: BLE001 (a hung daemon must not outlive its test)
                daemon.kill9()


def slot_creation_waits(db) -> bool:
    """Whether a walsender of this database waits on a transaction's lock (CREATE_REPLICATION_SLOT)."""
    return bool(db.fetchall(
        "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = %s "
        "AND wait_event_type = 'Lock' AND wait_event = 'transactionid'", (db.name,),
    ))


def topic_size(servers: str, prefix: str, schema: str, table: str) -> int:
    """Records in the table's topic so far (sum of the partitions' end offsets)."""
    from cdc.kafka.topics import TopicAdmin

    admin = TopicAdmin(TopicConfig(bootstrap_servers=servers))
    try:
        topic = topic_name(prefix, schema, table)
        return sum(admin.end_offsets([topic]).get(topic, {}).values())
    finally:
        admin.close()


def pid_alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in text


def slot_exists(dsn: str, slot: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone() is not None


def wait_state(
    config: Path, daemon: DaemonProcess, what: str, predicate, timeout: float = 120, poll: float = 0.5
) -> SnapshotState:
    def check():
        assert daemon.alive(), daemon.output()[-3000:]
        state = state_of(config)
        return state if state is not None and predicate(state) else None

    return wait_for(check, timeout, what, poll=poll)


def restart_until_complete(launch, config: Path, log: Path, dsn: str, slot: str, writers: Writers) -> DaemonProcess:
    """After a kill: a new daemon, until public.acct's snapshot is complete (writers still writing)."""
    daemon = launch(config, log)
    wait_streaming(daemon, dsn, slot)
    wait_state(config, daemon, "the snapshot to complete",
               lambda s: s.done == ["public.acct"] and s.incremental is None, timeout=180)
    assert writers.commits > 200
    return daemon


def assert_recovered(daemon: DaemonProcess, dsn: str, slot: str, servers: str, prefix: str) -> list[TopicRecord]:
    """Caught up and stopped: the topic equals the source, every key's history is whole."""
    wait_caught_up(dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(servers, prefix, "public", "acct")
    assert_equals_source(build(records), dsn, "SELECT id, version, note FROM public.acct")
    assert history_problems(records, snapshot_first=False, crashed=True) == []
    return records


# -- 1. the aligned initial snapshot -------------------------------------------------------------
@pytest.mark.fast
def test_aligned_snapshot_under_concurrent_writes(tmp_path, db, broker_servers, topic_prefix, launch):
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
        daemon = launch(config, tmp_path / "daemon.log")
        # CREATE_REPLICATION_SLOT waits for every open write transaction: for ours, too
        wait_for(lambda: slot_creation_waits(db), 60, "the slot's creation to wait for the open transaction")
        time.sleep(2)
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
    read_keys = [e["after"]["id"] for e in reads]
    assert len(read_keys) == len(set(read_keys)) > 19000  # the rows at C, each once
    # the held transaction committed before the consistent point: its rows are snapshot reads
    held_reads = {e["after"]["id"]: e["after"] for e in reads if e["after"]["id"] in (-1, 19999)}
    assert held_reads == {
        -1: {"id": -1, "version": 1, "note": "held open"}, 19999: {"id": 19999, "version": 2, "note": "held"},
    }
    assert {position_of(e) for e in reads} == {(consistent_point, 0)}
    streamed = [e for _, e in events(records) if e is not None and e["op"] != "r"]
    assert streamed and min(position_of(e) for e in streamed) > (consistent_point, 0)
    state = state_of(config)
    assert state is not None and (state.initial, state.done) == ("done", ["public.acct"])


# -- 2. kill -9 in the middle of the initial snapshot ------------------------------------------
def test_kill_9_during_initial_snapshot_then_restart(tmp_path, db, broker_servers, topic_prefix, launch):
    populate(db, 200000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"],
        topic={"linger_ms": 1}, snapshot={"parallelism": 2, "split_rows": 25000, "chunk_size": 5000},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    with Writers(db.dsn, keys=200000, hot=500, pause_s=0.005) as writers:
        daemon = launch(config, log)

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
        daemon = restart_until_complete(launch, config, log, db.dsn, slot, writers)
    assert_recovered(daemon, db.dsn, slot, broker_servers, topic_prefix)


# -- 3. an incremental snapshot under writes, kill -9 in the middle ------------------------------
def test_incremental_snapshot_with_kill_9_in_the_middle(tmp_path, db, broker_servers, topic_prefix, launch):
    populate(db, 200000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"],
        snapshot={"mode": "never", "chunk_size": 4000},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    with Writers(db.dsn, keys=200000, hot=500, pause_s=0.005) as writers:
        time.sleep(1)
        result = cdc("snapshot", "--incremental", "--tables", "public.acct", "--config", str(config))
        assert result.returncode == 0, result.stderr
        assert f"requested an incremental snapshot of public.acct from the daemon streaming from slot {slot}" in result.stdout
        wait_state(config, daemon, "some chunks of the incremental snapshot",
                   lambda s: s.incremental is not None and s.incremental.chunks >= 8, poll=0.05)
        daemon.kill9()
        progress = state_of(config)
        assert progress is not None and progress.incremental is not None
        assert progress.incremental.tables == ["public.acct"] and progress.incremental.rows < 200000
        daemon = restart_until_complete(launch, config, log, db.dsn, slot, writers)
    records = assert_recovered(daemon, db.dsn, slot, broker_servers, topic_prefix)
    reads = [e for _, e in events(records) if e is not None and e["op"] == "r"]
    assert reads and {e["source"]["snapshot"] for e in reads} == {"incremental"}
    assert "incremental snapshot of public.acct complete" in daemon.output()


def test_table_added_to_the_capture_is_snapshotted_incrementally(tmp_path, db, broker_servers, topic_prefix, launch):
    """Adding a table to [source] tables and restarting: streaming resumes where it stopped and
    the new table is read in chunks while its writers keep going; the first table is not read again."""
    db.execute("CREATE TABLE public.first (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.first SELECT g, 'f' || g FROM generate_series(1, 500) g")
    populate(db, 30000)
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.first"])
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    assert daemon.stop() == 0
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.first", "public.acct"],
        snapshot={"chunk_size": 1000},
    )
    with Writers(db.dsn, keys=30000, hot=300):
        daemon = launch(config, log)
        wait_streaming(daemon, db.dsn, slot)
        db.execute("UPDATE public.first SET v = 'changed' WHERE id <= 10")
        wait_state(config, daemon, "the new table's snapshot", lambda s: "public.acct" in s.done)
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    assert "incremental snapshot queued for public.acct" in daemon.output()
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    assert build(records).order_violations() == []
    reads = {e["source"]["snapshot"] for _, e in events(records) if e is not None and e["op"] == "r"}
    assert reads == {"incremental"}
    first = events(read_records(broker_servers, topic_prefix, "public", "first"))
    assert sum(1 for _, e in first if e is not None and e["op"] == "r") == 500  # its initial snapshot, once
    assert_equals_source(
        build(read_records(broker_servers, topic_prefix, "public", "first")), db.dsn, "SELECT id, v FROM public.first"
    )


def test_incremental_progress_is_recorded_only_behind_the_slot(tmp_path, db, broker_servers, topic_prefix, launch):
    """What keeps a kill -9 during an incremental snapshot harmless: a chunk may count as done
    in the durable state only once the slot's confirmed position is past its watermark H.
    Otherwise a daemon killed in between resumes after that chunk but streams again from
    below H, so older changes of the chunk's keys land after their `r` events (the test
    above sees that only when its kill falls into the gap). Every state record is compared
    with the slot's confirmed_flush_lsn read right after it."""
    populate(db, 80000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"],
        snapshot={"mode": "never", "chunk_size": 1000},  # 80 chunks, to see several progress records
    )
    slot = slot_of(topic_prefix)
    daemon = launch(config, tmp_path / "daemon.log")
    wait_streaming(daemon, db.dsn, slot)
    samples: list[tuple[SnapshotState, int]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def follow_state() -> None:
        from kafka import KafkaConsumer
        from kafka.structs import TopicPartition

        tp = TopicPartition(state_topic(topic_prefix), 0)
        consumer = KafkaConsumer(bootstrap_servers=broker_servers.split(","), group_id=None,
                                 enable_auto_commit=False, fetch_max_wait_ms=20)
        try:
            with psycopg.connect(db.dsn, autocommit=True) as conn:
                consumer.assign([tp])
                consumer.seek_to_beginning(tp)
                while not stop.is_set():
                    for records in consumer.poll(timeout_ms=50).values():
                        for record in records:
                            state = SnapshotState.from_bytes(record.value)
                            lsn = conn.execute(
                                "SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = %s",
                                (slot,),
                            ).fetchone()[0]
                            samples.append((state, int(lsn)))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            consumer.close()

    follower = threading.Thread(target=follow_state, daemon=True)
    follower.start()
    result = cdc("snapshot", "--tables", "public.acct", "--config", str(config))
    assert result.returncode == 0, result.stderr
    wait_state(config, daemon, "the incremental snapshot to complete", lambda s: s.done == ["public.acct"])
    time.sleep(0.5)
    stop.set()
    follower.join(30)
    assert not errors, errors
    assert daemon.stop() == 0
    watermark = {
        key: position_of(e)[0] for key, e in events(read_records(broker_servers, topic_prefix, "public", "acct"))
        if e is not None and e["source"]["snapshot"] == "incremental"
    }
    progress = [(s.incremental.chunks, s.incremental.after, lsn) for s, lsn in samples if s.incremental and s.incremental.after]
    assert len(progress) >= 5, samples  # recorded as it goes (several chunks may share a record)
    ahead = []
    for chunks, after, slot_lsn in progress:
        h = watermark[orjson.dumps({"id": int(after[0])})]  # the chunk's last key was read at (H, 0)
        if slot_lsn < h:
            ahead.append(f"chunk {chunks} (up to id {after[0]}, watermark {h}) recorded done, slot at {slot_lsn}")
    assert ahead == []


# -- 4. bad input ----------------------------------------------------------------------------------
def test_snapshot_of_a_table_that_is_not_captured(tmp_path, db, broker_servers, topic_prefix):
    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, version int NOT NULL)")
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    expected = (
        "error: table public.nope is not one of the captured tables (public.acct): check the name, "
        "or add it to [source] tables"
    )
    # no slot yet: the one-shot path refuses before creating a slot
    first = cdc("snapshot", "--tables", "public.nope", "--config", str(config))
    assert first.returncode == 1, first.stderr
    assert first.stderr.splitlines()[-1] == expected and first.stderr.count("error:") == 1, first.stderr
    assert first.stdout == ""
    assert not slot_exists(db.dsn, slot)
    # the slot in place: the request path refuses with the same line, and nothing is queued
    made = cdc("snapshot", "--config", str(config))
    assert made.returncode == 0, made.stderr
    for extra in ([], ["--incremental"]):
        again = cdc("snapshot", *extra, "--tables", "public.nope", "--config", str(config))
        assert (again.returncode, again.stdout, again.stderr) == (1, "", expected + "\n")
    state = state_of(config)
    assert state is not None and state.incremental is None and state.done == ["public.acct"]


def test_empty_table_snapshots_and_then_streams(tmp_path, db, broker_servers, topic_prefix, launch):
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 50) g")
    db.execute("CREATE TABLE public.empty (id int PRIMARY KEY, version int NOT NULL, note text)")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct", "public.empty"],
    )
    slot = slot_of(topic_prefix)
    daemon = launch(config, tmp_path / "daemon.log")
    wait_streaming(daemon, db.dsn, slot)
    state = state_of(config)
    assert state is not None and state.initial == "done"
    assert sorted(state.done) == ["public.acct", "public.empty"]
    assert read_records(broker_servers, topic_prefix, "public", "empty") == []
    db.execute("INSERT INTO public.empty VALUES (1, 1, 'first')")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    empty = read_records(broker_servers, topic_prefix, "public", "empty")
    assert [(key, e["op"], e["after"]) for key, e in events(empty)] == [
        (b'{"id":1}', "c", {"id": 1, "version": 1, "note": "first"}),
    ]
    acct = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(acct), db.dsn, "SELECT id, version, note FROM public.acct")
    status = orjson.loads(cdc("status", "--json", "--config", str(config)).stdout)
    assert status["snapshot"]["initial"] == "done"
    assert sorted(status["snapshot"]["complete_tables"]) == ["public.acct", "public.empty"]


def test_snapshot_markers_when_the_last_table_is_empty(tmp_path, db, broker_servers, topic_prefix, launch):
    """One reader: tables in catalog order, so the empty one completes last. The snapshot's
    final row (public.acct's last) must still say "last"."""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 5) g")
    db.execute("CREATE TABLE public.zz_empty (id int PRIMARY KEY, version int NOT NULL)")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct", "public.zz_empty"],
        topic={"partitions": 1}, snapshot={"mode": "initial_only", "parallelism": 1},
    )
    daemon = launch(config, tmp_path / "daemon.log")
    assert daemon.wait(60) == 0, daemon.output()[-3000:]
    markers = [e["source"]["snapshot"] for _, e in events(read_records(broker_servers, topic_prefix, "public", "acct"))]
    assert markers == ["true"] * 4 + ["last"]


@pytest.mark.parametrize("batch_size", [None, 16384], ids=["default_batch_size", "batches_below_the_limit"])
def test_record_too_large_during_initial_snapshot(tmp_path, db, broker_servers, topic_prefix, launch, batch_size):
    db.execute("CREATE TABLE public.blobs (id int PRIMARY KEY, version int NOT NULL, body text)")
    db.execute("INSERT INTO public.blobs SELECT g, 1, 'small ' || g FROM generate_series(1, 300) g")
    db.execute(
        "UPDATE public.blobs SET body = (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 1000) g) "
        "WHERE id = 150"
    )
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.blobs"],
        topic={"max_message_bytes": 20000, **({"batch_size": batch_size} if batch_size else {})},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    daemon = launch(config, log)
    assert daemon.wait(90) == 1, daemon.output()[-3000:]
    out = daemon.output()
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith('error: record for table public.blobs key {"id":150} is '), errors
    assert "raise [topic] max_message_bytes and the topic's max.message.bytes" in errors[0]
    state = state_of(config)
    assert state is not None and state.initial == "running" and "public.blobs" not in state.done

    # raise the limit (the topic's and ours) and start again: the snapshot completes
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker_servers)
    admin.alter_configs([ConfigResource(
        ConfigResourceType.TOPIC, topic_name(topic_prefix, "public", "blobs"), configs={"max.message.bytes": "200000"},
    )])
    admin.close()
    daemon = launch(config, log, env={"CDC_TOPIC_MAX_MESSAGE_BYTES": "200000"})
    wait_streaming(daemon, db.dsn, slot)
    db.execute("UPDATE public.blobs SET version = version + 1, body = 'changed' WHERE id IN (1, 299)")
    db.execute("INSERT INTO public.blobs VALUES (301, 1, 'new')")
    db.execute("DELETE FROM public.blobs WHERE id = 2")
    wait_state(config, daemon, "the snapshot to complete", lambda s: "public.blobs" in s.done and s.incremental is None)
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(broker_servers, topic_prefix, "public", "blobs")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, body FROM public.blobs")
    assert history_problems(records, snapshot_first=False) == []
    # the error named the limit the user set, as the streaming path does
    assert "above topic " + topic_name(topic_prefix, "public", "blobs") + "'s max.message.bytes=20000:" in errors[0]


ODD_SCHEMA = 'Odd "S" . x'
ODD_TABLE = 'Täble "Q" . ü'
ODD_PATTERN = '"Odd ""S"" . x"."Täble ""Q"" . ü"'
ODD_KEY = ("Key Col", "ID")
ODD_KEYS = ["a'b", 'c"d', "e\\f", "g\th", "i\nj", "ü ß", "plain", "Z z", "", "\\N"]


def test_quoted_identifiers_initial_and_incremental(tmp_path, db, broker_servers, topic_prefix, launch):
    db.execute('CREATE SCHEMA "Odd ""S"" . x"')
    table = f'{ODD_PATTERN}'
    db.execute(
        f'CREATE TABLE {table} ("Key Col" text, "ID" int, version int NOT NULL, "Näme ""n""" text, '
        'PRIMARY KEY ("Key Col", "ID"))'
    )
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        for i, text in enumerate(ODD_KEYS * 6):
            conn.execute(f"INSERT INTO {table} VALUES (%s, %s, 1, %s)", (text, i % 7, f"row {i} 'q' \"dq\" \\"))
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, [ODD_PATTERN],
        snapshot={"parallelism": 2, "split_rows": 10, "chunk_size": 7},
    )
    slot = slot_of(topic_prefix)
    select = f'SELECT "Key Col", "ID", version, "Näme ""n""" FROM {table}'
    daemon = launch(config, tmp_path / "daemon.log")
    wait_streaming(daemon, db.dsn, slot)
    state = state_of(config)
    assert state is not None and state.done == [ODD_PATTERN]
    # streamed changes, then an incremental snapshot of the same table
    db.execute(f"UPDATE {table} SET version = version + 1 WHERE \"Key Col\" IN ('a''b', 'i\nj')")
    db.execute(f"DELETE FROM {table} WHERE \"Key Col\" = 'Z z'")
    db.execute(f"INSERT INTO {table} VALUES ('new '' \"one\"', 1, 1, 'n')")
    wait_caught_up(db.dsn, slot, daemon)
    result = cdc("snapshot", "--tables", ODD_PATTERN, "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"requested an incremental snapshot of {ODD_PATTERN} from the daemon streaming" in result.stdout
    wait_for(lambda: f"incremental snapshot of {ODD_PATTERN} complete" in daemon.output(), 60, "the incremental snapshot")
    db.execute(f"UPDATE {table} SET version = version + 1 WHERE \"Key Col\" = 'plain'")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0

    records = read_records(broker_servers, topic_prefix, ODD_SCHEMA, ODD_TABLE)
    assert_equals_source(build(records), db.dsn, select, ODD_KEY)
    assert history_problems(records) == []
    source_keys = sorted(source_rows(db.dsn, select, ODD_KEY))
    initial = sorted(k for k, e in events(records) if e is not None and e["op"] == "r" and e["source"]["snapshot"] != "incremental")
    incremental = sorted(k for k, e in events(records) if e is not None and e["source"]["snapshot"] == "incremental")
    assert len(initial) == len(ODD_KEYS) * 6 and len(set(initial)) == len(initial)  # every row once
    assert incremental == source_keys  # every row once: no chunk boundary skipped or repeated a key
    for _, event in events(records):
        if event is not None:
            assert (event["source"]["schema"], event["source"]["table"]) == (ODD_SCHEMA, ODD_TABLE)


def test_second_request_while_an_incremental_snapshot_runs(tmp_path, db, broker_servers, topic_prefix, launch):
    populate(db, 60000)  # in 1,000 chunks
    db.execute("CREATE TABLE public.other (id int PRIMARY KEY, version int NOT NULL, note text)")
    db.execute("INSERT INTO public.other SELECT g, 1, 'o' FROM generate_series(1, 100) g")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct", "public.other"],
        snapshot={"mode": "never", "chunk_size": 60},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    first = cdc("snapshot", "--tables", "public.acct", "--config", str(config))
    assert first.returncode == 0, first.stderr
    wait_state(config, daemon, "the request to be recorded",
               lambda s: s.incremental is not None and s.incremental.tables == ["public.acct"])
    refused = (
        f"error: an incremental snapshot of public.acct is already running or queued on slot {slot}: wait until it "
        "completes (cdc status shows its progress)"
    )
    with psycopg.connect(db.dsn) as blocker:
        blocker.execute("LOCK TABLE public.acct IN ACCESS EXCLUSIVE MODE")  # the next chunk waits: still running
        for extra in ([], ["--incremental"]):
            again = cdc("snapshot", *extra, "--tables", "public.acct", "--config", str(config))
            assert (again.returncode, again.stdout) == (1, ""), again.stdout
            assert again.stderr.splitlines()[-1] == refused and again.stderr.count("error:") == 1, again.stderr
        blocker.rollback()
    assert daemon.stop() == 0  # stopped in the middle: the snapshot stays queued
    state = state_of(config)
    assert state is not None and state.incremental is not None and state.incremental.tables == ["public.acct"]
    again = cdc("snapshot", "--tables", "public.acct", "--config", str(config))
    assert (again.returncode, again.stdout) == (1, "") and again.stderr.splitlines()[-1] == refused, again.stderr
    # another table queues behind it; both complete when the daemon runs again
    other = cdc("snapshot", "--tables", "public.other", "--config", str(config))
    assert other.returncode == 0, other.stderr
    assert f"slot {slot}'s daemon, which is not running: it takes the snapshot when cdc run starts" in other.stdout
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    wait_state(config, daemon, "both snapshots to complete",
               lambda s: s.incremental is None and sorted(s.done) == ["public.acct", "public.other"])
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    for name in ("acct", "other"):
        records = read_records(broker_servers, topic_prefix, "public", name)
        assert_equals_source(build(records), db.dsn, f"SELECT id, version, note FROM public.{name}")


def test_second_request_while_queued_for_a_stopped_daemon(tmp_path, db, broker_servers, topic_prefix, launch):
    """The daemon is not running: the first request waits in the slot, the second is refused."""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 100) g")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"], snapshot={"mode": "never"},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    assert daemon.stop() == 0
    first = cdc("snapshot", "--tables", "public.acct", "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert "which is not running: it takes the snapshot when cdc run starts" in first.stdout
    second = cdc("snapshot", "--tables", "public.acct", "--config", str(config))
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    wait_state(config, daemon, "the snapshot to complete", lambda s: s.incremental is None and s.done == ["public.acct"])
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    reads = [k for k, e in events(records) if e is not None and e["op"] == "r"]
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 100  # one snapshot, not two
    assert (second.returncode, second.stdout) == (1, ""), second.stdout
    assert second.stderr.strip().splitlines()[-1].startswith(
        "error: an incremental snapshot of public.acct is already running or queued"
    ), second.stderr


# -- 5. the exact shape of snapshot reads -------------------------------------------------------
def test_snapshot_read_events_have_the_exact_shape(tmp_path, db, broker_servers, topic_prefix, launch):
    # database defaults that change text output must change no key bytes (pinned settings)
    db.execute(f'ALTER DATABASE "{db.name}" SET TimeZone = \'Asia/Kolkata\'')
    db.execute(f'ALTER DATABASE "{db.name}" SET DateStyle = \'SQL, DMY\'')
    db.execute(f'ALTER DATABASE "{db.name}" SET IntervalStyle = \'sql_standard\'')
    db.execute(f'ALTER DATABASE "{db.name}" SET extra_float_digits = 0')
    db.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text, qty int)")
    db.execute("INSERT INTO public.items VALUES (1, 'apple', 1), (2, 'pear', 5), (3, NULL, NULL)")
    db.execute(
        "CREATE TABLE public.k (at timestamptz, amount numeric(8,2), span interval, ratio float8, label text, v int, "
        "PRIMARY KEY (label, at, amount, span, ratio))"
    )
    k_row = "('2024-01-02 08:34:05.25+05:30', 1.5, '1 day 02:00:00', 0.1, 'x', 1)"
    db.execute(f"INSERT INTO public.k VALUES {k_row}")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.items", "public.k"],
        topic={"partitions": 1}, snapshot={"parallelism": 1},
    )
    slot = slot_of(topic_prefix)
    daemon = launch(config, tmp_path / "daemon.log")
    wait_streaming(daemon, db.dsn, slot)
    c = created_at(daemon, slot)
    state = state_of(config)
    assert state is not None and state.consistent_point == c
    # the same row streamed: deleted and inserted again, and a new row
    db.execute(f"DELETE FROM public.k WHERE label = 'x'; INSERT INTO public.k VALUES {k_row}")
    db.execute("INSERT INTO public.items VALUES (4, 'fig', 2)")
    wait_caught_up(db.dsn, slot, daemon)
    result = cdc("snapshot", "--tables", "public.items", "--config", str(config))
    assert result.returncode == 0, result.stderr
    wait_for(lambda: "incremental snapshot of public.items complete" in daemon.output(), 60, "the incremental snapshot")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0

    items = events(read_records(broker_servers, topic_prefix, "public", "items"))
    k = events(read_records(broker_servers, topic_prefix, "public", "k"))
    reads = [e for _, e in items + k if e is not None and e["op"] == "r" and e["source"]["snapshot"] != "incremental"]
    assert len(reads) == 4
    for event in reads:
        assert list(event) == ENVELOPE_KEYS
        assert list(event["source"]) == SOURCE_KEYS
        assert (event["op"], event["before"], event["transaction"]) == ("r", None, None)
        source = event["source"]
        assert source["version"].startswith("cdc-")
        assert (source["connector"], source["name"], source["db"], source["schema"]) == (
            "postgresql", topic_prefix, db.name, "public",
        )
        assert source["sequence"] == f'["{c}","0"]'
        assert (source["lsn"], source["txId"], source["xmin"]) == (c, None, None)
        assert source["ts_us"] // 1000 == source["ts_ms"] and source["ts_ns"] == source["ts_us"] * 1000
        assert source["ts_ms"] > 0 and event["ts_ms"] >= source["ts_ms"]
    # each table's final row says so; the snapshot's final row (whichever table finished last) says "last"
    *items_rest, items_final = [e["source"]["snapshot"] for _, e in items[:3]]
    assert items_rest == ["true", "true"]
    assert {items_final, k[0][1]["source"]["snapshot"]} == {"last_in_data_collection", "last"}
    assert {e["after"]["id"]: e["after"] for _, e in items[:3]} == {
        1: {"id": 1, "name": "apple", "qty": 1}, 2: {"id": 2, "name": "pear", "qty": 5},
        3: {"id": 3, "name": None, "qty": None},
    }
    # the read of public.k and the streamed insert of the same row: same key bytes, same row
    assert [(e and e["op"]) for _, e in k] == ["r", "d", None, "c"]
    assert len({key for key, _ in k}) == 1
    (read_key, read), (_, streamed) = k[0], k[3]
    assert orjson.loads(read_key) == {
        "label": "x", "at": "2024-01-02T03:04:05.25Z", "amount": "1.50", "span": 93600000000, "ratio": 0.1,
    }
    assert read["after"] == streamed["after"]
    assert streamed["source"]["snapshot"] == "false" and position_of(streamed) > (c, 0)
    # the incremental snapshot: op r at (H, 0), H the watermark's commit, above every earlier event
    incremental = [(key, e) for key, e in items if e["source"]["snapshot"] == "incremental"]
    assert sorted(orjson.loads(key)["id"] for key, _ in incremental) == [1, 2, 3, 4]
    streamed_insert = next(e for _, e in items if e["op"] == "c")
    for key, event in incremental:
        assert list(event) == ENVELOPE_KEYS and list(event["source"]) == SOURCE_KEYS
        assert (event["op"], event["before"]) == ("r", None)
        source = event["source"]
        h = source["lsn"]
        assert source["sequence"] == f'["{h}","0"]' and source["txId"] is None
        assert position_of(event) > position_of(streamed_insert)
        first = next(k2 for k2, e in items if e["after"] == event["after"])
        assert key == first  # same key bytes as the initial read / streamed insert of the row


# -- 6. snapshot modes and the one-shot snapshot ------------------------------------------------
def test_mode_initial_only_snapshots_then_exits(tmp_path, db, broker_servers, topic_prefix, launch):
    populate(db, 3000)
    path = tmp_path / "cdc.toml"
    config = write_config(
        path, db.dsn, broker_servers, topic_prefix, ["public.acct"], snapshot={"mode": "initial_only"},
    )
    slot = slot_of(topic_prefix)
    log = tmp_path / "daemon.log"
    daemon = launch(config, log)
    assert daemon.wait(90) == 0, daemon.output()[-3000:]
    assert "snapshot complete (initial_only, or cdc snapshot): stopping" in daemon.output()
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert {e["op"] for _, e in events(records)} == {"r"} and len(records) == 3000
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    state = state_of(config)
    assert state is not None and (state.initial, state.done) == ("done", ["public.acct"])
    assert slot_exists(db.dsn, slot) and not slot_active(db.dsn, slot)
    # changes made while nothing runs; then the daemon streams exactly from the snapshot on
    db.execute("UPDATE public.acct SET version = version + 1 WHERE id < 10")
    db.execute("DELETE FROM public.acct WHERE id BETWEEN 10 AND 14")
    db.execute("INSERT INTO public.acct VALUES (5000, 1, 'after')")
    write_config(path, db.dsn, broker_servers, topic_prefix, ["public.acct"])
    daemon = launch(config, log)
    wait_streaming(daemon, db.dsn, slot)
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    assert history_problems(records) == []
    assert sum(1 for _, e in events(records) if e is not None and e["op"] == "r") == 3000  # no second snapshot


def test_mode_never_sends_no_reads(tmp_path, db, broker_servers, topic_prefix, launch):
    populate(db, 1000)
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct"], snapshot={"mode": "never"},
    )
    slot = slot_of(topic_prefix)
    daemon = launch(config, tmp_path / "daemon.log")
    wait_streaming(daemon, db.dsn, slot)
    db.execute("UPDATE public.acct SET version = version + 1 WHERE id < 3")
    db.execute("INSERT INTO public.acct VALUES (1000, 1, 'new')")
    db.execute("DELETE FROM public.acct WHERE id = 5")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    assert "snapshot of" not in daemon.output()
    got = [(orjson.loads(key)["id"], e and e["op"]) for key, e in events(read_records(broker_servers, topic_prefix, "public", "acct"))]
    assert sorted(got, key=str) == sorted([(0, "u"), (1, "u"), (2, "u"), (1000, "c"), (5, "d"), (5, None)], key=str)
    state = state_of(config)
    assert state is not None and (state.initial, state.done, state.incremental) == ("skipped", [], None)


@pytest.mark.fast
def test_one_shot_snapshot_then_run_misses_nothing(tmp_path, db, broker_servers, topic_prefix, launch):
    populate(db, 20000)
    db.execute("CREATE TABLE public.other (id int PRIMARY KEY, version int NOT NULL, note text)")
    db.execute("INSERT INTO public.other SELECT g, 1, 'o' FROM generate_series(1, 500) g")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.acct", "public.other"],
        snapshot={"split_rows": 5000},
    )
    slot = slot_of(topic_prefix)
    with Writers(db.dsn, keys=21000, hot=300) as writers:
        result = cdc("snapshot", "--tables", "public.acct", "--config", str(config))
        assert result.returncode == 0, result.stderr
        assert slot_exists(db.dsn, slot) and not slot_active(db.dsn, slot)
        state = state_of(config)
        assert state is not None and (state.initial, state.done) == ("done", ["public.acct"])
        time.sleep(1)  # changes while no daemon runs
        daemon = launch(config, tmp_path / "daemon.log")
        wait_streaming(daemon, db.dsn, slot)
        time.sleep(1)
        assert writers.commits > 200
    # public.other was left out of the one-shot snapshot: cdc run takes it incrementally
    wait_state(config, daemon, "public.other's snapshot", lambda s: sorted(s.done) == ["public.acct", "public.other"])
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = read_records(broker_servers, topic_prefix, "public", "acct")
    assert_equals_source(build(records), db.dsn, "SELECT id, version, note FROM public.acct")
    assert history_problems(records) == []
    assert position_regressions(records) == []
    assert {e["source"]["snapshot"] for _, e in events(records) if e is not None and e["op"] == "r"} <= {
        "true", "last_in_data_collection", "last",
    }
    other = read_records(broker_servers, topic_prefix, "public", "other")
    assert_equals_source(build(other), db.dsn, "SELECT id, version, note FROM public.other")
    assert {e["source"]["snapshot"] for _, e in events(other)} == {"incremental"}
