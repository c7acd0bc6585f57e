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
from cdc.naming import is_table_topic
from cdc.source.pgtypes import BUILTIN_TYPES
from sinks.kafka_source import grouped, rate_limited
from sinks.pipeline import drained
from sinks.spark_types import POINT, numeric_precision, spark_type
from sinks.stores.delta.store import needs_column_mapping, table_path, widens
from sinks.topics import spark_options, subscription
from sinks.versions import ColumnShape, Registry, Version

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
                  "shop-1.eu.__cdc_sinks", "shop-1.eu.__cdc_metrics", "shop-1Xeu.public.orders", "other.public.orders"):
        assert not pattern.fullmatch(other), other


def test_table_topics_are_those_with_a_schema_and_a_table_after_the_prefix() -> None:
    assert is_table_topic("shop-1.eu", "shop-1.eu.public.orders")
    for other in ("shop-1.eu.__cdc_heartbeat", "shop-1.eu.__cdc_sinks", "shop-1Xeu.public.orders", "shop-1.eu.a.b.c"):
        assert not is_table_topic("shop-1.eu", other), other


def test_a_run_has_drained_the_topics_only_when_no_partition_grew_past_what_it_read() -> None:
    read = {"p.public.a": {0: 10, 1: 4}}
    assert drained(read, {"p.public.a": {0: 10, 1: 4}})
    assert drained(read, {"p.public.a": {0: 10, 1: 4}, "p.public.new": {0: 0}})  # a new, empty table
    assert not drained(read, {"p.public.a": {0: 11, 1: 4}})  # a record came after the run's last batch
    assert not drained(read, {"p.public.a": {0: 10, 1: 4, 2: 1}})  # a partition added since
    assert not drained(read, {"p.public.a": {0: 10, 1: 4}, "p.public.new": {0: 3}})


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


# --------------------------------------------------------------------------- the cache's batch fold


def _event(key: str, offset: int, op: str | None, after: dict | None = None, lsn: int | None = None,
           topic: str = "p.public.t", partition: int = 0) -> tuple:
    """A change row as the stores' writers get it: sinks.latest.COLUMNS, in that order."""
    from sinks.latest import COLUMNS

    row = {
        "_cdc_topic": topic, "_cdc_key": key, "_cdc_op": op, "_cdc_lsn": lsn, "_cdc_seq": lsn,
        "_cdc_partition": partition, "_cdc_offset": offset, "_cdc_tombstone": op is None,
        "after": orjson.dumps(after).decode() if after is not None else None,
    }
    return tuple(row[name] for name in COLUMNS)


def _toast_rows() -> list[tuple]:
    """A TOASTed value carried from an earlier update and one the batch lacks, a d and its
    tombstone, a lone tombstone."""
    from sinks.versions import TOAST_PLACEHOLDER as unchanged

    return [
        _event('{"id":1}', 1, "c", {"id": 1, "body": "long", "n": 0}, lsn=10),
        _event('{"id":1}', 2, "u", {"id": 1, "body": unchanged, "n": 1}, lsn=11),
        _event('{"id":2}', 3, "u", {"id": 2, "body": unchanged, "n": 5}, lsn=12),  # body: from the cache
        _event('{"id":3}', 4, "d", lsn=13),
        _event('{"id":3}', 5, None),  # the d's tombstone: the d's position
        _event('{"id":4}', 6, None),  # a lone tombstone: no position
    ]


def _interleaved_rows(schema_key: bool = False) -> list[tuple]:
    """Topic partition 0 of t, then topic partition 1 of t, then one of u (whose key carries its
    schema, or a space): keys interleaved within each."""
    from sinks.versions import TOAST_PLACEHOLDER

    u_key = '{"schema":{"type":"struct"},"payload":{"id": 1}}' if schema_key else '{"id": 1}'
    return [
        _event('{"id":2}', 1, "c", {"id": 2, "body": "first", "n": 0}, lsn=10),
        _event('{"id":1}', 2, "c", {"id": 1, "body": "x", "n": 0}, lsn=10),
        _event('{"id":2}', 3, "u", {"id": 2, "body": TOAST_PLACEHOLDER, "n": 1}, lsn=11),
        _event('{"id":1}', 4, "d", lsn=12),
        _event('{"id":2}', 5, "u", {"id": 2, "body": "second", "n": 2}, lsn=13),
        _event('{"id":1}', 6, None),  # the d's tombstone, after another key's change
        _event('{"id":3}', 1, "u", {"id": 3, "body": TOAST_PLACEHOLDER, "n": 7}, lsn=12, partition=1),
        _event(u_key, 1, "c", {"id": 1, "body": "u's", "n": 9}, lsn=14, topic="p.public.u"),
        _event('{"id":3}', 2, "u", {"id": 3, "body": TOAST_PLACEHOLDER, "n": 8}, lsn=13, partition=1),
    ]


