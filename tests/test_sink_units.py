"""The sinks' pure logic, without Spark running: table versions, the type table, names, options."""

from __future__ import annotations

import re

import orjson
import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

from cdc.config import TopicConfig
from cdc.events.shapes import column_shape
from cdc.events.types import field_schema
from cdc.source.pgtypes import BUILTIN_TYPES
from sinks.delta import needs_column_mapping, table_path, widens
from sinks.shapes import POINT, ColumnShape, Registry, Version, numeric_precision, spark_type
from sinks.topics import spark_options, subscription

pytestmark = pytest.mark.unit


def _type(name: str):
    return next(t for t in BUILTIN_TYPES.values() if t.name == name)


def _shape(name: str, typmod: int = -1) -> ColumnShape:
    pgtype = _type(name)
    raw = column_shape(pgtype, typmod, "c", False, field_schema(pgtype, typmod, "c", True))
    return ColumnShape(raw["name"], raw["type"], raw["modifier"], raw["key"], raw["connect"])


def _numeric(p: int, s: int) -> int:
    return ((p << 16) | (s & 0x7FF)) + 4


@pytest.mark.parametrize(("pg", "typmod", "spark"), [
    ("bool", -1, BooleanType()),
    ("int2", -1, ShortType()),
    ("int4", -1, IntegerType()),
    ("int8", -1, LongType()),
    ("oid", -1, LongType()),
    ("float4", -1, FloatType()),
    ("float8", -1, DoubleType()),
    ("numeric", _numeric(10, 2), DecimalType(10, 2)),
    ("numeric", _numeric(38, 0), DecimalType(38, 0)),
    ("numeric", _numeric(39, 2), StringType()),  # wider than Spark's decimals
    ("numeric", _numeric(5, -2), StringType()),  # a negative scale
    ("numeric", -1, StringType()),  # unconstrained
    ("money", -1, StringType()),
    ("text", -1, StringType()),
    ("jsonb", -1, StringType()),
    ("uuid", -1, StringType()),
    ("date", -1, DateType()),
    ("time", -1, LongType()),
    ("time", 3, LongType()),
    ("timetz", -1, StringType()),
    ("timestamp", -1, TimestampNTZType()),
    ("timestamp", 3, TimestampNTZType()),
    ("timestamptz", -1, TimestampType()),
    ("interval", -1, LongType()),
    ("bytea", -1, BinaryType()),
    ("bit", 1, BooleanType()),
    ("bit", 8, BinaryType()),
    ("varbit", -1, BinaryType()),
    ("point", -1, POINT),
    ("_int4", -1, ArrayType(IntegerType())),
    ("_text", -1, ArrayType(StringType())),
    ("_numeric", _numeric(6, 1), ArrayType(DecimalType(6, 1))),
    ("_timestamptz", -1, ArrayType(TimestampType())),
])
def test_the_sink_type_table(pg: str, typmod: int, spark) -> None:
    shape = _shape(pg, typmod)
    assert spark_type(shape.connect, shape.type, shape.modifier) == spark


def test_an_array_column_names_its_element_type() -> None:
    shape = _shape("_numeric", _numeric(6, 1))
    assert (shape.type, shape.modifier, shape.connect["type"]) == ("numeric[]", _numeric(6, 1), "array")


def test_numeric_precision_and_scale_from_the_modifier() -> None:
    assert numeric_precision(_numeric(10, 2)) == (10, 2)
    assert numeric_precision(_numeric(5, -3)) == (5, -3)
    assert numeric_precision(-1) is None


def _version(topic: str, from_lsn: int, *names: str) -> Version:
    value = {
        "schema": "public", "table": "t", "topic": topic, "from": str(from_lsn),
        "columns": [{"name": n, "type": "int4", "modifier": -1, "key": n == "id", "connect": {"type": "int32"}}
                    for n in names],
    }
    return Version.from_record(orjson.dumps(value))


def test_an_event_takes_the_version_in_force_at_its_commit_lsn() -> None:
    registry = Registry([_version("p.public.t", 300, "id", "a", "b"), _version("p.public.t", 100, "id", "a")])
    assert registry.at("p.public.t", 99) is None
    assert registry.at("p.public.t", 100).names == ["id", "a"]
    assert registry.at("p.public.t", 299).names == ["id", "a"]
    assert registry.at("p.public.t", 300).names == ["id", "a", "b"]
    assert registry.at("p.public.other", 300) is None
    spans = [(v.from_lsn, start, end) for v, start, end in registry.spanning("p.public.t", 150, 400)]
    assert spans == [(100, -(2**63), 300), (300, 300, 2**63 - 1)]
    assert [v.from_lsn for v, _, _ in registry.spanning("p.public.t", 150, 250)] == [100]
    # the same shape published again (a daemon restart) is a harmless duplicate
    registry.add(_version("p.public.t", 300, "id", "a", "b"))
    assert [v.from_lsn for v in registry.versions("p.public.t")] == [100, 300]


def test_type_widening_delta_takes() -> None:
    assert widens(IntegerType(), LongType()) and widens(ShortType(), IntegerType())
    assert widens(FloatType(), DoubleType())
    assert widens(DecimalType(10, 2), DecimalType(12, 2)) and widens(DecimalType(10, 2), DecimalType(12, 4))
    assert widens(DateType(), TimestampNTZType())
    assert not widens(LongType(), IntegerType())
    assert not widens(DecimalType(10, 2), DecimalType(10, 3))  # fewer integer digits
    assert not widens(IntegerType(), StringType()) and not widens(StringType(), IntegerType())


def test_warehouse_paths_use_the_topics_escaped_names() -> None:
    assert table_path("/w/", "current", "shop.public.orders") == "/w/current/public/orders"
    assert table_path("s3a://b/w", "history", "my.prefix.a-2eb.c") == "s3a://b/w/history/a-2eb/c"


def test_column_mapping_only_for_names_parquet_cannot_hold() -> None:
    assert not needs_column_mapping({"id": IntegerType(), "ü": StringType(), "CamelCase": StringType()})
    assert needs_column_mapping({"a b": IntegerType()})
    assert needs_column_mapping({"f(x)": IntegerType()})


def test_the_subscription_takes_table_topics_and_the_heartbeat_only() -> None:
    pattern = re.compile(subscription("shop-1.eu"))
    assert pattern.fullmatch("shop-1.eu.public.orders")
    assert pattern.fullmatch("shop-1.eu.my-2dschema.caf-c3-a9")
    assert pattern.fullmatch("shop-1.eu.__cdc_heartbeat")
    for other in ("shop-1.eu.__cdc_state", "shop-1.eu.__cdc_schemas", "shop-1.eu.__cdc_dlq",
                  "shop-1.eu.__cdc_sinks", "shop-1Xeu.public.orders", "other.public.orders"):
        assert not pattern.fullmatch(other), other


def test_spark_kafka_options_carry_sasl_credentials_quoted() -> None:
    config = TopicConfig(
        bootstrap_servers="b:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="cdc", sasl_password='pa"ss\\word',
    )
    options = spark_options(config)
    assert options["kafka.bootstrap.servers"] == "b:9093"
    assert options["kafka.security.protocol"] == "SASL_SSL"
    assert options["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert options["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="cdc" '
        'password="pa\\"ss\\\\word";'
    )
