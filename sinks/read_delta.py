"""The Delta warehouse's read side for `cdc verify` (compaction.verify.Side): `current/` hashed in Spark.

The digest is computed by the executors, where the data is: each row's typed columns go back
to the event's form (dates, timestamps and arrays of them by Spark's own functions, the rest
by `event_form` on the executors), then compaction.canonical hashes it and Spark sums up the
segments. Only the segments' (rows, XOR) pairs, the row hashes of differing segments and the
rows of differing keys reach the driver. Positions are the rows' `_cdc_lsn`/`_cdc_seq`;
`current/` keeps no delete markers. To be folded into the store once the stores share one
contract.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterable, Iterator
from decimal import Decimal
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import Column as SparkColumn
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DataType,
    DateType,
    FloatType,
    TimestampNTZType,
    TimestampType,
)

from cdc.events.calendar import iso_utc
from compaction.canonical import Column, bucket, row_hash, row_text, row_values
from compaction.verify import Digest, Found, TableSpec
from sinks.delta import table_path

_INFINITY_US = {9223372036825200000: "infinity", -9223372036832400000: "-infinity"}  # sinks.shapes, the other way


def _micros(value: SparkColumn, kind: DataType) -> SparkColumn:
    """Dates as epoch days, timestamps as epoch µs, in arrays too: exact over any range (Python's
    datetime stops at year 9999 and reads timestamps in the executor's time zone)."""
    if isinstance(kind, ArrayType):
        return F.transform(value, lambda x: _micros(x, kind.elementType))
    if isinstance(kind, DateType):
        return F.unix_date(value)
    if isinstance(kind, TimestampNTZType):
        return F.unix_micros(value.cast("timestamp"))  # the session's time zone is UTC: the wall time
    if isinstance(kind, TimestampType):
        return F.unix_micros(value)
    return value


def _float32(value: float) -> float:
    """A float column's value as the event has it: the shortest decimal that reads back as the
    same 32-bit float (PostgreSQL's float4 output), not the float32's exact double."""
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == value:
            return float(text)
    return value


def _back(value: Any, connect: dict[str, Any], kind: DataType | None) -> Any:
    """A typed value (dates and timestamps already numbers) as the event has it."""
    if value is None:
        return None
    ctype, name = connect.get("type"), connect.get("name")
    if ctype == "array" and isinstance(value, list):
        inner = kind.elementType if isinstance(kind, ArrayType) else None
        return [_back(x, connect.get("items", {}), inner) for x in value]
    if name == "io.debezium.time.ZonedTimestamp" and isinstance(value, int):
        return _INFINITY_US.get(value) or iso_utc(value)
    if name in ("io.debezium.time.Timestamp", "io.debezium.time.Time") and isinstance(value, int):
        return value // 1000  # the event's ms (the warehouse keeps µs)
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, float) and isinstance(kind, FloatType):
        return _float32(value)
    if isinstance(value, Row):  # a point
        point = value.asDict()
        if point.get("wkb") is not None:
            point["wkb"] = base64.b64encode(bytes(point["wkb"])).decode()
        return point
    return value


class _Rows:
    """What the executors do with a partition of `current/` (picklable: it travels with the job)."""

    def __init__(self, columns: tuple[Column, ...], kinds: list[DataType | None], bits: int,
                 segments: frozenset[int] | None = None) -> None:
        self.columns, self.kinds, self.bits, self.segments = columns, kinds, bits, segments

    def values(self, row: Row) -> list[Any]:
        event = {
            c.name: _back(row[i + 3], c.connect, kind)
            for i, (c, kind) in enumerate(zip(self.columns, self.kinds, strict=True))
        }
        return row_values(event, self.columns)

    def __call__(self, rows: Iterable[Row]) -> Iterator[Any]:
        for row in rows:
            key = row[0].encode()
            segment = bucket(key, self.bits)
            h = row_hash(row_text(self.values(row)))
            if self.segments is None:
                yield segment, (1, h)
            elif segment in self.segments:
                yield key, h


def _merge(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] ^ b[1]


class DeltaSide:
    name = "delta"

    def __init__(self, spark: SparkSession, root: str) -> None:
        self.spark = spark
        self.root = root

    def _frame(self, table: TableSpec) -> tuple[DataFrame, list[DataType | None]] | None:
        """`current/` of the table as (key, lsn, seq, each column in event-ready form), with the
        Spark type of each column (None: a column the table lacks, read as null)."""
        path = table_path(self.root, "current", table.topic)
        if not DeltaTable.isDeltaTable(self.spark, path):
            return None
        frame = self.spark.read.format("delta").load(path)
        types = {f.name: f.dataType for f in frame.schema.fields}
        kinds = [types.get(c.name) for c in table.columns]
        selected = [F.col("_cdc_key"), F.col("_cdc_lsn"), F.col("_cdc_seq")] + [
            F.lit(None).alias(f"_c{i}") if kind is None else _micros(F.col(f"`{c.name.replace('`', '``')}`"), kind).alias(f"_c{i}")
            for i, (c, kind) in enumerate(zip(table.columns, kinds, strict=True))
        ]
        return frame.select(*selected), kinds

    def digest(self, table: TableSpec) -> Digest:
        found = self._frame(table)
        if found is None:
            return {}
        frame, kinds = found
        pairs = frame.rdd.mapPartitions(_Rows(table.columns, kinds, table.bits)).reduceByKey(_merge).collect()
        return {int(segment): (int(n), int(x)) for segment, (n, x) in pairs}

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        found = self._frame(table)
        if found is None:
            return {}
        frame, kinds = found
        return dict(frame.rdd.mapPartitions(_Rows(table.columns, kinds, table.bits, frozenset(segments))).collect())

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        found = self._frame(table)
        if found is None:
            return {}
        frame, kinds = found
        rows = _Rows(table.columns, kinds, table.bits)
        picked = frame.where(F.col("_cdc_key").isin([k.decode() for k in keys])).collect()
        return {
            row[0].encode(): Found(rows.values(row), None if row[1] is None else (int(row[1]), int(row[2] or 0)))
            for row in picked
        }

    def close(self) -> None:
        """The session is the caller's."""
