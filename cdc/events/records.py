"""Change events: Debezium-compatible keys and envelopes, serialized once with orjson.

The contract (docs/design.md): the key is the primary key as compact canonical JSON with the
columns in key order; the value is Debezium's envelope; the position
`(commit_lsn, change_lsn)` rides in `source.sequence`. One model serves streaming and
snapshot reads, so every producer of events renders them identically.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import orjson

from cdc import __version__, accel
from cdc.events.types import NATIVE_KINDS
from cdc.toast import UNCHANGED

TOAST_PLACEHOLDER = "__debezium_unavailable_value"
TOAST_PLACEHOLDER_BYTES = base64.b64encode(TOAST_PLACEHOLDER.encode()).decode()
TRUNCATE_KEY = orjson.dumps("__truncate__")  # a JSON string: never equal to a row key (a JSON object)
SOURCE_VERSION = f"cdc-{__version__}"


_ENVELOPE = b'{"before":%b,"after":%b,"source":%b,"transaction":null,"op":%b,"ts_ms":%d,"ts_us":%d,"ts_ns":%d000}'
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_OPS = {op: orjson.dumps(op) for op in ("r", "c", "u", "d", "t")}


def _py_envelope(before: bytes | None, after: bytes | None, source: bytes, op: bytes) -> bytes:
    """The envelope around ready JSON pieces, stamped now (twin of the C `envelope`)."""
    now_us = time.time_ns() // 1000
    return _ENVELOPE % (before or b"null", after or b"null", source, op, now_us // 1000, now_us, now_us)


_envelope = _py_envelope


def _bind_accel(native: ModuleType | None) -> None:
    global _envelope
    _envelope = _py_envelope if native is None else native.envelope


accel.bind(_bind_accel)


class Record(NamedTuple):
    """One Kafka record (a tuple: built once per change on the hot path)."""

    topic: str
    key: bytes
    value: bytes | None
    table: str  # schema.table, for error messages and metrics


@dataclass(frozen=True, slots=True)
class Txn:
    """What every event of one transaction shares."""

    commit_lsn: int
    commit_ts_us: int
    xid: int | None


class KeyUnavailable(Exception):
    """A key column is missing from the tuple PostgreSQL sent (e.g. an unchanged TOASTed key)."""


@dataclass(frozen=True)
class Column:
    name: str
    convert: Callable[[str], Any]
    placeholder: Any  # what an unchanged TOASTed value becomes when nothing can fill it
    schema: dict[str, Any]  # Kafka Connect field schema (for the optional schema form)


@dataclass
class TableEvents:
    """Renders the events of one relation version (a new one after every Relation message)."""

    prefix: str
    database: str
    schema: str
    table: str
    topic: str
    columns: list[Column]
    key_indexes: list[int]
    with_schemas: bool = False
    #: each column as the sinks read it (cdc.events.shapes.column_shape), for the schema topic
    shape: list[dict[str, Any]] = field(default_factory=list)
    _names: list[str] = field(init=False)
    _key_names: list[str] = field(init=False)
    _envelope_schema: bytes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._names = [c.name for c in self.columns]
        self._key_names = [self._names[i] for i in self.key_indexes]
        self._columns = [(c.name, c.convert, c.placeholder) for c in self.columns]
        self._convert = [(c.name, c.convert) for c in self.columns]
        self.name = f"{self.schema}.{self.table}"
        self._native_encode = None
        #: The C renderer of this relation's streamed changes (cdc/_speedups.c render_change),
        #: or None: then, and for every change it declines, cdc/events/changes.py renders them.
        self.c_encoder = None
        native = accel.native  # chosen once per relation version
        if native is not None:
            encoder = native.RowEncoder(
                tuple(orjson.dumps(name) + b":" for name in self._names),
                bytes(NATIVE_KINDS.get(c.convert, 0) for c in self.columns),
                tuple(c.convert for c in self.columns),
                tuple(self.key_indexes),
                orjson.dumps,
                UNCHANGED,
                self.topic,
                self.name,
                Record,
                self._streamed_source_parts,
            )
            self._native_encode = encoder.encode
            if not self.with_schemas:
                self.c_encoder = encoder
        self._source_key: tuple | None = None
        self._source_head = self._source_tail = b""

    # -- rows -----------------------------------------------------------------------------
    def encode(self, values: list, fill: list | None = None) -> tuple[bytes, bytes]:
        """The key and the row JSON of one row of text values. Unchanged TOASTed values come
        from `fill` (the old row's values) when known: only the Python twin handles those."""
        if self._native_encode is not None:
            encoded = self._native_encode(values)
            if encoded is not None:
                return encoded
        row = self.row(values, None if fill is None else self.row(fill))
        return self.key(row), orjson.dumps(row)

    def row(self, values: list, fill: dict[str, Any] | None = None) -> dict[str, Any]:
        """Convert text values; unchanged TOASTed ones come from `fill` (the old row) when known."""
        if UNCHANGED not in values:  # the common case, as one comprehension
            return {n: None if v is None else c(v) for (n, c), v in zip(self._convert, values, strict=True)}
        out: dict[str, Any] = {}
        for (name, convert, placeholder), value in zip(self._columns, values, strict=True):
            if value is None:
                out[name] = None
            elif value is UNCHANGED:
                out[name] = placeholder if fill is None else fill[name]
            else:
                out[name] = convert(value)
        return out

    def key(self, row: dict[str, Any]) -> bytes:
        parts = {name: row[name] for name in self._key_names}
        for name, value in parts.items():
            if value is TOAST_PLACEHOLDER or value is TOAST_PLACEHOLDER_BYTES:
                raise KeyUnavailable(f"{self.name}: key column {name} arrived as an unchanged TOAST value")
        return orjson.dumps(parts)

    # -- envelopes ------------------------------------------------------------------------
    def source(
        self, commit_ts_us: int, snapshot: str, commit_lsn: int, change_lsn: int, xid: int | None, lsn: int | None = None
    ) -> bytes:
        """The serialized `source` block. What a transaction's events share is serialized once
        per transaction; per event only the position is formatted in. `lsn` is the change LSN,
        except for snapshot reads (position `(C, 0)`), which carry the snapshot's LSN C."""
        key = (commit_ts_us, snapshot, commit_lsn, xid)
        if key != self._source_key:
            self._source_key = key
            self._source_head, self._source_tail = self.source_parts(commit_ts_us, snapshot, commit_lsn, xid)
        return b'%b%d\\"]"%b%d,"xmin":null}' % (
            self._source_head, change_lsn, self._source_tail, change_lsn if lsn is None else lsn
        )

    def source_parts(self, commit_ts_us: int, snapshot: str, commit_lsn: int, xid: int | None) -> tuple[bytes, bytes]:
        """The `source` block around its per-event part: head + change LSN + tail + lsn."""
        # Debezium's field order (its Source schema's): sequence before ts_us and ts_ns
        head = {
            "version": SOURCE_VERSION,
            "connector": "postgresql",
            "name": self.prefix,
            "ts_ms": commit_ts_us // 1000,
            "snapshot": snapshot,
            "db": self.database,
        }
        tail = {
            "ts_us": commit_ts_us,
            "ts_ns": commit_ts_us * 1000,
            "schema": self.schema,
            "table": self.table,
            "txId": xid,
        }
        # sequence is a string holding a JSON array: '"[\"<commit>\",\"<change>\"]"'
        return (
            orjson.dumps(head)[:-1] + b',"sequence":"[\\"%d\\",\\"' % commit_lsn,
            b"," + orjson.dumps(tail)[1:-1] + b',"lsn":',
        )

    def _streamed_source_parts(self, txn: Txn) -> tuple[bytes, bytes]:
        return self.source_parts(txn.commit_ts_us, "false", txn.commit_lsn, txn.xid)

    def envelope(self, op: str, before: bytes | None, after: bytes | None, source: bytes) -> bytes:
        """`before` and `after` are row JSON, as `encode` renders it."""
        payload = _envelope(before, after, source, _OPS[op])
        if not self.with_schemas:
            return payload
        return b'{"schema":' + self.envelope_schema() + b',"payload":' + payload + b"}"

    @property
    def schema_name_prefix(self) -> str:
        """`<prefix>.<schema>.<table>` with every character outside ``[A-Za-z0-9._-]`` as
        ``_``: Debezium names its Connect schemas after its topic names, sanitized so."""
        return _UNSAFE_NAME.sub("_", f"{self.prefix}.{self.schema}.{self.table}")

    def envelope_schema(self) -> bytes:
        """Debezium's Connect schema of the envelope, serialized once per relation version."""
        if self._envelope_schema is None:
            value_name = f"{self.schema_name_prefix}.Value"
            row = {"type": "struct", "fields": [c.schema for c in self.columns], "optional": True, "name": value_name}
            self._envelope_schema = orjson.dumps(
                {
                    "type": "struct",
                    "fields": [
                        {**row, "field": "before"},
                        {**row, "field": "after"},
                        {**SOURCE_SCHEMA, "field": "source"},
                        TRANSACTION_SCHEMA,
                        {"type": "string", "optional": False, "field": "op"},
                        {"type": "int64", "optional": True, "field": "ts_ms"},
                        {"type": "int64", "optional": True, "field": "ts_us"},
                        {"type": "int64", "optional": True, "field": "ts_ns"},
                    ],
                    "optional": False,
                    "name": f"{self.schema_name_prefix}.Envelope",
                    "version": 2,
                }
            )
        return self._envelope_schema


def _field(kind: str, field_name: str, optional: bool = False, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "optional": optional, **extra, "field": field_name}


SOURCE_SCHEMA: dict[str, Any] = {  # Debezium 3.3's, field order and version included
    "type": "struct",
    "fields": [
        _field("string", "version"),
        _field("string", "connector"),
        _field("string", "name"),
        _field("int64", "ts_ms"),
        _field(
            "string", "snapshot", True, name="io.debezium.data.Enum", version=1,
            parameters={"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"},
            default="false",
        ),
        _field("string", "db"),
        _field("string", "sequence", True),
        _field("int64", "ts_us", True),
        _field("int64", "ts_ns", True),
        _field("string", "schema"),
        _field("string", "table"),
        _field("int64", "txId", True),
        _field("int64", "lsn", True),
        _field("int64", "xmin", True),
    ],
    "optional": False,
    "name": "io.debezium.connector.postgresql.Source",
    "version": 1,
}

TRANSACTION_SCHEMA: dict[str, Any] = {
    "type": "struct",
    "fields": [
        _field("string", "id"),
        _field("int64", "total_order"),
        _field("int64", "data_collection_order"),
    ],
    "optional": True,
    "name": "event.block",
    "version": 1,
    "field": "transaction",
}

