"""Stores of the events' JSON (the cache, the search index): what they share.

The job hands every table of a batch to the executors in one pass, as Arrow batches
(`mapInArrow`: no row is pickled); on each Spark partition the `PartitionWriter` folds each
key's changes into its last one (sinks.latest.fold, over the columns), drops those at or
below their table's newest truncate, fills unchanged TOASTed values the batch lacks from the
row the store holds, and gives the store chunks of last changes (sinks.latest.LAST) to
write. What the store refused comes back as Arrow rows too. A truncate walks the positions
the store holds and deletes what is below it, through the same writes (a delete leaves the
store's marker at the truncate's position).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

from sinks.latest import COLUMNS, changes_table, fold, position
from sinks.store import Store, Truncate
from sinks.versions import Registry

#: (topic, partition, offset, reason) of a record the store refused: a dead letter
Rejected = tuple[str, int, int, str]
#: Rejected as the executors hand them back to the driver
REJECTED = pa.schema([("_cdc_topic", pa.string()), ("_cdc_partition", pa.int32()), ("_cdc_offset", pa.int64()),
                      ("_reason", pa.string())])
CHUNK_KEYS = 1000  # last changes per round trip: one look-up and one write each
#: last changes packed at once: a column operation costs per call as well as per value, so a
#: slab of many round trips' worth (per chunk of 1,000 the calls cost as much as the values)
SLAB_KEYS = 20 * CHUNK_KEYS


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
    def write(self, changes: pa.Table) -> list[Rejected]:
        """Apply each last change of `changes` (sinks.latest.LAST, at most SLAB_KEYS) over a
        lower position the store holds for its key (a lone tombstone, without a position, over
        a lower offset of its partition), in round trips of at most CHUNK_KEYS; a delete leaves
        a marker at its position. What the store refused, for the dead letters."""

    @abstractmethod
    def positions(self, topic: str) -> Iterator[list[tuple[str, str]]]:
        """(key, position text) of every row the store holds for `topic`, a chunk at a time."""


class PartitionWriter:
    """One Spark partition's changes into the store (runs on an executor): Arrow batches of
    change rows (sinks.latest.ROWS) in, Arrow batches of what the store refused (REJECTED) out."""

    def __init__(self, writer: RowWriter, cuts: dict[str, str]) -> None:
        self.writer = writer
        self.cuts = cuts  # topic -> its newest truncate's position text

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        received = [batch for batch in batches if batch.num_rows]  # a key's changes may span batches
        if not received:  # most partitions of a batch hold other tables' records, or none
            return
        changes = self.above_cuts(fold(pa.Table.from_batches(received)))
        if not changes.num_rows:
            return
        writer = self.writer
        rejected: list[Rejected] = []
        writer.open()
        try:
            for start in range(0, changes.num_rows, SLAB_KEYS):
                rejected += writer.write(self.fill_toasted(changes.slice(start, SLAB_KEYS)))
        finally:
            writer.close()
        if rejected:
            yield pa.RecordBatch.from_pylist([dict(zip(REJECTED.names, r, strict=True)) for r in rejected],
                                             schema=REJECTED)

    def above_cuts(self, changes: pa.Table) -> pa.Table:
        """Changes above their table's newest truncate (a lone tombstone stays: deleting is safe)."""
        below = None
        for topic, cut in self.cuts.items():
            mask = pc.and_(pc.equal(changes["topic"], topic), pc.less_equal(changes["pos"], cut))
            below = mask if below is None else pc.or_(below, mask)
        if below is None:
            return changes
        lone = pc.is_null(changes["lsn"])
        return changes.filter(pc.or_(lone, pc.invert(below)))

    def fill_toasted(self, changes: pa.Table) -> pa.Table:
        """Unchanged TOASTed values the batch did not have: the held row's (null without one),
        read CHUNK_KEYS at a time."""
        needs = pc.greater(pc.list_value_length(changes["missing"]), 0)
        if not pc.any(needs).as_py():
            return changes
        rows = changes["row"].to_pylist()
        by_topic: dict[str, list[int]] = {}
        for i in pc.indices_nonzero(needs).to_pylist():
            by_topic.setdefault(changes["topic"][i].as_py(), []).append(i)
        missing = changes["missing"].to_pylist()
        keys = changes["key"].to_pylist()
        for topic, wanted in by_topic.items():
            for start in range(0, len(wanted), CHUNK_KEYS):
                self._fill(topic, wanted[start:start + CHUNK_KEYS], keys, rows, missing)
        return changes.set_column(changes.schema.get_field_index("row"), "row", pa.array(rows, pa.string()))

    def _fill(self, topic: str, places: list[int], keys: list[str], rows: list[str], missing: list[list[str]]) -> None:
        columns = {name for i in places for name in missing[i]}
        held = self.writer.held(topic, [keys[i] for i in places], columns)
        for i, found in zip(places, held, strict=True):
            row = orjson.loads(rows[i])
            for name in missing[i]:
                row[name] = (found or {}).get(name)
            rows[i] = orjson.dumps(row).decode()


class RowStore(Store):
    """A store of the events' JSON: the job writes every table of a batch in one pass."""

    writes = "rows"

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
                deletes: list[tuple[Any, ...]] = [
                    (topic, key, "d", lsn, seq, -1, -1, None, []) for key, pos in chunk if pos < cut
                ]
                if deletes:
                    writer.write(changes_table(deletes))
        finally:
            writer.close()

    #: what each Spark partition of a batch runs (a store may leave out a step it does itself)
    partition_class: type[PartitionWriter] = PartitionWriter

    def partition_writer(self, registry: Registry, cuts: dict[str, tuple[int, int]]) -> PartitionWriter:
        """What each Spark partition of a batch runs; `cuts`: each table's newest truncate."""
        return self.partition_class(self.writer(registry), {t: position(*c) for t, c in cuts.items()})

    def write(self, rows: DataFrame, registry: Registry, cuts: dict[str, tuple[int, int]]) -> list[Rejected]:
        """Every change row of the batch (CHANGE_COLUMNS, no truncate events) through the
        executors; what the store refused."""
        writer = self.partition_writer(registry, cuts)
        # a key's changes meet in one Spark partition, in offset order (sinks.latest)
        rejected = map_in_arrow(rows.select(*COLUMNS), writer, REJECTED).collect()
        return [(r[0], r[1], r[2], r[3]) for r in rejected]


def map_in_arrow(frame: DataFrame, func: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
                 schema: pa.Schema) -> DataFrame:
    """`DataFrame.mapInArrow` without pandas: pyspark 4.2 builds its function through
    `pandas_udf`, which demands pandas on the driver although neither side uses it (Spark
    fixed it for its Arrow UDFs, SPARK-53059, not for mapInArrow yet). The same plan, the
    function declared as what it is (an Arrow batch map); the executors need pyarrow only."""
    from pyspark.sql.udf import _create_udf
    from pyspark.util import PythonEvalType

    ddl = ", ".join(f"`{f.name}` {_SPARK_TYPES[f.type]}" for f in schema)
    udf = _create_udf(func, ddl, PythonEvalType.SQL_MAP_ARROW_ITER_UDF)
    column = udf(*[frame[name] for name in frame.columns])
    return DataFrame(frame._jdf.mapInArrow(column._jc, False, None), frame.sparkSession)


_SPARK_TYPES = {pa.string(): "string", pa.int32(): "int", pa.int64(): "bigint"}
