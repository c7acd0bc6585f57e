"""The C accelerator (cdc/_speedups.c) against its pure-Python twins: same values, same bytes.

Keys must be byte-identical whichever twin rendered them (a compacted topic keeps one
record per key *bytes*), so every comparison here is on the exact output, over the type
table's values, odd identifiers, every control character and random input. The two sides
are chosen through the accelerator switch (`cdc.accel.selected`), as a user's
`CDC_ACCEL=0` would choose them; the C functions' own contract (declining with None,
refusing wrong arguments) is tested on `accel.speedups` directly.
"""

from __future__ import annotations

import gc
import random
import re
import struct
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
import pytest

from cdc import accel
from cdc.events.changes import ChangeRenderer
from cdc.events.records import Column, Record, TableEvents, Txn
from cdc.events.types import NATIVE_KINDS, converter
from cdc.source.pgoutput import DecodeError, Decoder
from cdc.source.pgtypes import BUILTIN_TYPES
from cdc.toast import UNCHANGED
from snapshot import copy_text

# (type name, typmod, texts as PostgreSQL 15 prints them under the pinned session settings)
SAMPLES: list[tuple[str, int, list[str]]] = [
    ("int2", -1, ["0", "-32768", "32767"]),
    ("int4", -1, ["0", "7", "-2147483648", "2147483647"]),
    ("int8", -1, ["-9223372036854775808", "9223372036854775807", "1000003"]),
    ("oid", -1, ["0", "4294967295"]),
    ("bool", -1, ["t", "f"]),
    ("text", -1, ["", "plain", 'quote " backslash \\ tab \t nl \n', "é ☃ 𝄞", "\x01\x1f\x7f"]),
    ("varchar", 14, ["x" * 10]),
    ("numeric", -1, ["0", "-1.50", "NaN", "Infinity", "123456789012345678901234567890.000001"]),
    ("float8", -1, ["0", "-1.5", "1e+30", "NaN", "Infinity", "-Infinity", "2.2250738585072014e-308"]),
    ("float4", -1, ["3.4028235e+38", "1.5"]),
    ("timestamptz", -1, [
        "2024-01-02 03:04:05.123456+00", "2024-01-02 03:04:05+00", "2024-01-02 03:04:05+05:30",
        "0044-03-15 12:00:00+00 BC", "12345-01-01 00:00:00+00", "infinity", "-infinity",
    ]),
    ("timestamp", 3, ["2024-01-02 03:04:05.123", "1999-12-31 23:59:59"]),
    ("date", -1, ["2024-02-29", "0001-01-01 BC", "infinity"]),
    ("time", -1, ["13:14:15.5"]),
    ("timetz", -1, ["13:14:15+02"]),
    ("interval", -1, ["P1Y2M3DT4H5M6.5S", "PT0S", "PT-1H"]),
    ("uuid", -1, ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    ("json", -1, ['{"a": [1, "x\\ty"]}']),
    ("jsonb", -1, ['{"a": 1}']),
    ("bytea", -1, ["\\x", "\\x00ff10"]),
    ("money", -1, ["$1,234.56", "-$0.01"]),
    ("inet", -1, ["192.168.0.1/24"]),
    ("point", -1, ["(1.5,-2)"]),
    ("bit", 1, ["1"]),
    ("varbit", -1, ["10110"]),
    ("_int4", -1, ["{1,NULL,3}", "{}"]),
    ("_text", -1, ['{a,"b c",NULL,"d\\"e"}']),
]

_BY_NAME = {t.name: t for t in BUILTIN_TYPES.values()}

pytestmark = pytest.mark.skipif(accel.speedups is None, reason="the C accelerator is not built")
native: Any = accel.speedups
T = TypeVar("T")


def _both(make: Callable[[], T]) -> tuple[T, T]:
    """`make()` with the C path selected, then with the Python twins."""
    with accel.selected(True):
        fast = make()
    with accel.selected(False):
        slow = make()
    return fast, slow


def _raised(call: Callable[[], object], error: type[Exception]) -> tuple[str, str]:
    """The messages of the errors `call()` raises on each path."""
    def message() -> str:
        with pytest.raises(error) as caught:
            call()
        return str(caught.value)

    return _both(message)


def test_kind_numbers_agree_with_the_c_side():
    assert sorted(NATIVE_KINDS.values()) == [
        native.KIND_INT, native.KIND_STRING, native.KIND_BOOL, native.KIND_TIMESTAMPTZ
    ]
    assert NATIVE_KINDS[int] == native.KIND_INT and NATIVE_KINDS[str] == native.KIND_STRING


# ------------------------------------------------------------------ RowEncoder.encode


def _events(names: list[str], types: list[tuple[str, int]], key: list[int]) -> TableEvents:
    columns = [
        Column(name, converter(_BY_NAME[t], typmod), "__debezium_unavailable_value", {})
        for name, (t, typmod) in zip(names, types, strict=True)
    ]
    return TableEvents("p", "db", "public", "t", "p.public.t", columns, key)


def _twin_events(names: list[str], types: list[tuple[str, int]], key: list[int]) -> tuple[TableEvents, TableEvents]:
    """One relation's events with the C encoder, and with the Python twin."""
    fast, slow = _both(lambda: _events(names, types, key))
    assert fast.c_encoder is not None and slow.c_encoder is None
    return fast, slow


@pytest.mark.parametrize("type_name,typmod,texts", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_every_type_encodes_as_the_python_twin(type_name, typmod, texts):
    fast, slow = _twin_events(["id", "v"], [("int4", -1), (type_name, typmod)], [0])
    for i, text in enumerate([*texts, None]):
        values = [str(i), text]
        assert fast.encode(values) == slow.encode(values), (type_name, text)


@pytest.mark.parametrize("type_name,typmod,texts", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_every_type_as_a_key_column(type_name, typmod, texts):
    fast, slow = _twin_events(["v", "w"], [(type_name, typmod), ("text", -1)], [0])
    for text in texts:
        key, row = fast.encode([text, "x"])
        assert (key, row) == slow.encode([text, "x"])
        assert orjson.loads(key) == {"v": orjson.loads(row)["v"]}


def test_every_control_character_and_odd_names():
    names = ['id "x"', "wé\\rd", "tab\there", "a.b c"]
    fast, slow = _twin_events(names, [("int8", -1), ("text", -1), ("text", -1), ("bool", -1)], [2, 0])
    for code in range(0, 0x80):
        values = ["-1", chr(code) * 3, f"k{chr(code)}", "t"]
        assert fast.encode(values) == slow.encode(values), code


def test_random_rows_match_the_python_twin():
    rng = random.Random(20261122)
    alphabet = "ab \"\\\t\n\r\x00\x08\x0c\x1b\x7fé☃𝄞"
    types = [("int4", -1), ("text", -1), ("bool", -1), ("timestamptz", -1), ("numeric", -1), ("jsonb", -1)]
    fast, slow = _twin_events([f"c{i}" for i in range(len(types))], types, [0, 3])
    for _ in range(2000):
        values = [
            str(rng.randint(-(2**31), 2**31 - 1)),
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))),
            rng.choice(["t", "f", None]),
            rng.choice(["2024-05-06 07:08:09.1+00", "2024-05-06 07:08:09+01", "1999-01-01 00:00:00+00"]),
            rng.choice(["1.5", "NaN", None]),
            rng.choice(['{"k": "v"}', "[]", None]),
        ]
        assert fast.encode(values) == slow.encode(values)