def test_the_cache_keeps_the_last_change_of_each_key_with_toasted_values_carried() -> None:
    from sinks.latest import last_changes, position
    from sinks.versions import TOAST_PLACEHOLDER

    unchanged = TOAST_PLACEHOLDER
    rows = _toast_rows()
    out = [(t, c.key, c.kind, c.pos, c.row, c.missing) for t, c in last_changes(rows)]
    assert out == [
        ("p.public.t", '{"id":1}', "u", position(11, 11), {"id": 1, "body": "long", "n": 1}, ()),
        ("p.public.t", '{"id":2}', "u", position(12, 12), {"id": 2, "body": unchanged, "n": 5}, ("body",)),
        ("p.public.t", '{"id":3}', "d", position(13, 13), None, ()),
        ("p.public.t", '{"id":4}', "d", "", None, ()),
    ]


def test_the_fold_takes_each_partition_in_arrival_order_without_a_sort() -> None:
    """A Spark partition holds whole topic partitions one after the other (the job only
    coalesces): keys interleave, each key's changes in offset order. The fold needs no sort."""
    from sinks.latest import last_changes, position
    from sinks.versions import TOAST_PLACEHOLDER

    rows = _interleaved_rows()
    out = [(t, c.key, c.kind, c.pos, c.offset, c.row, c.missing) for t, c in last_changes(rows)]
    assert out == [
        ("p.public.t", '{"id":2}', "u", position(13, 13), 5, {"id": 2, "body": "second", "n": 2}, ()),
        ("p.public.t", '{"id":1}', "d", position(12, 12), 6, None, ()),
        ("p.public.t", '{"id":3}', "u", position(13, 13), 2, {"id": 3, "body": TOAST_PLACEHOLDER, "n": 8}, ("body",)),
        ("p.public.u", '{"id":1}', "u", position(14, 14), 1, {"id": 1, "body": "u's", "n": 9}, ()),
    ]


def test_the_fold_refuses_a_topic_partition_out_of_offset_order() -> None:
    """What the fold relies on, checked where it can break: a repartitioned batch would keep
    an older change of a key."""
    from sinks.latest import OutOfOrder, last_changes

    rows = [_event('{"id":1}', 5, "u", {"id": 1}, lsn=20), _event('{"id":1}', 4, "u", {"id": 1}, lsn=19)]
    with pytest.raises(OutOfOrder, match=r"p.public.t partition 0 reached a writer out of offset order \(4 after 5\)"):
        list(last_changes(rows))


def _folded(rows: list[tuple]) -> list[tuple]:
    """The Arrow fold of `rows` as Spark hands them to the writers (in batches, here of 4 rows),
    a tuple per key."""
    import pyarrow as pa

    from sinks.latest import as_rows, fold

    batches = pa.Table.from_batches(as_rows(rows).to_batches(max_chunksize=4))
    return [(c["topic"], c["key"], c["kind"], c["pos"], c["offset"], None if c["row"] is None else orjson.loads(c["row"]),
             tuple(c["missing"])) for c in fold(batches).to_pylist()]


def test_the_arrow_fold_carries_toasted_values_and_keeps_a_tombstones_position() -> None:
    from sinks.latest import position
    from sinks.versions import TOAST_PLACEHOLDER

    unchanged = TOAST_PLACEHOLDER
    rows = _toast_rows()
    assert _folded(rows) == [
        ("p.public.t", '{"id":1}', "u", position(11, 11), 2, {"id": 1, "body": "long", "n": 1}, ()),
        ("p.public.t", '{"id":2}', "u", position(12, 12), 3, {"id": 2, "body": unchanged, "n": 5}, ("body",)),
        ("p.public.t", '{"id":3}', "d", position(13, 13), 5, None, ()),
        ("p.public.t", '{"id":4}', "d", "", 6, None, ()),
    ]


def test_the_arrow_fold_takes_interleaved_keys_in_arrival_order() -> None:
    """Whole topic partitions one after the other, keys interleaved within them: the last row
    of each key wins, keys in the order they first came, schema-carrying keys canonical."""
    from sinks.latest import position
    from sinks.versions import TOAST_PLACEHOLDER

    rows = _interleaved_rows(schema_key=True)
    assert _folded(rows) == [
        ("p.public.t", '{"id":2}', "u", position(13, 13), 5, {"id": 2, "body": "second", "n": 2}, ()),
        ("p.public.t", '{"id":1}', "d", position(12, 12), 6, None, ()),
        ("p.public.t", '{"id":3}', "u", position(13, 13), 2, {"id": 3, "body": TOAST_PLACEHOLDER, "n": 8}, ("body",)),
        ("p.public.u", '{"id":1}', "u", position(14, 14), 1, {"id": 1, "body": "u's", "n": 9}, ()),
    ]


