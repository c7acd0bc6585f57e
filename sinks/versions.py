"""Table versions from `<prefix>.__cdc_schemas`, and the placeholder of an unchanged TOASTed value.

Column types come from the capture side (cdc.events.shapes), never from PostgreSQL: an
event is decoded with the version of its table in force at its commit LSN, so an event
written before an `ALTER TABLE` keeps its old shape. Pure Python: executors, the Spark
type mapping (sinks.spark_types) and the JSON stores' documents all read it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

TOAST_PLACEHOLDER = "__debezium_unavailable_value"
_PLACEHOLDER_BYTES = "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=="
#: What an unchanged TOASTed value is in an event (as Debezium renders it, cdc.events.changes):
#: the string, base64 of it for bytea, a one-element list for arrays of strings or bytes, a
#: one-pair object for hstore; as JSON text, the way the decoder sees a column's value.
UNAVAILABLE_FORMS = (
    TOAST_PLACEHOLDER, _PLACEHOLDER_BYTES, f'["{TOAST_PLACEHOLDER}"]', f'["{_PLACEHOLDER_BYTES}"]',
    f'{{"{TOAST_PLACEHOLDER}":"{TOAST_PLACEHOLDER}"}}',
)


@dataclass(frozen=True)
class ColumnShape:
    name: str
    type: str  # PostgreSQL type name, domains resolved; arrays `<element>[]`
    modifier: int
    key: bool
    connect: dict[str, Any] = field(hash=False, compare=False)


@dataclass(frozen=True)
class Version:
    """One shape of one table, valid from commit LSN `from_lsn` until the next version."""

    schema: str
    table: str
    topic: str
    from_lsn: int
    columns: tuple[ColumnShape, ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.table}"

    @classmethod
    def from_record(cls, value: bytes) -> Version:
        raw = orjson.loads(value)
        return cls(
            raw["schema"], raw["table"], raw["topic"], int(raw["from"]),
            tuple(ColumnShape(c["name"], c["type"], c["modifier"], c["key"], c["connect"]) for c in raw["columns"]),
        )


class Registry:
    """Every known version, per topic in `from_lsn` order."""

    def __init__(self, versions: Iterable[Version] = ()) -> None:
        self._by_topic: dict[str, list[Version]] = {}
        for version in versions:
            self.add(version)

    def add(self, version: Version) -> None:
        versions = self._by_topic.setdefault(version.topic, [])
        froms = [v.from_lsn for v in versions]
        at = bisect.bisect_left(froms, version.from_lsn)
        if at < len(versions) and versions[at].from_lsn == version.from_lsn:
            versions[at] = version
        else:
            versions.insert(at, version)

    def topics(self) -> list[str]:
        return list(self._by_topic)

    def versions(self, topic: str) -> list[Version]:
        return self._by_topic.get(topic, [])

    def at(self, topic: str, commit_lsn: int) -> Version | None:
        """The version in force at `commit_lsn` (None before the first one)."""
        versions = self.versions(topic)
        at = bisect.bisect_right([v.from_lsn for v in versions], commit_lsn)
        return versions[at - 1] if at else None

    def spanning(self, topic: str, low: int, high: int) -> list[tuple[Version, int, int]]:
        """The versions in force between commit LSNs low and high, each with the LSN range
        [start, end) it decodes; an event below the first version gets the first one."""
        versions = self.versions(topic)
        out = []
        for i, version in enumerate(versions):
            start = version.from_lsn if i else -(2**63)
            end = versions[i + 1].from_lsn if i + 1 < len(versions) else 2**63 - 1
            if start <= high and end > low:
                out.append((version, start, end))
        return out
