"""Tests for cdc.events.types: PostgreSQL text values -> Debezium JSON values and Connect schemas.

Every input literal below is PostgreSQL 15's real text output, observed under the pinned
session settings (cdc.source.session). Expected values were computed independently of the code
under test: by PostgreSQL itself (``d - '1970-01-01'``, ``extract(epoch ...)``,
``... at time zone 'UTC'``), with ``datetime``/``base64``, or by hand. No database needed.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

import pytest

from cdc.events import types as T
from cdc.events.types import PASSTHROUGH, converter, field_schema
from cdc.source.pgtypes import BUILTIN_TYPES, PgType, load_type

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def conv(oid: int, text: str, typmod: int = -1) -> Any:
    return converter(BUILTIN_TYPES[oid], typmod)(text)


def b64(hexstr: str) -> str:
    return base64.b64encode(bytes.fromhex(hexstr)).decode()


def ref_days(y: int, m: int, d: int) -> int:
    """Epoch days via datetime, shifting by whole 400-year Gregorian cycles (146097 days)."""
    shift = 0
    while y < 1:
        y += 400
        shift -= 146097
    while y > 9999:
        y -= 400
        shift += 146097
    return (dt.date(y, m, d) - dt.date(1970, 1, 1)).days + shift


# --------------------------------------------------------------------------- builtins


def test_builtin_table_has_scalars_and_arrays():
    assert BUILTIN_TYPES[23] == PgType(23, "int4", "b")
    arr = BUILTIN_TYPES[1007]
    assert arr.name == "_int4" and arr.element == BUILTIN_TYPES[23]
    assert BUILTIN_TYPES[3904].kind == "r" and BUILTIN_TYPES[4451].kind == "m"
    # types with a typelem that are not arrays must not parse as arrays
    for oid in (19, 22, 30, 600, 603, 628):
        assert BUILTIN_TYPES[oid].element is None
    assert BUILTIN_TYPES[1020].element == BUILTIN_TYPES[603]  # _box


# --------------------------------------------------------------------------- scalars

SCALARS = [
    # (oid, typmod, PostgreSQL text, expected JSON-ready value)
    (16, -1, "t", True),
    (16, -1, "f", False),
    (21, -1, "32767", 32767),
    (23, -1, "-2147483647", -2147483647),
    (20, -1, "9223372036854775807", 9223372036854775807),
    (26, -1, "4294967295", 4294967295),
    (700, -1, "1.5", 1.5),
    (700, -1, "0.1", 0.1),
    (700, -1, "3.4028235e+38", 3.4028235e38),
    (700, -1, "1e-45", 1e-45),
    (700, -1, "NaN", "NaN"),
    (700, -1, "Infinity", "Infinity"),
    (701, -1, "-Infinity", "-Infinity"),
    (701, -1, "1e+300", 1e300),
    (701, -1, "1e-300", 1e-300),
    (701, -1, "123456789.123", 123456789.123),
    (701, -1, "1", 1.0),
    # numeric: the text as PostgreSQL prints it (decimal.handling.mode=string)
    (1700, -1, "123.4500", "123.4500"),
    (1700, -1, "0.00000000000000000001", "0.00000000000000000001"),
    (1700, -1, "100000000000000000000", "100000000000000000000"),
    (1700, -1, "NaN", "NaN"),
    (1700, -1, "Infinity", "Infinity"),
    (1700, -1, "-Infinity", "-Infinity"),
    (1700, 655366, "12.50", "12.50"),
    # money under lc_monetary=C
    (790, -1, "$1,234.56", "1234.56"),
    (790, -1, "-$5.00", "-5.00"),
    (790, -1, "$0.00", "0.00"),
    (790, -1, "-$1,234,567.89", "-1234567.89"),
    (790, -1, "-$92,233,720,368,547,758.08", "-92233720368547758.08"),
    (790, -1, "$92,233,720,368,547,758.07", "92233720368547758.07"),
    (790, -1, "($5.00)", "-5.00"),  # parenthesised negatives of other locales
    # bytea (hex output) -> base64
    (17, -1, "\\x0102ff", "AQL/"),
    (17, -1, "\\x", ""),
    (17, -1, "a\\\\b\\001", base64.b64encode(b"a\\b\x01").decode()),  # escape format too
]


@pytest.mark.parametrize(("oid", "typmod", "text", "expected"), SCALARS)
def test_scalar(oid: int, typmod: int, text: str, expected: Any):
    got = conv(oid, text, typmod)
    assert got == expected
    assert type(got) is type(expected)


def test_negative_zero_float_keeps_sign():
    got = conv(701, "-0")
    assert got == 0.0 and str(got) == "-0.0"


PASSTHROUGH_SAMPLES = [
    (25, "hello"),
    (1043, "héllo wörld"),
    (1042, "abc  "),  # bpchar keeps its padding
    (18, "x"),
    (19, "nm"),
    (2950, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    (114, '{"a":  1}'),
    (3802, '{"a": [1, 2.50]}'),
    (142, "<a>x</a>"),
    (3614, "'a' 'cat' 'fat'"),
    (3615, "'fat' & 'rat'"),
    (3904, "[1,5)"),
    (3904, "empty"),
    (3910, '["2024-01-01 00:00:00+00",)'),
    (4451, "{[1,3),[5,7)}"),
    (869, "192.168.0.1/24"),
    (650, "10.0.0.0/8"),
    (829, "08:00:2b:01:02:03"),
    (774, "08:00:2b:01:02:03:04:05"),
    (603, "(3,4),(1,2)"),
    (718, "<(1,2),3>"),
    (628, "{1,2,3}"),
    (3220, "16/B374D848"),
]


@pytest.mark.parametrize(("oid", "text"), PASSTHROUGH_SAMPLES)
def test_passthrough(oid: int, text: str):
    fn = converter(BUILTIN_TYPES[oid], -1)
    assert fn is PASSTHROUGH
    assert fn(text) is text


# --------------------------------------------------------------------------- dates

DATES = [
    # PostgreSQL text, days as PostgreSQL computes ``d - '1970-01-01'``, (y, m, d) astronomical
    ("2024-01-02", 19724, (2024, 1, 2)),
    ("1970-01-01", 0, (1970, 1, 1)),
    ("1969-12-31", -1, (1969, 12, 31)),
    ("2000-02-29", 11016, (2000, 2, 29)),
    ("0001-01-01", -719162, (1, 1, 1)),
    ("0001-01-01 BC", -719528, (0, 1, 1)),
    ("0044-03-15 BC", -735160, (-43, 3, 15)),
    ("4713-01-01 BC", -2440550, (-4712, 1, 1)),
    ("10000-01-01", 2932897, (10000, 1, 1)),
    ("5874897-12-31", 2145042905, (5874897, 12, 31)),
]


@pytest.mark.parametrize(("text", "days", "ymd"), DATES)
def test_date(text: str, days: int, ymd: tuple[int, int, int]):
    assert ref_days(*ymd) == days  # the two independent references agree
    assert conv(1082, text) == days
    assert T.days_from_civil(*ymd) == days


def test_date_infinity_follows_debezium():
    # Debezium substitutes LocalDate -5877611-06-21 / -22 and emits their epoch days.
    assert conv(1082, "infinity") == ref_days(-5877611, 6, 21) == -2147472692
    assert conv(1082, "-infinity") == ref_days(-5877611, 6, 22) == -2147472691


def test_date_memo_is_bounded(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(T, "_MEMO_LIMIT", 2)
    T._DAYS_MEMO.clear()
    for text, days, _ in DATES[:5]:
        assert conv(1082, text) == days
    assert len(T._DAYS_MEMO) <= 2


def test_civil_round_trip():
    for z in (-2440550, -735160, -719528, -1, 0, 11016, 2932897, 2145042905):
        assert T.days_from_civil(*T._civil_from_days(z)) == z


# --------------------------------------------------------------------------- time

TIMES = [
    # text, typmod, expected (µs for p>3, ms for p<=3; PostgreSQL extract(epoch))
    ("03:04:05.123456", -1, 11045123456),
    ("00:00:00", -1, 0),
    ("23:59:59.999999", 6, 86399999999),
    ("24:00:00", -1, 86400000000),
    ("12:00:00.5", 4, 43200500000),
    ("03:04:05.123", 3, 11045123),
    ("12:00:00.5", 3, 43200500),
    ("24:00:00", 0, 86400000),
]


@pytest.mark.parametrize(("text", "typmod", "expected"), TIMES)
def test_time(text: str, typmod: int, expected: int):
    assert conv(1083, text, typmod) == expected


TIMETZ = [
    # text, expected; the UTC clock time is PostgreSQL's ``t at time zone 'UTC'``
    ("12:00:00+00", "12:00:00Z"),
    ("03:04:05.12+05:30", "21:34:05.12Z"),
    ("03:04:05-08", "11:04:05Z"),
    ("03:04:05.5+05:30:15", "21:33:50.5Z"),
    ("00:00:00+15:59", "08:01:00Z"),
    ("23:30:00-01", "00:30:00Z"),
    ("00:15:00+01", "23:15:00Z"),
    ("24:00:00+00", "24:00:00Z"),  # Debezium keeps the end-of-day boundary at UTC
    ("24:00:00+05", "19:00:00Z"),
    ("23:00:00-01", "00:00:00Z"),
    ("01:00:00+01", "00:00:00Z"),
]


@pytest.mark.parametrize(("text", "expected"), TIMETZ)
def test_timetz(text: str, expected: str):
    assert conv(1266, text) == expected


# --------------------------------------------------------------------------- timestamp

TIMESTAMPS = [
    # text, µs (PostgreSQL extract(epoch)*1e6), timestamp(3) text, ms
    ("2024-01-02 03:04:05.12", 1704164645120000, "2024-01-02 03:04:05.12", 1704164645120),
    ("1970-01-01 00:00:00", 0, "1970-01-01 00:00:00", 0),
    ("1969-12-31 23:59:59.999999", -1, "1970-01-01 00:00:00", 0),
    ("2000-02-29 12:34:56.000001", 951827696000001, "2000-02-29 12:34:56", 951827696000),
    ("0044-03-15 12:00:00 BC", -63517780800000000, "0044-03-15 12:00:00 BC", -63517780800000),
    ("4714-11-24 00:00:00 BC", -210866803200000000, "4714-11-24 00:00:00 BC", -210866803200000),
    ("10000-01-01 00:00:00.5", 253402300800500000, "10000-01-01 00:00:00.5", 253402300800500),
]


@pytest.mark.parametrize(("text", "micros", "text3", "millis"), TIMESTAMPS)
def test_timestamp(text: str, micros: int, text3: str, millis: int):
    assert conv(1114, text) == micros
    assert conv(1114, text, 6) == micros
    assert conv(1114, text3, 3) == millis


def test_timestamp_reference_by_datetime():
    text = "2024-01-02 03:04:05.12"
    ref = dt.datetime(2024, 1, 2, 3, 4, 5, 120000) - dt.datetime(1970, 1, 1)
    assert conv(1114, text) == ref // dt.timedelta(microseconds=1)


def test_timestamp_infinity_follows_debezium_docs():
    assert conv(1114, "infinity") == 9223372036825200000
    assert conv(1114, "-infinity") == -9223372036832400000
    assert conv(1114, "infinity", 3) == 9223372036825200
    assert conv(1114, "-infinity", 3) == -9223372036832400


def test_timestamp_beyond_int64_saturates():
    # PostgreSQL's maximum: extract(epoch)*1e6 = 9224318016000000000 > int64
    assert conv(1114, "294276-12-31 23:59:59.999999") == INT64_MAX
    assert conv(1114, "294277-01-01 00:00:00", 3) == 9224318016000000


TIMESTAMPTZ = [
    # text, expected ZonedTimestamp, µs since epoch (PostgreSQL extract(epoch)*1e6)
    ("2024-01-02 03:04:05.12+00", "2024-01-02T03:04:05.12Z", 1704164645120000),
    ("2024-01-02 03:04:05.1+00", "2024-01-02T03:04:05.1Z", 1704164645100000),
    ("2024-01-01 21:34:05+00", "2024-01-01T21:34:05Z", 1704144845000000),
    ("1970-01-01 00:00:00+00", "1970-01-01T00:00:00Z", 0),
    ("1899-12-31 23:40:28+00", "1899-12-31T23:40:28Z", -2208989972000000),
    ("0044-03-15 12:00:00+00 BC", "-0043-03-15T12:00:00Z", -63517780800000000),
    ("0001-01-01 00:00:00+00 BC", "0000-01-01T00:00:00Z", -62167219200000000),
    ("12345-06-07 08:09:10.000001+00", "+12345-06-07T08:09:10.000001Z", 327416976550000001),
    # not produced under TimeZone=UTC, but the parser must honour any offset
    ("2024-01-02 03:04:05+05:30", "2024-01-01T21:34:05Z", 1704144845000000),
    ("2024-01-02 03:04:05.5-08", "2024-01-02T11:04:05.5Z", 1704193445500000),
    ("0044-03-15 12:00:00+01:30:15 BC", "-0043-03-15T10:29:45Z", -63517786215000000),
]


@pytest.mark.parametrize(("text", "expected", "micros"), TIMESTAMPTZ)
def test_timestamptz(text: str, expected: str, micros: int):
    assert conv(1184, text) == expected
    assert T._iso_utc(micros) == expected


def test_timestamptz_matches_java_iso_for_ordinary_years():
    micros = 1704164645120000
    ref = (dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=micros)).isoformat()
    assert conv(1184, "2024-01-02 03:04:05.12+00") == ref.rstrip("0") + "Z"


@pytest.mark.parametrize("text", ["infinity", "-infinity"])
def test_timestamptz_infinity(text: str):
    assert conv(1184, text) == text


# --------------------------------------------------------------------------- interval

MONTH_S = 2629800  # 30.4375 days
INTERVALS = [
    ("P1Y2M3DT4H5M6.5S", (14 * MONTH_S + 3 * 86400 + 4 * 3600 + 5 * 60 + 6) * 10**6 + 500000),
    ("PT-1H", -3600 * 10**6),
    ("P-1Y-2M", -14 * MONTH_S * 10**6),
    ("PT0S", 0),
    ("P1DT-1H", 82800 * 10**6),
    ("P-1DT1H", -82800 * 10**6),
    ("PT-0.5S", -500000),
    ("PT-1.000001S", -1000001),
    ("PT0.000001S", 1),
    ("P1MT-1.5S", MONTH_S * 10**6 - 1500000),
    ("P1Y1M1DT1H1M1S", 34277461 * 10**6),
    ("P-1Y-1M-1DT-1H-1M-1.25S", -34277461250000),
    ("PT101H10M", 364200 * 10**6),
    ("PT1M", 60 * 10**6),
    ("P1Y6M", 18 * MONTH_S * 10**6),
    ("P3DT4H", (3 * 86400 + 4 * 3600) * 10**6),
    ("P1Y", 365 * 86400 * 10**6 + 6 * 3600 * 10**6),  # 365.25 days
    # beyond int64: saturate like Java's (long) cast of a double
    ("P178000000Y", INT64_MAX),
    ("P-178000000Y", INT64_MIN),
    ("P2147483647DT2562047788H54.775807S", INT64_MAX),
    # PostgreSQL 17 interval infinities
    ("infinity", INT64_MAX),
    ("-infinity", INT64_MIN),
]


@pytest.mark.parametrize(("text", "expected"), INTERVALS)
def test_interval(text: str, expected: int):
    assert conv(1186, text) == expected
    assert conv(1186, text) == expected  # memoized second call


def test_interval_rejects_other_styles():
    with pytest.raises(ValueError):
        conv(1186, "1 year 2 mons")


# --------------------------------------------------------------------------- bits

BITS = [
    # oid, typmod, text, expected
    (1560, 1, "1", True),
    (1560, 1, "0", False),
    (1562, 1, "1", True),
    (1560, 3, "101", b64("05")),
    (1560, 10, "0000000000", ""),  # no set bit: zero bytes (Debezium's BitSet.toByteArray)
    (1560, 10, "1000000001", b64("0102")),  # little-endian: 0x201 -> 01 02
    (1560, 10, "0000000001", b64("01")),
    (1562, -1, "10110", b64("16")),
    (1562, -1, "", ""),
    (1562, 16, "1111111100000000", b64("00ff")),
]


@pytest.mark.parametrize(("oid", "typmod", "text", "expected"), BITS)
def test_bits(oid: int, typmod: int, text: str, expected: Any):
    assert conv(oid, text, typmod) == expected


# --------------------------------------------------------------------------- point


def test_point():
    # WKB: byte order 01, type 1 (LE uint32), x and y as LE doubles (1.5 = 3ff8..., 2 = 4000...)
    wkb = "01" + "01000000" + "000000000000f83f" + "0000000000000040"
    assert conv(600, "(1.5,2)") == {"x": 1.5, "y": 2.0, "wkb": b64(wkb), "srid": None}


def test_point_special_values():
    got = conv(600, "(NaN,Infinity)")
    assert got["x"] == "NaN" and got["y"] == "Infinity"
    assert len(base64.b64decode(got["wkb"])) == 21
    got = conv(600, "(-0,1e+300)")
    assert got["y"] == 1e300 and str(got["x"]) == "-0.0"


# --------------------------------------------------------------------------- hstore

HSTORE = PgType(16389, "hstore", "b")
HSTORE_SAMPLES = [
    ("", {}),
    ('"a"=>"1", "aa"=>"0", "bb"=>"2", "ccc"=>"3"', {"a": "1", "aa": "0", "bb": "2", "ccc": "3"}),
    (
        '""=>"", "a"=>"1", "b"=>NULL, "c d"=>"x\\"y", "NULL"=>"NULL", "back\\\\slash"=>"q\\\\"',
        {"": "", "a": "1", "b": None, "c d": 'x"y', "NULL": "NULL", "back\\slash": "q\\"},
    ),
    ('"k"=>"line1\nline2", "tab"=>"a\tb"', {"k": "line1\nline2", "tab": "a\tb"}),
    ('"ké"=>"=>, "', {"ké": "=>, "}),
]


@pytest.mark.parametrize(("text", "expected"), HSTORE_SAMPLES)
def test_hstore(text: str, expected: dict[str, str | None]):
    got = converter(HSTORE, -1)(text)
    assert isinstance(got, str)
    assert json.loads(got) == expected
    assert list(json.loads(got)) == list(expected)  # PostgreSQL's key order is kept
    assert got == json.dumps(expected, ensure_ascii=False, separators=(",", ":"))


def test_hstore_exact_bytes():
    assert converter(HSTORE, -1)('"a"=>"1", "b"=>NULL') == '{"a":"1","b":null}'


# --------------------------------------------------------------------------- arrays

ARRAYS = [
    # oid, typmod, text, expected
    (1007, -1, "{}", []),
    (1007, -1, "{1,2,NULL}", [1, 2, None]),
    (1007, -1, "{{1,2},{3,4}}", [[1, 2], [3, 4]]),
    (1007, -1, "{{NULL,NULL}}", [[None, None]]),
    (1007, -1, "[0:1]={1,2}", [1, 2]),
    (1007, -1, "[1:2][3:4]={{1,2},{3,4}}", [[1, 2], [3, 4]]),
    (
        1009,
        -1,
        '{"a b","c\\"d","e\\\\f","",NULL,"NULL","x,y","{z}"}',
        ["a b", 'c"d', "e\\f", "", None, "NULL", "x,y", "{z}"],
    ),
    (1009, -1, '{"  spaced  "}', ["  spaced  "]),
    (1009, -1, '{"new\nline"}', ["new\nline"]),
    (1009, -1, "{P1D}", ["P1D"]),
    (1014, -1, '{"ab "}', ["ab "]),
    (1022, -1, "{1.5,NULL,NaN}", [1.5, None, "NaN"]),
    (1000, -1, "{t,f,NULL}", [True, False, None]),
    (1182, -1, '{2024-01-02,"0044-03-15 BC",infinity}', [19724, -735160, -2147472692]),
    (1185, -1, '{"2024-01-02 03:04:05.12+00"}', ["2024-01-02T03:04:05.12Z"]),
    (1115, 3, '{"2024-01-02 03:04:05.12"}', [1704164645120]),
    (1183, -1, "{24:00:00}", [86400000000]),
    (1001, -1, '{"\\\\x0102","\\\\x"}', ["AQI=", ""]),
    (3807, -1, '{"{\\"a\\": 1}","[1, \\"x\\"]"}', ['{"a": 1}', '[1, "x"]']),
    (
        1017,
        -1,
        '{"(1,2)","(3.5,-4)"}',
        [
            {
                "x": 1.0,
                "y": 2.0,
                "wkb": b64("0101000000" + "000000000000f03f" + "0000000000000040"),
                "srid": None,
            },
            {
                "x": 3.5,
                "y": -4.0,
                "wkb": b64("0101000000" + "0000000000000c40" + "00000000000010c0"),
                "srid": None,
            },
        ],
    ),
    (1563, -1, "{101,1}", [b64("05"), b64("01")]),
    (1561, 1, "{1,0}", [True, False]),
    (3905, -1, '{"[1,5)",empty}', ["[1,5)", "empty"]),
    (1187, -1, "{P1Y,PT-1H}", [365 * 86400 * 10**6 + 6 * 3600 * 10**6, -3600 * 10**6]),
    (791, -1, '{"$1,234.56","-$5.00"}', ["1234.56", "-5.00"]),
    (1020, -1, "{(3,4),(1,2);(5,6),(1,1)}", ["(3,4),(1,2)", "(5,6),(1,1)"]),  # box uses ';'
    (1231, -1, "{12.50,NaN}", ["12.50", "NaN"]),
]


@pytest.mark.parametrize(("oid", "typmod", "text", "expected"), ARRAYS)
def test_array(oid: int, typmod: int, text: str, expected: list[Any]):
    assert conv(oid, text, typmod) == expected


def test_hstore_array():
    arr = PgType(16394, "_hstore", "b", element=HSTORE)
    text = '{"\\"a\\"=>\\"1\\"","\\"b\\"=>\\"x y\\""}'
    assert converter(arr, -1)(text) == ['{"a":"1"}', '{"b":"x y"}']


# --------------------------------------------------------------------------- user types

MOOD = PgType(16807, "mood", "e", labels=("sad", "ok", "happy"))
PRICE = PgType(16814, "price", "d", base=BUILTIN_TYPES[1700], base_typmod=655366)
PRICE2 = PgType(16816, "price2", "d", base=PRICE)
TS3 = PgType(17000, "ts3", "d", base=BUILTIN_TYPES[1114], base_typmod=3)
COMP = PgType(16821, "comp", "c")


def test_enum_domain_composite():
    assert converter(MOOD, -1) is PASSTHROUGH
    assert converter(PgType(16806, "_mood", "b", element=MOOD), -1)("{sad,ok}") == ["sad", "ok"]
    assert converter(PRICE2, -1)("12.50") == "12.50"
    assert converter(TS3, -1)("2024-01-02 03:04:05.12") == 1704164645120  # domain typmod wins
    assert converter(PgType(17001, "_ts3", "b", element=TS3), -1)('{"1970-01-01 00:00:01"}') == [
        1000
    ]
    tags = PgType(16818, "tags", "d", base=BUILTIN_TYPES[1009])
    assert converter(tags, -1)('{"a b",c}') == ["a b", "c"]
    assert converter(COMP, -1)('(1,"x y")') == '(1,"x y")'
    assert converter(PgType(16820, "_comp", "b", element=COMP), -1)('{"(1,x)",NULL}') == [
        "(1,x)",
        None,
    ]


def test_unknown_base_type_is_text():
    assert converter(PgType(99999, "geometry", "b"), -1) is PASSTHROUGH
    assert converter(PgType(99998, "citext", "b"), -1) is PASSTHROUGH


# --------------------------------------------------------------------------- load_type


class _Result:
    def __init__(self, rows: list[tuple[Any, ...]]):
        self.rows = rows

    def fetchone(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows


class FakeConn:
    """Answers load_type's two queries from a dict; counts them."""

    def __init__(self, types: dict[int, tuple[Any, ...]], enums: dict[int, list[str]]):
        self.types = types
        self.enums = enums
        self.queries = 0

    def execute(self, query: str, params: tuple[int]) -> _Result:
        self.queries += 1
        (oid,) = params
        if "pg_enum" in query:
            return _Result([(label,) for label in self.enums.get(oid, [])])
        row = self.types.get(oid)
        return _Result([row] if row else [])


