"""`cdc cache rebuild` at its edges: stopped before its switch, a database that is not empty,
a cluster. (A rebuild while readers and the live job go on is in tests/test_every_store.py,
for every store.)

Real PostgreSQL, Kafka, Spark and Redis (a server of this module's: SWAPDB moves whole
databases, and the session's Redis holds other tests' prefixes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from cdc.local.redis import LocalRedis
from tests.support import (
    SINK_TIMEOUT_S,
    Sink,
    acct_changes_captured,
    acct_rows,
    cdc,
    cdc_here,
    wait_for,
    write_config,
)
from tests.test_sink_cache import _acct


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    with LocalRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _db(server: LocalRedis, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


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