def test_wide_row_past_the_stack_buffers():
    """More than 64 columns and a row past 4 KiB take the heap paths of the C side."""
    n = 150
    fast, slow = _twin_events([f"c{i}" for i in range(n)], [("text", -1)] * n, [n - 1, 0])
    values = [f"{i}" + "v" * 100 for i in range(n)]
    assert fast.encode(values) == slow.encode(values)
    assert len(fast.encode(values)[1]) > 4096


def test_unchanged_values_are_left_to_the_python_twin():
    events, _ = _twin_events(["id", "big"], [("int4", -1), ("text", -1)], [0])
    encoder = native.RowEncoder(
        (b'"id":', b'"big":'), bytes([1, 2]), (int, str), (0,), orjson.dumps, UNCHANGED
    )
    assert encoder.encode(["1", UNCHANGED]) is None
    assert events.encode(["1", UNCHANGED]) == (b'{"id":1}', b'{"id":1,"big":"__debezium_unavailable_value"}')
    assert events.encode(["1", UNCHANGED], ["1", "old"]) == (b'{"id":1}', b'{"id":1,"big":"old"}')


def test_a_converter_error_surfaces_unchanged():
    fast, slow = _twin_events(["id", "iv"], [("int4", -1), ("interval", -1)], [0])
    for events in (fast, slow):
        with pytest.raises(ValueError, match="IntervalStyle must be iso_8601"):
            events.encode(["1", "1 day"])


def test_a_row_of_the_wrong_width_is_refused():
    for events in _twin_events(["id", "v"], [("int4", -1), ("text", -1)], [0]):
        with pytest.raises(ValueError):
            events.encode(["1"])


