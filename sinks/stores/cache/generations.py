"""`cdc cache rebuild`'s two Redis databases: the live one (`[cache] url`'s) and the one a
rebuild fills (`[cache] rebuild_db`), and the switch between them.

The rebuild is the cache job under the name `cache-rebuild`, writing to the other database
with its own checkpoint and bookkeeping key (`__cdc:<prefix>:sink:cache-rebuild`, in the
database it fills). The switch is one MULTI/EXEC: COPY of the live job's bookkeeping key
into the rebuilt database, then SWAPDB. Every client, the live job's and `GET` readers',
sees the old rows or the rebuilt ones, never neither, and the live job finds its own
bookkeeping where it left it (its lost-write check, sinks.store, passes). After the swap
the rebuild's bookkeeping is in the live database: that is how a rebuild stopped after its
switch knows it switched.

SWAPDB moves whole databases: the live one must hold this prefix's cache alone (checked
before the rebuild starts), and Redis Cluster, which has only database 0, cannot do it.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

from cdc.config import Config, ConfigError
from cdc.naming import is_table_topic
from sinks.stores.cache import CacheConfig
from sinks.stores.cache.store import META, PIPELINE_KEYS, CacheStore, Settings, _topic_of

if TYPE_CHECKING:
    from sinks.query import StopSignal

log = logging.getLogger(__name__)

NAME = "cache-rebuild"


class Generations:
    """The live database and the rebuild's, on one Redis server."""

    name = NAME
    last_pass = True  # the live job goes on through the switch

    def __init__(self, config: CacheConfig, prefix: str) -> None:
        self.config, self.prefix = config, prefix
        self.settings = Settings.of(config)
        self.live = self.settings.db
        self.target = config.rebuild_db if config.rebuild_db >= 0 else self.live + 1
        if self.target == self.live:
            raise ConfigError(f"[cache] rebuild_db = {self.target} is the database of [cache] url: a rebuild fills "
                              "another one; set rebuild_db to an empty database")
        self.record_key = f"{META}{prefix}:sink:{NAME}"
        self.live_key = f"{META}{prefix}:sink:cache"

    def store(self, swapped: bool) -> CacheStore:
        """The rebuild's store: the database it fills, or, once swapped, the live one."""
        return CacheStore(self.config, self.prefix, NAME, db=None if swapped else self.target)

    def _client(self, db: int) -> Any:
        return self.settings.in_db(db).client(retries=2)

    def check(self) -> None:
        """Before anything: a server with databases, a live database of this prefix's alone, and a
        rebuild database that is empty or this rebuild's."""
        import redis

        client = self._client(self.live)
        try:
            if str(client.info("cluster").get("cluster_enabled", 0)) == "1":
                raise ConfigError(
                    f"{self.settings.where} is a Redis Cluster, which has no databases to rebuild into: fill a "
                    "second cache with cdc sink cache (its own [cache] url and [spark] checkpoint_dir) and move "
                    "the readers to it")
            target = self._client(self.target)
            try:
                size = target.dbsize()
                if size and not target.exists(self.record_key) and not client.exists(self.record_key):
                    raise ConfigError(
                        f"database {self.target} of {self.settings.where} holds {size} keys and no rebuild of "
                        f"{self.prefix}: empty it (FLUSHDB) or set [cache] rebuild_db to an empty database")
            except redis.ResponseError as exc:
                raise ConfigError(f"{self.settings.where} has no database {self.target} ({exc}): set [cache] "
                                  "rebuild_db to one it has (`databases` in redis.conf)") from None
            finally:
                target.close()
            foreign = self._foreign(client)
            if foreign is not None:
                raise ConfigError(
                    f"database {self.live} of {self.settings.where} holds {foreign!r}, not a key of the {self.prefix} "
                    "cache: SWAPDB would move it away; give the cache a database of its own")
        finally:
            client.close()

    def _foreign(self, client: Any) -> str | None:
        """A key of the live database that is not this prefix's cache (None: none)."""
        found = client.scan_iter(count=PIPELINE_KEYS)
        while chunk := list(itertools.islice(found, PIPELINE_KEYS)):
            for raw in chunk:
                key = raw.decode(errors="replace")
                if key.startswith(f"{META}{self.prefix}:sink:"):
                    continue
                if not is_table_topic(self.prefix, _topic_of(key)):
                    return key
        return None

    def swapped(self) -> bool:
        """Whether an earlier run of this rebuild switched already (its bookkeeping is live)."""
        client = self._client(self.live)
        try:
            return bool(client.exists(self.record_key))
        finally:
            client.close()

    def prepare(self, resumed: bool) -> None:
        """Before the first pass: the rebuild's database is empty, or this rebuild's own (`check`),
        gone on with when its checkpoint is (`resumed`), emptied when not."""
        client = self._client(self.target)
        try:
            if client.dbsize() and not resumed:
                client.flushdb()
                log.info("%s: emptied database %d, left by an unfinished rebuild", self.settings.where, self.target)
        finally:
            client.close()

    def swap(self) -> None:
        """The switch, atomically: the live job's bookkeeping copied into the rebuilt database,
        then the two databases swapped."""
        client = self._client(self.live)
        try:
            pipe = client.pipeline(transaction=True)
            pipe.execute_command("COPY", self.live_key, self.live_key, "DB", self.target, "REPLACE")
            pipe.execute_command("SWAPDB", self.live, self.target)
            pipe.execute()
        finally:
            client.close()
        log.info("%s: swapped database %d (rebuilt) with %d", self.settings.where, self.target, self.live)

    def finish(self) -> None:
        """After the last pass: the old generation (now in the rebuild's database) and the
        rebuild's bookkeeping go."""
        client = self._client(self.target)
        try:
            client.flushdb(asynchronous=True)
        finally:
            client.close()
        client = self._client(self.live)
        try:
            client.delete(self.record_key)
        finally:
            client.close()

    def rows(self) -> dict[str, int]:
        """The live database's rows per table topic."""
        client = self._client(self.live)
        counts: dict[str, int] = {}
        try:
            for raw in client.scan_iter(match=f"{self.prefix}.*", count=PIPELINE_KEYS):
                topic = _topic_of(raw.decode(errors="replace"))
                if is_table_topic(self.prefix, topic):
                    counts[topic] = counts.get(topic, 0) + 1
        finally:
            client.close()
        return counts


def rebuild_here(config: Config, stop: StopSignal) -> tuple[int, int, dict[str, int]]:
    """`cdc cache rebuild`: the cache again from the topics into another Redis database, then
    SWAPDB; (the rebuilt database's number before the swap, the live one's, rows per table).

    Passes until one is short, the switch, one more position-guarded pass into the live
    database for what the live job wrote after the rebuild's last pass (sinks.rebuild), then
    the old generation flushed."""
    from sinks.rebuild import rebuild
    from sinks.runner import check

    check(config, "cache")
    generations = Generations(config.cache, config.topic.prefix)
    generations.check()  # before Spark starts
    rebuild(config, "cache", lambda spark: generations, stop, "the cache is untouched")
    return generations.target, generations.live, generations.rows()
