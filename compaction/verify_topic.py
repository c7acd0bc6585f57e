"""The topics' side of `cdc verify` (compaction.verify.Side): each table topic read as a table."""

from __future__ import annotations

import threading

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic
from compaction.canonical import row_values
from compaction.table import TopicTable
from compaction.verify import Digest, Found, LocalDigest, TableSpec


class TopicSide:
    """A table topic read as a table (compaction.table), hashed here as it is read. Later reads
    go on from where the last one ended, so a round of `fetch` sees what arrived since."""

    name = "topic"

    def __init__(self, config: TopicConfig) -> None:
        self.config = config
        self._lock = threading.RLock()  # the stores' waits read it too, from their threads
        self._tables: dict[str, TopicTable] = {}
        self._ends: dict[str, dict[int, int]] = {}
        self._digests: dict[str, LocalDigest] = {}

    def read(self, table: TableSpec) -> TopicTable:
        """The topic's table, with every record up to the topic's current end folded in."""
        with self._lock:
            return self._read(table)

    def _read(self, table: TableSpec) -> TopicTable:
        fold = self._tables.get(table.topic)
        if fold is None:
            fold = self._tables[table.topic] = TopicTable(threadsafe=True)
        ends: dict[int, int] = {}
        try:
            fold.extend(read_topic(self.config, table.topic, start=self._ends.get(table.topic), ends=ends))
        except LookupError:  # no topic (yet): an empty table
            return fold
        self._ends[table.topic] = ends
        return fold

    def digest(self, table: TableSpec) -> Digest:
        found = LocalDigest(table.bits)
        with self._lock:
            for row in self._read(table).rows():
                found.add(row.key, row_values(row.row, table.columns, row.unresolved))
        old = self._digests.pop(table.topic, None)
        if old is not None:
            old.close()
        self._digests[table.topic] = found.done()
        return dict(found.segments)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        return self._digests[table.topic].hashes(segments)

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        with self._lock:
            states = self._read(table).lookup(keys)
        return {
            k: Found(None if s.row is None else row_values(s.row, table.columns, s.unresolved), s.position)
            for k, s in states.items()
        }

    def max_commit(self, table: TableSpec) -> int:
        """The highest commit LSN of any change read from the table's topic."""
        fold = self._tables.get(table.topic)
        return 0 if fold is None else fold.max_commit

    def close(self) -> None:
        for digest in self._digests.values():
            digest.close()
        for fold in self._tables.values():
            fold.close()