# ------------------------------------------------------------------ parse_tuple


def _tuple_bytes(values: list) -> bytes:
    out = struct.pack(">H", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value is UNCHANGED:
            out += b"u"
        else:
            data = value.encode()
            out += b"t" + struct.pack(">I", len(data)) + data
    return out


def test_parse_tuple_matches_the_python_twin():
    rng = random.Random(7)
    for _ in range(500):
        values = [
            rng.choice([None, UNCHANGED, "", "x" * rng.randint(1, 300), "é\t𝄞\x00"])
            for _ in range(rng.randint(0, 20))
        ]
        insert = b"I\x00\x00\x40\x00N" + _tuple_bytes(values)
        fast, slow = _both(lambda insert=insert: Decoder().decode(insert))
        assert fast == slow and slow.new == values
        buf = b"XYZ" + _tuple_bytes(values) + b"tail"
        assert native.parse_tuple(buf, 3, UNCHANGED) == (values, len(buf) - 4)
        assert native.parse_tuple(memoryview(buf), 3, UNCHANGED) == (values, len(buf) - 4)


@pytest.mark.parametrize(
    "payload",
    [
        b"I\x00\x00\x40\x00N" + _tuple_bytes(["1", "two"])[:-1],  # truncated inside a value
        b"I\x00\x00\x40\x00N\x00\x02t\x00\x00\x00\x011",  # one column of two
        b"I\x00\x00\x40\x00N\x00\x01t\x00\x00\x00\x02\xff\xfe",  # not UTF-8
        b"I\x00\x00\x40\x00N\x00\x01x",  # unknown column kind
        b"I\x00\x00\x40\x00N\x00\x01t\x7f\xff\xff\xff1",  # a length past the end
    ],
    ids=["truncated", "missing-column", "bad-utf8", "bad-kind", "huge-length"],
)
def test_bad_tuples_get_the_python_twins_error(payload):
    """The C side declines (None) and the twin names the problem, as without the accelerator."""
    assert native.parse_tuple(payload, 6, UNCHANGED) is None
    fast, slow = _raised(lambda: Decoder().decode(payload), DecodeError)
    assert fast == slow


def test_binary_columns_are_left_to_the_python_twin():
    buf = b"\x00\x01b\x00\x00\x00\x02\x00\xff"
    assert native.parse_tuple(buf, 0, UNCHANGED) is None
    fast, slow = _both(lambda: Decoder().decode(b"I\x00\x00\x40\x00N" + buf))
    assert fast == slow and fast.new == [b"\x00\xff"]


# ------------------------------------------------------------------ parse_copy_line


def _copy_field(value: str | None) -> str:
    if value is None:
        return "\\N"
    return value.translate(str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r",
                                          "\b": "\\b", "\f": "\\f", "\v": "\\v"}))


def test_parse_copy_line_matches_the_python_twin():
    rng = random.Random(11)
    alphabet = "ab\\\t\n\r\b\f\vN é𝄞"
    for _ in range(2000):
        values = [
            None if rng.random() < 0.2 else "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
            for _ in range(rng.randint(1, 8))
        ]
        line = ("\t".join(_copy_field(v) for v in values) + "\n").encode()
        fast, expected = _both(lambda line=line: copy_text.parse_line(line))
        assert fast == expected
        assert native.parse_copy_line(line) == expected
        assert native.parse_copy_line(memoryview(line)) == expected
        assert expected == values


@pytest.mark.parametrize("line", [b"1\tab\\qc\n", b"1\t\xff\xfe\n", b"\\Nx\t2"])
def test_bad_copy_lines_get_the_python_twins_error(line):
    assert native.parse_copy_line(line) is None
    fast, slow = _raised(lambda: copy_text.parse_line(line), ValueError)
    assert fast == slow


def test_a_lone_trailing_backslash_is_the_python_twins_call():
    """COPY never writes one; whatever the twin makes of it, the accelerated path agrees."""
    assert native.parse_copy_line(b"1\t\\") is None
    fast, slow = _both(lambda: copy_text.parse_line(b"1\t\\"))
    assert fast == slow


# ------------------------------------------------------------------ envelope