@pytest.mark.parametrize("offsets, message", [
    ([(0, 5), (0, 4)], r"\(4 after 5\)"),  # within a run of one topic partition
    ([(0, 5), (1, 1), (0, 5)], r"\(5 after 5\)"),  # a run that starts where its partition's last one ended
])
def test_the_arrow_fold_refuses_a_topic_partition_out_of_offset_order(offsets: list, message: str) -> None:
    from sinks.latest import OutOfOrder, as_rows, fold

    rows = [_event('{"id":1}', offset, "u", {"id": 1}, lsn=20, partition=partition) for partition, offset in offsets]
    with pytest.raises(OutOfOrder, match=r"^records of p.public.t partition 0 reached a writer out of offset order "
                                         + message):
        fold(as_rows(rows))


def test_the_arrow_fold_equals_the_row_fold_on_random_batches() -> None:
    """Any arrival-ordered batch: every key's last change as `last_changes` folds it row by row
    (deletes, tombstones after them or alone, TOASTed values carried across updates or not)."""
    import random

    from sinks.latest import last_changes
    from sinks.versions import TOAST_PLACEHOLDER

    rng = random.Random(7)
    for _ in range(100):
        rows, lsn = [], 0
        for topic, partition in rng.sample([("p.public.t", 0), ("p.public.t", 1), ("p.public.u", 0)], 2):
            for offset in range(rng.randint(1, 30)):
                lsn += 1
                key = f'{{"id":{rng.randint(1, 6)}}}'
                op = rng.choice(["c", "u", "u", "d", None])
                after = {"id": 1, "a": rng.choice(["x", TOAST_PLACEHOLDER]), "b": rng.choice([1, TOAST_PLACEHOLDER])}
                rows.append(_event(key, offset, op, after if op in ("c", "u") else None, lsn, topic, partition))
        expected = [(t, c.key, c.kind, c.pos, c.offset, c.row, c.missing) for t, c in last_changes(rows)]
        assert _folded(rows) == expected


def test_a_partition_writer_drops_changes_at_or_below_their_tables_truncate() -> None:
    from sinks.latest import as_rows, fold, position
    from sinks.rows import PartitionWriter

    rows = [
        _event('{"id":1}', 1, "u", {"id": 1}, lsn=10),
        _event('{"id":2}', 2, "u", {"id": 2}, lsn=20),  # the truncate's own position: dropped
        _event('{"id":3}', 3, "u", {"id": 3}, lsn=30),
        _event('{"id":4}', 4, None),  # a lone tombstone: deleting is safe
        _event('{"id":1}', 1, "u", {"id": 1}, lsn=5, topic="p.public.u"),  # another table
    ]
    writer = PartitionWriter(None, {"p.public.t": position(20, 20)})  # the cut alone: no store
    kept = writer.above_cuts(fold(as_rows(rows)))
    assert list(zip(kept["topic"].to_pylist(), kept["key"].to_pylist(), strict=True)) == [
        ("p.public.t", '{"id":3}'), ("p.public.t", '{"id":4}'), ("p.public.u", '{"id":1}'),
    ]


def test_json_packed_column_by_column_is_what_orjson_writes_value_by_value() -> None:
    """The writers pack rows, keys and positions a column at a time; the bytes must be orjson's
    for each value alone, whatever Spark's parser made of the text (1.0E300, \\uD83D escapes)."""
    import pyarrow as pa

    from sinks.json_columns import compact_json, concatenated, json_strings
    from sinks.latest import canonical_keys, position, position_texts

    ours = [orjson.dumps(v).decode() for v in ({"id": 1, "s": "a\r\nb é"}, {"id": 2, "f": 1.5, "t": None})]
    assert compact_json(pa.chunked_array([ours + [None]])).to_pylist() == [o.encode() for o in ours] + [None]
    sparks = ['{"f":1.0E300,"u":"\\uD83D\\uDE00","n":12345678901234567890}', '{"id": 3}', *ours]
    assert compact_json(pa.chunked_array([sparks])).to_pylist() == [orjson.dumps(orjson.loads(t)) for t in sparks]
    keys = [orjson.dumps(k).decode() for k in ({"id": 1}, {"k": 'a"b\\c\n\x01\x7f é \u2028 😀'}, {"t": "x", "n": [1.5]})]
    assert json_strings(pa.chunked_array([keys])).to_pylist() == [orjson.dumps(k) for k in keys]
    raw = pa.chunked_array([keys])
    assert canonical_keys(raw) is raw  # canonical already: the keys as they came
    odd = ['{"id": 1}', '{"schema":{"type":"struct"},"payload":{"id":2}}', '{"payload":7}']
    assert canonical_keys(pa.chunked_array([odd])) == ['{"id":1}', '{"id":2}', '{"payload":7}']
    texts = pa.array(["ab", None, "", "cde", "f"]).slice(1, 3)  # a slice shares its array's buffers
    assert concatenated(pa.chunked_array([texts, pa.array(["g"])])) == b"cdeg"
    lsn, seq = pa.chunked_array([[1, None, 2**40]]), pa.chunked_array([[2, None, 7]])
    assert position_texts(lsn, seq).to_pylist() == [position(1, 2), "", position(2**40, 7)]


