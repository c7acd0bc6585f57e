"""PostgreSQL text values -> Debezium JSON values, and their Kafka Connect field schemas.

Values reach us as PostgreSQL's *text output* (pgoutput text format, or COPY/SELECT text
in snapshots), always rendered under the pinned session settings of ``cdc.source.session``
(TimeZone=UTC, DateStyle='ISO, MDY', IntervalStyle=iso_8601, extra_float_digits=3,
bytea_output=hex, lc_monetary=C). Because the text is pinned, parsing it is exact and the
same row always yields the same JSON bytes, which compaction depends on.

``converter()`` is called once per column of a relation and returns a closure that is
called per value on the hot path, so all dispatch happens up front and the closures use
slicing/``split`` rather than regexes or ``datetime``. NULL never reaches a converter.

The mapping (Debezium's PostgreSQL connector, decimal.handling.mode=string), its special
values and every place it differs from Debezium: the type table of docs/events.md, the one copy.
"""

from __future__ import annotations

import binascii
import json
import struct
from collections.abc import Callable
from typing import Any

from cdc.events.calendar import civil_from_days as _civil_from_days  # noqa: F401 (tests take it from here)
from cdc.events.calendar import days_from_civil
from cdc.events.calendar import iso_utc as _iso_utc
from cdc.source.pgtypes import BUILTIN_TYPES, PgType

__all__ = [
    "NATIVE_KINDS",
    "NO_DEFAULT",
    "PASSTHROUGH",
    "Converter",
    "converter",
    "days_from_civil",
    "field_schema",
]

Converter = Callable[[str], Any]

#: The converter of every type whose JSON value is its text unchanged. ``str`` returns an
#: exact ``str`` argument itself, so it is the cheapest possible call; callers may also test
#: ``conv is PASSTHROUGH`` and skip the call entirely.
PASSTHROUGH: Converter = str


# --------------------------------------------------------------------------- helpers

_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)

_MICROS_PER_DAY = 86_400_000_000
_SECONDS_PER_MONTH = 2_629_800  # 365.25 / 12 days = 30.4375 days, exactly

# Debezium's sentinels (see module docstring).
_TS_POS_INF_MICROS = 9223372036825200000
_TS_NEG_INF_MICROS = -9223372036832400000
_TS_POS_INF_MILLIS = 9223372036825200
_TS_NEG_INF_MILLIS = -9223372036832400
_DATE_POS_INF_DAYS = -2147472692
_DATE_NEG_INF_DAYS = -2147472691


def _clamp64(v: int) -> int:
    """Saturate to int64 like Java's double->long cast (orjson also refuses wider ints)."""
    if v > _INT64_MAX:
        return _INT64_MAX
    if v < _INT64_MIN:
        return _INT64_MIN
    return v


# Memo tables for the hot temporal paths: a change stream's dates and clock times repeat
# heavily, and a dict hit is several times cheaper than re-parsing. Bounded by clearing.
_DAYS_MEMO: dict[str, int] = {}
_SECS_MEMO: dict[str, int] = {}
_MEMO_LIMIT = 100_000
# Multiplier turning a fraction of n digits into microseconds (PostgreSQL trims zeros).
_FRAC_SCALE = (0, 100_000, 10_000, 1_000, 100, 10, 1)


def _date_days_slow(s: str) -> int:
    bc = s.endswith(" BC")
    if bc:
        s = s[:-3]
    y, m, d = s.split("-")
    year = 1 - int(y) if bc else int(y)
    return days_from_civil(year, int(m), int(d))


def _memoized(memo: dict[str, int], parse: Callable[[str], int], s: str) -> int:
    """`parse(s)` through a bounded memo: dates and intervals repeat a lot in real tables."""
    value = memo.get(s)
    if value is None:
        value = parse(s)
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[s] = value
    return value


def _date_days(s: str) -> int:
    """'2024-01-02' / '0044-03-15 BC' / '10000-01-01' -> epoch days (memoized)."""
    return _memoized(_DAYS_MEMO, _date_days_slow, s)


