"""`cdc sink cache` end to end: PostgreSQL -> `cdc run` -> topics -> Redis.

Real PostgreSQL, Kafka, Spark and Redis. What a cache reader relies on: `GET
<topic>:<key JSON>` is the row (the event's `after`) or nothing, also after a replay.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic
from cdc.local.process import free_port
from cdc.local.redis import LocalRedis
from cdc.redact import display_url
from compaction.table import build
from sinks.latest import COLUMNS, as_rows, canonical_key, fold, position
from sinks.rows import PartitionWriter
from sinks.stores.cache import CacheConfig
from sinks.stores.cache.store import CacheWriter, Settings, guarded, round_trip
from tests.support import (
    Sink,
    acct_on_a_cluster,
    cdc,
    wait_caught_up,
    write_config,
)
from tests.test_sink_delta import CHANGES, SEED

# a body PostgreSQL stores out of line (TOAST): incompressible and over 2 kB
BIG = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 200))"


def _config(tmp_path: Path, db: Any, servers: str, prefix: str, url: str, **extra: dict) -> Path:
    spark = {"checkpoint_dir": str(tmp_path / "checkpoints"), **extra.pop("spark", {})}
    return write_config(tmp_path / "sink.toml", db.dsn, servers, prefix, ["public.*"], cache={"url": url},
                        spark=spark, **extra)


def _visible(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """What GET readers find under the prefix's topics: key -> row."""
    return {k.decode(): orjson.loads(client.get(k)) for k in client.scan_iter(match=f"{prefix}.*", count=1000)}


def _everything(client: redis.Redis) -> dict[str, Any]:
    """Every key with its value, positions and markers included (TTLs and the job's bookkeeping
    count aside)."""
    out: dict[str, Any] = {}
    for key in client.scan_iter(count=1000):
        if key.endswith(b":sink:cache"):
            continue
        kind = client.type(key)
        if kind == b"string":
            out[key.decode()] = client.get(key)
        elif kind == b"hash":
            out[key.decode()] = client.hgetall(key)
        elif kind == b"set":
            out[key.decode()] = client.smembers(key)
    return out


def _from_topics(servers: str, prefix: str, tables: list[str]) -> dict[str, Any]:
    """The rows the topics hold now (the compacted view): what the cache must show."""
    out = {}
    for table in tables:
        topic = f"{prefix}.public.{table}"
        for key, after in build(read_topic(TopicConfig(bootstrap_servers=servers), topic)).state().items():
            out[f"{topic}:{canonical_key(key.decode())}"] = after
    return out


@pytest.mark.fast
def test_the_cache_follows_the_source_and_a_replay_changes_nothing(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, redis_server: LocalRedis
) -> None:
    for sql in SEED:
        db.execute(sql)
    db.execute("CREATE TABLE public.doc (id int PRIMARY KEY, body text, n int)")  # REPLICA IDENTITY DEFAULT
    db.execute(f"INSERT INTO public.doc VALUES (1, {BIG}, 0), (2, {BIG}, 0)")
    daemon, slot = run_daemon(["public.*"])
    config = _config(tmp_path, db, broker_servers, topic_prefix, redis_server.url)
    sink = Sink(config, tmp_path / "sink.log", store="cache")
    client = redis.Redis.from_url(redis_server.url)

    def expected() -> dict[str, Any]:
        rows = _from_topics(broker_servers, topic_prefix, ["wide", "Odd-20Name"])
        for key, body, n in db.fetchall("SELECT id, body, n FROM public.doc"):  # the topic has TOAST placeholders
            rows[f"{topic_prefix}.public.doc:{{\"id\":{key}}}"] = {"id": key, "body": body, "n": n}
        return rows

    wait_caught_up(db.dsn, slot, daemon)
    out = sink.once()
    assert "0 dead letters" in out
    assert _visible(client, topic_prefix) == expected()

    # updates, a delete, a key change, ADD COLUMN, a truncate; unchanged TOASTed values
    # from the cache (doc 1) and from the batch (doc 2)
    for sql in CHANGES:
        db.execute(sql)
    db.execute("UPDATE public.doc SET n = 1 WHERE id = 1")
    db.execute(f"UPDATE public.doc SET body = {BIG} WHERE id = 2")
    db.execute("UPDATE public.doc SET n = 2 WHERE id = 2")
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()
    rows = _visible(client, topic_prefix)
    assert rows == expected()
    assert sorted(k.split(":", 1)[1] for k in rows if ".public.wide:" in k) == sorted(
        f'{{"id":{i}}}' for (i,) in db.fetchall("SELECT id FROM public.wide")
    )
    assert [v for k, v in rows.items() if "Odd-20Name" in k] == [{"Key": "k3", "a b": 3, "ü": "ß"}]

    # replay from the earliest offsets onto the same cache: nothing changes, deleted rows stay deleted
    before = _everything(client)
    shutil.rmtree(tmp_path / "checkpoints")
    sink.once()
    assert _everything(client) == before
    assert client.get(f'{topic_prefix}.public.wide:{{"id":2}}') is None
    assert daemon.stop() == 0


def _acct(client: redis.Redis, prefix: str) -> dict[int, tuple[int, str]]:
    rows = _visible(client, prefix)
    return {row["id"]: (row["version"], row["note"]) for key, row in rows.items() if ".public.acct:" in key}


def test_the_cache_job_on_a_standalone_cluster(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, redis_server: LocalRedis,
    spark_cluster: Any,
) -> None:
    config = _config(tmp_path, db, broker_servers, topic_prefix, redis_server.url,
                     spark={"master": spark_cluster.master_url})
    acct_on_a_cluster(db, run_daemon, Sink(config, tmp_path / "sink.log", store="cache"), spark_cluster,
                      lambda: _acct(redis.Redis.from_url(redis_server.url), topic_prefix))