def test_row_json_of_every_column_type_is_packed_as_orjson_writes_each_row() -> None:
    """Rows holding every kind of value the stores take (Debezium's PostgreSQL mapping: NUMERIC
    as a string, timestamps as epoch numbers and ISO text, arrays, json as text, bytea as
    base64, TOAST placeholders in each form), as cdc's events spell them and as Spark's parser
    writes them again: packed a column at a time, each is the bytes orjson gives it alone."""
    import pyarrow as pa

    from sinks.json_columns import compact_json, written_by_orjson
    from sinks.versions import UNAVAILABLE_FORMS

    placeholders = [orjson.loads(text) if text.startswith(("[", "{")) else text for text in UNAVAILABLE_FORMS]
    values = [
        {"id": 1, "price": "12.50", "big": "-99999999999999999999.000001", "n": 2**63 - 1, "m": -(2**63)},
        {"ts": 1_700_000_000_123_456, "tstz": "2024-02-29T23:59:59.999999Z", "d": 19782, "t": 45_296_000_000,
         "iv": 93784000000},
        {"ints": [1, None, 3], "texts": ["a", "b\"c", None], "nested": [[1.5, -0.0], []], "empty": []},
        {"j": '{"a": [1, 2], "b": null}', "jb": '{"k":"v"}', "parsed": {"a": [1, {"b": None}]}},
        {"raw": "3q2+7w==", "none": None, "bool": True, "f": 1e300, "g": -2.5e-8, "h": 0.1},
        {"s": "é 😀 \u2028 \r\n\t \x01 \x7f </script>", "quote": '"', "slash": "\\/"},
        *({"id": i, "body": placeholder} for i, placeholder in enumerate(placeholders)),
    ]
    ours = [orjson.dumps(v).decode() for v in values]
    assert written_by_orjson(ours)
    assert compact_json(pa.chunked_array([ours + [None]])).to_pylist() == [o.encode() for o in ours] + [None]
    # Spark's JSON writer: exponents, escapes and spaces orjson does not write; any one of them
    # makes the column be written again, and every row comes out as orjson writes its value
    sparks = [
        '{"f":1.0E300,"g":-2.5E-8,"h":0.1}', '{"s":"\\u00e9\\uD83D\\uDE00","slash":"\\/"}',
        '{ "id" : 1 , "a" : [ 1 , 2 ] }', '{"price":"12.50","ts":1700000000123456}',
    ]
    assert not written_by_orjson(sparks[:1])
    texts = [*ours, *sparks, None]
    expected = [None if t is None else orjson.dumps(orjson.loads(t)) for t in texts]
    assert compact_json(pa.chunked_array([texts[:5], texts[5:]])).to_pylist() == expected
    assert compact_json(pa.array(texts)).to_pylist() == expected


def test_a_partition_writer_fills_toasted_values_from_the_store_and_hands_back_what_it_refused() -> None:
    """Batches of a partition in, one fold over all of them (a key's changes span batches),
    the unchanged TOASTed values the batch lacks taken from the rows the store holds (null
    for a key it does not hold), what the store refused back as Arrow rows."""
    import pyarrow as pa

    from sinks.latest import as_rows, position
    from sinks.rows import REJECTED, PartitionWriter, RowWriter
    from sinks.versions import TOAST_PLACEHOLDER as unchanged

    class Held(RowWriter):
        def __init__(self) -> None:
            self.asked: list[tuple[str, list[str], set[str]]] = []
            self.written: list[dict] = []

        def held(self, topic: str, keys: list[str], columns: set[str]) -> list[dict | None]:
            self.asked.append((topic, keys, columns))
            return [{"id": 2, "body": "held", "n": 0} if key == '{"id":2}' else None for key in keys]

        def write(self, changes: pa.Table) -> list:
            self.written += changes.to_pylist()
            return [(c["topic"], c["partition"], c["offset"], "refused") for c in changes.to_pylist()
                    if c["key"] == '{"id":1}']

        def positions(self, topic: str):
            return iter(())

    rows = [*_toast_rows(), _event('{"id":5}', 7, "u", {"id": 5, "body": unchanged, "n": 3}, lsn=14)]
    writer = Held()
    batches = as_rows(rows).to_batches(max_chunksize=2)
    out = list(PartitionWriter(writer, {})(iter([batches[0].slice(0, 0), *batches])))
    assert writer.asked == [("p.public.t", ['{"id":2}', '{"id":5}'], {"body"})]
    assert [(c["key"], c["kind"], c["pos"], None if c["row"] is None else orjson.loads(c["row"]))
            for c in writer.written] == [
        ('{"id":1}', "u", position(11, 11), {"id": 1, "body": "long", "n": 1}),
        ('{"id":2}', "u", position(12, 12), {"id": 2, "body": "held", "n": 5}),
        ('{"id":3}', "d", position(13, 13), None),
        ('{"id":4}', "d", "", None),
        ('{"id":5}', "u", position(14, 14), {"id": 5, "body": None, "n": 3}),
    ]
    assert [batch.schema for batch in out] == [REJECTED]
    assert pa.Table.from_batches(out).to_pylist() == [
        {"_cdc_topic": "p.public.t", "_cdc_partition": 0, "_cdc_offset": 2, "_reason": "refused"},
    ]
    assert list(PartitionWriter(Held(), {})(iter([]))) == []  # a partition of other tables' records


