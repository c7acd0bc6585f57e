"""The notes store: `rows(topic, key, pos, partition, offset, row)` in SQLite, `row` NULL for a
delete marker, and the job's bookkeeping in `meta`. A RowStore: the job folds each key's last
change on the executors and hands it here (sinks.rows)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
from pyspark.sql import SparkSession

from cdc.config import Config, ConfigError
from sinks.query import StopSignal
from sinks.rows import Rejected, RowStore, RowWriter
from sinks.versions import Registry

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS rows (topic TEXT, key TEXT, pos TEXT, partition INTEGER, offset INTEGER, row TEXT, "
    "PRIMARY KEY (topic, key)); CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, record TEXT)"
)


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    conn.executescript(SCHEMA)
    return conn


class NotesWriter(RowWriter):
    def __init__(self, path: str) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None

    def open(self) -> None:
        self.conn = connect(self.path)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def held(self, topic: str, keys: list[str], columns: set[str]) -> list[dict[str, Any] | None]:
        assert self.conn is not None
        found = dict(self.conn.execute(
            f"SELECT key, row FROM rows WHERE topic = ? AND key IN ({','.join('?' * len(keys))})", [topic, *keys]))
        return [orjson.loads(found[k]) if found.get(k) else None for k in keys]

    def write(self, changes: pa.Table) -> list[Rejected]:
        assert self.conn is not None
        self.conn.execute("BEGIN IMMEDIATE")
        for c in changes.to_pylist():
            held = self.conn.execute("SELECT pos, partition, offset FROM rows WHERE topic = ? AND key = ?",
                                     (c["topic"], c["key"])).fetchone()
            if c["pos"] == "":  # a lone tombstone: over a lower offset of its partition only
                if held is not None and held[1] == c["partition"] and held[2] < c["offset"]:
                    self.conn.execute("UPDATE rows SET row = NULL, offset = ? WHERE topic = ? AND key = ?",
                                      (c["offset"], c["topic"], c["key"]))
                continue
            if held is not None and held[0] >= c["pos"]:
                continue  # the store holds this change or a later one
            row = c["row"] if c["kind"] == "u" else None
            self.conn.execute("INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, ?, ?)",
                              (c["topic"], c["key"], c["pos"], c["partition"], c["offset"], row))
        self.conn.execute("COMMIT")
        return []

    def positions(self, topic: str) -> Iterator[list[tuple[str, str]]]:
        assert self.conn is not None
        yield list(self.conn.execute("SELECT key, pos FROM rows WHERE topic = ? AND row IS NOT NULL", (topic,)))


class NotesStore(RowStore):
    def __init__(self, path: str, name: str = "notes") -> None:
        self.path, self.name, self.where = path, name, f"the notes file {path}"

    def _one(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        conn = connect(self.path)
        try:
            return conn.execute(sql, args).fetchone()
        finally:
            conn.close()

    def load(self) -> dict[str, Any] | None:
        found = self._one("SELECT record FROM meta WHERE name = ?", (self.name,))
        return None if found is None else orjson.loads(found[0])

    def save(self, record: dict[str, Any]) -> None:
        self._one("INSERT OR REPLACE INTO meta VALUES (?, ?)", (self.name, orjson.dumps(record).decode()))

    def clear(self) -> None:
        conn = connect(self.path)
        try:
            conn.execute("DELETE FROM rows")
            conn.execute("DELETE FROM meta WHERE name = ?", (self.name,))
        finally:
            conn.close()

    def writer(self, registry: Registry) -> NotesWriter:
        return NotesWriter(self.path)


def check(config: Config) -> None:
    if not config.notes.path:
        raise ConfigError("[notes] path is empty: set it to the SQLite file the rows go to")


def build(spark: SparkSession, config: Config) -> NotesStore:
    return NotesStore(config.notes.path)


class Generations:
    """The file filled again beside the live one (sinks.rebuild.Generations), then moved over it."""

    name = "notes-rebuild"
    last_pass = False

    def __init__(self, path: str) -> None:
        self.live, self.next = path, f"{path}.rebuild"

    def swapped(self) -> bool:
        return False

    def store(self, swapped: bool) -> NotesStore:
        return NotesStore(self.live if swapped else self.next, name="notes-rebuild")

    def prepare(self, resumed: bool) -> None:
        if not resumed:
            Path(self.next).unlink(missing_ok=True)

    def swap(self) -> int:
        rows = self._one_count()
        os.replace(self.next, self.live)
        return rows

    def _one_count(self) -> int:
        conn = connect(self.next)
        try:
            return int(conn.execute("SELECT count(*) FROM rows WHERE row IS NOT NULL").fetchone()[0])
        finally:
            conn.close()

    def finish(self) -> None:
        pass


def rebuild(config: Config, stop: StopSignal) -> list[str]:
    from sinks.rebuild import rebuild as rebuild_store

    _, rows = rebuild_store(config, "notes", lambda spark: Generations(config.notes.path), stop,
                            "the notes file is untouched")
    return [f"notes rebuild: {rows} rows moved over {config.notes.path}"]


def local(workdir: Path) -> tuple[Any, dict[str, str]]:
    return None, {"CDC_NOTES_PATH": str(workdir / "notes.db")}


def show(config: Config, topics: list[str]) -> list[str]:
    conn = connect(config.notes.path)
    try:
        return [f"{topic} {key} -> {row}" for topic in topics for key, row in conn.execute(
            "SELECT key, row FROM rows WHERE topic = ? AND row IS NOT NULL ORDER BY key", (topic,))]
    finally:
        conn.close()


class _Rows:
    def __init__(self, config: Config) -> None:
        self.path = config.notes.path

    def count(self, topics: list[str]) -> dict[str, int | None]:
        conn = connect(self.path)
        try:
            return {t: int(conn.execute("SELECT count(*) FROM rows WHERE topic = ? AND row IS NOT NULL",
                                        (t,)).fetchone()[0]) for t in topics}
        finally:
            conn.close()

    def close(self) -> None:
        pass


def counter(config: Config) -> _Rows:
    return _Rows(config)
