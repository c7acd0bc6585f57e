"""The one suite every registered store passes, by the same code: kill -9 mid-batch under load;
a fault of its server under load, then a replay from a deleted checkpoint; a truncate read before or
after the rows it removes; a store restored from an old backup; columns added and dropped;
a rebuild while readers and the live job go on. The store's own parts come from its kit
(tests/store_kits.py); `cdc verify`'s tampered stores are in tests/test_verify.py, over the
same registry.

Real PostgreSQL, Kafka, Spark and each store's server.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.config import TopicConfig
from cdc.kafka.partitioner import partition_for
from cdc.kafka.reader import read_topic
from sinks.progress import read_progress
from sinks.stores import STORES
from tests.store_kits import Kit, Reach, kit
from tests.support import (
    ACCT,
    EAGER_COMPACTION,
    Sink,
    acct_rows,
    acct_under_load,
    rebuild_while_streaming,
    slot_of,
    start_streaming,
    wait_caught_up,
    wait_for,
    write_config,
)

#: every store the product registers (an installed package's too): one run of each scenario a store
EVERY_STORE = sorted(STORES)
PARTITIONS = 3


@pytest.fixture(params=EVERY_STORE)
def store(request: pytest.FixtureRequest) -> Kit:
    return kit(request.param)


def _config(tmp_path: Path, db: Any, servers: str, prefix: str, store: Kit, reach: Reach, **spark: Any) -> Path:
    """The sink's own config (the daemon writes cdc.toml)."""
    return write_config(tmp_path / "sink.toml", db.dsn, servers, prefix, ["public.*"],
                        **{store.name: reach.section},
                        spark={"checkpoint_dir": str(tmp_path / "checkpoints"), **spark})


def _wrong(store: Kit, reach: Reach, table: str, columns: tuple[str, ...], expected: dict[int, tuple],
           places: tuple[str, ...] | None = None) -> dict[str, str]:
    """Per place a reader looks (or those of `places`), what differs from `expected`, in a line
    (none: every place holds it)."""
    wrong = {}
    for place, held in store.views(reach, table, columns).items():
        if places is not None and place not in places:
            continue
        extra = {i: row for i, row in held.items() if expected.get(i) != row}
        missing = [i for i in expected if i not in held]
        if extra or missing:
            wrong[f"{place} {table}"] = (f"{len(extra)} rows PostgreSQL does not have (e.g. {list(extra.items())[:3]}), "
                                         f"{len(missing)} missing (e.g. {missing[:3]})")
    return wrong


def _acct(db: Any) -> dict[int, tuple]:
    return {i: tuple(row) for i, row in acct_rows(db).items()}


def _under_load(store: Kit, reach: Reach, tmp_path: Path, db: Any, servers: str, prefix: str, run_daemon: Any,
                meanwhile: Callable[[Sink], None]) -> Sink:
    """`acct_under_load` with the store's job (its batch size and environment under load)."""
    config = _config(tmp_path, db, servers, prefix, store, reach, max_offsets_per_trigger=store.load_max_offsets)
    sink = Sink(config, tmp_path / "sink.log", store=store.name, env=store.job_env)
    acct_under_load(db, run_daemon, sink, meanwhile,
                    lambda: next(iter(store.views(reach, "acct", ("version", "note")).values())))
    return sink


def test_kill_9_mid_batch_three_times_under_load(
    store: Kit, request: pytest.FixtureRequest, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str,
    run_daemon: Any,
) -> None:
    """Writers keep writing while the job is killed -9 mid-batch three times: the store equals
    the table, every batch applied whole once, in every place a reader finds it."""
    with store.reach(request, tmp_path, topic_prefix, own=False) as reach:
        _under_load(store, reach, tmp_path, db, broker_servers, topic_prefix, run_daemon, store.kill_mid_batches)
        assert _wrong(store, reach, "acct", ("version", "note"), _acct(db)) == {}


def test_a_fault_of_its_server_under_load_then_a_replay_from_a_deleted_checkpoint(
    store: Kit, request: pytest.FixtureRequest, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str,
    run_daemon: Any,
) -> None:
    """Writers keep writing while the streaming job meets its store's fault (its server killed
    or emptied; the warehouse's job killed between two commits of a batch): the job rides it
    out and the store equals the table. A replay of the whole topic from a deleted checkpoint
    then changes nothing."""

    def through_the_fault(sink: Sink) -> None:
        sink.start()
        store.fault(reach, sink)
        sink.next_batch("a batch after the fault")

    with store.reach(request, tmp_path, topic_prefix, own=True) as reach:
        sink = _under_load(store, reach, tmp_path, db, broker_servers, topic_prefix, run_daemon, through_the_fault)
        assert store.faulted(reach, sink.log.read_text()), sink.log.read_text()[-3000:]
        shutil.rmtree(tmp_path / "checkpoints")
        assert "0 dead letters" in sink.once(env={"CDC_SPARK_MAX_OFFSETS_PER_TRIGGER": "1000000"})
        assert _wrong(store, reach, "acct", ("version", "note"), _acct(db)) == {}