def test_guard_calls_packed_column_by_column_are_the_commands_redis_reads() -> None:
    import pyarrow as pa

    from sinks.stores.cache.store import GUARD_SHA, META, _command, guarded_calls

    packed = guarded_calls(pa.array(['t:{"id":"é"}', "t:{}"]), pa.array(["u", "d"]), pa.array(["p1", ""]),
                           pa.array([2, 0], pa.int32()), pa.array([10, 11]), pa.array([b'{"v":"a\r\nb"}', b""]),
                           0, 60000)
    assert packed == [
        _command(b"EVALSHA", GUARD_SHA, b"2", key, META.encode() + key, kind, pos, part, off, row, b"0", b"60000")
        for key, kind, pos, part, off, row in (
            ('t:{"id":"é"}'.encode(), b"u", b"p1", b"2", b"10", b'{"v":"a\r\nb"}'),
            (b"t:{}", b"d", b"", b"0", b"11", b""),
        )
    ]


@pytest.mark.parametrize("shared", [False, True], ids=["index-per-table", "shared"])
def test_search_upserts_packed_column_by_column_are_the_documents_of_the_row_path(shared: bool) -> None:
    """A table whose rows need no converting has its upserts packed from the columns; one with
    dates goes row by row: both give the action and `_source` the row-by-row writer gave. In
    shared indexes, `_id` starts with the table's alias and the document names its table."""
    from sinks.latest import changes_table, position
    from sinks.stores.search.opensearch import versioned
    from sinks.stores.search.shapes import Documents
    from sinks.stores.search.store import SearchWriter, Settings
    from sinks.versions import Version

    plain = Version("public", "p", "x.public.p", 0, (_column("id", "int4", {"type": "int32"}, key=True),
                                                   _column("s", "text", {"type": "string"})))
    dated = Version("public", "d", "x.public.d", 0, (_column("id", "int4", {"type": "int32"}, key=True),
                                                   _column("d", "date", {"type": "int32", "name": "io.debezium.time.Date"})))
    registry = Registry([plain, dated])

    class NoMarkers:  # the look-up's answer: no key has a delete marker
        def ok(self, method: str, path: str, body: bytes) -> dict:
            return {"docs": [{"found": False}] * body.count(b'{"_index"')}

    writer = SearchWriter(Settings(None, "false", 1 << 20, 1000, "x", shared), registry)  # no request leaves
    writer._client = NoMarkers()
    rows = [("x.public.p", '{"id":1}', '{"id":1,"s":"q\\"é"}'), ("x.public.d", '{"id":"k\\"1"}', '{"id":2,"d":19782}')]
    changes = changes_table([(t, k, "u", 7, 3, 0, i, row, []) for i, (t, k, row) in enumerate(rows)])
    (actions,) = list(writer._actions(changes))
    documents = Documents(registry)
    table = (lambda t: {"_cdc_table": t}) if shared else (lambda t: {})  # noqa: E731
    assert [a.lines for a in actions] == [
        versioned("index", t, f"{t}:{k}" if shared else k, 7)
        + orjson.dumps({**documents.source(t, 7, orjson.loads(row), position(7, 3)), **table(t)}) + b"\n"
        for t, k, row in rows
    ]
    assert [a.origin for a in actions] == [("x.public.p", 0, 0), ("x.public.d", 0, 1)]


