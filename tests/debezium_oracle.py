"""The Debezium oracle's workload and its comparison, kept apart from the test functions.

One PostgreSQL database, four pipelines reading it: cdc and the real Debezium connector,
each with JsonConverter schemas on and off. `Workload` writes the fixture tables (a
snapshot part, then a streaming part), `collect` reads every pipeline's topics, and
`compare` pairs events per table, key and order and lists every place where the two
differ, down to one column of one event. `DOCUMENTED` names each difference docs/events.md
documents, with the rule that recognises it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic

# -- the fixture tables -----------------------------------------------------------------

SCHEMA_SQL = r'''
CREATE EXTENSION IF NOT EXISTS hstore;
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS int CHECK (VALUE > 0);
CREATE TYPE pair AS (a int, b text);
CREATE TABLE public.wide (
  id serial PRIMARY KEY,
  i2 int2 NOT NULL DEFAULT 7, i4 int4 DEFAULT 42, i8 int8 NOT NULL DEFAULT -5, o oid,
  f4 float4 DEFAULT 1.5, f8 float8 DEFAULT 'NaN', n numeric(10,3) DEFAULT 1.25, nn numeric,
  b bool NOT NULL DEFAULT true, t text DEFAULT 'dflt', vc varchar(10) DEFAULT 'x''y',
  bp char(3) DEFAULT 'ab', nm name, ch "char",
  u uuid DEFAULT gen_random_uuid(), u2 uuid DEFAULT 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11',
  j json DEFAULT '{"a":1}', jb jsonb DEFAULT '{"b":2}', x xml,
  ba bytea DEFAULT '\x0102', d date DEFAULT '2024-01-02', d2 date DEFAULT now(),
  tm time DEFAULT '01:02:03', tm3 time(3), ts timestamp DEFAULT '2024-01-02 03:04:05.123456',
  ts3 timestamp(3) DEFAULT '2020-01-01 00:00:00.5', tstz timestamptz DEFAULT '2024-01-02 03:04:05+00',
  tstz0 timestamptz(0) DEFAULT now(), ttz timetz DEFAULT '01:02:03+02',
  iv interval DEFAULT '1 day', m money DEFAULT 12.5, e mood DEFAULT 'ok', h hstore,
  bi bit(1) DEFAULT B'1', bits bit(8) DEFAULT B'10101010', vb varbit DEFAULT B'101',
  p point, inet_ inet DEFAULT '10.0.0.1', cidr_ cidr, mac macaddr, r int4range, tsv tsvector,
  tsq tsquery, lsn pg_lsn, bx box, cmp pair, dom posint DEFAULT 3,
  ia int[] DEFAULT '{1,2}', ta text[], ia2 int[][], na numeric[], tza timestamptz[], ua uuid[],
  ma money[], ba_ bytea[], bita bit(3)[]
);
CREATE TABLE public.comp (a int, b text, v int NOT NULL, PRIMARY KEY (b, a));
CREATE TABLE public.toasty (id int PRIMARY KEY, small int, big text, bigarr text[], hs hstore, bb bytea);
CREATE TABLE public.toasty_full (id int PRIMARY KEY, small int, big text, bigarr text[], hs hstore, bb bytea);
ALTER TABLE public.toasty_full REPLICA IDENTITY FULL;
CREATE TABLE public.evolve (id int PRIMARY KEY, a int, note text NOT NULL DEFAULT 'n');
CREATE SCHEMA "Odd S";
CREATE TABLE "Odd S"."T-1 x" ("Id" int PRIMARY KEY, "Col ""Q""" text, "ÄÖ" int);
CREATE TABLE public.marker (id int PRIMARY KEY);
'''

#: (values SQL for public.wide without id): defaults, extremes, nulls everywhere possible
WIDE_ROWS = [
    "DEFAULT VALUES",
    r"""(i2, i4, i8, o, f4, f8, n, nn, b, t, vc, bp, nm, ch, x, ba, d, tm, tm3, ts, ts3, tstz, ttz,
        iv, m, e, h, bi, bits, vb, p, inet_, cidr_, mac, r, tsv, tsq, lsn, bx, cmp, dom,
        ia, ta, ia2, na, tza, ua, ma, ba_, bita)
       VALUES (-32768, 2147483647, -9223372036854775808, 4294967295, 'Infinity', '-Infinity',
        -1234567.891, 'NaN', false, E'tab\there "q" \\ \u00e9', 'ünï', 'a', 'nm', 'c', '<a>1</a>',
        '\x00ff', 'infinity', '24:00:00', '23:59:59.999', '-infinity', '294276-12-31 23:59:59.999',
        'infinity', '24:00:00+00', '100000 years 1 month 0.000001 sec', -92233720368547758.08,
        'happy', '"k 2"=>"v", a=>NULL, zz=>"c"', B'0', B'00000001', B'1', '(1.5,-2)', '::1',
        '10.0.0.0/8', '08:00:2b:01:02:03', '[1,5)', 'a:1 b:2', 'a & !b', '16/B374D848',
        '(1,2),(3,4)', '(1,"x y")', 2147483647,
        '{1,NULL,3}', '{"a b",NULL,"","NULL","q\"x"}', '{{1,2},{3,4}}', '{1.50,NaN,NULL}',
        '{"2024-01-02 03:04:05.5+00",infinity}', '{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}',
        '{1.5}', '{"\\x01"}', '{101,NULL}')""",
    r"""(i2, i4, i8, f4, f8, n, b, t, d, ts, tstz, tm, iv, ia, ta, h, m)
       VALUES (0, NULL, 0, 'NaN', 1e300, 0.00000001, true, NULL, '0044-03-15 BC',
        '1900-01-01 00:00:00.000001', '0010-01-01 00:00:00.123+00', '00:00:00', '-1 mons -2 days 00:00:00.5',
        '{}', '{}', '', '0.00')""",
]

BIG = "(SELECT string_agg(md5(i::text || 'x'), '') FROM generate_series(1, 300) AS i)"

TOAST_ROWS = f"""
INSERT INTO public.{{t}} VALUES
  (1, 1, {BIG}, ARRAY[{BIG}, NULL], hstore('k', {BIG}), convert_to({BIG}, 'UTF8')),
  (2, 2, 'short', '{{{{a,b}}}}', 'k=>v', '\\x01')
"""

SNAPSHOT_SQL = [
    *(f"INSERT INTO public.wide {r}" for r in WIDE_ROWS),
    "INSERT INTO public.comp VALUES (1, 'x', 1), (2, 'y', 2)",
    TOAST_ROWS.format(t="toasty"),
    TOAST_ROWS.format(t="toasty_full"),
    "INSERT INTO public.evolve VALUES (1, 1, 'a')",
    """INSERT INTO "Odd S"."T-1 x" VALUES (1, 'q', 2)""",
]

STREAM_SQL = [
    *(f"INSERT INTO public.wide {r}" for r in WIDE_ROWS),
    "UPDATE public.wide SET t = 'changed', i4 = NULL WHERE id = 4",
    "DELETE FROM public.wide WHERE id = 5",
    "INSERT INTO public.comp VALUES (3, 'z', 3)",
    "UPDATE public.comp SET v = 30 WHERE a = 3",
    "UPDATE public.comp SET a = 4 WHERE a = 3",  # a key change
    "DELETE FROM public.comp WHERE a = 1",
    TOAST_ROWS.format(t="toasty").replace("  (1, 1,", "  (11, 1,").replace("  (2, 2,", "  (12, 2,"),
    TOAST_ROWS.format(t="toasty_full").replace("  (1, 1,", "  (11, 1,").replace("  (2, 2,", "  (12, 2,"),
    "UPDATE public.toasty SET small = small + 100",  # big, bigarr, hs, bb unchanged: TOAST
    "UPDATE public.toasty_full SET small = small + 100",
    # a fast default (attmissingval): the old tuple in the WAL has no such attribute
    "ALTER TABLE public.toasty_full ADD COLUMN extra int DEFAULT 9",
    "UPDATE public.toasty_full SET small = 0 WHERE id = 2",
    "DELETE FROM public.toasty WHERE id = 12",
    "DELETE FROM public.toasty_full WHERE id = 12",
    "INSERT INTO public.evolve VALUES (2, 2, 'b')",
    "ALTER TABLE public.evolve ADD COLUMN added int DEFAULT 5, ALTER COLUMN a SET NOT NULL, "
    "ALTER COLUMN note DROP NOT NULL",
    "UPDATE public.evolve SET a = 10 WHERE id = 1",  # a row from before the ADD COLUMN
    "INSERT INTO public.evolve (id, a) VALUES (3, 3)",
    """UPDATE "Odd S"."T-1 x" SET "ÄÖ" = 3""",
    """INSERT INTO "Odd S"."T-1 x" VALUES (2, NULL, NULL)""",
    "TRUNCATE public.comp",
    "INSERT INTO public.marker VALUES (1)",
]

TABLES = ["public.wide", "public.comp", "public.toasty", "public.toasty_full", "public.evolve",
          '"Odd S"."T-1 x"', "public.marker"]
DEBEZIUM_TABLES = [r"public\.(wide|comp|toasty|toasty_full|evolve|marker)", r"Odd S\.T-1 x"]


# -- reading the pipelines ----------------------------------------------------------------

@dataclass
class Event:
    """One record of a pipeline, its key and value parsed (schema and payload apart)."""

    topic: str
    key: Any  # the key's payload (None for Debezium's truncates)
    key_schema: Any
    value: dict[str, Any] | None  # the envelope payload; None for a tombstone
    schema: dict[str, Any] | None


@dataclass
class Pipeline:
    name: str  # "cdc" or "debezium"
    prefix: str
    schemas: bool
    events: dict[str, list[Event]] = field(default_factory=dict)  # "schema.table" -> events in topic order

    def read(self, servers: str, topics: list[str]) -> None:
        by_table: dict[str, list[Event]] = {}
        for topic in topics:
            events = []
            for rec in read_topic(TopicConfig(bootstrap_servers=servers), topic, idle_timeout_s=30):
                key = None if rec.key is None else orjson.loads(rec.key)
                key_schema = None
                if self.schemas and isinstance(key, dict) and set(key) == {"schema", "payload"}:
                    key_schema, key = key["schema"], key["payload"]
                value = schema = None
                if rec.value is not None:
                    value = orjson.loads(rec.value)
                    if self.schemas:
                        schema, value = value["schema"], value["payload"]
                events.append(Event(topic, key, key_schema, value, schema))
            names = {f"{e.value['source']['schema']}.{e.value['source']['table']}" for e in events if e.value}
            for name in names or {topic}:
                by_table[name] = events
        self.events = by_table

    def count(self) -> int:
        return sum(len(v) for v in self.events.values())


# -- differences ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Difference:
    phase: str  # "snapshot" or "stream"
    table: str
    where: str  # "after.col", "before.col", "source.x", "schema.after.col", "key", "op", ...
    ours: Any
    theirs: Any
    column_type: str = ""  # the column's PostgreSQL type (format_type), when a column


MISSING = "<absent>"


def _prefixless(value: Any, prefix: str) -> Any:
    """Schema names carry the topic prefix: compare them without it."""
    if isinstance(value, dict):
        return {k: _prefixless(v, prefix) for k, v in value.items()}
    if isinstance(value, list):
        return [_prefixless(v, prefix) for v in value]
    if isinstance(value, str) and value.startswith(prefix + "."):
        return "<prefix>" + value[len(prefix):]
    return value


def _row_diffs(out: list[Difference], base: Difference, ours: Any, theirs: Any, types: dict[str, str]) -> None:
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        if ours != theirs:
            out.append(base)
        return
    for col in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(col, MISSING), theirs.get(col, MISSING)
        if not _same(a, b):
            out.append(Difference(base.phase, base.table, f"{base.where}.{col}", a, b, types.get(col, "")))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b) if not isinstance(a, (int, float)) or isinstance(a, bool) else a == b


def compare(
    ours: Pipeline, theirs: Pipeline, phase_of: Callable[[Event], str], types: dict[str, dict[str, str]]
) -> list[Difference]:
    """Every difference between two pipelines' events, paired per table, key and order."""
    out: list[Difference] = []
    for table in sorted(set(ours.events) | set(theirs.events)):
        column_types = types.get(table, {})
        mine, other = ours.events.get(table, []), theirs.events.get(table, [])
        if not mine or not other:
            out.append(Difference("stream", table, "topic", len(mine), len(other)))
            continue
        for (_key, op, _n), (a, b) in _pairs(mine, other).items():
            phase = phase_of(a or b)  # type: ignore[arg-type]
            if a is None or b is None:
                out.append(Difference(phase, table, f"event {op}", _brief(a), _brief(b)))
                continue
            if a.key != b.key:
                out.append(Difference(phase, table, "key", a.key, b.key))
            elif a.key is not None and isinstance(a.key, dict) and list(a.key) != list(b.key):
                out.append(Difference(phase, table, "key order", list(a.key), list(b.key)))
            if a.value is None or b.value is None:
                continue
            for part in ("before", "after"):
                _row_diffs(out, Difference(phase, table, part, a.value[part], b.value[part]),
                           a.value[part], b.value[part], column_types)
            sa, sb = a.value["source"], b.value["source"]
            if list(sa) != list(sb):
                out.append(Difference(phase, table, "source order", list(sa), list(sb)))
            for name in ("version", "connector", "db", "schema", "table", "snapshot", "sequence", "ts_ms",
                         "ts_us", "ts_ns", "txId", "lsn", "xmin"):
                if sa.get(name) != sb.get(name):
                    out.append(Difference(phase, table, f"source.{name}", sa.get(name), sb.get(name)))
            if list(a.value) != list(b.value):
                out.append(Difference(phase, table, "envelope order", list(a.value), list(b.value)))
            if ours.schemas and theirs.schemas:
                _schema_diffs(out, phase, table, a, b, ours.prefix, theirs.prefix, column_types)
    return out


def _schema_diffs(
    out: list[Difference], phase: str, table: str, a: Event, b: Event, pa: str, pb: str, types: dict[str, str]
) -> None:
    sa, sb = _prefixless(a.schema, pa), _prefixless(b.schema, pb)
    assert sa is not None and sb is not None
    fa = {f["field"]: f for f in sa["fields"]}
    fb = {f["field"]: f for f in sb["fields"]}
    for part in ("before", "after"):
        cols_a = {f["field"]: f for f in fa[part]["fields"]}
        cols_b = {f["field"]: f for f in fb[part]["fields"]}
        for col in dict.fromkeys([*cols_a, *cols_b]):
            x, y = cols_a.get(col, MISSING), cols_b.get(col, MISSING)
            if x != y:
                out.append(Difference(phase, table, f"schema.{part}.{col}", x, y, types.get(col, "")))
        rest_a = {k: v for k, v in fa[part].items() if k != "fields"}
        rest_b = {k: v for k, v in fb[part].items() if k != "fields"}
        if rest_a != rest_b:
            out.append(Difference(phase, table, f"schema.{part}", rest_a, rest_b))
    for name in fa.keys() | fb.keys():
        if name not in ("before", "after") and fa.get(name) != fb.get(name):
            out.append(Difference(phase, table, f"schema.{name}", fa.get(name), fb.get(name)))
    if {k: v for k, v in sa.items() if k != "fields"} != {k: v for k, v in sb.items() if k != "fields"}:
        out.append(Difference(phase, table, "schema", "envelope", "envelope"))
    if b.key_schema is not None or a.key_schema is not None:
        out.append(Difference(phase, table, "key schema", a.key_schema, _prefixless(b.key_schema, pb)))


def _brief(e: Event | None) -> Any:
    if e is None:
        return None
    return {"key": e.key, "op": None if e.value is None else e.value["op"]}


def _pairs(mine: list[Event], other: list[Event]) -> dict[tuple, tuple[Event | None, Event | None]]:
    """Events matched by (key, op or tombstone, n-th such event of that key). Truncates pair
    with truncates whatever their key (cdc's reserved key, Debezium's null)."""
    def index(events: list[Event]) -> dict[tuple, Event]:
        seen: dict[tuple, int] = defaultdict(int)
        out = {}
        for e in events:
            op = "tombstone" if e.value is None else e.value["op"]
            key = "truncate" if op == "t" else orjson.dumps(e.key, option=orjson.OPT_SORT_KEYS)
            seen[(key, op)] += 1
            out[(key, op, seen[(key, op)])] = e
        return out

    a, b = index(mine), index(other)
    return {k: (a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b])}


# -- the documented differences (docs/events.md, "Debezium 3.x differs") ---------------

def _numeric(d: Difference) -> bool:
    if not d.column_type.startswith("numeric") or not d.where.startswith(("after.", "before.")):
        return False
    a, b = d.ours, d.theirs
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_numeric_text(x, y) for x, y in zip(a, b, strict=True))
    return _numeric_text(a, b)


def _numeric_text(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if a == "NaN" and b == "NAN":
        return True
    try:
        return isinstance(a, str) and isinstance(b, str) and Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def _zoned_padding(d: Difference) -> bool:
    if not d.column_type.startswith("timestamp") or "with time zone" not in d.column_type:
        return False
    a, b = d.ours, d.theirs
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_instant(x, y) for x, y in zip(a, b, strict=True))
    return _same_instant(a, b)


def _same_instant(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str)) or not a.endswith("Z") or not b.endswith("Z"):
        return False
    whole_a, _, frac_a = a[:-1].partition(".")
    whole_b, _, frac_b = b[:-1].partition(".")
    return whole_a == whole_b and frac_a.ljust(9, "0") == frac_b.ljust(9, "0")


def _interval(d: Difference) -> bool:
    """Debezium computes a MicroDuration in double: beyond 2^53 µs it is off by some µs."""
    return (d.column_type == "interval" and isinstance(d.ours, int) and isinstance(d.theirs, int)
            and abs(d.ours) > 2**53 and abs(d.ours - d.theirs) < 1_000_000)


def _hstore(d: Difference) -> bool:
    return (d.column_type == "hstore" and isinstance(d.ours, str) and isinstance(d.theirs, str)
            and d.ours != d.theirs and orjson.loads(d.ours) == orjson.loads(d.theirs))


UNMAPPED = ("tsquery", "pg_lsn", "box", "pair", "int4range[]")
LEFT_OUT_ARRAYS = ("money[]", "name[]", "interval[]", "bit varying[]", "xml[]", "point[]")


def _unmapped(d: Difference) -> bool:
    return (d.theirs == MISSING and d.where.startswith(("after.", "before.", "schema.after.", "schema.before."))
            and d.column_type in UNMAPPED)


def _arrays_left_out(d: Difference) -> bool:
    return (d.theirs == MISSING and d.where.startswith(("after.", "before.", "schema.after.", "schema.before."))
            and (d.column_type in LEFT_OUT_ARRAYS or d.column_type.startswith("bit(")) and d.column_type.endswith("[]"))


def _sequence(d: Difference) -> bool:
    """Position: cdc puts the transaction's own commit LSN first, Debezium the previous one
    (null in its snapshot); the change LSN (second) must agree when streaming."""
    if d.where != "source.sequence":
        return False
    a, b = orjson.loads(d.ours), orjson.loads(d.theirs)
    return d.phase == "snapshot" or a[1] == b[1]


def _truncate_key(d: Difference) -> bool:
    return d.where == "key" and d.ours == "__truncate__" and d.theirs is None


def _null_is_default(d: Difference) -> bool:
    """JsonConverter's replace.null.with.default (on by default): a NULL in a column with a
    default becomes the default in Debezium's events (also in a delete's before image)."""
    return d.where.startswith(("after.", "before.")) and d.ours is None and d.theirs is not None \
        and d.theirs != MISSING


def _multidim(d: Difference) -> bool:
    """Debezium renders each element of a multi-dimensional array as null."""
    return (isinstance(d.ours, list) and isinstance(d.theirs, list) and len(d.ours) == len(d.theirs)
            and any(isinstance(x, list) for x in d.ours) and all(y is None for y in d.theirs))


def _multidim_schema(d: Difference) -> bool:
    if not d.where.startswith("schema.") or not isinstance(d.ours, dict) or not isinstance(d.theirs, dict):
        return False
    items = d.ours.get("items", {})
    return items.get("type") == "array" and {**d.ours, "items": items.get("items")} == d.theirs


def _snapshot_source(d: Difference) -> bool:
    """Snapshot reads: Debezium marks the first row "first", carries the snapshot
    transaction's id and LSN and the time of the read; cdc's reads are at position (C, 0)
    with no transaction, stamped with the snapshot's start."""
    return d.phase == "snapshot" and d.where in (
        "source.snapshot", "source.txId", "source.lsn", "source.ts_ms", "source.ts_us", "source.ts_ns")


def _version(d: Difference) -> bool:
    return d.where == "source.version" and str(d.ours).startswith("cdc-") and str(d.theirs).endswith(".Final")


def _jdbc_snapshot(d: Difference) -> bool:
    """Debezium's snapshot reads values over JDBC, its stream from pgoutput's text, and the two
    disagree: date 'infinity' (-622191234 vs -2147472692), dates and timestamptz before the
    Gregorian reform (java.sql's Julian calendar: 0044-03-15 BC is -703383, not -735160) and
    money through a double ("12.5" for 12.50, "-9.223372036854776E16")."""
    if d.phase != "snapshot" or not d.where.startswith(("after.", "before.")):
        return False
    if d.column_type == "date" and isinstance(d.ours, int) and isinstance(d.theirs, int):
        return d.ours in (-2147472692, -2147472691) or d.ours < _GREGORIAN_REFORM_DAYS
    if d.column_type.startswith("timestamp") and isinstance(d.ours, str) and isinstance(d.theirs, str):
        return d.ours[:4] < "1582" and d.theirs[:4] < "1583"
    return d.column_type == "money" and float(d.ours) == float(d.theirs)


_GREGORIAN_REFORM_DAYS = -141427  # 1582-10-15


def _timetz_end_of_day(d: Difference) -> bool:
    """timetz '24:00:00+00': Debezium 3.3.1 sends "00:00:00Z", cdc keeps "24:00:00Z"."""
    return d.column_type.startswith("time with") and d.ours == "24:00:00Z" and d.theirs == "00:00:00Z"


def _name_streamed_null(d: Difference) -> bool:
    """A `name` column is null in Debezium's streamed events (its snapshot has the value)."""
    return d.phase == "stream" and d.column_type == "name" and d.theirs is None and isinstance(d.ours, str)


def _non_ascii_column(d: Difference) -> bool:
    """Debezium's pgoutput decoder reads a column name's UTF-8 bytes as one char each (its
    snapshot has the right name): in streamed events ÄÖ arrives as another field name."""
    if d.phase != "stream":
        return False
    column = d.where.rsplit(".", 1)[-1]
    if d.theirs == MISSING:
        return not column.isascii()
    if d.ours == MISSING:
        return any(0xFF00 <= ord(c) <= 0xFFFF for c in column)
    return False


def _bit_arrays(d: Difference) -> bool:
    """bit(n)[]: Debezium declares the element's schema, not an array, and sends null."""
    if not d.column_type.startswith("bit(") or not d.column_type.endswith("[]"):
        return False
    if d.where.startswith("schema."):
        return isinstance(d.ours, dict) and d.ours.get("type") == "array" and d.theirs == {
            **d.ours["items"], "optional": d.ours["optional"], "field": d.ours["field"]}
    return isinstance(d.ours, list) and d.theirs is None


def _numeric_array_nan(d: Difference) -> bool:
    """numeric[] holding NaN: Debezium sends null for the whole array."""
    return d.column_type.startswith("numeric") and d.column_type.endswith("[]") and d.theirs is None \
        and isinstance(d.ours, list) and "NaN" in d.ours


def _truncate_cleanup(d: Difference) -> bool:
    """cdc's daemon follows a truncate with a tombstone per key it removed; Debezium does not."""
    return d.phase == "stream" and d.where == "event tombstone" and d.theirs is None \
        and isinstance(d.ours, dict) and d.ours.get("op") is None


def _key_schema(d: Difference) -> bool:
    return d.where == "key schema" and d.ours is None and d.theirs is not None


#: name -> (the words of docs/events.md, recogniser). Every observed difference must match one; every one
#: listed here must be observed at least once.
DOCUMENTED: dict[str, tuple[str, Callable[[Difference], bool]]] = {
    "numeric text": ("numeric: Debezium prints BigDecimal.toString(), NAN", _numeric),
    "timestamptz padding": ("Debezium pads the fraction to the column's precision", _zoned_padding),
    "interval rounding": ("Debezium computes intervals in double", _interval),
    "hstore key order": ("hstore JSON: Debezium's HashMap order", _hstore),
    "unmapped types": ("Debezium leaves out columns of types it does not map", _unmapped),
    "arrays left out": ("Debezium leaves out money[], name[], ..., bit(n)[] columns", _arrays_left_out),
    "sequence": ("source.sequence: own commit LSN first (Debezium: the previous one)", _sequence),
    "truncate key": ("truncates: Debezium sends a null key", _truncate_key),
    "source version": ("source.version names the producer", _version),
    "null replaced with default": ("JsonConverter's replace.null.with.default", _null_is_default),
    "multi-dimensional arrays": ("Debezium sends null elements for int[][] values", _multidim),
    "multi-dimensional array schema": ("cdc declares attndims levels of arrays", _multidim_schema),
    "snapshot source": ("snapshot reads: first/true marks, txId and lsn of the snapshot", _snapshot_source),
    "snapshot over JDBC": ("Debezium's snapshot values from JDBC differ from its stream's", _jdbc_snapshot),
    "key schema": ("keys never carry a schema in cdc", _key_schema),
    "timetz end of day": ("timetz 24:00:00+00: Debezium sends 00:00:00Z", _timetz_end_of_day),
    "name columns streamed as null": ("Debezium streams null for name columns", _name_streamed_null),
    "non-ASCII column names in the stream": ("Debezium's decoder mangles them", _non_ascii_column),
    "bit arrays": ("bit(n)[]: non-array schema, null value in Debezium", _bit_arrays),
    "numeric arrays with NaN": ("numeric[] with NaN: null in Debezium", _numeric_array_nan),
    "tombstones after a truncate": ("cdc's truncate clean-up; Debezium sends the truncate alone", _truncate_cleanup),
}


def explain(d: Difference) -> str | None:
    for name, (_, rule) in DOCUMENTED.items():
        try:
            if rule(d):
                return name
        except (ValueError, TypeError, KeyError, IndexError):  # not this rule's shape of value
            continue
    return None
