"""The Delta warehouse's read side for `cdc verify` (compaction.verify.Side): `current/` hashed in Spark.

The digest is computed where the data is. For a table whose columns Spark SQL can render in
the canonical form exactly (integers, booleans, decimals, text that is not JSON, dates,
timestamps, binary, arrays of integers, booleans or text) the whole row text, its MD5 and the
segments' sums are Spark expressions: no row leaves the JVM. Otherwise each row's typed
columns go back to the event's form on the executors (dates and timestamps as numbers by
Spark's own functions, the rest in Python) and compaction.canonical hashes them there. Only
the segments' (rows, XOR) pairs, the row hashes of differing segments and the rows of
differing keys reach the driver; rows the narrowing fetches are always rendered in Python. Positions are the rows' `_cdc_lsn`/`_cdc_seq`;
`current/` keeps no delete markers. To be folded into the store (sinks.store) as its read side.
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
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

from cdc.events.calendar import iso_utc
from compaction.canonical import (
    JSON_NAMES,
    MAX_BITS,
    Column,
    bucket,
    row_hash,
    row_text,
    row_values,
)
from compaction.verify import Digest, Found, TableSpec
from sinks.spark_types import _INFINITY_US as INFINITY_US
from sinks.stores.delta.store import table_path

_INFINITY_US = {micros: text for text, micros in INFINITY_US.items()}  # how the warehouse holds them, the other way


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


def float32_leaf(kind: DataType | None) -> bool:
    """Whether the column's values (its arrays' innermost elements) are 32-bit floats."""
    while isinstance(kind, ArrayType):
        kind = kind.elementType
    return isinstance(kind, FloatType)


def event_value(value: Any, connect: dict[str, Any], float32: bool) -> Any:
    """A typed value (dates and timestamps already numbers) as the event has it, as Spark or
    delta-rs (sinks.stores.delta.read) reads it; `float32`: the column holds 32-bit floats."""
    if value is None:
        return None
    ctype, name = connect.get("type"), connect.get("name")
    if ctype == "array" and isinstance(value, list):
        return [event_value(x, connect.get("items", {}), float32) for x in value]
    if name == "io.debezium.time.ZonedTimestamp" and isinstance(value, int):
        return _INFINITY_US.get(value) or iso_utc(value)
    if name in ("io.debezium.time.Timestamp", "io.debezium.time.Time") and isinstance(value, int):
        return value // 1000  # the event's ms (the warehouse keeps µs)
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, float) and float32:
        return _float32(value)
    if isinstance(value, Row | dict):  # a point (a Row from Spark, a dict from Arrow)
        point = value.asDict() if isinstance(value, Row) else dict(value)
        if point.get("wkb") is not None:
            point["wkb"] = base64.b64encode(bytes(point["wkb"])).decode()
        return point
    return value


class _Rows:
    """What the executors do with a partition of `current/` (picklable: it travels with the job)."""

    def __init__(self, columns: tuple[Column, ...], kinds: list[DataType | None], bits: int,
                 segments: frozenset[int] | None = None) -> None:
        self.columns, self.bits, self.segments = columns, bits, segments
        self.float32 = [float32_leaf(kind) for kind in kinds]

    def values(self, row: Row) -> list[Any]:
        event = {
            c.name: event_value(row[i + 3], c.connect, float32)
            for i, (c, float32) in enumerate(zip(self.columns, self.float32, strict=True))
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


_INTEGERS = (ShortType, IntegerType, LongType)
# Jackson writes these escapes with capital hex digits, orjson (the canonical form) with small ones
_CAPITAL_ESCAPES = ("\\u000B", "\\u000E", "\\u000F", *(f"\\u001{c}" for c in "ABCDEF"))


def _json_text(value: SparkColumn) -> SparkColumn:
    """A string as a JSON string literal, escaped as orjson escapes it."""
    quoted = F.to_json(F.struct(value.alias("v"))).substr(F.lit(6), F.length(F.to_json(F.struct(value.alias("v")))) - 6)
    for escape in _CAPITAL_ESCAPES:
        quoted = F.replace(quoted, F.lit(escape), F.lit(escape.lower()))
    return quoted


def _native(value: SparkColumn, kind: DataType, connect: dict[str, Any]) -> SparkColumn | None:
    """The canonical JSON text of a typed column as Spark expressions, where they are exact
    (None: this column goes through Python)."""
    name = connect.get("name")
    if name in JSON_NAMES:
        return None  # compared by meaning: parsed in Python
    if isinstance(kind, _INTEGERS):
        if name in ("io.debezium.time.Time",):
            return F.floor(value / 1000).cast("string")  # the event's ms (the warehouse keeps µs)
        return value.cast("string")
    if isinstance(kind, BooleanType):
        return F.when(value, F.lit("true")).otherwise(F.lit("false"))
    if isinstance(kind, StringType):
        return _json_text(value)
    if isinstance(kind, DecimalType):
        return F.concat(F.lit('"'), value.cast("string"), F.lit('"'))
    if isinstance(kind, DateType):
        return F.unix_date(value).cast("string")
    if isinstance(kind, TimestampNTZType):
        micros = F.unix_micros(value.cast("timestamp"))
        return (F.floor(micros / 1000) if name == "io.debezium.time.Timestamp" else micros).cast("string")
    if isinstance(kind, TimestampType):
        micros = F.unix_micros(value)
        fraction = F.regexp_replace(F.date_format(value, "SSSSSS"), "0+$", "")
        iso = F.concat(
            F.lit('"'), F.date_format(value, "yyyy-MM-dd'T'HH:mm:ss"),
            F.when(fraction == "", F.lit("")).otherwise(F.concat(F.lit("."), fraction)), F.lit('Z"'),
        )
        outside = F.lit('"(a year Spark and Python print apart)"')  # compared in Python, if it differs
        return (
            F.when(micros == F.lit(9223372036825200000), F.lit('"infinity"'))
            .when(micros == F.lit(-9223372036832400000), F.lit('"-infinity"'))
            .when(F.year(value).between(1, 9999), iso).otherwise(outside)
        )
    if isinstance(kind, BinaryType):
        return F.concat(F.lit('"'), F.replace(F.base64(value), F.lit("\r\n"), F.lit("")), F.lit('"'))
    if isinstance(kind, ArrayType):
        element = kind.elementType
        if isinstance(element, _INTEGERS + (BooleanType,)) or (
            isinstance(element, StringType) and connect.get("items", {}).get("name") not in JSON_NAMES
        ):
            text = F.to_json(value)
            for escape in _CAPITAL_ESCAPES:
                text = F.replace(text, F.lit(escape), F.lit(escape.lower()))
            return text
    return None


def _signed(hex16: SparkColumn) -> SparkColumn:
    """16 hex digits as a signed 64-bit integer (Python's `int.from_bytes(..., signed=True)`)."""
    unsigned = F.conv(hex16, 16, 10).cast(DecimalType(20, 0))
    high, wrap = F.lit(str(2**63)).cast(DecimalType(20, 0)), F.lit(str(2**64)).cast(DecimalType(20, 0))
    return F.when(unsigned >= high, unsigned - wrap).otherwise(unsigned).cast("long")


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

    def _hashed(self, table: TableSpec) -> DataFrame | None:
        """(key, segment, row hash) of every row as Spark expressions, when every column has one."""
        path = table_path(self.root, "current", table.topic)
        frame = self.spark.read.format("delta").load(path)
        types = {f.name: f.dataType for f in frame.schema.fields}
        parts = []
        for c in table.columns:
            kind = types.get(c.name)
            if kind is None:
                parts.append(F.lit("null"))
                continue
            column = F.col(f"`{c.name.replace('`', '``')}`")
            text = _native(column, kind, c.connect)
            if text is None:
                return None
            parts.append(F.when(column.isNull(), F.lit("null")).otherwise(text))
        row = F.concat(F.lit("["), F.concat_ws(",", *parts), F.lit("]"))
        segment = F.shiftright(F.conv(F.md5(F.col("_cdc_key")).substr(1, 4), 16, 10).cast("int"), MAX_BITS - table.bits)
        return frame.select(F.col("_cdc_key").alias("k"), segment.alias("s"), _signed(F.md5(row).substr(1, 16)).alias("h"))

    def digest(self, table: TableSpec) -> Digest:
        if not DeltaTable.isDeltaTable(self.spark, table_path(self.root, "current", table.topic)):
            return {}
        hashed = self._hashed(table)
        if hashed is not None:
            rows = hashed.groupBy("s").agg(F.count(F.lit(1)), F.bit_xor("h")).collect()
            return {int(s): (int(n), int(x)) for s, n, x in rows}
        found = self._frame(table)
        assert found is not None
        frame, kinds = found
        pairs = frame.rdd.mapPartitions(_Rows(table.columns, kinds, table.bits)).reduceByKey(_merge).collect()
        return {int(segment): (int(n), int(x)) for segment, (n, x) in pairs}

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        if not DeltaTable.isDeltaTable(self.spark, table_path(self.root, "current", table.topic)):
            return {}
        hashed = self._hashed(table)
        if hashed is not None:
            picked = hashed.where(F.col("s").isin(sorted(segments))).select("k", "h").collect()
            return {k.encode(): int(h) for k, h in picked}
        found = self._frame(table)
        assert found is not None
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