def test_cache_keys_positions_and_urls() -> None:
    from cdc.redact import display_url
    from sinks.latest import canonical_key, position

    assert canonical_key('{"schema":{"type":"struct"},"payload":{"tenant":"a","id":7}}') == '{"tenant":"a","id":7}'
    assert canonical_key('{"id": 42}') == '{"id":42}'
    assert position(0x16B3748, 2) < position(0x16B3748, 10) < position(0x1_0000_0000, 0)
    assert position(None, None) == ""
    assert display_url("rediss://app:p%40ss@cache.internal:6380/2") == "rediss://app:***@cache.internal:6380/2"
    assert display_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# --------------------------------------------------------------------------- the search index


def _column(name: str, pg_type: str, connect: dict, key: bool = False) -> object:
    from sinks.versions import ColumnShape

    return ColumnShape(name, pg_type, -1, key, connect)


def test_search_aliases_are_the_topic_names_in_an_injective_lowercase_escape() -> None:
    from sinks.stores.search.shapes import (
        alias_name,
        generation,
        index_name,
        markers_name,
        rebuild_alias,
    )

    assert alias_name("cdc.public.orders") == "cdc.public.orders"
    assert alias_name("cdc.public.Odd-20Name") == "cdc.public.-uodd-20-uname"
    # a topic escape is '-' and two hex digits: '-u' never comes from one
    assert alias_name("cdc.public.odd-20name") != alias_name("cdc.public.Odd-20Name")
    assert (index_name("cdc.public.t"), markers_name("cdc.public.t")) == ("cdc.public.t-v1", "cdc.public.t-markers")
    # a rebuild fills the next generation through its own alias; no name of one table is another's
    assert (index_name("cdc.public.t", 12), rebuild_alias("cdc.public.t")) == ("cdc.public.t-v12", "cdc.public.t-rebuild")
    assert [generation("cdc.public.t", name) for name in (
        "cdc.public.t-v12", "cdc.public.t-v1", "cdc.public.t-markers", "cdc.public.t-vx", "cdc.public.tt-v2",
        "cdc.public.t-rebuild",
    )] == [12, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"^topic Cdc.public.t gives the index name '-ucdc.public.t', which "
                                         r"OpenSearch refuses .*: use a \[topic\] prefix that starts with a "
                                         r"lowercase letter or digit$"):
        alias_name("Cdc.public.t")


def test_search_mapping_follows_the_type_table() -> None:
    from sinks.stores.search.shapes import DATE, KEYWORD, TEXT, mapping
    from sinks.versions import Version

    columns = (
        _column("id", "int8", {"type": "int64"}, key=True),
        _column("d", "date", {"type": "int32", "name": "io.debezium.time.Date"}),
        _column("ts", "timestamp", {"type": "int64", "name": "io.debezium.time.MicroTimestamp"}),
        _column("tsz", "timestamptz", {"type": "string", "name": "io.debezium.time.ZonedTimestamp"}),
        _column("tm", "time", {"type": "int64", "name": "io.debezium.time.MicroTime"}),
        _column("j", "jsonb", {"type": "string", "name": "io.debezium.data.Json"}),
        _column("ja", "jsonb[]", {"type": "array", "items": {"type": "string", "name": "io.debezium.data.Json"}}),
        _column("u", "uuid", {"type": "string", "name": "io.debezium.data.Uuid"}),
        _column("ip", "inet", {"type": "string"}),
        _column("n", "numeric", {"type": "string"}),
        _column("f", "float8", {"type": "double"}),
        _column("t", "text", {"type": "string"}),
        _column("da", "date[]", {"type": "array", "items": {"type": "int32", "name": "io.debezium.time.Date"}}),
        _column("by", "bytea", {"type": "bytes"}),
    )
    whole = mapping(Version("public", "t", "p.public.t", 0, columns))
    assert whole["properties"] == {
        "id": {"type": "long"}, "d": DATE, "ts": DATE, "tsz": DATE, "tm": {"type": "long"},
        "j": {"type": "flat_object"}, "ja": TEXT, "u": KEYWORD, "ip": KEYWORD,
        "n": {"type": "double", "ignore_malformed": True}, "f": {"type": "double", "ignore_malformed": True},
        "t": TEXT, "da": DATE, "by": {"type": "binary"},
        "_cdc_pos": {"type": "keyword", "store": True},  # the document's position, which a truncate compares
    }
    assert whole["_source"] == {"excludes": ["_cdc_pos"]}  # readers' `_source` is the row
    assert mapping(Version("public", "t", "p.public.t", 0, columns[5:6]), "flattened")["properties"] == {
        "j": {"type": "flattened"}, "_cdc_pos": {"type": "keyword", "store": True}}