def _time_micros(t: str) -> int:
    """'03:04:05.12' -> microseconds past midnight ('24:00:00' allowed)."""
    hms = t[:8]
    secs = _SECS_MEMO.get(hms)
    if secs is None:  # at most 86401 distinct keys: no bound needed
        secs = _SECS_MEMO[hms] = int(t[:2]) * 3600 + int(t[3:5]) * 60 + int(t[6:8])
    if len(t) > 8:  # '.f' .. '.ffffff'
        frac = t[9:15]
        return secs * 1_000_000 + int(frac) * _FRAC_SCALE[len(frac)]
    return secs * 1_000_000


def _offset_seconds(o: str) -> int:
    """'+05', '-08', '+05:30', '+05:30:15' -> signed seconds east of UTC."""
    secs = int(o[1:3]) * 3600
    if len(o) > 3:
        secs += int(o[4:6]) * 60
        if len(o) > 6:
            secs += int(o[7:9])
    return -secs if o[0] == "-" else secs


def _timestamp_micros(s: str) -> int:
    """'2024-01-02 03:04:05.12' (optionally ' BC') -> epoch microseconds."""
    if s[4:5] == "-" and s[-1:] != "C":  # AD, 4-digit year
        return _date_days(s[:10]) * _MICROS_PER_DAY + _time_micros(s[11:])
    bc = s.endswith(" BC")
    date, time = (s[:-3] if bc else s).split(" ")
    return _date_days(date + " BC" if bc else date) * _MICROS_PER_DAY + _time_micros(time)


def _split_offset(t: str) -> tuple[str, str]:
    """'03:04:05.12+05:30' -> ('03:04:05.12', '+05:30')."""
    i = t.find("+", 8)
    if i < 0:
        i = t.find("-", 8)
    return t[:i], t[i:]


# --------------------------------------------------------------------------- scalar converters


def _bool(s: str) -> bool:
    return s == "t"


def _float(s: str) -> float | str:
    """Jackson quotes non-finite doubles ("NaN", "Infinity", "-Infinity"); orjson would write null."""
    if s.endswith(("y", "N")):
        return s
    return float(s)


_MONEY_STRIP = str.maketrans("", "", "$,() ")


def _money(s: str) -> str:
    """'-$1,234.56' -> '-1234.56' (lc_monetary=C; '(…)' negatives handled for safety)."""
    t = s.translate(_MONEY_STRIP)
    return "-" + t if s[:1] == "(" else t


def _bytea_bytes(s: str) -> bytes:
    if s[:2] == "\\x":
        return bytes.fromhex(s[2:])
    # bytea_output=escape: printable ASCII, '\\\\' and '\\ooo' only
    return s.encode("ascii").decode("unicode_escape").encode("latin-1")


def _b64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _bytea(s: str) -> str:
    """Connect bytes are base64 strings in the JSON converter."""
    return _b64(_bytea_bytes(s))


def _bit1(s: str) -> bool:
    return s == "1"


def _bits(s: str) -> str:
    """'0101' -> base64 of the value's little-endian bytes, minimal length (Debezium Bits)."""
    if not s:
        return ""
    v = int(s, 2)
    return _b64(v.to_bytes((v.bit_length() + 7) >> 3, "little"))


def _date(s: str) -> int:
    days = _DAYS_MEMO.get(s)
    if days is not None:
        return days
    if s[:1].isascii() and s[:1].isdigit():
        return _date_days(s)
    if s == "infinity":
        return _DATE_POS_INF_DAYS
    if s == "-infinity":
        return _DATE_NEG_INF_DAYS
    raise ValueError(f"invalid date text: {s!r}")


def _time_millis(s: str) -> int:
    return _time_micros(s) // 1000


