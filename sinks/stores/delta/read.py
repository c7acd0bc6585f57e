"""The Delta warehouse's read side for `cdc verify` without a Spark session: `current/` read by
delta-rs (`deltalake`) in a child process and hashed here, for the tables where that is
cheaper than starting Spark; Spark (sinks.stores.delta.read_spark, hashed where the data is) for the rest.

A Spark session costs 10-40 s before its first row, whatever the table holds; delta-rs reads a
small table in well under a second. `WarehouseSide` picks per table, once, from the table's
Delta log (`[delta] verify_reader`): delta-rs for a local table of at most `DIRECT_BYTES` of
data files whose protocol it reads (no deletion vectors, column mapping or type widening:
delta-rs refuses the first and reads the others wrong), Spark otherwise. The rows come back
as Arrow batches, dates and timestamps as numbers (exact over any range, as Spark's side
takes them), and go through the same conversion to the event's form as on Spark's executors
(sinks.stores.delta.read_spark.event_value), so both readers give the same hashes.

delta-rs runs in a child process (sinks.stores.delta.rs) that lives as long as the side.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc

from cdc.config import Config, ConfigError
from compaction.canonical import row_values
from compaction.verify import Digest, Found, Side, TableSpec, digest_of, hashes_of
from sinks.stores.delta.read_spark import event_value
from sinks.stores.delta.rs import DeltaRs, ReaderError, remote
from sinks.stores.delta.store import table_path

log = logging.getLogger(__name__)

DIRECT_BYTES = 64 * 2**20  # `auto`: delta-rs up to this many bytes of a table's data files, Spark beyond
READABLE_FEATURES = frozenset({"timestampNtz"})  # reader features delta-rs reads right (the sinks write this one)
_POSITION = ("_cdc_key", "_cdc_lsn", "_cdc_seq")
_YEAR_1, _YEAR_9999 = -62135596800000000, 253402300799999999  # µs from the epoch, first and last

def _as_number(kind: pa.DataType) -> pa.DataType:
    """Dates as epoch days, timestamps as epoch µs (the wall time for those without a zone), in
    lists too: what Spark's side computes (sinks.stores.delta.read_spark._micros)."""
    if pa.types.is_list(kind):
        return pa.list_(_as_number(kind.value_type))
    if pa.types.is_date32(kind):
        return pa.int32()
    if pa.types.is_timestamp(kind):
        return pa.int64()
    return kind


def _zoned(kind: pa.DataType) -> bool:
    while pa.types.is_list(kind):
        kind = kind.value_type
    return pa.types.is_timestamp(kind) and kind.tz is not None


