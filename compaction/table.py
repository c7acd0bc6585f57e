"""The topic read as a table: the latest value per key, tombstones delete, truncates by position.

This is what compaction converges to and what every derived store must equal, so it is
also how the tests compare a topic with the source tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc.events.records import TRUNCATE_KEY

Position = tuple[int, int]


class MalformedEvent(ValueError):
    """A record that is not a change event of ours; names topic, partition and offset."""


def position_of(event: dict[str, Any]) -> Position:
    """(commit LSN, change LSN) from `source.sequence`, the order of events of one key."""
    commit, change = orjson.loads(event["source"]["sequence"])
    return int(commit), int(change)


def payload_of(value: bytes) -> dict[str, Any]:
    """The envelope, with or without the `{"schema":..., "payload":...}` wrapper."""
    event = orjson.loads(value)
    if isinstance(event, dict) and "payload" in event and "schema" in event:
        event = event["payload"]
    return event


@dataclass
class TopicTable:
    rows: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    positions: dict[bytes, Position] = field(default_factory=dict)
    max_position: dict[bytes, Position] = field(default_factory=dict)
    truncated_at: Position | None = None
    records: int = 0

    def apply(self, key: bytes | None, value: bytes | None, where: str = "") -> None:
        self.records += 1
        if key is None:
            raise MalformedEvent(f"record without a key at {where}: compacted topics need keys")
        if value is None:
            self.rows.pop(key, None)
            return
        try:
            event = payload_of(value)
            op = event["op"]
            pos = position_of(event)
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedEvent(f"malformed event at {where}: {exc}") from None
        if key == TRUNCATE_KEY:
            if self.truncated_at is None or pos > self.truncated_at:
                self.truncated_at = pos
            return
        self.positions[key] = pos
        if pos > self.max_position.get(key, (-1, -1)):
            self.max_position[key] = pos
        if op == "d":
            self.rows.pop(key, None)
        else:
            self.rows[key] = event["after"]

    def state(self) -> dict[bytes, dict[str, Any]]:
        """Latest row per key, without rows older than the latest truncate."""
        cut = self.truncated_at
        if cut is None:
            return dict(self.rows)
        return {k: v for k, v in self.rows.items() if self.positions[k] > cut}

    def order_violations(self) -> list[bytes]:
        """Keys whose last record is not their newest position: compaction would keep stale data."""
        return [k for k, pos in self.positions.items() if pos != self.max_position[k]]


def build(records: Iterable[Any]) -> TopicTable:
    """A TopicTable from `compaction.reader.TopicRecord`s (or anything with key/value/offset)."""
    table = TopicTable()
    for r in records:
        table.apply(r.key, r.value, f"{r.topic}[{r.partition}]@{r.offset}")
    return table