def test_load_type_resolves_recursively():
    # (typname, typtype, typelem, typbasetype, typtypmod, is_array)
    conn = FakeConn(
        types={
            16807: ("mood", "e", 0, 0, -1, False),
            16806: ("_mood", "b", 16807, 0, -1, True),
            16814: ("price", "d", 0, 1700, 655366, False),
            16816: ("price2", "d", 0, 16814, -1, False),
            16815: ("_price2", "b", 16816, 0, -1, True),
            16389: ("hstore", "b", 0, 0, -1, False),
            16821: ("comp", "c", 0, 0, -1, False),
            16900: ("gvec", "b", 701, 0, -1, False),  # typelem but not an array
        },
        enums={16807: ["sad", "ok", "happy"]},
    )
    assert load_type(conn, 16806) == PgType(16806, "_mood", "b", element=MOOD)
    assert load_type(conn, 16815).element == PRICE2
    assert load_type(conn, 16815).element.base == PRICE
    assert load_type(conn, 16389) == HSTORE
    assert load_type(conn, 16821) == COMP
    assert load_type(conn, 16900).element is None
    before = conn.queries
    assert load_type(conn, 1007) is BUILTIN_TYPES[1007]  # builtins: no query
    assert conn.queries == before
    with pytest.raises(LookupError):
        load_type(conn, 424242)


