"""Stores of the events' JSON (the cache, the search index): what they share.

The job hands every table of a batch to the executors in one pass; on each Spark partition
the `PartitionWriter` folds each key's changes into its last one (sinks.latest), drops
those at or below their table's newest truncate, fills unchanged TOASTed values the batch
lacks from the row the store holds, and gives the store chunks of last changes to write.
A truncate walks the positions the store holds and deletes what is below it, through the
same writes (a delete leaves the store's marker at the truncate's position).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

from pyspark.sql import DataFrame, Row

from sinks.latest import COLUMNS, Change, last_changes, position
from sinks.store import Store, Truncate
from sinks.versions import Registry

#: (topic, partition, offset, reason) of a record the store refused: a dead letter
Rejected = tuple[str, int, int, str]
CHUNK_KEYS = 1000  # last changes per chunk: one look-up and one write round trip each


class RowWriter(ABC):
    """A store's writes of last changes (picklable: it travels to the executors)."""

    def open(self) -> None:  # noqa: B027 (a writer without a connection)
        """Before the first chunk of a partition."""

    def close(self) -> None:  # noqa: B027
        """After the last one."""

    @abstractmethod
    def held(self, topic: str, keys: list[str], columns: set[str]) -> list[dict[str, Any] | None]:
        """The rows the store holds for `keys` (canonical key JSON), with at least `columns`
        (None for a key it does not hold)."""

    @abstractmethod
    def write(self, chunk: list[tuple[str, Change]]) -> list[Rejected]:
        """Apply each (topic, last change) over a lower position the store holds for its key
        (a lone tombstone, without a position, over a lower offset of its partition); a
        delete leaves a marker at its position. What the store refused, for the dead letters."""

    @abstractmethod
    def positions(self, topic: str) -> Iterator[list[tuple[str, str]]]:
        """(key, position text) of every row the store holds for `topic`, a chunk at a time."""


class RowStore(Store):
    """A store of the events' JSON: the job writes every table of a batch in one pass."""

    def prepare(self, topics: list[str], registry: Registry) -> None:  # noqa: B027
        """On the driver, before a batch's writes: what the tables need (an index, a mapping)."""

    @abstractmethod
    def writer(self, registry: Registry) -> RowWriter: ...

    def after_batch(self, topics: list[str]) -> None:  # noqa: B027
        """On the driver, after a batch's writes (making them searchable)."""

    def truncate(self, topic: str, truncate: Truncate) -> None:
        """Delete every row held below the truncate's position, as deletes at that position."""
        lsn, seq, _ = truncate
        cut = position(lsn, seq)
        writer = self.writer(Registry())
        writer.open()
        try:
            for chunk in writer.positions(topic):
                below = [(topic, Change(key, "d", lsn, seq, -1, -1)) for key, pos in chunk if pos < cut]
                if below:
                    writer.write(below)
        finally:
            writer.close()

    def write(self, rows: DataFrame, registry: Registry, cuts: dict[str, tuple[int, int]]) -> list[Rejected]:
        """Every change row of the batch (CHANGE_COLUMNS, no truncate events) through the
        executors; what the store refused."""
        writer = PartitionWriter(self.writer(registry), {t: position(*c) for t, c in cuts.items()})
        # a key's changes meet in one Spark partition, in offset order (sinks.latest)
        return rows.select(*COLUMNS).rdd.mapPartitions(writer).collect()


class PartitionWriter:
    """One Spark partition's changes into the store (runs on an executor)."""

    def __init__(self, writer: RowWriter, cuts: dict[str, str]) -> None:
        self.writer = writer
        self.cuts = cuts  # topic -> its newest truncate's position text

    def __call__(self, rows: Iterable[Row | tuple]) -> Iterator[Rejected]:
        changes = self.above_cuts(last_changes(rows))
        first = next(changes, None)
        if first is None:  # most partitions of a batch hold other tables' records, or none
            return
        changes = itertools.chain([first], changes)
        writer = self.writer
        writer.open()
        try:
            while chunk := list(itertools.islice(changes, CHUNK_KEYS)):
                self.fill_toasted(chunk)
                yield from writer.write(chunk)
        finally:
            writer.close()

    def above_cuts(self, changes: Iterator[tuple[str, Change]]) -> Iterator[tuple[str, Change]]:
        """Changes above their table's newest truncate (a lone tombstone stays: deleting is safe)."""
        cuts = self.cuts
        for topic, change in changes:
            cut = cuts.get(topic)
            if cut is None or change.lsn is None or change.pos > cut:
                yield topic, change

    def fill_toasted(self, chunk: list[tuple[str, Change]]) -> None:
        """Unchanged TOASTed values the batch did not have: the held row's (null without one)."""
        by_topic: dict[str, list[Change]] = {}
        for topic, change in chunk:
            if change.missing:
                by_topic.setdefault(topic, []).append(change)
        for topic, changes in by_topic.items():
            columns = {name for change in changes for name in change.missing}
            held = self.writer.held(topic, [c.key for c in changes], columns)
            for change, row in zip(changes, held, strict=True):
                assert change.row is not None
                for name in change.missing:
                    change.row[name] = (row or {}).get(name)
