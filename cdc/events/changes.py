"""From decoded pgoutput changes of committed transactions to Kafka records.

This is where the contract's event rules live: a tombstone after every delete, a
primary-key change as `d` + tombstone on the old key then `c` on the new key, a
truncate under the table's reserved key, unchanged TOASTed values filled from the old
row under REPLICA IDENTITY FULL and the Debezium placeholder otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import orjson

from cdc import accel
from cdc.events.defaults import default_value
from cdc.events.records import (
    TOAST_PLACEHOLDER,
    TOAST_PLACEHOLDER_BYTES,
    TRUNCATE_KEY,
    Column,
    Record,
    TableEvents,
    Txn,
)
from cdc.events.shapes import column_shape
from cdc.events.types import converter, field_schema
from cdc.naming import TablePattern, parse_table_pattern, topic_name
from cdc.source import pgoutput
from cdc.source.catalog import Catalog
from cdc.source.pgtypes import PgType

log = logging.getLogger(__name__)


class NoKey(Exception):
    """A captured table has neither a primary key nor a usable replica identity."""


class ColumnDef(NamedTuple):
    """One column of a table's shape: what a Relation message says of it."""

    name: str
    type_oid: int
    type_modifier: int
    key: bool
    #: from the catalog (pgoutput does not send them): the field schema's optional and default
    not_null: bool = False
    default: str | None = None  # the default expression's text (pg_get_expr), None if none
    dimensions: int = 1  # declared array depth (pg_attribute.attndims)


_HSTORE_PLACEHOLDER = orjson.dumps({TOAST_PLACEHOLDER: TOAST_PLACEHOLDER}).decode()


def _toast_placeholder(pgtype: PgType, field: dict[str, Any]) -> Any:
    """Debezium's value for an unchanged TOASTed column, in the column's own shape (checked
    against the real connector): base64 of the placeholder for bytea, a one-pair JSON object
    for hstore, a one-element list for arrays of strings or bytes, else the string."""
    while pgtype.kind == "d" and pgtype.base is not None:
        pgtype = pgtype.base
    if pgtype.name == "bytea":
        return TOAST_PLACEHOLDER_BYTES
    if pgtype.name == "hstore":
        return _HSTORE_PLACEHOLDER
    items = field.get("items")
    if field["type"] == "array" and items is not None and items["type"] in ("string", "bytes"):
        return [TOAST_PLACEHOLDER_BYTES if items["type"] == "bytes" else TOAST_PLACEHOLDER]
    return TOAST_PLACEHOLDER