def _timestamp_micro(s: str) -> int:
    if s[4:5] == "-" and s[-1:] != "C":  # AD, 4-digit year: inlined for speed
        days = _DAYS_MEMO.get(s[:10])
        if days is None:
            days = _date_days(s[:10])
        secs = _SECS_MEMO.get(s[11:19])
        if secs is None:
            secs = _time_micros(s[11:19]) // 1_000_000
        if len(s) > 19:
            frac = s[20:]
            return days * _MICROS_PER_DAY + secs * 1_000_000 + int(frac) * _FRAC_SCALE[len(frac)]
        return days * _MICROS_PER_DAY + secs * 1_000_000
    if s == "infinity":
        return _TS_POS_INF_MICROS
    if s == "-infinity":
        return _TS_NEG_INF_MICROS
    return _clamp64(_timestamp_micros(s))


def _timestamp_milli(s: str) -> int:
    if s == "infinity":
        return _TS_POS_INF_MILLIS
    if s == "-infinity":
        return _TS_NEG_INF_MILLIS
    return _clamp64(_timestamp_micros(s) // 1000)


def _timestamptz(s: str) -> str:
    """'2024-01-02 03:04:05.12+00' -> '2024-01-02T03:04:05.12Z'."""
    if s[-3:] == "+00" and s[4:5] == "-":  # UTC session, AD, 4-digit year: reuse the text
        return s[:10] + "T" + s[11:-3] + "Z"
    if s == "infinity" or s == "-infinity":
        return s
    bc = s.endswith(" BC")
    date, rest = (s[:-3] if bc else s).split(" ")
    time, offset = _split_offset(rest)
    micros = _date_days(date + " BC" if bc else date) * _MICROS_PER_DAY + _time_micros(time)
    return _iso_utc(micros - _offset_seconds(offset) * 1_000_000)


def _timetz(s: str) -> str:
    """'03:04:05.12+05:30' -> '21:34:05.12Z' (shifted to UTC; '24:00:00+00' stays 24:00)."""
    if s[-3:] == "+00" and len(s) >= 11:
        return s[:-3] + "Z"
    time, offset = _split_offset(s)
    secs = int(time[:2]) * 3600 + int(time[3:5]) * 60 + int(time[6:8]) - _offset_seconds(offset)
    secs %= 86400  # only the literal '24:00:00+00' (fast path above) keeps hour 24
    hh, r = divmod(secs, 3600)
    mm, ss = divmod(r, 60)
    return f"{hh:02d}:{mm:02d}:{ss:02d}{time[8:]}Z"


def _signed_micros(sec: str) -> int:
    """'-1.25' -> -1250000."""
    neg = sec[:1] == "-"
    if neg:
        sec = sec[1:]
    dot = sec.find(".")
    if dot < 0:
        v = int(sec) * 1_000_000
    else:
        v = int(sec[:dot] or "0") * 1_000_000 + int(sec[dot + 1 : dot + 7].ljust(6, "0"))
    return -v if neg else v


_INTERVAL_MEMO: dict[str, int] = {}


def _interval(s: str) -> int:
    """ISO 8601 interval ('P1Y2M3DT4H5M6.5S', 'PT-1H', 'P-1Y-2M', 'PT0S') -> microseconds."""
    return _memoized(_INTERVAL_MEMO, _interval_parse, s)


def _interval_parse(s: str) -> int:
    if s[:1] != "P":
        if s == "infinity":
            return _INT64_MAX
        if s == "-infinity":
            return _INT64_MIN
        raise ValueError(f"invalid interval text (IntervalStyle must be iso_8601): {s!r}")
    t = s.find("T")
    part = s[1:t] if t >= 0 else s[1:]
    months = days = 0
    if part:
        i = part.find("Y")
        if i >= 0:
            months = 12 * int(part[:i])
            part = part[i + 1 :]
        i = part.find("M")
        if i >= 0:
            months += int(part[:i])
            part = part[i + 1 :]
        if part:  # 'nD'
            days = int(part[:-1])
    seconds = 0
    micros = 0
    if t >= 0:
        part = s[t + 1 :]
        i = part.find("H")
        if i >= 0:
            seconds = 3600 * int(part[:i])
            part = part[i + 1 :]
        i = part.find("M")
        if i >= 0:
            seconds += 60 * int(part[:i])
            part = part[i + 1 :]
        if part:  # 'n.nS'
            micros = _signed_micros(part[:-1])
    seconds += months * _SECONDS_PER_MONTH + days * 86400
    return _clamp64(seconds * 1_000_000 + micros)


_WKB_POINT = struct.Struct("<BIdd")


def _point(s: str) -> dict[str, Any]:
    """'(1.5,2)' -> Debezium Point struct with a little-endian WKB point."""
    xs, ys = s[1:-1].split(",")
    return {
        "x": _float(xs),
        "y": _float(ys),
        "wkb": _b64(_WKB_POINT.pack(1, 1, float(xs), float(ys))),
        "srid": None,
    }


def _quoted(s: str, i: int) -> tuple[str, int]:
    """The double-quoted, backslash-escaped string starting at ``s[i] == '"'`` (array
    elements and hstore keys/values quote alike): (text, index after the closing quote)."""
    parts: list[str] = []
    j = i + 1
    while True:
        q = s.find('"', j)
        b = s.find("\\", j, q)
        if b < 0:
            parts.append(s[j:q])
            return "".join(parts), q + 1
        parts.append(s[j:b])
        parts.append(s[b + 1])
        j = b + 2


def _hstore_token(s: str, i: int) -> tuple[str, int, bool]:
    """Read one hstore key/value at ``i``: (text, next index, was quoted)."""
    if s[i] == '"':
        text, end = _quoted(s, i)
        return text, end, True
    j = i
    n = len(s)
    while j < n and s[j] not in " ,=":
        j += 1
    return s[i:j], j, False


def _hstore_dict(s: str) -> dict[str, str | None]:
    """Parse hstore_out text ('"a"=>"1", "b"=>NULL') keeping PostgreSQL's key order."""
    out: dict[str, str | None] = {}
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == " " or c == ",":
            i += 1
            continue
        key, i, _ = _hstore_token(s, i)
        i = s.index("=>", i) + 2
        while s[i] == " ":
            i += 1
        value, i, quoted = _hstore_token(s, i)
        out[key] = None if not quoted and value.upper() == "NULL" else value
    return out


def _hstore(s: str) -> str:
    """hstore.handling.mode=json: the map as a compact JSON object string."""
    if not s:
        return "{}"
    return json.dumps(_hstore_dict(s), ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------- arrays


def _parse_array(s: str, delim: str) -> list[Any]:
    """array_out text -> nested lists of element text (None for NULL)."""
    if s[:1] == "[":  # explicit bounds '[0:1]={1,2}': bounds are not part of the value
        s = s[s.index("=") + 1 :]
    if '"' not in s and s.find("{", 1) < 0:  # flat and unquoted: split
        inner = s[1:-1]
        if not inner:
            return []
        return [None if e == "NULL" else e for e in inner.split(delim)]
    root: list[Any] = []
    stack: list[list[Any]] = []
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "{":
            new: list[Any] = []
            if stack:
                stack[-1].append(new)
            else:
                root = new
            stack.append(new)
            i += 1
        elif c == "}":
            stack.pop()
            i += 1
        elif c == delim:
            i += 1
        elif c == '"':
            text, i = _quoted(s, i)
            stack[-1].append(text)
        else:
            j = s.find("}", i)
            d = s.find(delim, i, j)
            if d >= 0:
                j = d
            tok = s[i:j]
            stack[-1].append(None if tok == "NULL" else tok)
            i = j
    return root


def _map_nested(items: list[Any], conv: Converter) -> list[Any]:
    return [
        None if e is None else (_map_nested(e, conv) if type(e) is list else conv(e)) for e in items
    ]


def _array_converter(element: PgType, typmod: int) -> Converter:
    elem_conv = converter(element, typmod)
    root = element
    while root.base is not None:
        root = root.base
    delim = ";" if root.oid == 603 else ","  # box is the only builtin with typdelim ';'

    if elem_conv is PASSTHROUGH:

        def convert_text_array(s: str) -> list[Any]:
            return _parse_array(s, delim)

        return convert_text_array

    def convert_array(s: str) -> list[Any]:
        items = _parse_array(s, delim)
        if items and type(items[0]) is list:
            return _map_nested(items, elem_conv)
        return [None if e is None else elem_conv(e) for e in items]

    return convert_array


# --------------------------------------------------------------------------- dispatch


def _precision(typmod: int) -> int:
    """Fractional-second precision of time/timestamp types (typmod -1 means 6)."""
    return 6 if typmod < 0 else typmod


def _is_builtin(t: PgType) -> bool:
    return BUILTIN_TYPES.get(t.oid) is not None


_SIMPLE: dict[str, Converter] = {
    "bool": _bool,
    "int2": int,
    "int4": int,
    "int8": int,
    "oid": int,
    "float4": _float,
    "float8": _float,
    "money": _money,
    "bytea": _bytea,
    "date": _date,
    "timestamptz": _timestamptz,
    "timetz": _timetz,
    "interval": _interval,
    "point": _point,
}


#: Converters whose JSON the C encoder (cdc/_speedups.c) writes straight from the text,
#: by its KIND_* numbers (1 integer, 2 string, 3 boolean, 4 timestamptz); it calls every
#: other converter, and these ones too for any text outside their common form.
NATIVE_KINDS: dict[Converter, int] = {int: 1, PASSTHROUGH: 2, _bool: 3, _timestamptz: 4}


def converter(pgtype: PgType, typmod: int) -> Converter:
    """Return a fast closure: PostgreSQL text of one non-NULL value -> JSON-ready value.

    ``typmod`` is the column's atttypmod (pgoutput Relation message), -1 if none; for
    arrays it applies to the elements, for domains the domain's own typmod wins.
    """
    kind = pgtype.kind
    if kind == "d" and pgtype.base is not None:
        return converter(pgtype.base, pgtype.base_typmod if pgtype.base_typmod >= 0 else typmod)
    if pgtype.element is not None:
        return _array_converter(pgtype.element, typmod)
    if kind != "b":  # enum, range, multirange, composite, pseudo
        return PASSTHROUGH
    name = pgtype.name
    if _is_builtin(pgtype):
        simple = _SIMPLE.get(name)
        if simple is not None:
            return simple
        if name == "time":
            return _time_millis if _precision(typmod) <= 3 else _time_micros
        if name == "timestamp":
            return _timestamp_milli if _precision(typmod) <= 3 else _timestamp_micro
        if name == "bit" or name == "varbit":
            return _bit1 if typmod == 1 else _bits
        return PASSTHROUGH
    if name == "hstore":
        return _hstore
    return PASSTHROUGH


# --------------------------------------------------------------------------- schemas

_Schema = tuple[str, str | None, dict[str, str] | None]  # (type, name, parameters)

_STRING: _Schema = ("string", None, None)

_SIMPLE_SCHEMAS: dict[str, _Schema] = {
    "bool": ("boolean", None, None),
    "int2": ("int16", None, None),
    "int4": ("int32", None, None),
    "int8": ("int64", None, None),
    "oid": ("int64", None, None),
    "float4": ("float", None, None),
    "float8": ("double", None, None),
    "bytea": ("bytes", None, None),
    "uuid": ("string", "io.debezium.data.Uuid", None),
    "json": ("string", "io.debezium.data.Json", None),
    "jsonb": ("string", "io.debezium.data.Json", None),
    "xml": ("string", "io.debezium.data.Xml", None),
    "tsvector": ("string", "io.debezium.data.Tsvector", None),  # Debezium >= 3.3
    "date": ("int32", "io.debezium.time.Date", None),
    "timestamptz": ("string", "io.debezium.time.ZonedTimestamp", None),
    "timetz": ("string", "io.debezium.time.ZonedTime", None),
    "interval": ("int64", "io.debezium.time.MicroDuration", None),
}

_POINT_FIELDS: list[dict[str, Any]] = [
    {"type": "double", "optional": False, "field": "x"},
    {"type": "double", "optional": False, "field": "y"},
    {"type": "bytes", "optional": True, "field": "wkb"},
    {"type": "int32", "optional": True, "field": "srid"},
]


def _schema(pgtype: PgType, typmod: int, optional: bool) -> dict[str, Any]:
    """Connect JSON schema in JsonConverter's key order (type, items/fields, optional,
    name, version, doc, parameters); the caller appends ``field``."""
    if pgtype.kind == "d" and pgtype.base is not None:
        return _schema(
            pgtype.base, pgtype.base_typmod if pgtype.base_typmod >= 0 else typmod, optional
        )
    if pgtype.element is not None:
        return {
            "type": "array",
            "items": _schema(pgtype.element, typmod, True),
            "optional": optional,
        }
    if pgtype.kind == "e":
        return {
            "type": "string",
            "optional": optional,
            "name": "io.debezium.data.Enum",
            "version": 1,
            "parameters": {"allowed": ",".join(pgtype.labels)},
        }
    spec = _STRING
    name = pgtype.name
    if pgtype.kind == "b":
        if _is_builtin(pgtype):
            found = _SIMPLE_SCHEMAS.get(name)
            if found is not None:
                spec = found
            elif name == "time":
                spec = (
                    ("int32", "io.debezium.time.Time", None)
                    if _precision(typmod) <= 3
                    else ("int64", "io.debezium.time.MicroTime", None)
                )
            elif name == "timestamp":
                spec = (
                    ("int64", "io.debezium.time.Timestamp", None)
                    if _precision(typmod) <= 3
                    else ("int64", "io.debezium.time.MicroTimestamp", None)
                )
            elif name == "bit" or name == "varbit":
                if typmod == 1:
                    spec = ("boolean", None, None)
                else:
                    length = str(typmod if typmod > 0 else 2147483647)
                    spec = ("bytes", "io.debezium.data.Bits", {"length": length})
            elif name == "point":
                return {
                    "type": "struct",
                    "fields": [dict(f) for f in _POINT_FIELDS],
                    "optional": optional,
                    "name": "io.debezium.data.geometry.Point",
                    "version": 1,
                    "doc": "Geometry (POINT)",
                }
        elif name == "hstore":
            spec = ("string", "io.debezium.data.Json", None)
        elif name == "ltree":
            spec = ("string", "io.debezium.data.Ltree", None)
    ctype, sname, params = spec
    out: dict[str, Any] = {"type": ctype, "optional": optional}
    if sname is not None:
        out["name"] = sname
        out["version"] = 1
    if params is not None:
        out["parameters"] = dict(params)
    return out


#: `field_schema`'s `default` when the column's schema declares none (None is a valid default)
NO_DEFAULT: Any = object()


def field_schema(
    pgtype: PgType, typmod: int, field: str, optional: bool, default: Any = NO_DEFAULT, dimensions: int = 1
) -> dict[str, Any]:
    """Kafka Connect JSON schema of one column, as Debezium's JsonConverter writes it
    when schemas are enabled (key order included, so the bytes match). `default` is the
    JSON value of the column default (``cdc.events.defaults``), omitted when not given;
    `dimensions` is the declared depth of an array column (pg_attribute.attndims)."""
    out = _schema(pgtype, typmod, optional)
    if out["type"] == "array":
        for _ in range(dimensions - 1):  # int[][]: an array of arrays, as the values are nested
            out["items"] = {"type": "array", "items": out["items"], "optional": True}
    if default is not NO_DEFAULT:
        out["default"] = default
    out["field"] = field
    return out
