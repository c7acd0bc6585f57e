"""The Redis cache: `GET <topic>:<key JSON>` is the row (the event's `after`) or nothing.

Written from the executors, one pipeline per Spark partition, every key through one Lua
script (loaded once, then EVALSHA) that applies a change only over a lower position:
- the row: a string at `<topic>:<key JSON>`, compact JSON in column order;
- its position: a hash at `__cdc:<topic>:<key JSON>` (`pos` = commit LSN and change LSN
  as 32 hex digits, `part`/`off` = the record's partition and offset, `del` on a delete
  marker). A delete keeps the hash for `[cache] marker_ttl_s`, so a replay of an older
  upsert cannot bring the row back;
- the keys of a table: a set at `__cdc:<topic>:keys`, which a truncate walks (no scan of
  the keyspace) to delete every row older than the truncate, leaving markers.
Both keys of a row hash to one Redis Cluster slot: a key JSON is an object, and Cluster
hashes the text between its first `{` and `}` (the same in both names). The set is
another key, written beside the scripts in the same round trip (one SADD per table and chunk).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from pyspark.sql import Row

from cdc.config import CacheConfig
from cdc.redact import display_url
from sinks.batch import ChangeBatch
from sinks.latest import COLUMNS, Change, last_changes, position

log = logging.getLogger(__name__)

PIPELINE_KEYS = 1000  # keys per pipeline round trip
META = "__cdc:"

# KEYS: row, meta. ARGV: kind (u: upsert, d: delete, t: truncate), position ('' when unknown:
# a tombstone whose d was compacted away), partition, offset, row JSON, row TTL ms, marker TTL ms.
# A change applies over a lower position; without two positions, over a lower offset of the
# same partition; a truncate only over a row it finds with a lower position. 1 if applied.
GUARD = """
local kind, pos, part, off = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local m = redis.call('HMGET', KEYS[2], 'pos', 'part', 'off', 'del')
local newer
if kind == 't' then
  newer = m[1] and m[1] ~= '' and m[1] < pos and not m[4]
elseif not m[1] and not m[2] then
  newer = true
elseif pos ~= '' and m[1] and m[1] ~= '' then
  newer = pos > m[1]
elseif m[2] == part then
  newer = off > tonumber(m[3])
else
  newer = true
end
if not newer then
  return 0
end
if kind == 'u' then
  local ttl = tonumber(ARGV[6])
  if ttl > 0 then
    redis.call('SET', KEYS[1], ARGV[5], 'PX', ttl)
  else
    redis.call('SET', KEYS[1], ARGV[5])
  end
  redis.call('HSET', KEYS[2], 'pos', pos, 'part', part, 'off', ARGV[4])
  redis.call('HDEL', KEYS[2], 'del')
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[2], ttl)
  else
    redis.call('PERSIST', KEYS[2])
  end
  return 1
end
redis.call('DEL', KEYS[1])
if pos == '' then
  pos = m[1] or ''
end
if kind == 't' then
  redis.call('HSET', KEYS[2], 'pos', pos, 'del', '1')
else
  redis.call('HSET', KEYS[2], 'pos', pos, 'part', part, 'off', ARGV[4], 'del', '1')
