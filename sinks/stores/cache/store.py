"""The Redis cache: `GET <topic>:<key JSON>` is the row (the event's `after`) or nothing.

Written from the executors (sinks.rows), one pipeline per chunk of last changes, every key
through one Lua script (loaded once, then EVALSHA) that applies a change only over a lower
position:
- the row: a string at `<topic>:<key JSON>`, compact JSON in column order;
- its position: a hash at `__cdc:<topic>:<key JSON>` (`pos` = commit LSN and change LSN
  as 32 hex digits, `part`/`off` = the record's partition and offset, `del` on a delete
  marker). A delete keeps the hash for `[cache] marker_ttl_s`, so a replay of an older
  upsert cannot bring the row back;
- the keys of a table: a set at `__cdc:<topic>:keys`, which a truncate walks (no scan of
  the keyspace) to find the rows below it.
Both keys of a row hash to one Redis Cluster slot: a key JSON is an object, and Cluster
hashes the text between its first `{` and `}` (the same in both names). The set is
another key, written beside the scripts in the same round trip (one SADD per table and
chunk). The job's bookkeeping is a string at `__cdc:<prefix>:sink:<job>`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from cdc.config import Config
from cdc.naming import is_table_topic
from cdc.redact import display_url
from sinks.json_columns import compact_json
from sinks.rows import CHUNK_KEYS, Rejected, RowStore, RowWriter
from sinks.store import StoreUnavailable
from sinks.stores.cache import CacheConfig
from sinks.versions import Registry

if TYPE_CHECKING:
    from sinks.query import StopSignal

log = logging.getLogger(__name__)

PIPELINE_KEYS = 1000  # keys per pipeline round trip
META = "__cdc:"

# KEYS: row, meta. ARGV: kind (u: upsert, d: delete), position ('' when unknown: a tombstone
# whose d was compacted away), partition, offset, row JSON, row TTL ms, marker TTL ms.
# A change applies over a lower position; without two positions, over a lower offset of the
# same partition. 1 if applied.
GUARD = """
local kind, pos, part, off = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local m = redis.call('HMGET', KEYS[2], 'pos', 'part', 'off', 'del')
local newer
if not m[1] and not m[2] then
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
redis.call('HSET', KEYS[2], 'pos', pos, 'part', part, 'off', ARGV[4], 'del', '1')
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

    @property
    def where(self) -> str:
        return f"Redis at {display_url(self.url)}"

    @property
    def db(self) -> int:
        """The URL's logical database (`/n`, or `?db=n`; 0 when it names none)."""
        parts = urlsplit(self.url)
        query = dict(parse_qsl(parts.query))
        path = parts.path.strip("/") if parts.scheme != "unix" else ""
        return int(query.get("db") or path or 0)

    def in_db(self, db: int) -> Settings:
        """The same server, logical database `db`."""
        parts = urlsplit(self.url)
        query = [(k, v) for k, v in parse_qsl(parts.query) if k != "db"]
        if parts.scheme == "unix":
            return replace(self, url=f"unix://{parts.path}?{urlencode([*query, ('db', str(db))])}")
        return replace(self, url=urlunsplit(parts._replace(path=f"/{db}", query=urlencode(query))))

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

    where = Settings.of(config).where
    try:
        Settings.of(config).client(retries=0).ping()
    except redis.AuthenticationError:
        raise ConfigError(f"{where} refused the password: fix [cache] password (or the URL's)") from None
    except redis.RedisError as exc:  # its text goes out through the CLI's redaction, like every error
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot reach {where} ({first}): start it, or fix [cache] url") from None


def row_key(topic: str, key: str) -> str:
    return f"{topic}:{key}"


def keys_set(topic: str) -> str:
    return f"{META}{topic}:keys"


