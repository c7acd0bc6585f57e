"""`cdc cache rebuild`, `cdc delta rebuild` and `cdc postgres rebuild`: a store filled again from the topics beside
the one readers use, while the live job streams and rows keep changing, then switched.

Real PostgreSQL, Kafka, Spark and Redis (a server of this module's: SWAPDB moves whole
databases, and the session's Redis holds other tests' prefixes).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from cdc.config import TopicConfig
from cdc.local.redis import LocalRedis
from sinks.progress import read_progress
from tests.support import (
    ACCT,
    SINK_TIMEOUT_S,
    Sink,
    acct_changes_captured,
    acct_rows,
    cdc,
    cdc_here,
    rebuild_while_streaming,
    wait_caught_up,
    wait_for,
    write_config,
)
from tests.test_sink_cache import _acct, _config


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _db(server: LocalRedis, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


def test_a_cache_rebuild_swaps_databases_while_readers_and_the_job_go_on(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, cache_server: LocalRedis
) -> None:
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 400) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix, _db(cache_server, 0))
    sink = Sink(config, tmp_path / "sink.log", store="cache")
    assert "0 dead letters" in sink.once()
    live, other = redis.Redis.from_url(_db(cache_server, 0)), redis.Redis.from_url(_db(cache_server, 1))

    # GET readers count acct's rows all along: never none, never a half-filled cache
    reader = redis.Redis.from_url(_db(cache_server, 0))
    done, counts = rebuild_while_streaming(
        db.dsn, sink, ("cache", "rebuild", "--config", str(config)), every_s=0.02, pause_s=0.02, batches_after=2,
        read=lambda: sum(1 for _ in reader.scan_iter(match=f"{topic_prefix}.public.acct:*", count=1000)))
    assert re.fullmatch(r"cache rebuild: database 1 swapped in as database 0, 1 tables, \d+ rows", done.stdout.strip())
    assert counts and min(counts) > 200, counts[:20]
    wait_caught_up(db.dsn, slot, daemon)
    assert sink.stop() == 0
    assert "lost writes" not in sink.log.read_text()  # the job found its bookkeeping in the rebuilt database
    sink.once()  # what the writers committed after the job's last streamed batch
    assert _acct(live, topic_prefix) == acct_rows(db)
    # nothing of the rebuild is left: the old generation, its bookkeeping, checkpoint and progress
    assert other.dbsize() == 0
    assert not live.exists(f"__cdc:{topic_prefix}:sink:cache-rebuild")
    assert not (tmp_path / "checkpoints" / "cache-rebuild").exists()
    assert set(read_progress(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix))) == {"cache"}
    assert daemon.stop() == 0


def test_a_cache_rebuild_stopped_before_its_switch_leaves_the_cache_and_goes_on(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, cache_server: LocalRedis
) -> None:
    daemon = acct_changes_captured(db, run_daemon)
    config = write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                          cache={"url": _db(cache_server, 2), "rebuild_db": 3},
                          spark={"checkpoint_dir": str(tmp_path / "checkpoints")})
    assert "0 dead letters" in Sink(config, tmp_path / "sink.log", store="cache").once()
    live, other = redis.Redis.from_url(_db(cache_server, 2)), redis.Redis.from_url(_db(cache_server, 3))
    before = {k: live.get(k) for k in live.scan_iter(match=f"{topic_prefix}.*")}

    # a database holding anything else is refused, in one line
    other.set("someone-else", "x")
    refused = cdc("cache", "rebuild", "--config", str(config))
    assert (refused.returncode, refused.stderr.strip()) == (1, (
        f"error: database 3 of Redis at {_db(cache_server, 2)} holds 1 keys and no rebuild of "
        f"{topic_prefix}: empty it (FLUSHDB) or set [cache] rebuild_db to an empty database"))
    other.flushdb()

    env = {**os.environ, "CDC_SPARK_MAX_OFFSETS_PER_TRIGGER": "40"}  # many batches
    log = tmp_path / "rebuild.log"
    with log.open("w") as out:
        rebuild = subprocess.Popen([sys.executable, "-m", "cdc", "cache", "rebuild", "--config", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: "sinks.pipeline: batch 1:" in log.read_text(), SINK_TIMEOUT_S, "a rebuild batch")
        rebuild.send_signal(signal.SIGTERM)
        assert rebuild.wait(300) == 1
    assert [line for line in log.read_text().splitlines() if line.startswith("error:")] == [
        "error: the rebuild stopped before its switch; the cache is untouched: run `cdc cache rebuild` again to go "
        "on from where it stopped"]
    assert {k: live.get(k) for k in live.scan_iter(match=f"{topic_prefix}.*")} == before
    assert other.exists(f"__cdc:{topic_prefix}:sink:cache-rebuild")

    # the rest in one batch: going on from the stopped rebuild's offsets needs no small batches
    done = cdc_here("cache", "rebuild", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"cache rebuild: database 3 swapped in as database 2, 1 tables, {len(acct_rows(db))} rows"
    assert "sinks.pipeline: batch 0:" not in done.stderr  # it went on from its offsets
    assert _acct(live, topic_prefix) == acct_rows(db)
    assert other.dbsize() == 0
    assert daemon.stop() == 0


def test_a_postgres_rebuild_switches_schemas_while_readers_and_the_job_go_on(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, read_model: str
) -> None:
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 400) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    config = write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                          postgres={"dsn": read_model}, spark={"checkpoint_dir": str(tmp_path / "checkpoints")})
    sink = Sink(config, tmp_path / "sink.log", store="postgres")
    assert "0 dead letters" in sink.once()

    # a reader's SELECT counts acct's rows all along: never an error, never none, never half a table
    reader = psycopg.connect(read_model, autocommit=True)
    done, counts = rebuild_while_streaming(
        db.dsn, sink, ("postgres", "rebuild", "--config", str(config)), every_s=0.02, pause_s=0.02, batches_after=2,
        read=lambda: reader.execute("SELECT count(*) FROM cdc_public.acct").fetchone()[0])  # type: ignore[index]
    reader.close()
    assert re.fullmatch(r"postgres rebuild: 1 tables switched in, \d+ rows", done.stdout.strip()), done.stdout
    assert counts and min(counts) > 200, counts[:20]
    wait_caught_up(db.dsn, slot, daemon)
    assert sink.stop() == 0
    assert "lost writes" not in sink.log.read_text()  # the job's bookkeeping stayed where it was
    sink.once()  # what the writers committed after the job's last streamed batch
    with psycopg.connect(read_model, autocommit=True) as conn:
        held = {r[0]: (r[1], r[2]) for r in conn.execute("SELECT id, version, note FROM cdc_public.acct")}
        schemas = [r[0] for r in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'cdc%' ORDER BY 1")]
        records = [r[0] for r in conn.execute("SELECT name FROM _cdc.bookkeeping")]
    assert held == acct_rows(db)
    # nothing of the rebuild is left: the old generation, its bookkeeping, checkpoint and progress
    assert schemas == ["cdc_public"] and records == ["postgres"]
    assert not (tmp_path / "checkpoints" / "postgres-rebuild").exists()
    assert set(read_progress(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix))) == {"postgres"}
    assert daemon.stop() == 0


def _delta_config(tmp_path: Path, db: Any, servers: str, prefix: str) -> Path:
    """The warehouse's history query streams once an hour: the rebuild replaces current/, and
    `--once` runs bring history/ along, so its batches need not share the two cores meanwhile."""
    return write_config(tmp_path / "sink.toml", db.dsn, servers, prefix, ["public.*"],
                        delta={"path": str(tmp_path / "warehouse"), "history_interval_s": 3600},
                        spark={"checkpoint_dir": str(tmp_path / "checkpoints")})


def _verify(config: Path, store: str) -> None:
    done = cdc_here("verify", "--stores", store, "--tables", "public.acct", "--config", str(config))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_delta_rebuild_replaces_current_while_readers_and_the_job_go_on(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any
) -> None:
    from cdc.config import load
    from sinks.stores import counter

    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 400) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    config = _delta_config(tmp_path, db, broker_servers, topic_prefix)
    sink = Sink(config, tmp_path / "sink.log", store="delta")
    acct = f"{topic_prefix}.public.acct"

    # the live job's first batch fills current/ with the seed, then readers of current/ (delta-rs)
    # count acct all along: the version before the switch or after it
    rows = counter("delta", load(str(config)))
    try:
        done, counts = rebuild_while_streaming(
            db.dsn, sink, ("delta", "rebuild", "--config", str(config)), every_s=0.1, pause_s=0.2,
            read=lambda: rows.count([acct])[acct])
    finally:
        rows.close()
    assert re.fullmatch(r"delta rebuild: 1 tables of current/ replaced, \d+ rows", done.stdout.strip()), done.stdout
    # the live job paused between two batches for the switch, and went on after it
    assert "cdc sink delta paused; the rebuilt tables catch up to its offsets" in done.stderr, done.stderr[-3000:]
    assert "paused between batches for the Delta rebuild's switch" in sink.log.read_text()
    assert counts and all(n is not None and n > 200 for n in counts), counts[:20]
    wait_caught_up(db.dsn, slot, daemon)
    assert sink.stop() == 0
    assert "0 dead letters" in sink.once()  # what the writers committed after the job's last streamed batch
    _verify(config, "delta")
    # the version before the switch is still there for time travel; nothing of the rebuild is left
    spark_free = subprocess.run(
        [sys.executable, "-c", "import sys, json; from deltalake import DeltaTable; "
         "print(json.dumps([h['operation'] for h in DeltaTable(sys.argv[1]).history()])); import os; os._exit(0)",
         str(tmp_path / "warehouse" / "current" / "public" / "acct")], capture_output=True, text=True)
    assert "WRITE" in spark_free.stdout and "MERGE" in spark_free.stdout, spark_free.stdout + spark_free.stderr
    assert not (tmp_path / "warehouse" / "_cdc" / "rebuild").exists()
    assert not (tmp_path / "checkpoints" / "delta-rebuild").exists()
    assert set(read_progress(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix))) == {"delta", "delta-history"}
    assert daemon.stop() == 0


def test_a_cache_rebuild_names_its_databases_and_refuses_a_cluster() -> None:
    from cdc.config import ConfigError
    from sinks.stores.cache import CacheConfig
    from sinks.stores.cache.generations import Generations
    from sinks.stores.cache.store import Settings

    settings = Settings("rediss://:pw@h:6380/3?ssl_cert_reqs=none", "", "", 1000, 0)
    assert (settings.db, settings.in_db(7).url) == (3, "rediss://:pw@h:6380/7?ssl_cert_reqs=none")
    assert Settings("unix:///run/r.sock?db=2", "", "", 1000, 0).in_db(5).url == "unix:///run/r.sock?db=5"
    assert (Generations(CacheConfig(url="redis://h:1/4"), "cdc").target,
            Generations(CacheConfig(url="redis://h:1", rebuild_db=9), "cdc").target) == (5, 9)
    with pytest.raises(ConfigError, match=r"^\[cache\] rebuild_db = 4 is the database of \[cache\] url"):
        Generations(CacheConfig(url="redis://h:1/4", rebuild_db=4), "cdc")

    class Cluster:
        def info(self, section: str) -> dict[str, Any]:
            return {"cluster_enabled": 1}

        def close(self) -> None:
            pass

    generations = Generations(CacheConfig(url="redis://h:1/0"), "cdc")
    generations._client = lambda db: Cluster()  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="^Redis at redis://h:1/0 is a Redis Cluster, which has no databases to "
                                          "rebuild into: fill a second cache with cdc sink cache"):
        generations.check()