@pytest.mark.parametrize("before,after", [(None, b'{"id":1}'), (b'{"id":1}', None), (None, None), (b"{}", b"{}")])
def test_envelope_matches_the_python_twin(before, after):
    source = b'{"version":"x","lsn":5}'
    events = _events(["id"], [("int4", -1)], [0])
    t0 = time.time_ns() // 1000
    fast, slow = _both(lambda: events.envelope("u", before, after, source))
    t1 = time.time_ns() // 1000
    stamps = re.compile(rb'"ts_ms":(\d+),"ts_us":(\d+),"ts_ns":(\d+)}$')
    assert stamps.sub(b"", fast) == stamps.sub(b"", slow)
    ms, us, ns = (int(x) for x in stamps.search(fast).groups())
    assert t0 <= us <= t1 and ms == us // 1000 and ns == us * 1000
    assert orjson.loads(fast)["before"] == (None if before is None else orjson.loads(before))


def test_envelope_refuses_what_is_not_bytes():
    with pytest.raises(TypeError):
        native.envelope(None, "text", b"{}", b'"c"')
    with pytest.raises(TypeError):
        native.envelope(None, None, None, b'"c"')


# ------------------------------------------------------------------ render_change


OID = 16400


def _renderer(with_schemas: bool = False) -> ChangeRenderer:
    """The relation cache as a Relation message for `public.t` (id int4 key, note text, flag bool) leaves it."""
    renderer = ChangeRenderer(None, "p", "db", ["public.t"], with_schemas)  # type: ignore[arg-type]
    columns = [
        Column(name, converter(_BY_NAME[t], -1), "__debezium_unavailable_value", {})
        for name, t in (("id", "int4"), ("note", "text"), ("flag", "bool"))
    ]
    events = TableEvents("p", "db", "public", "t", "p.public.t", columns, [0], with_schemas)
    renderer.tables[OID] = events
    if events.c_encoder is not None and renderer.render_xlogdata is not None:
        renderer.c_encoders[OID] = events.c_encoder
    return renderer


def _c_renderer(with_schemas: bool = False) -> ChangeRenderer:
    with accel.selected(True):
        return _renderer(with_schemas)


def _head(kind: bytes, oid: int = OID) -> bytes:
    return kind + struct.pack(">I", oid)


CHANGES = {
    "insert": _head(b"I") + b"N" + _tuple_bytes(["1", 'a "q"\n', "t"]),
    "insert-nulls": _head(b"I") + b"N" + _tuple_bytes(["2", None, None]),
    "update": _head(b"U") + b"N" + _tuple_bytes(["1", "b", "f"]),
    "update-same-key": _head(b"U") + b"K" + _tuple_bytes(["1", None, None]) + b"N" + _tuple_bytes(["1", "c", "t"]),
    "update-key-change": _head(b"U") + b"K" + _tuple_bytes(["1", None, None]) + b"N" + _tuple_bytes(["9", "c", "t"]),
    "update-full": _head(b"U") + b"O" + _tuple_bytes(["1", "old", "f"]) + b"N" + _tuple_bytes(["1", "new", "t"]),
    "update-full-key-change": _head(b"U") + b"O" + _tuple_bytes(["1", "old", "f"]) + b"N" + _tuple_bytes(["3", "n", "t"]),
    "delete-key": _head(b"D") + b"K" + _tuple_bytes(["1", None, None]),
    "delete-full": _head(b"D") + b"O" + _tuple_bytes(["1", "old", "t"]),
}

DECLINED = {
    "unchanged-toast": _head(b"U") + b"N" + _tuple_bytes(["1", UNCHANGED, "t"]),
    "unknown-relation": _head(b"I", OID + 1) + b"N" + _tuple_bytes(["1", "a", "t"]),
    "begin": b"B" + b"\0" * 20,
    "truncate": b"T" + struct.pack(">IBI", 1, 0, OID),
    "trailing-bytes": CHANGES["insert"] + b"x",
    "truncated": CHANGES["update-full"][:-2],
    "bad-tag": _head(b"U") + b"X" + _tuple_bytes(["1", "a", "t"]),
    "empty": b"",
}

_STAMPS = re.compile(rb'"ts_ms":\d+,"ts_us":\d+,"ts_ns":\d+}$')


def _xlogdata(change_lsn: int, payload: bytes) -> bytes:
    """The CopyData message the walsender wraps a pgoutput payload in: start LSN, WAL end, clock."""
    return b"w" + struct.pack(">QQq", change_lsn, change_lsn + 64, 0) + payload


def _unstamped(records: list) -> list:
    return [(r.topic, r.key, None if r.value is None else _STAMPS.sub(b"", r.value), r.table) for r in records]