# --------------------------------------------------------------------------- schemas


def test_field_schema_examples_and_key_order():
    s = field_schema(BUILTIN_TYPES[1114], -1, "created_at", False)
    assert s == {
        "type": "int64",
        "optional": False,
        "name": "io.debezium.time.MicroTimestamp",
        "version": 1,
        "field": "created_at",
    }
    assert list(s) == ["type", "optional", "name", "version", "field"]
    assert field_schema(BUILTIN_TYPES[3802], -1, "doc", True) == {
        "type": "string",
        "optional": True,
        "name": "io.debezium.data.Json",
        "version": 1,
        "field": "doc",
    }
    assert field_schema(BUILTIN_TYPES[1700], 655366, "amount", True) == {
        "type": "string",
        "optional": True,
        "field": "amount",
    }


SCHEMAS = [
    # (type, typmod, (type, name or None))
    (BUILTIN_TYPES[16], -1, ("boolean", None)),
    (BUILTIN_TYPES[21], -1, ("int16", None)),
    (BUILTIN_TYPES[23], -1, ("int32", None)),
    (BUILTIN_TYPES[20], -1, ("int64", None)),
    (BUILTIN_TYPES[26], -1, ("int64", None)),
    (BUILTIN_TYPES[700], -1, ("float", None)),
    (BUILTIN_TYPES[701], -1, ("double", None)),
    (BUILTIN_TYPES[790], -1, ("string", None)),
    (BUILTIN_TYPES[17], -1, ("bytes", None)),
    (BUILTIN_TYPES[25], -1, ("string", None)),
    (BUILTIN_TYPES[3904], -1, ("string", None)),
    (BUILTIN_TYPES[2950], -1, ("string", "io.debezium.data.Uuid")),
    (BUILTIN_TYPES[142], -1, ("string", "io.debezium.data.Xml")),
    (BUILTIN_TYPES[114], -1, ("string", "io.debezium.data.Json")),
    (BUILTIN_TYPES[3614], -1, ("string", "io.debezium.data.Tsvector")),  # Debezium >= 3.3
    (BUILTIN_TYPES[1082], -1, ("int32", "io.debezium.time.Date")),
    (BUILTIN_TYPES[1083], 3, ("int32", "io.debezium.time.Time")),
    (BUILTIN_TYPES[1083], -1, ("int64", "io.debezium.time.MicroTime")),
    (BUILTIN_TYPES[1114], 0, ("int64", "io.debezium.time.Timestamp")),
    (BUILTIN_TYPES[1114], 4, ("int64", "io.debezium.time.MicroTimestamp")),
    (BUILTIN_TYPES[1184], -1, ("string", "io.debezium.time.ZonedTimestamp")),
    (BUILTIN_TYPES[1266], -1, ("string", "io.debezium.time.ZonedTime")),
    (BUILTIN_TYPES[1186], -1, ("int64", "io.debezium.time.MicroDuration")),
    (BUILTIN_TYPES[1560], 1, ("boolean", None)),
    (HSTORE, -1, ("string", "io.debezium.data.Json")),
    (PgType(16622, "ltree", "b"), -1, ("string", "io.debezium.data.Ltree")),
    (COMP, -1, ("string", None)),
    (PRICE2, -1, ("string", None)),
    (TS3, -1, ("int64", "io.debezium.time.Timestamp")),
]