def _keys_in(partition: int, count: int, start: int = 1) -> list[int]:
    """`count` ids from `start` on whose key (`{"id":N}`) the partitioner puts in `partition`."""
    out, n = [], start
    while len(out) < count:
        if partition_for(orjson.dumps({"id": n}), PARTITIONS) == partition:
            out.append(n)
        n += 1
    return out


def _values(ids: list[int], tag: str) -> str:
    return ", ".join(f"({i}, '{tag}{i}')" for i in ids)


def test_a_truncate_read_before_or_after_the_rows_it_removes(
    store: Kit, request: pytest.FixtureRequest, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str,
    run_daemon: Any,
) -> None:
    """A truncate is one record in one partition of its table's topic; the rows it removes sit
    in the other partitions, and Spark's Kafka source splits a backlog over the partitions in
    proportion to each one's backlog. So with keys unevenly spread, a row older than a
    truncate is read in a later batch than the truncate, and rows a transaction wrote before
    its own TRUNCATE in an earlier one. Every store ends up with PostgreSQL's rows either way."""
    truncates = partition_for(b'"__truncate__"', PARTITIONS)  # the reserved key's partition
    others = [p for p in range(PARTITIONS) if p != truncates]
    db.execute("CREATE TABLE public.old (id int PRIMARY KEY, v text)")
    db.execute("CREATE TABLE public.ins (id int PRIMARY KEY, v text)")
    daemon, slot = run_daemon(["public.*"])
    # old: 150 rows in one partition, a TRUNCATE (alone in its partition: read in the first
    # batch), then rows and updates in the third partition
    db.execute(f"INSERT INTO public.old VALUES {_values(_keys_in(others[0], 150), 'a')}")
    db.execute("TRUNCATE public.old")
    after = _keys_in(others[1], 20)
    db.execute(f"INSERT INTO public.old VALUES {_values(after, 'b')}")
    db.execute(f"UPDATE public.old SET v = 'u' || id WHERE id IN ({', '.join(map(str, after[:5]))})")
    # ins: 400 rows in the truncate's partition (its TRUNCATE is read last), then one
    # transaction inserting 60 rows in another partition, truncating and inserting 5 more
    db.execute(f"INSERT INTO public.ins VALUES {_values(_keys_in(truncates, 400), 'x')}")
    own = _keys_in(others[0], 65)
    db.execute(f"BEGIN; INSERT INTO public.ins VALUES {_values(own[:60], 'y')}; TRUNCATE public.ins; "
               f"INSERT INTO public.ins VALUES {_values(own[60:], 'z')}; COMMIT")
    wait_caught_up(db.dsn, slot, daemon)

    # 1,252 records (the tombstones of the daemon's truncate clean-ups come last), 420 a batch:
    # 3 batches, each taking the same third of every partition's backlog (Spark prorates the
    # limit). old's TRUNCATE, alone in its partition, is read in batch 0, the 150 rows before
    # it (the first half of theirs) in batches 0-1; ins's, half-way through its partition, in
    # batch 1, after the 60 rows written before it (the first half of theirs) began in batch
    # 0. 2 batches would read old's rows with its truncate, 4 put ins's truncate on a batch
    # boundary. The checkpoint's offsets files show the split.
    expected = {table: {i: (v,) for i, v in db.fetchall(f"SELECT id, v FROM public.{table}")} for table in ("old", "ins")}
    assert (len(expected["old"]), len(expected["ins"])) == (20, 5)
    with store.reach(request, tmp_path, topic_prefix, own=False) as reach:
        reach.section.update(store.truncate_settings)
        Sink(_config(tmp_path, db, broker_servers, topic_prefix, store, reach, max_offsets_per_trigger=420),
             tmp_path / "sink.log", store=store.name).once()
        wrong = {}
        for table, rows in expected.items():
            wrong.update(_wrong(store, reach, table, ("v",), rows))
        assert wrong == {}
    assert daemon.stop() == 0


