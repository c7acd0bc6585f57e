"""Property tests: the round trips the contract rests on, over generated inputs.

Each mapping here is public contract that examples alone cover thinly: topic name <->
table name, table pattern <-> its text, pgoutput bytes <-> messages (through the
independent encoder of tests/test_pgoutput.py, on both sides of the accelerator
switch), and column values <-> their Kafka Connect schemas. The last section feeds
random and mutated bytes to the decoder: whatever arrives, it raises only DecodeError.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc import accel
from cdc.events.types import converter, field_schema
from cdc.naming import (
    IDENTIFIER_MAX_BYTES,
    TablePattern,
    parse_table_pattern,
    parse_topic_name,
    topic_name,
)
from cdc.source.pgoutput import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    DecodeError,
    Decoder,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from cdc.source.pgtypes import BUILTIN_TYPES
from tests.test_pgoutput import encode

PATHS = ["c", "python"]


def _select(path: str) -> None:
    if path == "c" and accel.speedups is None:
        pytest.skip("the C accelerator is not built")


# ------------------------------------------------------------------ names

# What PostgreSQL can store as a name: no NUL, valid Unicode, at most 63 bytes.
identifiers = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1, max_size=15
).filter(lambda name: len(name.encode()) <= IDENTIFIER_MAX_BYTES)
# SQL-ish names too, where bare spellings, case folding and keywords live.
sqlish = st.text(st.sampled_from("abcxyzXYZ_$09 .\"'-*"), min_size=1, max_size=10)
names = st.one_of(identifiers, sqlish, st.sampled_from(["select", "table", "user", "Order", "a.b"]))
prefixes = st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True).filter(lambda p: p not in (".", ".."))


@given(prefixes, names, names)
def test_topic_name_round_trips_to_the_table(prefix: str, schema: str, table: str) -> None:
    topic = topic_name(prefix, schema, table)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", topic)  # only Kafka's alphabet (a topic may be longer than a prefix)
    assert parse_topic_name(topic) == (prefix, schema, table)


@given(prefixes, names, names, names, names)
def test_distinct_tables_get_distinct_topics(prefix: str, s1: str, t1: str, s2: str, t2: str) -> None:
    assert (topic_name(prefix, s1, t1) == topic_name(prefix, s2, t2)) == ((s1, t1) == (s2, t2))


@given(names, st.none() | names)
def test_table_pattern_round_trips_through_its_text(schema: str, table: str | None) -> None:
    pattern = TablePattern(schema, table)
    text = str(pattern)
    assert parse_table_pattern(text) == pattern
    assert parse_table_pattern(f"  {text}\t") == pattern  # as written in a config list


@given(st.text(max_size=30))
def test_table_pattern_text_either_parses_canonically_or_says_why(text: str) -> None:
    try:
        pattern = parse_table_pattern(text)
    except ValueError as exc:
        assert "\n" not in str(exc)  # one-line errors
        return
    assert parse_table_pattern(str(pattern)) == pattern


# ------------------------------------------------------------------ pgoutput

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
int32 = st.integers(-(2**31), 2**31 - 1)
# commit times from 1900 to 2200, in microseconds since the UNIX epoch
timestamps = st.integers(-2_208_988_800_000_000, 7_258_118_400_000_000)
wire_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)
namespaces = wire_text.filter(bool)  # the empty namespace stands for pg_catalog on the wire
values = st.one_of(
    st.none(), st.just(UNCHANGED), st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
    st.binary(max_size=20),
)
rows = st.lists(values, max_size=8)
columns = st.builds(Column, st.integers(0, 1), wire_text, u32, int32)


def _data_messages(xid: st.SearchStrategy[int | None]) -> st.SearchStrategy[object]:
    return st.one_of(
        st.builds(Relation, xid, u32, namespaces, wire_text, st.sampled_from("dnfi"), st.lists(columns, max_size=5)),
        st.builds(Type, xid, u32, namespaces, wire_text),
        st.builds(Insert, xid, u32, rows),
        st.builds(Update, xid, u32, st.none(), st.none(), rows),
        st.builds(Update, xid, u32, st.sampled_from("KO"), rows, rows),
        st.builds(Delete, xid, u32, st.sampled_from("KO"), rows),
        st.builds(Truncate, xid, st.integers(0, 3), st.lists(u32, max_size=5)),
        st.builds(Message, xid, st.booleans(), u64, wire_text, st.binary(max_size=30)),
    )


control_messages = st.one_of(
    st.builds(Begin, u64, timestamps, u32),
    st.builds(Commit, st.integers(0, 127), u64, u64, timestamps),
    st.builds(Origin, u64, wire_text),
    st.builds(StreamStart, u32, st.booleans()),
    st.builds(StreamStop),
    st.builds(StreamCommit, u32, st.integers(0, 127), u64, u64, timestamps),
    st.builds(StreamAbort, u32, u32),
)
# (message, whether it was sent inside a stream block)
messages = st.one_of(
    st.tuples(_data_messages(st.none()), st.just(False)),
    st.tuples(_data_messages(u32), st.just(True)),
    st.tuples(control_messages, st.booleans()),
)


@pytest.mark.parametrize("path", PATHS)
@given(sent=messages)
def test_pgoutput_decode_inverts_encode(path: str, sent: tuple[object, bool]) -> None:
    _select(path)
    message, in_stream = sent
    with accel.selected(path == "c"):
        assert Decoder(in_stream=in_stream).decode(encode(message)) == message


# ------------------------------------------------------------------ decoder fuzzing


def _decodes_or_raises_decode_error(data: bytes, in_stream: bool) -> None:
    try:
        Decoder(in_stream=in_stream).decode(data)
    except DecodeError as exc:
        assert exc.kind is None or exc.kind == chr(data[0])
        assert exc.offset is None or 0 <= exc.offset <= len(data)


# Payloads that start like real messages reach deeper than uniform noise.
type_bytes = st.sampled_from(b"BCORYIUDTMSEcA")


@pytest.mark.parametrize("path", PATHS)
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(st.binary(max_size=200), st.builds(lambda t, rest: bytes([t]) + rest, type_bytes, st.binary(max_size=80))),
       in_stream=st.booleans())
def test_random_bytes_raise_only_decode_error(path: str, data: bytes, in_stream: bool) -> None:
    _select(path)
    with accel.selected(path == "c"):
        _decodes_or_raises_decode_error(data, in_stream)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A valid message's bytes with bytes flipped, inserted, deleted or cut off."""
    message, in_stream = draw(messages)
    data = bytearray(encode(message))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if action == "flip" and at < len(data):
            data[at] ^= draw(st.integers(1, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        else:
            del data[at:]
    return bytes(data), draw(st.booleans()) if draw(st.booleans()) else in_stream


@pytest.mark.parametrize("path", PATHS)
@given(sent=mutated())
def test_mutated_messages_raise_only_decode_error(path: str, sent: tuple[bytes, bool]) -> None:
    _select(path)
    with accel.selected(path == "c"):
        _decodes_or_raises_decode_error(*sent)


# ------------------------------------------------------------------ values <-> Connect schemas

_TYPES = {t.name: t for t in BUILTIN_TYPES.values()}
_EPOCH = dt.datetime(1970, 1, 1)
_EPOCH_DATE = dt.date(1970, 1, 1)
_INT_BITS = {"int16": 16, "int32": 32, "int64": 64}


def _conforms(value: Any, schema: dict[str, Any]) -> bool:
    """Whether a JSON value is what JsonConverter writes for the Connect schema."""
    kind = schema["type"]
    if kind in _INT_BITS:
        bits = _INT_BITS[kind]
        return type(value) is int and -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)
    if kind in ("float", "double"):
        return type(value) is float or value in ("NaN", "Infinity", "-Infinity")
    if kind == "boolean":
        return type(value) is bool
    if kind == "bytes":
        return type(value) is str and base64.b64decode(value, validate=True) is not None
    return kind == "string" and type(value) is str


def _pg_timestamp(t: dt.datetime) -> str:
    """PostgreSQL's text of a timestamp (DateStyle ISO): trailing zeros of the fraction dropped."""
    text = f"{t.year:04d}-{t.month:02d}-{t.day:02d} {t:%H:%M:%S}"
    if t.microsecond:
        text += f".{t.microsecond:06d}".rstrip("0")
    return text


def _micros(delta: dt.timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


# (type name, typmod, strategy of Python values, value -> PostgreSQL text, Connect value -> Python value)
Case = tuple[str, int, st.SearchStrategy[Any], Callable[[Any], str], Callable[[Any], Any]]
datetimes = st.datetimes(dt.datetime(1, 1, 1), dt.datetime(9999, 12, 31, 23, 59, 59, 999_999))
CASES: list[Case] = [
    ("int2", -1, st.integers(-(2**15), 2**15 - 1), str, int),
    ("int4", -1, int32, str, int),
    ("int8", -1, st.integers(-(2**63), 2**63 - 1), str, int),
    ("oid", -1, u32, str, int),
    ("bool", -1, st.booleans(), lambda b: "t" if b else "f", bool),
    ("float8", -1, st.floats(allow_nan=False, allow_infinity=False), repr, float),
    ("float8", -1, st.sampled_from([math.inf, -math.inf]), lambda f: "Infinity" if f > 0 else "-Infinity", float),
    ("text", -1, st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00")), str, str),
    ("uuid", -1, st.uuids(), str, uuid.UUID),
    ("bytea", -1, st.binary(), lambda b: "\\x" + b.hex(), base64.b64decode),
    ("date", -1, st.dates(), dt.date.isoformat, lambda days: _EPOCH_DATE + dt.timedelta(days=days)),
    ("timestamp", -1, datetimes, _pg_timestamp, lambda us: _EPOCH + dt.timedelta(microseconds=us)),
    (
        "timestamp", 3, datetimes.map(lambda t: t.replace(microsecond=t.microsecond // 1000 * 1000)),
        _pg_timestamp, lambda ms: _EPOCH + dt.timedelta(milliseconds=ms),
    ),
    (
        "timestamptz", -1, datetimes.map(lambda t: t.replace(tzinfo=dt.UTC)),
        lambda t: _pg_timestamp(t) + "+00", dt.datetime.fromisoformat,
    ),
    (
        "time", -1, st.times(), lambda t: t.isoformat(),
        lambda us: (dt.datetime.min + dt.timedelta(microseconds=us)).time(),
    ),
    (
        "interval", -1, st.timedeltas(dt.timedelta(days=-10**6), dt.timedelta(days=10**6)),
        lambda d: f"P{d.days}DT{d.seconds}.{d.microseconds:06d}S" if d.days or d.seconds or d.microseconds else "PT0S",
        lambda us: dt.timedelta(microseconds=us),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}({c[1]})" for c in CASES])
@given(data=st.data())
def test_values_round_trip_through_their_connect_schema(case: Case, data: st.DataObject) -> None:
    """PostgreSQL text -> the converter -> JSON bytes -> back through the Connect schema's
    meaning is the value PostgreSQL held, and the JSON value has the schema's type."""
    name, typmod, strategy, to_text, from_connect = case
    pgtype = _TYPES[name]
    schema = field_schema(pgtype, typmod, "v", True)
    value = data.draw(strategy)
    converted = orjson.loads(orjson.dumps(converter(pgtype, typmod)(to_text(value))))
    assert _conforms(converted, schema), (converted, schema)
    assert from_connect(converted) == value