@pytest.mark.parametrize(("pgtype", "typmod", "spec"), SCHEMAS)
def test_field_schema_types(pgtype: PgType, typmod: int, spec: tuple[str, str | None]):
    s = field_schema(pgtype, typmod, "c", True)
    ctype, name = spec
    expected: dict[str, Any] = {"type": ctype, "optional": True}
    if name:
        expected.update(name=name, version=1)
    expected["field"] = "c"
    assert s == expected
    assert list(s) == list(expected)


def test_field_schema_bits_enum_array_point():
    assert field_schema(BUILTIN_TYPES[1560], 10, "b", False) == {
        "type": "bytes",
        "optional": False,
        "name": "io.debezium.data.Bits",
        "version": 1,
        "parameters": {"length": "10"},
        "field": "b",
    }
    assert field_schema(BUILTIN_TYPES[1562], -1, "v", True)["parameters"] == {
        "length": "2147483647"
    }
    s = field_schema(MOOD, -1, "m", True)
    assert s == {
        "type": "string",
        "optional": True,
        "name": "io.debezium.data.Enum",
        "version": 1,
        "parameters": {"allowed": "sad,ok,happy"},
        "field": "m",
    }
    assert list(s) == ["type", "optional", "name", "version", "parameters", "field"]
    s = field_schema(BUILTIN_TYPES[1007], -1, "ids", True)
    assert s == {
        "type": "array",
        "items": {"type": "int32", "optional": True},
        "optional": True,
        "field": "ids",
    }
    assert list(s) == ["type", "items", "optional", "field"]
    assert field_schema(BUILTIN_TYPES[1115], 3, "ts", False)["items"] == {
        "type": "int64",
        "optional": True,
        "name": "io.debezium.time.Timestamp",
        "version": 1,
    }
    s = field_schema(BUILTIN_TYPES[600], -1, "p", True)
    assert s == {
        "type": "struct",
        "fields": [
            {"type": "double", "optional": False, "field": "x"},
            {"type": "double", "optional": False, "field": "y"},
            {"type": "bytes", "optional": True, "field": "wkb"},
            {"type": "int32", "optional": True, "field": "srid"},
        ],
        "optional": True,
        "name": "io.debezium.data.geometry.Point",
        "version": 1,
        "doc": "Geometry (POINT)",
        "field": "p",
    }
    assert list(s) == ["type", "fields", "optional", "name", "version", "doc", "field"]


def test_field_schema_does_not_share_mutable_state():
    a = field_schema(BUILTIN_TYPES[600], -1, "p", True)
    a["fields"][0]["field"] = "mutated"
    assert field_schema(BUILTIN_TYPES[600], -1, "p", True)["fields"][0]["field"] == "x"


@pytest.mark.parametrize("text", ["", "+00", "1+00", "2024+00", "(", "P", "[", "-", "y"])
def test_short_malformed_text_is_a_value_error_for_every_builtin_type(text: str) -> None:
    """Text PostgreSQL never sends (the fuzzer's): a ValueError the caller reports, never an
    IndexError from a converter that looked at a character the text does not have."""
    for oid in BUILTIN_TYPES:
        try:
            conv(oid, text)
        except ValueError:
            pass