def _command(*parts: bytes) -> bytes:
    """One command in Redis's wire protocol (RESP), packed here: redis-py's packing of the
    same pipeline was a large share of the writer's time."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


def _bulk_string(values: pa.Array | pa.ChunkedArray) -> list[Any]:
    """The pieces that make each value a RESP bulk string: `$<length>\r\n<value>\r\n`."""
    values = values.cast(pa.binary())
    return [b"$", pc.cast(pc.cast(pc.binary_length(values), pa.string()), pa.binary()), b"\r\n", values, b"\r\n"]


def guarded_calls(keys: pa.Array | pa.ChunkedArray, kinds: pa.Array | pa.ChunkedArray,
                  positions: pa.Array | pa.ChunkedArray, partitions: pa.Array | pa.ChunkedArray,
                  offsets: pa.Array | pa.ChunkedArray, rows: pa.Array | pa.ChunkedArray, row_ttl_ms: int,
                  marker_ttl_ms: int) -> list[bytes]:
    """One call of GUARD per row `key` (`<topic>:<key JSON>`) and its position hash, packed
    column by column: EVALSHA, GUARD_SHA, 2, the key, its hash, the kind, the position, the
    partition, the offset, the row JSON, the TTLs."""
    head = _command(b"EVALSHA", GUARD_SHA, b"2").replace(b"*3\r\n", b"*12\r\n", 1)
    tail = _command(b"%d" % row_ttl_ms, b"%d" % marker_ttl_ms).split(b"\r\n", 1)[1]
    meta = pc.binary_join_element_wise(META.encode(), keys.cast(pa.binary()), b"")
    pieces = [
        head, *_bulk_string(keys), *_bulk_string(meta), *_bulk_string(kinds), *_bulk_string(positions),
        *_bulk_string(pc.cast(partitions, pa.string())), *_bulk_string(pc.cast(offsets, pa.string())),
        *_bulk_string(rows), tail,
    ]
    return pc.binary_join_element_wise(*pieces, b"").to_pylist()


def guarded(key: str, kind: str, pos: str, partition: int, offset: int, row: bytes, row_ttl_ms: int,
            marker_ttl_ms: int) -> bytes:
    """One call of GUARD on the row `key` (`<topic>:<key JSON>`) and its position hash."""
    def one(value: Any, of: pa.DataType) -> pa.Array:
        return pa.array([value], of)

    return guarded_calls(one(key, pa.string()), one(kind, pa.string()), one(pos, pa.string()),
                         one(partition, pa.int32()), one(offset, pa.int64()), one(row, pa.binary()), row_ttl_ms,
                         marker_ttl_ms)[0]


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
            return _replies(conn, len(commands))
        except redis.exceptions.NoScriptError:
            conn.disconnect()  # the other replies are left unread
            client.script_load(GUARD)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            conn.disconnect()
            if attempt == attempts - 1:
                raise StoreUnavailable(f"Redis did not answer through {attempts} attempts: {exc}") from None
            time.sleep(min(10.0, 0.5 * 2**attempt))
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
    raise StoreUnavailable(f"Redis kept losing the guard script over {attempts} attempts")


def _replies(conn: Any, count: int) -> list[int]:
    """The replies of `count` commands that answer one line each (GUARD and SADD: an integer, or
    an error, raised as redis-py raises it), read from the socket in bulk: redis-py's reader
    costs more a reply than the packing of its command."""
    import redis

    received = bytearray()
    while received.count(b"\r\n") < count:
        try:
            chunk = conn._sock.recv(1 << 16)
        except TimeoutError:
            raise redis.TimeoutError("Timeout reading from socket") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading from socket: {exc}") from None
        if not chunk:
            raise redis.ConnectionError("Connection closed by server.")
        received += chunk
    replies = []
    for line in bytes(received).split(b"\r\n", count)[:count]:
        if line[:1] != b":":
            raise conn._parser.parse_error(line[1:].decode(errors="replace"))
        replies.append(int(line[1:]))
    return replies


class CacheWriter(RowWriter):
    """Writes last changes through GUARD (runs on the executors, and on the driver for a truncate)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._client: Any = None

    def open(self) -> None:
        self._client = self.settings.client()
        self._client.script_load(GUARD)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def held(self, topic: str, keys: list[str], columns: set[str]) -> list[dict[str, Any] | None]:
        return [orjson.loads(raw) if raw else None for raw in self._client.mget([row_key(topic, k) for k in keys])]

    def write(self, changes: pa.Table) -> list[Rejected]:  # Redis takes any row
        calls = self._calls(changes)
        for start in range(0, changes.num_rows, CHUNK_KEYS):
            round_trip(self._client, self._commands(changes.slice(start, CHUNK_KEYS), calls[start:start + CHUNK_KEYS]))
        return []

    def _calls(self, changes: pa.Table) -> list[bytes]:
        """A script call per last change (sinks.latest.LAST), packed column by column. Rows are
        stored as compact JSON in column order (orjson's, as the events')."""
        settings = self.settings
        return guarded_calls(pc.binary_join_element_wise(changes["topic"], changes["key"], ":"), changes["kind"],
                             changes["pos"], changes["partition"], changes["offset"],
                             pc.fill_null(compact_json(changes["row"]), b""), settings.row_ttl_ms,
                             settings.marker_ttl_ms)

    def _commands(self, chunk: pa.Table, calls: list[bytes] | None = None) -> list[bytes]:
        """A round trip's commands: the chunk's script calls (`calls`, packed with the rest of
        its slab, or here), then one SADD per table of the keys it upserts."""
        commands = self._calls(chunk) if calls is None else list(calls)
        upserted: dict[str, list[bytes]] = {}
        for topic, key, kind in zip(*(chunk[name].to_pylist() for name in ("topic", "key", "kind")), strict=True):
            if kind == "u":
                upserted.setdefault(topic, []).append(key.encode())
        for topic, keys in upserted.items():
            commands.append(_command(b"SADD", keys_set(topic).encode(), *keys))
        return commands

    def positions(self, topic: str) -> Iterator[list[tuple[str, str]]]:
        """The table's live rows from its key set; keys of deleted rows leave the set on the way."""
        client, index = self._client, keys_set(topic)
        members = client.sscan_iter(index, count=PIPELINE_KEYS)
        while chunk := [m.decode() for m in itertools.islice(members, PIPELINE_KEYS)]:
            pipe = client.pipeline(transaction=False)
            for key in chunk:
                pipe.hmget(META + row_key(topic, key), "pos", "del")
            live, gone = [], []
            for key, (pos, deleted) in zip(chunk, pipe.execute(), strict=True):
                if pos is None or deleted:
                    gone.append(key)
                else:
                    live.append((key, pos.decode()))
            if gone:
                client.srem(index, *gone)
            yield live


