"""The topic read as a table: what compaction converges to, and what every derived store must equal.

A fold over a table topic's records, in each partition's offset order (a key's records all
sit in one partition, in position order: docs/design.md's invariant):
- the latest record of a key wins (Kafka's cleaner keeps the highest offset of a key);
- a `d` event and a tombstone remove the row (a tombstone keeps the `d`'s position, if seen);
- a truncate (`t` under the reserved key, in one partition while the rows it removes sit in
  all of them) removes every row of the table with a lower position, whatever order the
  partitions were read in: the rows are cut by position when they are read out, not when
  the truncate arrives;
- an unchanged TOASTed value (Debezium's placeholder, sent under REPLICA IDENTITY DEFAULT)
  takes the value of the key's earlier record; when the topic no longer has one (compaction
  removed it, or the key is new: a primary-key change) the column is reported as unresolved
  and holds no value, never the placeholder.

Memory stays bounded whatever the table's size: the state per key (position, the row's JSON)
lives in a SQLite file, with at most `flush_every` keys' changes in memory at a time.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from cdc.events.records import TOAST_PLACEHOLDER, TOAST_PLACEHOLDER_BYTES, TRUNCATE_KEY

Position = tuple[int, int]

#: An unchanged TOASTed value in an event, in every shape cdc renders it (cdc.events.changes):
#: the text, base64 of it for bytea, a one-element list for arrays, and the hstore object as
#: a JSON string. The first two, as bytes, tell cheaply whether a record holds any at all.
PLACEHOLDERS: tuple[Any, ...] = (
    TOAST_PLACEHOLDER, TOAST_PLACEHOLDER_BYTES, [TOAST_PLACEHOLDER], [TOAST_PLACEHOLDER_BYTES],
    orjson.dumps({TOAST_PLACEHOLDER: TOAST_PLACEHOLDER}).decode(),
)
_MARKS = (TOAST_PLACEHOLDER.encode(), TOAST_PLACEHOLDER_BYTES.encode())


class MalformedEvent(ValueError):
    """A record that is not a change event of ours; names topic, partition and offset."""


class Record(Protocol):
    """What the fold reads of a record (cdc.kafka.reader.TopicRecord has it)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...


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


def is_placeholder(value: Any) -> bool:
    return isinstance(value, (str, list)) and value in PLACEHOLDERS


@dataclass(frozen=True, slots=True)
class TableRow:
    """A live row of the table: its columns (unresolved ones hold None) and its record's position."""

    key: bytes
    row: dict[str, Any]
    position: Position
    unresolved: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KeyState:
    """What the topic says of one key: its row (None when deleted or truncated) and the
    position of its latest record (None for a lone tombstone whose `d` is gone)."""

    row: dict[str, Any] | None
    position: Position | None
    unresolved: tuple[str, ...] = ()


# per key while in memory: [commit, change, max commit, max change, deleted, row dict or None, unresolved]
_State = list[Any]

_SCHEMA = """
CREATE TABLE rows (
  key BLOB PRIMARY KEY, c INTEGER, s INTEGER, mc INTEGER, ms INTEGER,
  deleted INTEGER NOT NULL, row BLOB, unresolved TEXT
) WITHOUT ROWID
"""
# Later records of a key replace its state; the highest position seen stays (order checks).
_UPSERT = """
INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET
  c = coalesce(excluded.c, c), s = coalesce(excluded.s, s),
  mc = CASE WHEN mc IS NULL OR (excluded.mc, excluded.ms) > (mc, ms) THEN excluded.mc ELSE mc END,
  ms = CASE WHEN mc IS NULL OR (excluded.mc, excluded.ms) > (mc, ms) THEN excluded.ms ELSE ms END,
  deleted = excluded.deleted, row = excluded.row, unresolved = excluded.unresolved
"""


