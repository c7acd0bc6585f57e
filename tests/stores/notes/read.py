"""The notes store's side of `cdc verify`: its rows, read from the file and hashed here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson

from cdc.config import Config
from compaction.canonical import row_values
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of
from sinks.latest import parse_position
from tests.stores.notes.store import connect


class NotesSide:
    name = "notes"

    def __init__(self, path: str) -> None:
        self.path = path  # a connection per read: verify reads the sides from threads of its own

    def _pairs(self, table: TableSpec) -> Iterator[tuple[bytes, bytes]]:
        conn = connect(self.path)
        try:
            for key, row in conn.execute("SELECT key, row FROM rows WHERE topic = ? AND row IS NOT NULL",
                                         (table.topic,)):
                yield key.encode(), row.encode()
        finally:
            conn.close()

    def digest(self, table: TableSpec) -> Digest:
        return digest_of(self._pairs(table), lambda v: row_values(orjson.loads(v), table.columns), table.bits)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        return hashes_of(self._pairs(table), lambda v: row_values(orjson.loads(v), table.columns), table.bits, segments)

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        out = {}
        conn = connect(self.path)
        try:
            for key in keys:
                found = conn.execute("SELECT row, pos FROM rows WHERE topic = ? AND key = ?",
                                     (table.topic, key.decode())).fetchone()
                if found is not None:
                    row = None if found[0] is None else row_values(orjson.loads(found[0]), table.columns)
                    out[key] = Found(row, parse_position(found[1] or ""))
        finally:
            conn.close()
        return out

    def close(self) -> None:
        pass


def side(config: Config, spark: Callable[[], Any]) -> NotesSide:
    return NotesSide(config.notes.path)
