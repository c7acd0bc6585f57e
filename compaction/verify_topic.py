"""The topics' side of `cdc verify` (compaction.verify.Side): each table topic read as a table."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from cdc.config import TopicConfig
from cdc.kafka.clients import consumer
from cdc.kafka.reader import read_topic
from compaction.canonical import row_values
from compaction.horizon import newest_commit
from compaction.table import TableRow, TopicTable
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of


class TopicSide:
    """A table topic read as a table (compaction.table), hashed here as it is read. Later reads
    go on from where the last one ended, so a round of `fetch` sees what arrived since."""

    name = "topic"

    def __init__(self, config: TopicConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._probe: Any = None  # looks at the ends of the topics for the stores' waits, in their threads
        self._probe_lock = threading.Lock()
        self._tables: dict[str, TopicTable] = {}
        self._ends: dict[str, dict[int, int]] = {}

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
        with self._lock:
            return digest_of(self._pairs(self._read(table)), _values(table), table.bits)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        """Of the table as the digest read it (the rounds read on, after the narrowing)."""
        with self._lock:
            return hashes_of(self._pairs(self._tables[table.topic]), _values(table), table.bits, segments)

    @staticmethod
    def _pairs(fold: TopicTable) -> Iterator[tuple[bytes, TableRow]]:
        return ((row.key, row) for row in fold.rows())

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        with self._lock:
            states = self._read(table).lookup(keys)
        return {
            k: Found(None if s.row is None else row_values(s.row, table.columns, s.unresolved), s.position)
            for k, s in states.items()
        }

    def newest_commit(self, table: TableSpec) -> int:
        """The highest commit LSN of the changes the table's topic holds now (a look at the end
        of each partition: the fold stays as the digest read it)."""
        with self._probe_lock:
            if self._probe is None:
                self._probe = consumer(self.config, "cdc-verify", max_poll_records=20, fetch_max_wait_ms=10)
            partitions = self._probe.partitions_for_topic(table.topic) or set()
            return newest_commit(self._probe, table.topic, len(partitions))

    def close(self) -> None:
        for fold in self._tables.values():
            fold.close()
        if self._probe is not None:
            self._probe.close()


def _values(table: TableSpec) -> Any:
    return lambda row: row_values(row.row, table.columns, row.unresolved)
