"""Relation versions for the sinks: the shape every event of a table was rendered with.

Sinks never ask PostgreSQL for column types. The daemon (and every snapshot reader)
publishes each table shape it renders with to the compacted `<prefix>.__cdc_schemas`
topic before the events that use it. A version is valid from the commit LSN of the
first transaction rendered with it (snapshot reads: the snapshot's position), so an
event at position `(C, L)` is decoded with the version of its table whose `from` is the
highest not above C. The key holds the topic and that LSN: compaction keeps every
version, and an unchanged shape republished after a restart is a harmless duplicate.
"""

from __future__ import annotations

from typing import Any

import orjson

from cdc.events.records import Record, TableEvents
from cdc.source.pgtypes import PgType

SCHEMAS_SUFFIX = "__cdc_schemas"


def schemas_topic(prefix: str) -> str:
    """One segment after the prefix: never a table's topic (those have two)."""
    return f"{prefix}.{SCHEMAS_SUFFIX}"


def _resolved(pgtype: PgType, typmod: int) -> tuple[PgType, int]:
    """A domain is its base type, with the domain's own modifier when it has one."""
    while pgtype.kind == "d" and pgtype.base is not None:
        typmod = pgtype.base_typmod if pgtype.base_typmod >= 0 else typmod
        pgtype = pgtype.base
    return pgtype, typmod


def column_shape(pgtype: PgType, typmod: int, name: str, key: bool, connect: dict[str, Any]) -> dict[str, Any]:
    """One column as the sinks read it: name, PostgreSQL type (domains resolved; arrays name
    their element), modifier, key flag and the Connect schema of its JSON value."""
    base, mod = _resolved(pgtype, typmod)
    element = None
    if base.element is not None:
        element, mod = _resolved(base.element, mod)
    shape: dict[str, Any] = {
        "name": name,
        "type": base.name if element is None else f"{element.name}[]",
        "modifier": mod,
        "key": key,
        "connect": {k: v for k, v in connect.items() if k != "field"},
    }
    return shape


def version_record(events: TableEvents, from_lsn: int) -> Record:
    """The schema-topic record of the version `events` renders, valid from commit LSN `from_lsn`."""
    key = orjson.dumps({"topic": events.topic, "from": str(from_lsn)})
    value = orjson.dumps(
        {
            "schema": events.schema,
            "table": events.table,
            "topic": events.topic,
            "from": str(from_lsn),
            "columns": events.shape,
        }
    )
    return Record(schemas_topic(events.prefix), key, value, events.name)