end
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[7]))
return 1
"""
GUARD_SHA = hashlib.sha1(GUARD.encode()).hexdigest().encode()

@dataclass(frozen=True)
class Settings:
    """What an executor needs to write (picklable: it travels with the partition function)."""

    url: str
    password: str
    tls_cafile: str
    marker_ttl_ms: int
    row_ttl_ms: int

    @classmethod
    def of(cls, config: CacheConfig) -> Settings:
        return cls(config.url, config.password, config.tls_cafile, config.marker_ttl_s * 1000,
                   config.row_ttl_s * 1000)

    def client(self, retries: int = 6) -> Any:
        """A client that retries a lost connection with backoff (then the batch fails and
        Spark reads it again)."""
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        options: dict[str, Any] = {
            "socket_timeout": 30, "socket_connect_timeout": 10,
            "retry": Retry(ExponentialBackoff(cap=10, base=0.5), retries),
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        }
        if self.password:
            options["password"] = self.password
        if self.tls_cafile:
            options["ssl_ca_certs"] = self.tls_cafile
        return redis.Redis.from_url(self.url, **options)


def check_reachable(config: CacheConfig) -> None:
    """PING the cache; a one-line error naming the fix when it does not answer."""
    import redis

    from cdc.config import ConfigError

    try:
        Settings.of(config).client(retries=0).ping()
    except redis.AuthenticationError:
        raise ConfigError(
            f"Redis at {display_url(config.url)} refused the password: fix [cache] password (or the URL's)"
        ) from None
    except redis.RedisError as exc:  # its text goes out through the CLI's redaction, like every error
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"cannot reach Redis at {display_url(config.url)} ({first}): start it, or fix [cache] url"
        ) from None


def row_key(topic: str, key: str) -> str:
    return f"{topic}:{key}"


def _command(*parts: bytes) -> bytes:
    """One command in Redis's wire protocol (RESP), packed here: redis-py's packing of the
    same pipeline took 40 % of the writer's time (measured)."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


def guarded(key: str, kind: str, pos: str, partition: int, offset: int, row: bytes, row_ttl_ms: int,
             marker_ttl_ms: int) -> bytes:
    """One call of GUARD on the row `key` (`<topic>:<key JSON>`) and its position hash."""
    name = key.encode()
    return _command(
        b"EVALSHA", GUARD_SHA, b"2", name, META.encode() + name, kind.encode(), pos.encode(), b"%d" % partition,
        b"%d" % offset, row, b"%d" % row_ttl_ms, b"%d" % marker_ttl_ms,
    )


def round_trip(client: Any, commands: list[bytes], attempts: int = 6) -> list[Any]:
    """Send the commands in one round trip and read every reply. A lost connection is retried
    with backoff, a server that lost GUARD (a restart, SCRIPT FLUSH) gets it again: replaying
    every command is safe, every write is position-guarded."""
    import redis

    pool = client.connection_pool
    for attempt in range(attempts):
        conn = pool.get_connection()
        try:
            conn.send_packed_command([b"".join(commands)])
            return [conn.read_response() for _ in commands]
        except redis.exceptions.NoScriptError:
            conn.disconnect()  # the other replies are left unread
            client.script_load(GUARD)
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            if attempt == attempts - 1:
                raise
            time.sleep(min(10.0, 0.5 * 2**attempt))
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
    raise RuntimeError(f"Redis kept losing the guard script over {attempts} attempts")


class PartitionWriter:
    """Writes one Spark partition's changes (runs on an executor)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __call__(self, rows: Iterator[Row]) -> None:
        changes = last_changes(rows)
        first = next(changes, None)
        if first is None:  # most partitions of a batch hold other tables' records, or none
            return
        changes = itertools.chain([first], changes)
        client = self.settings.client()
        try:
            client.script_load(GUARD)
            while chunk := list(itertools.islice(changes, PIPELINE_KEYS)):
                self._fill_toasted(client, chunk)
                round_trip(client, self._commands(chunk))
        finally:
            client.close()

    def _commands(self, chunk: list[tuple[str, Change]]) -> list[bytes]:
        """The chunk's script calls, then one SADD per table of the keys it upserts."""
        settings = self.settings
        commands: list[bytes] = []
        upserted: dict[str, list[bytes]] = {}
        for topic, change in chunk:
            if change.kind == "u":
                upserted.setdefault(topic, []).append(change.key.encode())
            value = orjson.dumps(change.row) if change.row is not None else b""
            commands.append(guarded(row_key(topic, change.key), change.kind, change.pos, change.partition,
                                     change.offset, value, settings.row_ttl_ms, settings.marker_ttl_ms))
        for topic, keys in upserted.items():
            commands.append(_command(b"SADD", f"{META}{topic}:keys".encode(), *keys))
        return commands

    @staticmethod
    def _fill_toasted(client: Any, chunk: list[tuple[str, Change]]) -> None:
        """Unchanged TOASTed values the batch did not have: the cached row's (null without one)."""
        toasted = [(t, c) for t, c in chunk if c.missing]
        if not toasted:
            return
        for (_, change), stored in zip(
            toasted, client.mget([row_key(t, c.key) for t, c in toasted]), strict=True
        ):
            held = orjson.loads(stored) if stored else {}
            assert change.row is not None
            for name in change.missing:
                change.row[name] = held.get(name)