class TopicTable:
    """One table topic folded into a table (see the module docstring). Feed it records with
    `add`/`extend` (it can go on later with newer records), then read `rows()`."""

    def __init__(self, path: Path | None = None, flush_every: int = 20000, threadsafe: bool = False) -> None:
        """`threadsafe`: filled in one thread, read in another (one at a time)."""
        if path is None:
            fd, name = tempfile.mkstemp(prefix="cdc-topic-table-", suffix=".sqlite")
            os.close(fd)
            path, self._temporary = Path(name), True
        else:
            self._temporary = False
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=not threadsafe)
        for pragma in ("journal_mode = OFF", "synchronous = OFF", "cache_size = -65536", "temp_store = FILE"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("DROP TABLE IF EXISTS rows")
        self._db.execute(_SCHEMA)
        self._pending: dict[bytes, _State] = {}
        self._flush_every = flush_every
        self.truncated_at: Position | None = None
        self.records = 0
        self.max_commit = 0  # the highest commit LSN of any change in the topic

    # -- folding ------------------------------------------------------------------------
    def extend(self, records: Iterable[Record]) -> TopicTable:
        for r in records:
            self.add(r.key, r.value, f"{r.topic}[{r.partition}]@{r.offset}")
        return self

    def add(self, key: bytes | None, value: bytes | None, where: str = "") -> None:
        self.records += 1
        if key is None:
            raise MalformedEvent(f"record without a key at {where}: compacted topics need keys")
        if value is None:
            prior = self._state(key)
            if prior is None:
                self._put(key, [None, None, None, None, 1, None, ()])
            else:
                self._put(key, [prior[0], prior[1], prior[2], prior[3], 1, None, ()])
            return
        try:
            event = payload_of(value)
            op = event["op"]
            pos = position_of(event)
            after = event["after"]
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedEvent(f"malformed event at {where}: {exc}") from None
        self.max_commit = max(self.max_commit, pos[0])
        if key == TRUNCATE_KEY:
            if self.truncated_at is None or pos > self.truncated_at:
                self.truncated_at = pos
            return
        if op == "d":
            self._put(key, [pos[0], pos[1], pos[0], pos[1], 1, None, ()])
            return
        if not isinstance(after, dict):
            raise MalformedEvent(f"malformed event at {where}: op {op} without after")
        unresolved: tuple[str, ...] = ()
        if any(mark in value for mark in _MARKS):
            after, unresolved = self._resolve(key, after)
        self._put(key, [pos[0], pos[1], pos[0], pos[1], 0, after, unresolved])

    def _resolve(self, key: bytes, after: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
        """Placeholders take the key's earlier value; what the topic no longer has is unresolved."""
        prior = self._state(key)
        earlier = prior[5] if prior is not None and not prior[4] and prior[5] is not None else {}
        lost = set(prior[6]) if prior is not None else set()
        unresolved = []
        for name, value in after.items():
            if is_placeholder(value):
                if name in earlier and name not in lost:
                    after[name] = earlier[name]
                else:
                    after[name] = None
                    unresolved.append(name)
        return after, tuple(unresolved)

    def _state(self, key: bytes) -> _State | None:
        found = self._pending.get(key)
        if found is not None:
            return found
        row = self._db.execute(
            "SELECT c, s, mc, ms, deleted, row, unresolved FROM rows WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            return None
        c, s, mc, ms, deleted, data, unresolved = row
        return [c, s, mc, ms, deleted, None if data is None else orjson.loads(data), _names(unresolved)]

    def _put(self, key: bytes, state: _State) -> None:
        prior = self._pending.get(key)
        if prior is not None and prior[2] is not None and (state[2] is None or (prior[2], prior[3]) > (state[2], state[3])):
            state[2], state[3] = prior[2], prior[3]  # the highest position seen stays
        self._pending[key] = state
        if len(self._pending) >= self._flush_every:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        self._db.execute("BEGIN")
        self._db.executemany(
            _UPSERT,
            (
                (key, c, s, mc, ms, deleted, None if row is None else orjson.dumps(row),
                 orjson.dumps(unresolved).decode() if unresolved else None)
                for key, (c, s, mc, ms, deleted, row, unresolved) in self._pending.items()
            ),
        )
        self._db.execute("COMMIT")
        self._pending.clear()

    # -- reading ------------------------------------------------------------------------
    def rows(self) -> Iterator[TableRow]:
        """Every live row, truncates applied by position, in key byte order."""
        self._flush()
        cut = self.truncated_at or (-1, -1)
        query = self._db.execute(
            "SELECT key, c, s, row, unresolved FROM rows WHERE deleted = 0 AND (c, s) > (?, ?) ORDER BY key", cut
        )
        for key, c, s, data, unresolved in query:
            yield TableRow(key, orjson.loads(data), (c, s), _names(unresolved))

    def keys_older_than_truncate(self) -> Iterator[bytes]:
        """Keys whose latest record is a live row the newest truncate removed (their records stay
        in the compacted topic until a tombstone follows them)."""
        self._flush()
        if self.truncated_at is None:
            return iter(())
        query = self._db.execute("SELECT key FROM rows WHERE deleted = 0 AND (c, s) < (?, ?) ORDER BY key", self.truncated_at)
        return (key for (key,) in query)

    def lookup(self, keys: Iterable[bytes]) -> dict[bytes, KeyState]:
        """What the topic says of these keys (absent keys: no record at all)."""
        self._flush()
        cut = self.truncated_at
        out = {}
        for key in keys:
            state = self._state(key)
            if state is None:
                continue
            position = None if state[0] is None else (state[0], state[1])
            if cut is not None and (position is None or position < cut):
                out[key] = KeyState(None, max(position, cut) if position is not None else cut)
            elif state[4]:
                out[key] = KeyState(None, position)
            else:
                out[key] = KeyState(state[5], position, state[6])
        return out

    def state(self) -> dict[bytes, dict[str, Any]]:
        """Every live row by key, in memory: for small tables (the tests, the demo)."""
        return {r.key: r.row for r in self.rows()}

    def unresolved(self) -> dict[bytes, tuple[str, ...]]:
        """Keys whose latest record holds TOAST placeholders the topic cannot fill."""
        return {r.key: r.unresolved for r in self.rows() if r.unresolved}

    def order_violations(self) -> list[bytes]:
        """Keys whose last record is not their newest position: compaction would keep stale data."""
        self._flush()
        query = self._db.execute("SELECT key FROM rows WHERE c IS NOT NULL AND (c, s) != (mc, ms) ORDER BY key")
        return [key for (key,) in query]

    def close(self) -> None:
        self._db.close()
        if self._temporary:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> TopicTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_temporary", False) and self.path.exists():
            self.close()


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(orjson.loads(text)) if text else ()


def build(records: Iterable[Record], path: Path | None = None) -> TopicTable:
    """A TopicTable from records (`cdc.kafka.reader.TopicRecord`s, or anything with their fields)."""
    return TopicTable(path).extend(records)