def test_search_documents_turn_dates_into_iso_text_and_json_into_objects() -> None:
    from sinks.stores.search.shapes import Documents
    from sinks.versions import Version

    columns = (
        _column("d", "date", {"type": "int32", "name": "io.debezium.time.Date"}),
        _column("ts", "timestamp", {"type": "int64", "name": "io.debezium.time.MicroTimestamp"}),
        _column("t3", "timestamp(3)", {"type": "int64", "name": "io.debezium.time.Timestamp"}),
        _column("j", "jsonb", {"type": "string", "name": "io.debezium.data.Json"}),
        _column("da", "date[]", {"type": "array", "items": {"type": "int32", "name": "io.debezium.time.Date"}}),
    )
    v1 = Version("public", "t", "p.public.t", 0, columns)
    v2 = Version("public", "t", "p.public.t", 100, (_column("d", "text", {"type": "string"}),))
    docs = Documents(Registry([v1, v2]))
    assert docs.source("p.public.t", 50, {
        "d": 19782, "ts": 1704164645678901, "t3": 1704164645678, "j": '{"k": [1, 2]}', "da": [0, None, -1],
    }, "p1") == {
        "d": "2024-02-29", "ts": "2024-01-02T03:04:05.678901", "t3": "2024-01-02T03:04:05.678000",
        "j": {"k": [1, 2]}, "da": ["1970-01-01", None, "1969-12-31"], "_cdc_pos": "p1",
    }
    # beyond years 1-9999 (Debezium's infinities): epoch ms; JSON OpenSearch will refuse stays text
    assert docs.source("p.public.t", 50, {"d": -2**31, "ts": 9223372036825200000, "j": "not json"}, "p2") == {
        "d": -2**31 * 86_400_000, "ts": 9223372036825200, "j": "not json", "_cdc_pos": "p2"}
    assert docs.source("p.public.t", 100, {"d": "x"}, "p3") == {"d": "x", "_cdc_pos": "p3"}  # the commit LSN's version


def test_a_delta_rebuild_holds_a_live_job_between_batches_and_lets_it_go_on(spark, tmp_path, monkeypatch) -> None:
    """sinks.handover on a real Hadoop file system: the rebuild waits for a running job's
    answer (never for a job that is not running), the job holds until the switch is done,
    and a request or a lease nobody renews stops counting."""
    import threading
    import time

    from sinks import handover
    from sinks.store import SinkStopped

    root = str(tmp_path / "warehouse")
    live = handover.LiveSide(spark, root, "delta")

    # no job running (no lease): the rebuild does not wait; a job starting now finds the request
    alone = handover.RebuildSide(spark, root, "delta")
    alone.request()
    assert alone.wait_for_live(lambda: False) == "not running"
    assert live.requested()
    alone.release()
    assert not live.requested()

    # a running job (its lease): the rebuild waits for its answer, and the job holds until released
    live.beat()
    rebuild = handover.RebuildSide(spark, root, "delta")
    rebuild.request()
    with pytest.raises(SinkStopped, match="while it waited for `cdc sink delta` to pause; current/ is untouched"):
        rebuild.wait_for_live(lambda: True)
    went_on = threading.Event()
    job = threading.Thread(target=lambda: (live.hold(lambda: False), went_on.set()), daemon=True)
    job.start()
    assert rebuild.wait_for_live(lambda: False) == "paused"
    time.sleep(2 * handover.POLL_S)
    assert not went_on.is_set() and rebuild.held()
    rebuild.release()
    assert went_on.wait(10)
    assert not (tmp_path / "warehouse" / "_cdc" / "rebuild" / "paused").exists()

    # a job that ended leaves no lease; one killed leaves a lease that goes stale
    live.end()
    assert handover.RebuildSide(spark, root, "delta").wait_for_live(lambda: False) == "not running"
    monkeypatch.setattr(handover, "STALE_S", 1.0)
    live._beat = 0.0
    live.beat()
    time.sleep(1.5)
    assert handover.RebuildSide(spark, root, "delta").wait_for_live(lambda: False) == "not running"

    # a request its rebuild stopped renewing: the job removes it and goes on; the rebuild sees it lost it
    monkeypatch.setattr(handover, "LEASE_S", 60.0)
    stalled = handover.RebuildSide(spark, root, "delta")
    stalled.request()
    time.sleep(1.5)
    assert not live.requested()
    assert not stalled.held()
    stalled.release()