class CacheStore:
    """Keeps the cache equal to the source tables, one table of a micro-batch at a time.

    Redis may restart without its data (no persistence, a failover to a stale replica): the
    job counts its batches in `__cdc:<prefix>:sink:cache:batches`, written after each
    batch's writes and checked before the next one commits. A count that is missing or
    behind means writes were lost, and the job rebuilds the cache from the topics."""

    name = "cache"

    def __init__(self, config: CacheConfig, prefix: str) -> None:
        self.settings = Settings.of(config)
        self.where = f"Redis at {display_url(config.url)}"
        self.counter = f"{META}{prefix}:sink:cache:batches"
        self.batches = 0

    def start(self, resumed: bool) -> None:
        from sinks.job import StoreLost

        client = self.settings.client()
        try:
            held = client.get(self.counter)
            if held is None and resumed:
                raise StoreLost(f"{self.where} holds no trace of the batches this job committed")
            if held is None:
                client.set(self.counter, 0)
            self.batches = int(held or 0)
            self._check_policy(client)
        finally:
            client.close()

    def done(self) -> None:
        from sinks.job import StoreLost

        client = self.settings.client()
        try:
            held = client.get(self.counter)
            if held is None or int(held) != self.batches:
                count = "no count" if held is None else f"a count of {int(held)}"
                raise StoreLost(
                    f"{self.where} lost writes: it holds {count} of this job's batches, which wrote {self.batches}"
                )
            self.batches += 1
            client.set(self.counter, self.batches)
        finally:
            client.close()

    def _check_policy(self, client: Any) -> None:
        """An evicting Redis drops rows, and delete markers whose loss lets a replay bring a
        deleted row back: say so once (CONFIG may be refused on managed servers)."""
        import redis

        try:
            policy = client.config_get("maxmemory-policy").get("maxmemory-policy", "noeviction")
        except redis.ResponseError:
            return
        if policy != "noeviction":
            log.warning(
                "%s evicts keys (maxmemory-policy %s): rows and delete markers may go; set maxmemory-policy "
                "noeviction for a cache that must equal the source", self.where, policy,
            )

    def apply_changes(self, batch: ChangeBatch) -> None:  # Redis takes any row: nothing to reject
        for topic, truncates in batch.truncates.items():
            for lsn, seq, _ in truncates:
                self._truncate(topic, position(lsn, seq))
        # a key's changes meet in one Spark partition, in offset order (sinks.latest)
        batch.changes().select(*COLUMNS).foreachPartition(PartitionWriter(self.settings))

    def _truncate(self, topic: str, pos: str) -> None:
        """Delete every row of the table older than `pos`, walking its key set (on the driver:
        truncates are rare and the set is the table's keys, not the keyspace)."""
        client = self.settings.client()
        index = f"{META}{topic}:keys"
        try:
            client.script_load(GUARD)
            members = client.sscan_iter(index, count=PIPELINE_KEYS)
            while chunk := [m.decode() for m in itertools.islice(members, PIPELINE_KEYS)]:
                commands = [guarded(row_key(topic, key), "t", pos, 0, 0, b"", 0, self.settings.marker_ttl_ms)
                            for key in chunk]
                done = [key for key, applied in zip(chunk, round_trip(client, commands), strict=True) if applied]
                if done:
                    client.srem(index, *done)
        finally:
            client.close()