def test_the_guard_applies_a_change_only_over_a_lower_position(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    row, meta = "t.public.g:{\"id\":1}", "__cdc:t.public.g:{\"id\":1}"
    client.delete(row, meta)

    def change(kind: str, pos: str, offset: int, value: bytes = b"", partition: int = 0) -> int:
        return round_trip(client, [guarded(row, kind, pos, partition, offset, value, 0, 60000)])[0]

    p = [position(100, i) for i in range(6)]
    assert change("u", p[1], 10, b'{"v":1}') == 1
    assert change("u", p[0], 9, b'{"v":0}') == 0  # older: skipped
    assert change("u", p[1], 10, b'{"v":1}') == 0  # the same again: skipped
    assert client.get(row) == b'{"v":1}'
    assert change("d", p[2], 11) == 1
    assert client.get(row) is None and client.hget(meta, "del") == b"1"
    assert 0 < client.pttl(meta) <= 60000  # the marker expires
    assert change("u", p[1], 10, b'{"v":1}') == 0  # a replayed upsert cannot bring it back
    assert client.get(row) is None
    assert change("u", p[3], 13, b'{"v":3}') == 1 and client.pttl(meta) == -1  # a newer one does
    # a tombstone whose d is gone (compacted) has no position: the offset decides
    assert change("d", "", 12) == 0
    assert change("d", "", 14) == 1 and client.get(row) is None and client.hget(meta, "pos") == p[3].encode()
    assert change("u", p[3], 13, b'{"v":3}') == 0
    # a truncate removes rows older than itself only
    assert change("u", p[4], 15, b'{"v":4}') == 1
    assert change("t", p[3], 0) == 0 and client.get(row) == b'{"v":4}'
    assert change("t", p[5], 0) == 1 and client.get(row) is None
    assert change("u", p[4], 15, b'{"v":4}') == 0


def test_the_writer_packs_its_own_commands_and_reloads_a_lost_script(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    topic = "w.public.packed"
    client.delete(*client.keys(f"*{topic}*") or ["none"])

    def rows(*changes: tuple[int, str | None, int, dict | None]) -> list[tuple]:
        out = []
        for key, op, offset, after in changes:
            row = {"_cdc_topic": topic, "_cdc_key": orjson.dumps({"id": key}).decode(), "_cdc_op": op,
                   "_cdc_lsn": 100 + offset, "_cdc_seq": 0, "_cdc_partition": 0, "_cdc_offset": offset,
                   "_cdc_tombstone": op is None, "after": orjson.dumps(after).decode() if after else None}
            out.append(tuple(row[name] for name in COLUMNS))
        return sorted(out, key=lambda r: r[6])  # a topic partition arrives in offset order

    writer = CacheWriter(Settings(redis_server.url, "", "", 60_000, 0))
    list(PartitionWriter(writer, {})(as_rows(rows((1, "c", 1, {"id": 1, "s": "a\r\nb é"}), (2, "c", 2, {"id": 2}),
                                                  (2, "d", 3, None))).to_batches()))
    assert orjson.loads(client.get(f'{topic}:{{"id":1}}')) == {"id": 1, "s": "a\r\nb é"}
    assert client.get(f'{topic}:{{"id":2}}') is None and client.hget(f'__cdc:{topic}:{{"id":2}}', "del") == b"1"
    assert client.smembers(f"__cdc:{topic}:keys") == {b'{"id":1}'}  # the keys a truncate walks: rows held
    # a Redis that lost its scripts (a restart, SCRIPT FLUSH) gets the guard again, the chunk is replayed
    client.script_flush()
    chunk = fold(as_rows(rows((3, "c", 4, {"id": 3}), (1, "u", 5, {"id": 1, "s": "z"}))))
    round_trip(client, writer._commands(chunk))
    assert orjson.loads(client.get(f'{topic}:{{"id":3}}')) == {"id": 3}
    assert orjson.loads(client.get(f'{topic}:{{"id":1}}')) == {"id": 1, "s": "z"}


def test_an_unreachable_cache_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://app:s3cret@127.0.0.1:{port}/0"
    config = tmp_path / "cdc.toml"
    config.write_text(f'[topic]\nbootstrap_servers = "127.0.0.1:1"\n[cache]\nurl = "{url}"\n')
    done = cdc("sink", "cache", "--once", "--config", str(config))
    assert done.returncode == 1
    assert display_url(url) == f"redis://app:***@127.0.0.1:{port}/0"
    assert done.stderr.strip().startswith(f"error: cannot reach Redis at redis://app:***@127.0.0.1:{port}/0 (")
    assert done.stderr.strip().endswith("): start it, or fix [cache] url")
    assert len(done.stderr.strip().splitlines()) == 1 and "s3cret" not in done.stdout + done.stderr


def test_cache_settings_are_checked() -> None:
    from cdc.config import ConfigError, load

    assert CacheConfig().url == "redis://127.0.0.1:6379/0"
    try:
        load(environ={"CDC_CACHE_ROW_TTL_S": "60", "CDC_CACHE_MARKER_TTL_S": "3600"})
    except ConfigError as exc:
        assert str(exc) == (
            "[cache] row_ttl_s = 60 is shorter than marker_ttl_s = 3600: a row would expire before a replayed "
            "delete is guarded; raise row_ttl_s (or 0: never)"
        )
    else:
        raise AssertionError("a row TTL below the marker TTL was accepted")
