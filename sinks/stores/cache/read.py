"""The Redis cache's read side for `cdc verify` (compaction.verify.Side): its rows, hashed here.

The cache has no compute of its own, so its rows are read in bulk (SCAN over `<topic>:*`, MGET
in chunks: the keys a reader could GET, including any that got there without the sink) and
hashed as they arrive. Positions come from the hash beside each row (sinks.stores.cache.store): a delete
marker says where a row went. To be folded into the store (sinks.store) as its read side.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from cdc.config import Config
from compaction.canonical import row_values
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of
from sinks.latest import parse_position
from sinks.stores.cache import CacheConfig
from sinks.stores.cache.store import META, PIPELINE_KEYS, Settings, row_key


class CacheSide:
    name = "cache"

    def __init__(self, config: CacheConfig) -> None:
        self.client: Any = Settings.of(config).client()

    def _pairs(self, table: TableSpec) -> Iterator[tuple[bytes, bytes]]:
        """(key JSON, row JSON) of every row a reader could GET."""
        prefix = f"{table.topic}:".encode()
        names = self.client.scan_iter(match=f"{table.topic}:*", count=PIPELINE_KEYS)
        while chunk := list(itertools.islice(names, PIPELINE_KEYS)):
            for name, value in zip(chunk, self.client.mget(chunk), strict=True):
                if value is not None:  # deleted since the scan saw it
                    yield name[len(prefix):], value

    def digest(self, table: TableSpec) -> Digest:
        return digest_of(self._pairs(table), lambda v: row_values(orjson.loads(v), table.columns), table.bits)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        return hashes_of(self._pairs(table), lambda v: row_values(orjson.loads(v), table.columns), table.bits, segments)

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        out = {}
        for start in range(0, len(keys), PIPELINE_KEYS):
            chunk = keys[start:start + PIPELINE_KEYS]
            pipe = self.client.pipeline(transaction=False)
            for key in chunk:
                name = row_key(table.topic, key.decode())
                pipe.get(name)
                pipe.hget(META + name, "pos")
            answers = pipe.execute()
            for key, value, pos in zip(chunk, answers[0::2], answers[1::2], strict=True):
                if value is not None or pos is not None:
                    row = None if value is None else row_values(orjson.loads(value), table.columns)
                    out[key] = Found(row, parse_position(pos.decode() if pos else ""))
        return out

    def close(self) -> None:
        self.client.close()


def side(config: Config, spark: Callable[[], Any]) -> CacheSide:
    return CacheSide(config.cache)
