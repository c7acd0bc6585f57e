"""Change events: Debezium-compatible keys and envelopes, serialized once with orjson.

The contract (DESIGN.md): the key is the primary key as compact canonical JSON with the
columns in key order; the value is Debezium's envelope; the position
`(commit_lsn, change_lsn)` rides in `source.sequence`. One model serves streaming and
snapshot reads, so every producer of events renders them identically.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc import __version__
from cdc.pgoutput import UNCHANGED

TOAST_PLACEHOLDER = "__debezium_unavailable_value"
TOAST_PLACEHOLDER_BYTES = base64.b64encode(TOAST_PLACEHOLDER.encode()).decode()
TRUNCATE_KEY = orjson.dumps("__truncate__")  # a JSON string: never equal to a row key (a JSON object)
SOURCE_VERSION = f"cdc-{__version__}"


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
    _names: list[str] = field(init=False)
    _key_names: list[str] = field(init=False)
    _envelope_schema: bytes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._names = [c.name for c in self.columns]
        self._key_names = [self._names[i] for i in self.key_indexes]
        self._converters = [(c.convert, c.placeholder) for c in self.columns]
        self._convert = [c.convert for c in self.columns]
        self.name = f"{self.schema}.{self.table}"
        self._source_key: tuple | None = None
        self._source_base: dict[str, Any] = {}

    # -- rows -----------------------------------------------------------------------------
    def row(self, values: list, fill: list | None = None) -> list:
        """Convert text values; unchanged TOASTed ones come from `fill` (the old row) when known."""
        if UNCHANGED not in values:  # the common case, as one comprehension
            return [None if v is None else c(v) for c, v in zip(self._convert, values, strict=True)]
        out = []
        for i, value in enumerate(values):
            convert, placeholder = self._converters[i]
            if value is None:
                out.append(None)
            elif value is UNCHANGED:
                out.append(placeholder if fill is None else fill[i])
            else:
                out.append(convert(value))
        return out

    def as_dict(self, row: list | None) -> dict[str, Any] | None:
        return None if row is None else dict(zip(self._names, row, strict=True))

    def key(self, row: list) -> bytes:
        parts = {}
        for name, i in zip(self._key_names, self.key_indexes, strict=True):
            value = row[i]
            if value is TOAST_PLACEHOLDER or value is TOAST_PLACEHOLDER_BYTES:
                raise KeyUnavailable(f"{self.schema}.{self.table}: key column {name} arrived as an unchanged TOAST value")
            parts[name] = value
        return orjson.dumps(parts)

    # -- envelopes ------------------------------------------------------------------------
    def source(self, commit_ts_us: int, snapshot: str, commit_lsn: int, change_lsn: int, xid: int | None) -> dict:
        """The `source` block; what a transaction's events share is built once per transaction."""
        key = (commit_ts_us, snapshot, commit_lsn, xid)
        if key != self._source_key:
            self._source_key = key
            self._source_base = {
                "version": SOURCE_VERSION,
                "connector": "postgresql",
                "name": self.prefix,
                "ts_ms": commit_ts_us // 1000,
                "ts_us": commit_ts_us,
                "ts_ns": commit_ts_us * 1000,
                "snapshot": snapshot,
                "db": self.database,
                "sequence": None,
                "schema": self.schema,
                "table": self.table,
                "txId": xid,
                "lsn": None,
                "xmin": None,
            }
        source = self._source_base.copy()
        source["sequence"] = f'["{commit_lsn}","{change_lsn}"]'
        source["lsn"] = change_lsn
        return source

    def envelope(self, op: str, before: list | None, after: list | None, source: dict) -> bytes:
        now_us = time.time_ns() // 1000
        payload = {
            "before": self.as_dict(before),
            "after": self.as_dict(after),
            "source": source,
            "transaction": None,
            "op": op,
            "ts_ms": now_us // 1000,
            "ts_us": now_us,
            "ts_ns": now_us * 1000,
        }
        if not self.with_schemas:
            return orjson.dumps(payload)
        return b'{"schema":' + self.envelope_schema() + b',"payload":' + orjson.dumps(payload) + b"}"

    def envelope_schema(self) -> bytes:
        """Debezium's Connect schema of the envelope, serialized once per relation version."""
        if self._envelope_schema is None:
            value_name = f"{self.prefix}.{self.schema}.{self.table}.Value"
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
                    "name": f"{self.prefix}.{self.schema}.{self.table}.Envelope",
                    "version": 2,
                }
            )
        return self._envelope_schema


def _field(kind: str, field_name: str, optional: bool = False, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "optional": optional, **extra, "field": field_name}


SOURCE_SCHEMA: dict[str, Any] = {
    "type": "struct",
    "fields": [
        _field("string", "version"),
        _field("string", "connector"),
        _field("string", "name"),
        _field("int64", "ts_ms"),
        _field("int64", "ts_us", True),
        _field("int64", "ts_ns", True),
        _field(
            "string", "snapshot", True, name="io.debezium.data.Enum", version=1,
            parameters={"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"},
            default="false",
        ),
        _field("string", "db"),
        _field("string", "sequence", True),
        _field("string", "schema"),
        _field("string", "table"),
        _field("int64", "txId", True),
        _field("int64", "lsn", True),
        _field("int64", "xmin", True),
    ],
    "optional": False,
    "name": "io.debezium.connector.postgresql.Source",
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

