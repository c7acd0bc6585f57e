"""Column defaults in field schemas: the values the real Debezium 3.3.1 connector declared for
the same default expressions (tests/test_debezium_oracle.py compares them live)."""

from __future__ import annotations

import pytest

from cdc.events.defaults import default_value
from cdc.events.types import NO_DEFAULT, field_schema
from cdc.source.pgtypes import BUILTIN_TYPES, PgType

MOOD = PgType(50001, "mood", "e", labels=("sad", "ok", "happy"))
POSINT = PgType(50002, "posint", "d", base=BUILTIN_TYPES[23])


@pytest.mark.parametrize(
    ("oid", "typmod", "expr", "expected"),
    [
        (23, -1, "nextval('wide_id_seq'::regclass)", 0),  # serial keys: Debezium's placeholder
        (21, -1, "7", 7),
        (23, -1, "42", 42),
        (20, -1, "'-5'::integer", -5),
        (23, -1, "(1 + 1)", NO_DEFAULT),  # an expression: not evaluated
        (700, -1, "1.5", 1.5),
        (701, -1, "'NaN'::double precision", "NaN"),
        (1700, (10 << 16 | 3) + 4, "1.25", "1.250"),  # scaled to the column
        (1700, -1, "'NaN'::numeric", NO_DEFAULT),
        (16, -1, "true", True),
        (25, -1, "'dflt'::text", "dflt"),
        (1043, 14, "'x''y'::character varying", "x"),  # Debezium stops at the doubled quote
        (1042, 7, "'ab'::bpchar", "ab"),
        (25, -1, "now()::text", ""),
        (2950, -1, "gen_random_uuid()", "00000000-0000-0000-0000-000000000000"),
        (2950, -1, "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'::uuid", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        (114, -1, "'{\"a\":1}'::json", '{"a":1}'),
        (3802, -1, "'{\"b\": 2}'::jsonb", '{"b": 2}'),
        (17, -1, "'\\x0102'::bytea", NO_DEFAULT),
        (1082, -1, "'2024-01-02'::date", 19724),
        (1082, -1, "now()", 0),
        (1083, -1, "'01:02:03'::time without time zone", 3_723_000_000),
        (1114, -1, "'2024-01-02 03:04:05.123456'::timestamp without time zone", 1_704_164_645_123_456),
        (1114, 3, "'2020-01-01 00:00:00.5'::timestamp without time zone", 1_577_836_800_500),
        (1184, -1, "'2024-01-02 03:04:05+00'::timestamp with time zone", "2024-01-02T03:04:05.000000Z"),
        (1184, 0, "now()", "1970-01-01T00:00:00Z"),
        (1266, -1, "'01:02:03+02'::time with time zone", NO_DEFAULT),
        (1186, -1, "'P1D'::interval", 86_400_000_000),
        (790, -1, "12.5", NO_DEFAULT),
        (1560, 1, "'1'::\"bit\"", True),
        (1560, 8, "'10101010'::\"bit\"", "qg=="),
        (1562, -1, "'101'::\"bit\"", "BQ=="),
        (869, -1, "'10.0.0.1'::inet", NO_DEFAULT),
        (1007, -1, "'{1,2}'::integer[]", NO_DEFAULT),
        (23, -1, "NULL::integer", NO_DEFAULT),
        (23, -1, None, NO_DEFAULT),
    ],
)
def test_defaults_as_debezium_declares_them(oid: int, typmod: int, expr: str | None, expected: object) -> None:
    got = default_value(BUILTIN_TYPES[oid], typmod, expr)
    assert got is NO_DEFAULT if expected is NO_DEFAULT else got == expected


def test_enum_defaults_and_none_for_domains() -> None:
    assert default_value(MOOD, -1, "'ok'::mood") == "ok"
    assert default_value(POSINT, -1, "3") is NO_DEFAULT


def test_the_default_sits_before_field_and_null_is_a_value() -> None:
    schema = field_schema(BUILTIN_TYPES[23], -1, "id", False, 0)
    assert list(schema) == ["type", "optional", "default", "field"]
    assert "default" not in field_schema(BUILTIN_TYPES[23], -1, "id", False)


def test_declared_array_depth_nests_the_schema() -> None:
    schema = field_schema(BUILTIN_TYPES[1007], -1, "m", True, dimensions=2)
    assert schema["items"] == {"type": "array", "items": {"type": "int32", "optional": True}, "optional": True}