class ChangeRenderer:
    """Keeps the relation cache (one TableEvents per relation version) and renders changes."""

    def __init__(
        self, catalog: Catalog, prefix: str, database: str, patterns: list[str], with_schemas: bool,
        skip_truncates: bool = False,
    ) -> None:
        self.catalog = catalog
        #: `[events] skipped_operations = "t"`: Debezium consumers that fail on op `t` get none
        self.skip_truncates = skip_truncates
        self.prefix = prefix
        self.database = database
        self.patterns: list[TablePattern] = [parse_table_pattern(p) for p in patterns]
        self.with_schemas = with_schemas
        self.tables: dict[int, TableEvents | None] = {}
        #: relation oid -> the C encoder of its streamed changes (a `TableEvents.c_encoder`)
        self.c_encoders: dict[int, object] = {}
        #: The C twin of decoding one XLogData message and calling `records`, chosen by the
        #: accelerator switch when the renderer is built, or None. It takes the whole CopyData
        #: message and the open transaction, and returns the records of an insert, update or
        #: delete of a relation with a c_encoder, or None for everything else (then decode and call
        #: `records`). Only for changes outside stream blocks: streamed ones are spilled first.
        self.render_xlogdata: Callable[[bytes | memoryview, Txn], list[Record] | None] | None = (
            None if accel.native is None else partial(accel.native.render_change, self.c_encoders)
        )

    def reset(self) -> None:
        """A new walsender sends every Relation again before using it."""
        self.tables.clear()
        self.c_encoders.clear()

    def relation(self, msg: pgoutput.Relation) -> None:
        """A Relation message of the stream: how that table's rows look from here on."""
        facts = self.catalog.column_facts(msg.oid)
        columns = []
        for c in msg.columns:
            fact = facts.get(c.name)
            columns.append(
                ColumnDef(c.name, c.type_oid, c.type_modifier, bool(c.flags & 1))
                if fact is None
                else ColumnDef(
                    c.name, c.type_oid, c.type_modifier, bool(c.flags & 1),
                    fact.not_null, fact.default, max(fact.dimensions, 1),
                )
            )
        self.describe(msg.oid, msg.namespace, msg.name, columns)

    def describe(self, oid: int, schema: str, table: str, columns: list[ColumnDef]) -> None:
        """A table's shape, from a Relation message or (for snapshots) from the catalog;
        `key` marks the replica identity columns PostgreSQL would send."""
        self.c_encoders.pop(oid, None)
        if not any(p.matches(schema, table) for p in self.patterns):
            self.tables[oid] = None
            return
        display = str(TablePattern(schema, table))
        described = self.catalog.table_by_oid(oid)
        names = [c.name for c in columns]
        key_names = list(described.key_columns) if described else []
        if not key_names or not set(key_names) <= set(names):
            key_names = [c.name for c in columns if c.key]  # the replica identity PostgreSQL sent
            if described is not None and described.replica_identity == "f":
                key_names = []
        if not key_names:
            raise NoKey(
                f"table {display} has no primary key and no replica identity index: add a primary key, or "
                f"ALTER TABLE {display} REPLICA IDENTITY USING INDEX <unique index>"
            )
        keys = set(key_names)
        rendered, shape = [], []
        for col in columns:
            pgtype = self.catalog.pg_type(col.type_oid)
            connect = field_schema(
                pgtype, col.type_modifier, col.name, not (col.not_null or col.name in keys),
                default_value(pgtype, col.type_modifier, col.default), col.dimensions,
            )
            rendered.append(
                Column(
                    name=col.name,
                    convert=converter(pgtype, col.type_modifier),
                    placeholder=_toast_placeholder(pgtype, connect),
                    schema=connect,
                )
            )
            shape.append(column_shape(pgtype, col.type_modifier, col.name, col.name in key_names, connect))
        events = self.tables[oid] = TableEvents(
            prefix=self.prefix,
            database=self.database,
            schema=schema,
            table=table,
            topic=topic_name(self.prefix, schema, table),
            columns=rendered,
            key_indexes=[names.index(k) for k in key_names],
            with_schemas=self.with_schemas,
            shape=shape,
        )
        if events.c_encoder is not None and self.render_xlogdata is not None:
            self.c_encoders[oid] = events.c_encoder
        log.debug("relation %s: columns %s, key %s", display, names, key_names)

    def table(self, oid: int) -> TableEvents | None:
        try:
            return self.tables[oid]
        except KeyError:
            raise RuntimeError(f"change for relation {oid} arrived before its Relation message") from None

    def records(self, msg: object, txn: Txn, change_lsn: int, snapshot: str = "false") -> list[Record]:
        """The records of one Insert, Update, Delete or Truncate message."""
        kind = type(msg)
        if kind is pgoutput.Truncate:
            return self._truncate(msg, txn, change_lsn)  # type: ignore[arg-type]
        table = self.table(msg.relation_oid)  # type: ignore[attr-defined]
        if table is None:
            return []
        source = table.source(txn.commit_ts_us, snapshot, txn.commit_lsn, change_lsn, txn.xid)
        name = table.name
        if kind is pgoutput.Insert:
            key, after = table.encode(msg.new)  # type: ignore[attr-defined]
            return [Record(table.topic, key, table.envelope("c", None, after, source), name)]
        if kind is pgoutput.Delete:
            key, before = table.encode(msg.old)  # type: ignore[attr-defined]
            return [
                Record(table.topic, key, table.envelope("d", before, None, source), name),
                Record(table.topic, key, None, name),
            ]
        assert kind is pgoutput.Update
        full = msg.old_kind == "O"  # type: ignore[attr-defined]
        key, after = table.encode(msg.new, msg.old if full else None)  # type: ignore[attr-defined]
        if msg.old is not None:  # type: ignore[attr-defined]
            old_key, old = table.encode(msg.old)  # type: ignore[attr-defined]
            if old_key != key:  # a key change: the old key must disappear from the compacted topic
                return [
                    Record(table.topic, old_key, table.envelope("d", old, None, source), name),
                    Record(table.topic, old_key, None, name),
                    Record(table.topic, key, table.envelope("c", None, after, source), name),
                ]
            if full:
                return [Record(table.topic, key, table.envelope("u", old, after, source), name)]
        return [Record(table.topic, key, table.envelope("u", None, after, source), name)]

    def _truncate(self, msg: pgoutput.Truncate, txn: Txn, change_lsn: int) -> list[Record]:
        out = []
        for oid in msg.relation_oids:
            table = self.table(oid)
            if table is None:
                continue
            if self.skip_truncates:
                log.info("truncate of %s not sent ([events] skipped_operations = \"t\")", table.name)
                continue
            source = table.source(txn.commit_ts_us, "false", txn.commit_lsn, change_lsn, txn.xid)
            out.append(Record(table.topic, TRUNCATE_KEY, table.envelope("t", None, None, source), table.name))
        return out