def test_a_lease_or_a_request_found_gone_for_one_look_still_counts(spark, tmp_path, monkeypatch) -> None:
    """hadoop.write_bytes renames the new file over the old, which Hadoop's local file system
    does as a delete, then a rename: a look between the two finds no file. Such a look must
    not let a held job go on, nor make the rebuild take the job for stopped or its own
    request for lost (the looks are made to fall into that gap here, one at a time)."""
    import threading
    import time

    from sinks import hadoop, handover

    root = str(tmp_path / "warehouse")
    live = handover.LiveSide(spark, root, "delta")
    live.beat()
    rebuild = handover.RebuildSide(spark, root, "delta")
    rebuild.request()
    in_the_gap: set[str] = set()  # the files the next look at finds missing, once each

    def between_delete_and_rename(look):
        def looked(session, path):
            if path in in_the_gap:
                in_the_gap.discard(path)
                return None
            return look(session, path)
        return looked

    monkeypatch.setattr(hadoop, "age_s", between_delete_and_rename(hadoop.age_s))
    monkeypatch.setattr(hadoop, "read_bytes", between_delete_and_rename(hadoop.read_bytes))

    in_the_gap.add(live.lease)
    assert rebuild.live_running(), "a lease being written again read as a job that is not running"
    in_the_gap.add(live.request)
    assert rebuild.held(), "a request being written again read as lost"

    in_the_gap.add(live.request)  # the job's first look at the request, between two batches
    went_on = threading.Event()
    job = threading.Thread(target=lambda: (live.hold(lambda: False), went_on.set()), daemon=True)
    job.start()
    assert not went_on.wait(2 * handover.POLL_S), "the job went on without pausing"
    assert rebuild.wait_for_live(lambda: False) == "paused"
    in_the_gap.add(live.request)  # a look while it holds
    time.sleep(3 * handover.POLL_S)
    assert not in_the_gap and not went_on.is_set(), "a held job went on during the switch"
    rebuild.release()
    assert went_on.wait(10)


def test_every_registered_store_has_the_rebuild_verb_with_its_help() -> None:
    """`cdc <store> rebuild` is made from the registry (sinks.stores), one verb for every store."""
    from click.testing import CliRunner

    from cdc.cli import main
    from sinks.stores import STORES

    for store in STORES.values():
        shown = CliRunner().invoke(main, [store.name, "rebuild", "--help"])
        assert shown.exit_code == 0, shown.output
        assert " ".join(store.rebuilds.split()) in " ".join(shown.output.split())
        assert callable(store.load().rebuild)


def test_tables_pack_into_shared_indexes_whose_fields_agree() -> None:
    """`[search] tables_per_index`: a new table joins the first shared index with room whose
    fields agree with its own; a column named like another table's with another type, or
    more fields than a mapping may hold, takes another index."""
    from sinks.stores.search.shapes import (
        SHARED_FIELDS,
        field_count,
        pack,
        shared_name,
        shared_place,
    )

    number, keyword = {"type": "integer"}, {"type": "keyword"}
    names = iter(["new1", "new2", "new3"])
    placed = pack([("a", {"id": number}), ("b", {"id": number, "code": number}), ("c", {"id": number, "code": keyword}),
                   ("d", {"id": number})], {"old": (1, {"id": number})}, 2, lambda: next(names))
    assert placed == {"a": "old", "b": "new1", "c": "new2", "d": "new1"}
    wide = {f"a{i}": number for i in range(SHARED_FIELDS // 2 + 1)}
    other = {f"b{i}": number for i in range(SHARED_FIELDS // 2 + 1)}
    names = iter(["x", "y"])
    assert pack([("a", wide), ("b", other)], {}, 10, lambda: next(names)) == {"a": "x", "b": "y"}
    text = {"type": "text", "fields": {"keyword": {"type": "keyword"}}}
    point = {"properties": {"x": number, "y": number}}
    assert field_count({"t": text, "p": point, "n": number}) == 6
    assert shared_place("cdc", shared_name("cdc", 3, 2)) == (3, 2)
    assert shared_place("cdc", "cdc.public.t-v1") is None and shared_place("cdc", "cdcx-shared1-v1") is None


def test_a_batch_of_many_partitions_is_a_few_groups_of_about_equal_records() -> None:
    ranges = [(f"p.s.t{i}", i % 3, -2 if i % 4 == 0 else 10, 10 + i) for i in range(30)]
    groups = grouped(ranges, 4)
    assert len(groups) == 4
    assert sorted(r for group in groups for r in group) == sorted(ranges)
    assert all(group == sorted(group) for group in groups)  # a task reads its partitions in order
    loads = [sum(end - max(start, 0) for _, _, start, end in group) for group in groups]
    assert max(loads) - min(loads) <= max(end - max(start, 0) for _, _, start, end in ranges)
    assert grouped(ranges[:2], 4) == [[ranges[0]], [ranges[1]]]  # no empty group
    assert grouped([], 2) == []


def test_max_offsets_per_trigger_is_shared_in_proportion_to_what_waits() -> None:
    start = {("a", 0): 0, ("b", 0): 100, ("c", 0): 5, ("d", 0): 7}
    end = {("a", 0): 900, ("b", 0): 190, ("c", 0): 6, ("d", 0): 7}
    limited = rate_limited(start, end, 100)
    assert limited == {("a", 0): 90, ("b", 0): 109, ("c", 0): 6, ("d", 0): 7}
    assert rate_limited(start, end, 10_000) == end  # everything waiting fits
