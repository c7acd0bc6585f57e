"""The Spark (and Delta) type of every column, and the decoding of an event's values into it.

The mapping is the sink type table of docs/sinks/delta.md; `decode` turns one column's JSON text (as the
event carries it) into that type and says when a value does not fit.
"""

from __future__ import annotations

from typing import Any

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

from sinks.versions import UNAVAILABLE_FORMS

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
    """The Spark/Delta type of a column (the sink type table of docs/sinks/delta.md)."""
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