class CacheStore(RowStore):
    """Keeps the cache equal to the source tables.

    Redis may restart without its data (no persistence, a failover to a stale replica): the
    job's bookkeeping (sinks.store), written after each batch's writes and checked before the
    next one commits, then shows it, and the job rebuilds the cache from the topics."""

    transient = ("redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError",
                 "redis.exceptions.BusyLoadingError")

    def __init__(self, config: CacheConfig, prefix: str, name: str = "cache", db: int | None = None) -> None:
        self.name = name
        self.settings = Settings.of(config) if db is None else Settings.of(config).in_db(db)
        self.where = self.settings.where
        self.prefix = prefix
        self.record_key = f"{META}{prefix}:sink:{name}"

    def open(self, resumed: bool) -> None:
        client = self.settings.client()
        try:
            self._check_policy(client)
        finally:
            client.close()

    def load(self) -> dict[str, Any] | None:
        client = self.settings.client()
        try:
            raw = client.get(self.record_key)
        finally:
            client.close()
        return None if raw is None else orjson.loads(raw)

    def save(self, record: dict[str, Any]) -> None:
        client = self.settings.client()
        try:
            client.set(self.record_key, orjson.dumps(record))
        finally:
            client.close()

    def clear(self) -> None:
        """Every row, position and key set of the prefix's tables, and the bookkeeping."""
        client = self.settings.client()
        removed = 0
        try:
            for pattern in (f"{self.prefix}.*", f"{META}{self.prefix}.*"):
                found = client.scan_iter(match=pattern, count=PIPELINE_KEYS)
                while chunk := list(itertools.islice(found, PIPELINE_KEYS)):
                    ours = [k for k in chunk if is_table_topic(self.prefix, _topic_of(k.decode()))]
                    if ours:
                        removed += client.delete(*ours)
            client.delete(self.record_key)
        finally:
            client.close()
        log.info("%s: cleared %d keys of %s", self.where, removed, self.prefix)

    def writer(self, registry: Registry) -> CacheWriter:
        return CacheWriter(self.settings)

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


def _topic_of(key: str) -> str:
    """The topic of a row, position or key-set name of the cache."""
    return key.removeprefix(META).split(":", 1)[0]


def check(config: Config) -> None:
    check_reachable(config.cache)


def build(spark: SparkSession, config: Config) -> CacheStore:
    return CacheStore(config.cache, config.topic.prefix)


def rebuild(config: Config, stop: StopSignal) -> list[str]:
    from sinks.stores.cache.generations import rebuild_here

    rebuilt, live, rows = rebuild_here(config, stop)
    return [f"cache rebuild: database {rebuilt} swapped in as database {live}, {len(rows)} tables, "
            f"{sum(rows.values())} rows"]


def local(workdir: Path) -> tuple[Any, dict[str, str]]:
    """A throwaway Redis (the demo's), and the settings that point the job at it."""
    from cdc.local.redis import LocalRedis

    server = LocalRedis(workdir / "redis").start()
    return server, {"CDC_CACHE_URL": server.url}


def show(config: Config, topics: list[str]) -> list[str]:
    """What `GET` readers find for the tables' rows, a line each."""
    client = Settings.of(config.cache).client()
    try:
        return [f"GET '{key.decode()}' -> {client.get(key).decode()}"
                for topic in topics for key in sorted(client.scan_iter(match=f"{topic}:*"))]
    finally:
        client.close()


class _Rows:
    """The `<topic>:*` keys Redis has (the key set `__cdc:<topic>:keys` also holds deleted keys)."""

    def __init__(self, config: Config) -> None:
        self.client = Settings.of(config.cache).client(retries=0)

    def count(self, topics: list[str]) -> dict[str, int | None]:
        # topic names are [A-Za-z0-9._-]: nothing a glob pattern would read as special
        return {topic: sum(1 for _ in self.client.scan_iter(match=f"{topic}:*", count=1000)) for topic in topics}

    def close(self) -> None:
        self.client.close()


def counter(config: Config) -> _Rows:
    return _Rows(config)