def test_a_store_restored_from_an_old_backup_is_rebuilt_not_replayed_into(
    store: Kit, request: pytest.FixtureRequest, tmp_path: Path, db: Any, eager_broker: Any, topic_prefix: str,
) -> None:
    """A store behind the job's checkpoint (a restored backup, a stale replica) holds rows whose
    delete and tombstone the topic has since compacted away: only a cleared store loses them."""
    from kafka.admin import KafkaAdminClient, NewTopic

    servers = eager_broker.bootstrap_servers
    topic = f"{topic_prefix}.public.acct"
    admin = KafkaAdminClient(bootstrap_servers=servers)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1, topic_configs=EAGER_COMPACTION)])  # tombstones go in 2 s
    admin.close()
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'v' || g FROM generate_series(0, 29) g")
    with store.reach(request, tmp_path, topic_prefix, own=False) as reach:
        config = _config(tmp_path, db, servers, topic_prefix, store, reach)
        slot = slot_of(topic_prefix)
        daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
        wait_caught_up(db.dsn, slot, daemon)
        sink = Sink(config, tmp_path / "sink.log", store=store.name)
        sink.once()
        saved = store.backup(reach)

        db.execute("DELETE FROM public.acct WHERE id < 10")
        db.execute("UPDATE public.acct SET version = 2, note = 'later'")
        wait_caught_up(db.dsn, slot, daemon)
        sink.once()
        gone = {orjson.dumps({"id": i}) for i in range(10)}

        def compacted_away() -> bool:
            db.execute("UPDATE public.acct SET note = note || '.'")  # every partition's segment rolls on a write
            wait_caught_up(db.dsn, slot, daemon)
            return not gone & {r.key for r in read_topic(TopicConfig(bootstrap_servers=servers), topic)}

        wait_for(compacted_away, 300, "the log cleaner to drop the deleted rows' records", poll=1.5)
        store.restore(reach, saved)
        sink.once()
        assert _wrong(store, reach, "acct", ("version", "note"), _acct(db), store.restored) == {}
        if store.says_behind:  # it says why it was cleared
            assert "is behind: it holds the writes of batch" in sink.log.read_text()
        assert daemon.stop() == 0


def test_columns_added_and_dropped_under_the_job(
    store: Kit, request: pytest.FixtureRequest, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str,
    run_daemon: Any,
) -> None:
    """ADD COLUMN: rows written since hold it, older ones have none (as in PostgreSQL); DROP
    COLUMN: rows written since have none, rows not written since keep their value."""
    db.execute("CREATE TABLE public.doc (id int PRIMARY KEY, n int, gone text)")
    db.execute("INSERT INTO public.doc SELECT g, g, 'g' || g FROM generate_series(1, 20) g")
    daemon, slot = run_daemon(["public.*"])
    with store.reach(request, tmp_path, topic_prefix, own=False) as reach:
        sink = Sink(_config(tmp_path, db, broker_servers, topic_prefix, store, reach), tmp_path / "sink.log",
                    store=store.name)
        sink.once()
        db.execute("ALTER TABLE public.doc ADD COLUMN added text")
        db.execute("ALTER TABLE public.doc DROP COLUMN gone")
        db.execute("UPDATE public.doc SET added = 'a' || id, n = n + 100 WHERE id <= 10")
        db.execute("INSERT INTO public.doc VALUES (21, 21, 'a21')")
        db.execute("DELETE FROM public.doc WHERE id = 20")
        wait_caught_up(db.dsn, slot, daemon)
        sink.once()
        expected = {i: (n, added, None if i <= 10 or i == 21 else f"g{i}")
                    for i, n, added in db.fetchall("SELECT id, n, added FROM public.doc")}
        assert _wrong(store, reach, "doc", ("n", "added", "gone"), expected) == {}
    assert daemon.stop() == 0


def test_a_rebuild_while_readers_and_the_live_job_go_on(
    store: Kit, request: pytest.FixtureRequest, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str,
    run_daemon: Any,
) -> None:
    """`cdc <store> rebuild` fills the store again from the topics beside the one readers use,
    while writers change the table and the live job streams, then switches: readers count the
    table all along and never find it missing, empty or half full; afterwards the store equals
    the source and nothing of the rebuild is left."""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 400) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    with store.reach(request, tmp_path, topic_prefix, own=False) as reach:
        reach.section.update(store.rebuild_settings)
        config = _config(tmp_path, db, broker_servers, topic_prefix, store, reach)
        sink = Sink(config, tmp_path / "sink.log", store=store.name)
        assert "0 dead letters" in sink.once()
        with store.counting(reach, config, "acct") as count:
            done, counts = rebuild_while_streaming(
                db.dsn, sink, (store.name, "rebuild", "--config", str(config)), every_s=0.05, pause_s=0.02,
                batches_after=2, read=count)
        wrong = [n for n in counts if not isinstance(n, int) or n <= 200]
        assert counts and not wrong, wrong[:20]
        wait_caught_up(db.dsn, slot, daemon)
        assert sink.stop() == 0
        assert "lost writes" not in sink.log.read_text()  # the job's bookkeeping went where the rows went
        assert "0 dead letters" in sink.once()  # what the writers committed after the job's last streamed batch
        assert _wrong(store, reach, "acct", ("version", "note"), _acct(db)) == {}
        store.rebuilt(reach, done, sink, config)
        assert not (tmp_path / "checkpoints" / f"{store.name}-rebuild").exists()
        assert set(read_progress(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix))) == store.progress
    assert daemon.stop() == 0


def test_every_registered_store_has_a_kit() -> None:
    """A store registered without a kit would pass no scenario here: it fails by name instead."""
    from tests import test_verify

    for name in EVERY_STORE:
        assert kit(name).name == name
    assert sorted(test_verify.STORES) == EVERY_STORE  # the tampered-store `cdc verify` covers every store
