"""Column defaults in the Connect field schema, rendered as Debezium's PostgreSQL connector does.

A consumer that builds tables from the schemas (a JDBC sink, Flink, a schema registry's
compatibility check) reads the column default from the field's ``default``; cdc must
declare the same one Debezium 3.x declares, or the same table looks different from two
producers. Debezium does not evaluate the default expression: it reads the text
``pg_get_expr`` gives (here on a connection with the pinned session settings) and, per
type, takes the first quoted literal, the bare text when nothing is quoted, or a fixed
placeholder when the expression starts with a function call (``nextval(...)`` gives 0,
``now()`` the epoch, ``gen_random_uuid()`` the nil UUID). Types it has no rule for
(bytea, money, timetz, network and geometric types, arrays, hstore, domains, ...) and
texts it cannot parse get no default. The results, quirks included (``'x''y'`` gives
``x``), were checked against the real connector (tests/test_debezium_oracle.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from cdc.events.types import NO_DEFAULT, converter
from cdc.source.pgtypes import BUILTIN_TYPES, PgType

__all__ = ["NO_DEFAULT", "default_value"]

_FUNCTION_CALL = re.compile(r"^\(?[A-Za-z0-9_]+\((?:.+(?:, ?.+)*)?\)")
_LITERAL = re.compile(r"'(.*?)'")

#: Debezium's placeholder per type when the default is a function call
_PLACEHOLDERS: dict[str, str] = {
    "bit": "00", "varbit": "0", "bool": "false", "bpchar": "", "varchar": "", "text": "",
    "numeric": "0.0", "float4": "0.0", "float8": "0.0", "int2": "0", "int4": "0", "int8": "0",
    "json": "{}", "jsonb": "{}", "xml": "", "uuid": "00000000-0000-0000-0000-000000000000",
    "date": "1970-01-01", "time": "00:00", "timestamp": "1970-01-01 00:00:00",
    "timestamptz": "1970-01-01 00:00:00+00", "interval": "PT0S",
}


def _extract(expr: str, placeholder: str) -> str:
    if _FUNCTION_CALL.search(expr):
        return placeholder
    if "'" not in expr:
        return expr
    found = _LITERAL.search(expr)
    if found is None:  # an unbalanced quote: Debezium's matcher fails, so no default
        raise ValueError(expr)
    return found.group(1)


def _numeric(text: str, typmod: int) -> str:
    value = Decimal(text)
    if not value.is_finite():
        raise InvalidOperation(text)  # Java's BigDecimal has no NaN nor infinities
    scale = (typmod - 4) & 0xFFFF if typmod >= 4 else None
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)
    if scale is not None and scale > -exponent:
        value = value.quantize(Decimal(1).scaleb(-scale))
    return str(value)


def _zoned(text: str, typmod: int, convert: Callable[[str], Any]) -> Any:
    """Debezium pads a default timestamptz's fraction to the column's precision."""
    value = convert(text)
    if not isinstance(value, str) or not value.endswith("Z") or "T" not in value:
        return value
    digits = 6 if typmod < 0 else typmod
    body = value[:-1]
    whole, _, fraction = body.partition(".")
    return whole + ("." + fraction.ljust(digits, "0") if digits else "") + "Z"


def default_value(pgtype: PgType, typmod: int, expr: str | None) -> Any:
    """The JSON value of a column's ``default`` in its field schema, or NO_DEFAULT."""
    if expr is None:
        return NO_DEFAULT
    if pgtype.kind == "e":
        name = "enum"
    elif BUILTIN_TYPES.get(pgtype.oid) is not None and pgtype.kind == "b" and pgtype.element is None:
        name = pgtype.name
    else:
        return NO_DEFAULT
    if name != "enum" and name not in _PLACEHOLDERS:
        return NO_DEFAULT
    if expr.startswith("NULL::"):
        # Debezium: none for bool, numeric, float and int types; for the others it keeps the
        # text itself ("NULL::text") as the default, which no consumer should see.
        return NO_DEFAULT
    try:
        text = _extract(expr, _PLACEHOLDERS.get(name, ""))
        if name in ("int2", "int4", "int8"):
            return int(text.strip() if text.strip() == text else "x")
        if name == "bool":
            return text.lower() == "true"
        if name == "numeric":
            return _numeric(text, typmod)
        if name == "uuid":
            return str(uuid.UUID(text))
        if name == "bit" and len(text) == 1:
            return text == "1"
        convert = converter(pgtype, typmod)
        if name == "timestamptz":
            return _zoned(text, typmod, convert)
        return convert(text)
    except (ValueError, IndexError, InvalidOperation):
        return NO_DEFAULT
