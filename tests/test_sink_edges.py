"""The sinks at their edges, the same scenario through every store: a truncate read in
another micro-batch than the rows it removes, in either order.

A truncate is one record in one partition of its table's topic; the rows it removes sit in
the other partitions, and Spark's Kafka source splits a backlog over the partitions in
proportion to each one's backlog. So with a table whose keys are unevenly spread, a row
older than a truncate is read in a later batch than the truncate, and rows a transaction
wrote before its own TRUNCATE are read in an earlier one. Every store must end up with
PostgreSQL's rows either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
import redis

from cdc.kafka.partitioner import partition_for
from cdc.local.opensearch import LocalOpenSearch
from cdc.local.redis import LocalRedis
from cdc.naming import topic_name
from tests.support import Sink, wait_caught_up, write_config
from tests.test_sink_cache import _visible
from tests.test_sink_search import _rows

STORES = ("cache", "search", "delta", "postgres")
PARTITIONS = 3

_READ_DELTA = """
import json, os, sys
from deltalake import DeltaTable
history = sys.argv[1].split("/")[-3] == "history"
rows = DeltaTable(sys.argv[1]).to_pyarrow_table(columns=["id", "v", *(["_cdc_is_current"] if history else [])])
rows = [r for r in rows.to_pylist() if not history or r["_cdc_is_current"]]
sys.stdout.write(json.dumps(sorted([r["id"], r["v"]] for r in rows)))
sys.stdout.flush()
os._exit(0)
"""


def keys_in(partition: int, count: int, start: int = 1) -> list[int]:
    """`count` ids from `start` on whose key (`{"id":N}`) the partitioner puts in `partition`."""
    out, n = [], start
    while len(out) < count:
        if partition_for(orjson.dumps({"id": n}), PARTITIONS) == partition:
            out.append(n)
        n += 1
    return out


def _values(ids: list[int], tag: str) -> str:
    return ", ".join(f"({i}, '{tag}{i}')" for i in ids)


def sink_config(tmp_path: Path, db: Any, servers: str, prefix: str, search_url: str, cache_url: str,
                read_model: str = "", **spark: Any) -> Path:
    """One config for the three stores (the daemon's own is cdc.toml). The warehouse's history
    query reads one file of the change log per batch: a truncate and the rows it removes
    fall into different history batches, as they do into the job's."""
    return write_config(
        tmp_path / "sink.toml", db.dsn, servers, prefix, ["public.*"],
        delta={"path": str(tmp_path / "warehouse"), "history_batch_bytes": 1},
        search={"url": search_url, "replicas": 0},
        cache={"url": cache_url},
        postgres={"dsn": read_model},
        spark={"checkpoint_dir": str(tmp_path / "checkpoints"), **spark},
    )


def store_rows(store: str, tmp_path: Path, prefix: str, table: str, search_url: str, cache_url: str,
               read_model: str = "") -> list:
    """[id, v] of every row the store holds for `public.<table>`, sorted (`delta history`: the
    current versions of the warehouse's history)."""
    topic = topic_name(prefix, "public", table)
    if store == "cache":
        rows = [row for key, row in _visible(redis.Redis.from_url(cache_url), prefix).items()
                if key.startswith(topic + ":")]
    elif store == "search":
        rows = list(_rows(search_url, topic).values())
    elif store == "postgres":
        with psycopg.connect(read_model, autocommit=True) as conn:
            return sorted([i, v] for i, v in conn.execute(f"SELECT id, v FROM cdc_public.{table}"))
    else:
        path = tmp_path / "warehouse" / ("history" if store == "delta history" else "current") / "public" / table
        done = subprocess.run([sys.executable, "-c", _READ_DELTA, str(path)], capture_output=True, text=True,
                              check=True, timeout=120)
        return json.loads(done.stdout)
    return sorted([row["id"], row["v"]] for row in rows)


@pytest.mark.parametrize("store", STORES)  # one test a store: each its own job over the same topics
def test_a_truncate_read_before_or_after_the_rows_it_removes(
    store: str, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any,
    opensearch: LocalOpenSearch, redis_server: LocalRedis, read_model: str,
) -> None:
    truncates = partition_for(b'"__truncate__"', PARTITIONS)  # the reserved key's partition
    others = [p for p in range(PARTITIONS) if p != truncates]
    db.execute("CREATE TABLE public.old (id int PRIMARY KEY, v text)")
    db.execute("CREATE TABLE public.ins (id int PRIMARY KEY, v text)")
    daemon, slot = run_daemon(["public.*"])
    # old: 150 rows in one partition, a TRUNCATE (alone in its partition: read in the first
    # batch), then rows and updates in the third partition
    db.execute(f"INSERT INTO public.old VALUES {_values(keys_in(others[0], 150), 'a')}")
    db.execute("TRUNCATE public.old")
    after = keys_in(others[1], 20)
    db.execute(f"INSERT INTO public.old VALUES {_values(after, 'b')}")
    db.execute(f"UPDATE public.old SET v = 'u' || id WHERE id IN ({', '.join(map(str, after[:5]))})")
    # ins: 400 rows in the truncate's partition (its TRUNCATE is read last), then one
    # transaction inserting 60 rows in another partition, truncating and inserting 5 more
    db.execute(f"INSERT INTO public.ins VALUES {_values(keys_in(truncates, 400), 'x')}")
    own = keys_in(others[0], 65)
    db.execute(f"BEGIN; INSERT INTO public.ins VALUES {_values(own[:60], 'y')}; TRUNCATE public.ins; "
               f"INSERT INTO public.ins VALUES {_values(own[60:], 'z')}; COMMIT")
    wait_caught_up(db.dsn, slot, daemon)

    # 1,252 records (the tombstones of the daemon's truncate clean-ups come last), 420 a batch:
    # 3 batches, each taking the same third of every partition's backlog (Spark prorates the
    # limit). old's TRUNCATE, alone in its partition, is read in batch 0, the 150 rows before
    # it (the first half of theirs) in batches 0-1; ins's, half-way through its partition, in
    # batch 1, after the 60 rows written before it (the first half of theirs) began in batch
    # 0. 2 batches would read old's rows with its truncate, 4 put ins's truncate on a batch
    # boundary; 7 or 22 only made each store run more, at seconds a batch (and a history
    # batch per batch and table). The checkpoint's offsets files show the split.
    config = sink_config(tmp_path, db, broker_servers, topic_prefix, opensearch.url, redis_server.url, read_model,
                         max_offsets_per_trigger=420)
    expected = {table: sorted([i, v] for i, v in db.fetchall(f"SELECT id, v FROM public.{table}"))
                for table in ("old", "ins")}
    assert len(expected["old"]) == 20 and len(expected["ins"]) == 5
    wrong = {}
    Sink(config, tmp_path / f"{store}.log", store=store).once()
    for table, rows in expected.items():
        for held_in in (store, "delta history") if store == "delta" else (store,):
            held = store_rows(held_in, tmp_path, topic_prefix, table, opensearch.url, redis_server.url, read_model)
            extra, missing = [r for r in held if r not in rows], [r for r in rows if r not in held]
            if extra or missing:
                wrong[f"{held_in} {table}"] = f"{len(extra)} rows PostgreSQL does not have, {len(missing)} missing"
    assert wrong == {}
    assert daemon.stop() == 0


def _backup_redis(client: redis.Redis) -> list[tuple[bytes, int, bytes]]:
    return [(key, max(0, client.pttl(key)), client.dump(key)) for key in client.scan_iter(count=1000)]


def _restore_redis(client: redis.Redis, backup: list[tuple[bytes, int, bytes]]) -> None:
    client.flushdb()
    for key, ttl, dumped in backup:
        client.restore(key, ttl, dumped, replace=True)


def _backup_read_model(dsn: str, restore: bool = False) -> None:
    """The read model's table and bookkeeping copied aside, or (`restore`) put back."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for live, aside in (("cdc_public.acct", "backup.acct"), ("_cdc.bookkeeping", "backup.bookkeeping")):
            if restore:
                conn.execute(f"TRUNCATE {live}")
                conn.execute(f"INSERT INTO {live} SELECT * FROM {aside}")
            else:
                conn.execute("CREATE SCHEMA IF NOT EXISTS backup")
                conn.execute(f"CREATE TABLE {aside} AS TABLE {live}")


@pytest.mark.parametrize("store", ("cache", "delta", "postgres"))  # one test a store: each its own job over the same topic
def test_a_store_restored_from_an_old_backup_is_rebuilt_not_replayed_into(
    store: str, tmp_path: Path, db: Any, eager_broker: Any, topic_prefix: str, redis_server: LocalRedis,
    read_model: str,
) -> None:
    """A store behind the job's checkpoint (a restored backup, a stale replica) holds rows whose
    delete and tombstone the topic has since compacted away: only a cleared store loses them."""
    import shutil

    from kafka.admin import KafkaAdminClient, NewTopic

    from tests.support import EAGER_COMPACTION, slot_of, start_streaming, wait_for

    servers = eager_broker.bootstrap_servers
    topic = topic_name(topic_prefix, "public", "acct")
    admin = KafkaAdminClient(bootstrap_servers=servers)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1, topic_configs=EAGER_COMPACTION)])  # tombstones go in 2 s
    admin.close()
    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.acct SELECT g, 'v' || g FROM generate_series(0, 29) g")
    config = sink_config(tmp_path, db, servers, topic_prefix, "http://127.0.0.1:9", redis_server.url, read_model)
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    wait_caught_up(db.dsn, slot, daemon)
    sink = Sink(config, tmp_path / f"{store}.log", store=store)
    sink.once()
    client = redis.Redis.from_url(redis_server.url)
    warehouse = tmp_path / "warehouse"
    if store == "cache":
        backup = _backup_redis(client)
    elif store == "postgres":
        _backup_read_model(read_model)
    else:
        shutil.copytree(warehouse, tmp_path / "backup")

    db.execute("DELETE FROM public.acct WHERE id < 10")
    db.execute("UPDATE public.acct SET v = 'later'")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    gone = {orjson.dumps({"id": i}) for i in range(10)}

    def compacted_away() -> bool:
        db.execute("UPDATE public.acct SET v = v || '.'")  # every partition's segment rolls on a write
        wait_caught_up(db.dsn, slot, daemon)
        from cdc.config import TopicConfig
        from cdc.kafka.reader import read_topic

        return not gone & {r.key for r in read_topic(TopicConfig(bootstrap_servers=servers), topic)}

    wait_for(compacted_away, 300, "the log cleaner to drop the deleted rows' records", poll=1.5)
    if store == "cache":
        _restore_redis(client, backup)
    elif store == "postgres":
        _backup_read_model(read_model, restore=True)
    else:
        shutil.rmtree(warehouse)
        shutil.copytree(tmp_path / "backup", warehouse)
    sink.once()
    expected = sorted([i, v] for i, v in db.fetchall("SELECT id, v FROM public.acct"))
    held = {store: store_rows(store, tmp_path, topic_prefix, "acct", "", redis_server.url, read_model)}
    assert held == {store: expected}
    if store in ("cache", "postgres"):  # it says why it was cleared; the warehouse's rebuild is checked by its rows
        assert "is behind: it holds the writes of batch" in sink.log.read_text()
    assert daemon.stop() == 0


def test_a_topic_created_again_under_the_job_stops_it_in_one_line(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, redis_server: LocalRedis
) -> None:
    """A table's topic deleted and created again starts its offsets over: what the job's
    checkpoint and store know of the old one no longer holds (Delta's offset watermarks would
    skip the new records), so the job stops and says how to rebuild."""
    import time

    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from cdc.config import TopicConfig
    from cdc.kafka.reader import read_topic
    from tests.support import wait_for

    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.acct SELECT g, 'v' || g FROM generate_series(1, 20) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    config = sink_config(tmp_path, db, broker_servers, topic_prefix, "http://127.0.0.1:9", redis_server.url)
    sink = Sink(config, tmp_path / "cache.log", store="cache")
    sink.once()
    topic = topic_name(topic_prefix, "public", "acct")
    records = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), topic))
    admin = KafkaAdminClient(bootstrap_servers=broker_servers)
    admin.delete_topics([topic])
    wait_for(lambda: topic not in admin.list_topics(), 60, "the topic to go")
    for _ in range(60):  # the broker may still be removing it
        try:
            admin.create_topics([NewTopic(topic, PARTITIONS, 1, topic_configs={"cleanup.policy": "compact"})])
            break
        except Exception:  # noqa: BLE001 (TopicAlreadyExistsError while the deletion finishes)
            time.sleep(1)
    admin.close()
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    for r in records[:5]:
        producer.send(topic, key=r.key, value=r.value, partition=r.partition)
    producer.flush()
    producer.close()
    err = sink.once(exit_code=1)
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: topic {topic} was deleted and created again (id "), line
    assert line.endswith(
        "its offsets started over, and the cache job's checkpoint and store follow the old topic; rebuild the store "
        "from the topics: stop the job, clear the store and delete its checkpoint folder (cache under [spark] "
        "checkpoint_dir)"
    ), line
