"""The Redis cache's read side for `cdc verify` (compaction.verify.Side): its rows, hashed here.

The cache has no compute of its own, so its rows are read in bulk (SCAN over `<topic>:*`, MGET
in chunks: the keys a reader could GET, including any that got there without the sink) and
hashed as they arrive. Positions come from the hash beside each row (sinks.cache): a delete
marker says where a row went. To be folded into the store once the stores share one contract.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from cdc.config import CacheConfig
from compaction.canonical import row_values
from compaction.verify import Digest, Found, LocalDigest, TableSpec
from sinks.cache import META, PIPELINE_KEYS, Settings, row_key


def _position(pos: bytes | None) -> tuple[int, int] | None:
    """`pos` of the hash (commit LSN and change LSN as 32 hex digits) as a position."""
    if not pos or len(pos) != 32:
        return None
    return int(pos[:16], 16), int(pos[16:], 16)


class CacheSide:
    name = "cache"

    def __init__(self, config: CacheConfig) -> None:
        self.client: Any = Settings.of(config).client()
        self._digests: dict[str, LocalDigest] = {}

    def digest(self, table: TableSpec) -> Digest:
        found = LocalDigest(table.bits)
        prefix = f"{table.topic}:".encode()
        names = self.client.scan_iter(match=f"{table.topic}:*", count=PIPELINE_KEYS)
        while chunk := list(itertools.islice(names, PIPELINE_KEYS)):
            for name, value in zip(chunk, self.client.mget(chunk), strict=True):
                if value is not None:  # deleted since the scan saw it
                    found.add(name[len(prefix):], row_values(orjson.loads(value), table.columns))
        old = self._digests.pop(table.topic, None)
        if old is not None:
            old.close()
        self._digests[table.topic] = found.done()
        return dict(found.segments)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        return self._digests[table.topic].hashes(segments)

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
                    out[key] = Found(row, _position(pos))
        return out

    def close(self) -> None:
        for digest in self._digests.values():
            digest.close()
        self.client.close()