def _numbers(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Dates and timestamps as numbers. Spark writes zoned timestamps as INT96, and the
    ±infinity of timestamptz (beyond its calendar) in a wrapped form only Spark reads back: a
    zoned timestamp outside years 1 to 9999 is left to Spark (ReaderError)."""
    columns = []
    for column, field in zip(batch.columns, batch.schema, strict=True):
        if pa.types.is_timestamp(field.type) and field.type.unit != "us":
            column = column.cast(pa.timestamp("us", field.type.tz))
        column = column.cast(_as_number(field.type))
        if _zoned(field.type):
            flat = column
            while pa.types.is_list(flat.type):
                flat = flat.flatten()
            low, high = pc.min_max(flat).values()
            if (low.as_py() or 0) < _YEAR_1 or (high.as_py() or 0) > _YEAR_9999:
                raise ReaderError(f"column {field.name} holds a timestamp beyond years 1 to 9999, which Spark reads")
        columns.append(column)
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names)


def _float32_leaf(kind: pa.DataType | None) -> bool:
    while kind is not None and pa.types.is_list(kind):
        kind = kind.value_type
    return kind is not None and pa.types.is_float32(kind)


Position = tuple[int, int] | None
_CONVERTED_NAMES = ("io.debezium.time.ZonedTimestamp", "io.debezium.time.Timestamp", "io.debezium.time.Time")


def _as_is(kind: pa.DataType, connect: dict[str, Any]) -> bool:
    """Whether a column's Python values are already the event's (event_value would keep them)."""
    if connect.get("name") in _CONVERTED_NAMES:
        return False
    return bool(pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_string(kind)
                or pa.types.is_large_string(kind) or pa.types.is_float64(kind))


class DeltaRsSide:
    """`current/` of each table read by delta-rs and hashed here (compaction.verify.Side); an
    error midway (ReaderError) leaves nothing: the caller asks again, of Spark."""

    name = "delta"

    def __init__(self, reader: DeltaRs, root: str) -> None:
        self.reader, self.root = reader, root

    def _rows(self, table: TableSpec, keys: list[bytes] | None = None) -> Iterator[tuple[bytes, tuple[list[Any], Position]]]:
        """(key, (canonical values, position)) of the table's rows (of these keys), converted a
        column at a time (most columns are taken as they are)."""
        path = table_path(self.root, "current", table.topic)
        wanted = [*_POSITION, *(c.name for c in table.columns)]
        names = [c.name for c in table.columns]
        for raw in self.reader.batches(path, wanted, None if keys is None else [k.decode() for k in keys]):
            batch = _numbers(raw)
            held = set(batch.schema.names)
            columns: list[list[Any]] = []
            for c in table.columns:
                if c.name not in held:
                    columns.append([None] * batch.num_rows)  # a column the table lacks: null
                    continue
                kind = batch.schema.field(c.name).type
                raw = batch.column(c.name).to_pylist()
                if not _as_is(kind, c.connect):
                    float32 = _float32_leaf(kind)
                    raw = [event_value(v, c.connect, float32) for v in raw]
                columns.append(raw)
            position = [batch.column(p).to_pylist() for p in _POSITION]
            for key, lsn, seq, *values in zip(*position, *columns, strict=True):
                row = row_values(dict(zip(names, values, strict=True)), table.columns)
                yield key.encode(), (row, None if lsn is None else (int(lsn), int(seq or 0)))

    def digest(self, table: TableSpec) -> Digest:
        return digest_of(self._rows(table), lambda row: row[0], table.bits)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        return hashes_of(self._rows(table), lambda row: row[0], table.bits, segments)

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        return {key: Found(values, position) for key, (values, position) in self._rows(table, keys)}


def choose(reader: str, root: str, facts: dict[str, Any]) -> str | None:
    """Why Spark reads this table (None: delta-rs does), from `[delta] verify_reader` and the
    table's log (`DeltaRs.describe`)."""
    if reader == "spark":
        return "[delta] verify_reader = spark"
    if remote(root):
        return "a remote warehouse (its credentials are Spark's)"
    if not facts.get("table"):
        return None  # no table yet: nothing to read
    unread = set(facts.get("reader_features") or ()) - READABLE_FEATURES
    if facts.get("reader_version") == 2 or facts.get("column_mapping", "none") != "none":
        unread.add("columnMapping")
    if unread:
        return f"table features delta-rs cannot read: {', '.join(sorted(unread))}"
    if reader == "auto" and int(facts.get("bytes") or 0) > DIRECT_BYTES:
        return f"{facts['bytes']:,} bytes of data files, more than {DIRECT_BYTES:,} (Spark hashes where the data is)"
    return None


class WarehouseSide:
    """The warehouse's side (compaction.verify.Side): per table, delta-rs here or Spark where
    the data is, chosen at the table's first read and kept for its later ones. `spark` gives
    the Spark session, made only when a table needs it."""

    name = "delta"

    def __init__(self, root: str, reader: str, spark: Callable[[], Any]) -> None:
        self.root, self.reader, self._spark = root, reader, spark
        self._rs: DeltaRs | None = None
        self._in_spark: Side | None = None
        self._chosen: dict[str, str] = {}  # topic -> "delta-rs" or "spark"
        self._lock = threading.Lock()

    def how(self, table: TableSpec) -> str | None:
        return self._chosen.get(table.topic)

    def _direct(self) -> DeltaRs:
        with self._lock:
            if self._rs is None:
                self._rs = DeltaRs()
            return self._rs

    def _spark_side(self, table: TableSpec, why: str | None) -> Side:
        """Spark's side, for this table from now on (`why`: the reason, logged once per table)."""
        if why is not None:
            log.info("verify: the warehouse's %s is hashed in Spark: %s", table.display, why)
        with self._lock:
            self._chosen[table.topic] = "spark"
            if self._in_spark is None:
                from sinks.stores.delta.read_spark import DeltaSide

                self._in_spark = DeltaSide(self._spark(), self.root)
            return self._in_spark

    def _side(self, table: TableSpec) -> Side:
        chosen = self._chosen.get(table.topic)
        if chosen == "spark":
            return self._spark_side(table, None)
        if chosen is None:
            why = choose(self.reader, self.root, {})  # what the setting and the warehouse's place decide alone
            if why is None:
                try:
                    why = choose(self.reader, self.root, self._direct().describe(table_path(self.root, "current", table.topic)))
                except ReaderError as exc:
                    why = str(exc)
            if why is not None:
                return self._spark_side(table, why)
            self._chosen[table.topic] = "delta-rs"
        return DeltaRsSide(self._direct(), self.root)

    def _ask(self, table: TableSpec, question: Callable[[Side], Any]) -> Any:
        side = self._side(table)
        if isinstance(side, DeltaRsSide):
            try:
                return question(side)
            except ReaderError as exc:  # a table delta-rs turned out not to read: Spark reads it from now on
                return question(self._spark_side(table, str(exc)))
        return question(side)

    def digest(self, table: TableSpec) -> Digest:
        result: Digest = self._ask(table, lambda side: side.digest(table))
        return result

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        result: dict[bytes, int] = self._ask(table, lambda side: side.hashes(table, segments))
        return result

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        result: dict[bytes, Found] = self._ask(table, lambda side: side.fetch(table, keys))
        return result

    def close(self) -> None:
        """The Spark session is the caller's."""
        if self._rs is not None:
            self._rs.close()


def check(config: Config) -> None:
    if not config.delta.path:
        raise ConfigError("[delta] path is not set: set it (or CDC_DELTA_PATH), or leave delta out of --stores")


def side(config: Config, spark: Callable[[], Any]) -> WarehouseSide:
    return WarehouseSide(config.delta.path, config.delta.verify_reader, spark)