@pytest.mark.parametrize("name", list(CHANGES))
def test_render_change_matches_the_python_path(name):
    payload = CHANGES[name]
    renderer, python = _both(_renderer)
    assert python.render_xlogdata is None and renderer.render_xlogdata is not None
    txn = Txn(commit_lsn=0x1_0000_0000, commit_ts_us=1_700_000_000_123_456, xid=812)
    for change_lsn in (0x1_0000_0010, 0x1_0000_0020):  # the transaction's source parts are cached
        fast = renderer.render_xlogdata(_xlogdata(change_lsn, payload), txn)
        with accel.selected(False):
            slow = python.records(Decoder().decode(payload), txn, change_lsn)
        assert fast is not None and all(type(r) is Record for r in fast)
        assert _unstamped(fast) == _unstamped(slow)
        assert fast[0].value is not None and _STAMPS.search(fast[0].value)
    other = Txn(commit_lsn=0x2_0000_0000, commit_ts_us=1_700_000_001_000_000, xid=None)
    fast = renderer.render_xlogdata(memoryview(_xlogdata(0xFFFF_FFFF_0000_0008, payload)), other)
    with accel.selected(False):
        slow = python.records(Decoder().decode(payload), other, 0xFFFF_FFFF_0000_0008)
    assert fast is not None and _unstamped(fast) == _unstamped(slow)


def test_a_rendered_change_leaves_its_transaction_to_the_collector():
    """The encoder keeps the transaction's values, not the Txn: over many tables each encoder
    would hold a Txn until its table's next change, past the collector's young passes."""
    renderer = _c_renderer()
    assert renderer.render_xlogdata is not None
    txn = Txn(commit_lsn=0x1_0000_0000, commit_ts_us=1_700_000_000_123_456, xid=812)
    held = sys.getrefcount(txn)
    first = renderer.render_xlogdata(_xlogdata(0x1_0000_0010, CHANGES["insert"]), txn)
    assert sys.getrefcount(txn) == held
    again = Txn(commit_lsn=txn.commit_lsn, commit_ts_us=txn.commit_ts_us, xid=txn.xid)  # a replay's equal Txn
    second = renderer.render_xlogdata(_xlogdata(0x1_0000_0010, CHANGES["insert"]), again)
    assert first is not None and second is not None and _unstamped(first) == _unstamped(second)


@pytest.mark.parametrize("name", list(DECLINED))
def test_render_change_declines_what_the_python_path_judges(name):
    renderer = _c_renderer()
    txn = Txn(commit_lsn=100, commit_ts_us=1, xid=5)
    assert renderer.render_xlogdata is not None
    assert renderer.render_xlogdata(_xlogdata(200, DECLINED[name]), txn) is None


def test_render_change_declines_what_is_not_xlogdata():
    txn = Txn(commit_lsn=100, commit_ts_us=1, xid=5)
    message = _xlogdata(200, CHANGES["insert"])
    assert native.render_change(_c_renderer().c_encoders, message, txn) is not None
    assert native.render_change(_c_renderer().c_encoders, b"k" + message[1:], txn) is None  # a keepalive
    assert native.render_change(_c_renderer().c_encoders, message[:30], txn) is None


def test_no_c_encoder_for_events_with_schemas():
    """The schema form wraps the envelope in Python: such relations have no C encoder."""
    assert _c_renderer(with_schemas=True).c_encoders == {}
    assert _c_renderer().c_encoders.keys() == {OID}


def test_render_change_refuses_c_encoders_that_are_not_encoders():
    txn = Txn(commit_lsn=100, commit_ts_us=1, xid=5)
    message = _xlogdata(200, CHANGES["insert"])
    with pytest.raises(TypeError, match="RowEncoders"):
        native.render_change({OID: object()}, message, txn)
    bare = native.RowEncoder((b'"id":',), bytes([1]), (int,), (0,), orjson.dumps, UNCHANGED)
    with pytest.raises(TypeError, match="RowEncoders"):
        native.render_change({OID: bare}, message, txn)


def test_a_relation_version_is_freed_when_replaced():
    """The encoder calls back into its TableEvents (source parts): the cycle must be collectable,
    or every Relation message (each reconnect, each ALTER TABLE) would leak one."""
    events, _ = _twin_events(["id", "v"], [("int4", -1), ("text", -1)], [0])
    assert events.c_encoder is not None
    ref = weakref.ref(events)
    del events
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("text", ['"024-01-02 03:04:05+00', "2024-01-02 03:04:05\\1+00", "2024-01-02 03:04\n05.5+00"])
def test_timestamptz_text_that_needs_an_escape_stays_valid_json(text):
    """Found by fuzz/run.sh: the C fast case copied such text unescaped (PostgreSQL never sends it)."""
    fast, slow = _twin_events(["at"], [("timestamptz", -1)], [0])
    assert fast.encode([text]) == slow.encode([text])
    orjson.loads(fast.encode([text])[1])
