"""Table versions from `<prefix>.__cdc_schemas`, and the Spark type of every column.

Column types come from the capture side (cdc.events.shapes), never from PostgreSQL: an
event is decoded with the version of its table in force at its commit LSN, so an event
written before an `ALTER TABLE` keeps its old shape. The mapping into Spark (and Delta)
types is the README's sink type table; `decode` turns one column's JSON text (as the
event carries it) into that type and says when a value does not fit.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

TOAST_PLACEHOLDER = "__debezium_unavailable_value"
_PLACEHOLDER_BYTES = "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=="
#: What an unchanged TOASTed value is in an event (as Debezium renders it, cdc.events.changes):
#: the string, base64 of it for bytea, a one-element list for arrays of strings or bytes, a
#: one-pair object for hstore; as JSON text, the way the decoder sees a column's value.
UNAVAILABLE_FORMS = (
    TOAST_PLACEHOLDER, _PLACEHOLDER_BYTES, f'["{TOAST_PLACEHOLDER}"]', f'["{_PLACEHOLDER_BYTES}"]',
    f'{{"{TOAST_PLACEHOLDER}":"{TOAST_PLACEHOLDER}"}}',
)

# Debezium's timestamp infinities (µs); timestamptz ones arrive as the strings below
_INFINITY_US = {"infinity": 9223372036825200000, "-infinity": -9223372036832400000}

POINT = StructType(
    [
        StructField("x", DoubleType()),
        StructField("y", DoubleType()),
        StructField("wkb", BinaryType()),
        StructField("srid", IntegerType()),
    ]
)


@dataclass(frozen=True)
class ColumnShape:
    name: str
    type: str  # PostgreSQL type name, domains resolved; arrays `<element>[]`
    modifier: int
    key: bool
    connect: dict[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class Version:
    """One shape of one table, valid from commit LSN `from_lsn` until the next version."""

    schema: str
    table: str
    topic: str
    from_lsn: int
    columns: tuple[ColumnShape, ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.table}"

    @classmethod
    def from_record(cls, value: bytes) -> Version:
        raw = orjson.loads(value)
        return cls(
            raw["schema"], raw["table"], raw["topic"], int(raw["from"]),
            tuple(ColumnShape(c["name"], c["type"], c["modifier"], c["key"], c["connect"]) for c in raw["columns"]),
        )


class Registry:
    """Every known version, per topic in `from_lsn` order."""

    def __init__(self, versions: Iterable[Version] = ()) -> None:
        self._by_topic: dict[str, list[Version]] = {}
        for version in versions:
            self.add(version)

    def add(self, version: Version) -> None:
        versions = self._by_topic.setdefault(version.topic, [])
        froms = [v.from_lsn for v in versions]
        at = bisect.bisect_left(froms, version.from_lsn)
        if at < len(versions) and versions[at].from_lsn == version.from_lsn:
            versions[at] = version
        else:
            versions.insert(at, version)

    def topics(self) -> list[str]:
        return list(self._by_topic)

    def versions(self, topic: str) -> list[Version]:
        return self._by_topic.get(topic, [])

    def at(self, topic: str, commit_lsn: int) -> Version | None:
        """The version in force at `commit_lsn` (None before the first one)."""
        versions = self.versions(topic)
        at = bisect.bisect_right([v.from_lsn for v in versions], commit_lsn)
        return versions[at - 1] if at else None

    def spanning(self, topic: str, low: int, high: int) -> list[tuple[Version, int, int]]:
        """The versions in force between commit LSNs low and high, each with the LSN range
        [start, end) it decodes; an event below the first version gets the first one."""
        versions = self.versions(topic)
        out = []
        for i, version in enumerate(versions):
            start = version.from_lsn if i else -(2**63)
            end = versions[i + 1].from_lsn if i + 1 < len(versions) else 2**63 - 1
            if start <= high and end > low:
                out.append((version, start, end))
        return out


# --------------------------------------------------------------------------- types


def numeric_precision(modifier: int) -> tuple[int, int] | None:
    """numeric(p, s) from its type modifier; None when unconstrained."""
    if modifier < 4:
        return None
    packed = modifier - 4
    precision, scale = (packed >> 16) & 0xFFFF, packed & 0x7FF
    if scale > 1023:  # PostgreSQL 15+: an 11-bit signed scale
        scale -= 2048
    return precision, scale


def spark_type(connect: dict[str, Any], pg_type: str, modifier: int) -> DataType:
    """The Spark/Delta type of a column (the README's sink type table)."""
    ctype, name = connect["type"], connect.get("name")
    if ctype == "array":
        from pyspark.sql.types import ArrayType

        element = pg_type[:-2] if pg_type.endswith("[]") else pg_type
        return ArrayType(spark_type(connect["items"], element, modifier), containsNull=True)
    if ctype == "struct":
        return POINT
    if ctype == "boolean":
        return BooleanType()
    if ctype == "int16":
        return ShortType()
    if ctype == "int32":
        if name == "io.debezium.time.Date":
            return DateType()
        if name == "io.debezium.time.Time":
            return LongType()  # normalised to µs past midnight, like MicroTime
        return IntegerType()
    if ctype == "int64":
        if name in ("io.debezium.time.Timestamp", "io.debezium.time.MicroTimestamp"):
            return TimestampNTZType()
        return LongType()
    if ctype == "float":
        return FloatType()
    if ctype == "double":
        return DoubleType()
    if ctype == "bytes":
        return BinaryType()
    if name == "io.debezium.time.ZonedTimestamp":
        return TimestampType()
    if pg_type == "numeric":
        ps = numeric_precision(modifier)
        if ps is not None and 1 <= ps[0] <= 38 and 0 <= ps[1] <= ps[0]:
            return DecimalType(*ps)
    return StringType()


def _scalar(raw: Column, connect: dict[str, Any], target: DataType) -> Column:
    """The typed value of one scalar's JSON text (null when it does not fit `target`)."""
    name = connect.get("name")
    if isinstance(target, StringType):
        return raw
    if isinstance(target, BinaryType):
        return F.try_to_binary(raw, F.lit("base64"))
    if isinstance(target, DateType):
        return F.date_from_unix_date(raw.try_cast("int"))
    if isinstance(target, TimestampNTZType):
        micros = raw.try_cast("long")
        if name == "io.debezium.time.Timestamp":
            micros = micros * 1000
        return F.timestamp_micros(micros).cast("timestamp_ntz")  # the session runs in UTC
    if isinstance(target, TimestampType):
        infinity = F.when(raw == "infinity", F.lit(_INFINITY_US["infinity"])).when(
            raw == "-infinity", F.lit(_INFINITY_US["-infinity"])
        )
        return F.coalesce(F.timestamp_micros(infinity), raw.try_cast("timestamp"))
    if name == "io.debezium.time.Time":
        return raw.try_cast("long") * 1000
    if isinstance(target, StructType):
        point = F.from_json(raw, "x double, y double, wkb string, srid int")
        return F.when(
            point.isNotNull(),
            F.struct(point.x.alias("x"), point.y.alias("y"), F.try_to_binary(point.wkb, F.lit("base64")).alias("wkb"),
                     point.srid.alias("srid")),
        )
    return raw.try_cast(target)


def decode(raw: Column, connect: dict[str, Any], target: DataType) -> tuple[Column, Column]:
    """(typed value, bad) of one column's JSON text: `bad` is true when a value is present
    but does not fit the type (e.g. numeric NaN in a decimal, a nested array in a flat one).
    Arrays decode element by element, at any depth."""
    from pyspark.sql.types import ArrayType

    if isinstance(target, ArrayType):
        items, element = connect["items"], target.elementType
        parsed = F.from_json(raw, "array<string>")
        typed = F.transform(parsed, lambda x: decode(x, items, element)[0])
        misfit = F.exists(parsed, lambda x: decode(x, items, element)[1])
        return typed, raw.isNotNull() & (parsed.isNull() | misfit)
    typed = _scalar(raw, connect, target)
    return typed, raw.isNotNull() & typed.isNull()


def unavailable(raw: Column) -> Column:
    """True where the event says "unchanged TOASTed value, not sent"."""
    return raw.isin(*UNAVAILABLE_FORMS)
