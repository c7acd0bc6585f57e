"""Incremental snapshots inside the streaming daemon: DBLog's watermark method.

Streaming never pauses. Per chunk (the next `chunk_size` keys of a table, in key order) the
daemon, in one REPEATABLE READ transaction, notes which transactions its snapshot cannot
see (`pg_current_snapshot()`), COPYs the chunk and writes a watermark as a transactional
logical message. While it keeps streaming, every change to a chunk key by a transaction
the chunk could not see drops that key from the chunk: the streamed change is newer. When
the watermark arrives in the stream the remaining rows go out as `op: "r"` events at the
watermark's position `(H, 0)`: every change before it is either visible in the chunk or was
dropped, every change after it has a higher position. (DBLog opens the window at a low
watermark; deciding by transaction visibility also covers a transaction that committed in
WAL before the low watermark but was not yet visible to the chunk's snapshot.)

Progress is made durable only once the slot is confirmed past a chunk's watermark, so a
restart never resends older stream events after a chunk that counts as done.
"""

from __future__ import annotations

import copy
import logging
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass

import orjson
import psycopg

from cdc.config import Config
from cdc.events.records import TRUNCATE_KEY, Record, TableEvents, Txn
from cdc.source.catalog import CapturedTable, Catalog
from cdc.source.replication import format_lsn, pinned_conninfo
from snapshot.copy_text import parse_line
from snapshot.initial import table_events
from snapshot.state import Incremental, SnapshotState
from snapshot.tables import SnapshotTable, describe

log = logging.getLogger(__name__)

MESSAGE_PREFIX = "cdc"
RECENT_COMMITS = 4096
_XID_MASK = 0xFFFFFFFF


class Visibility:
    """Which 32-bit xids (as pgoutput names transactions) a `pg_current_snapshot()` sees."""

    def __init__(self, snapshot: str) -> None:
        _, xmax, xip = snapshot.split(":")
        self.xmax = int(xmax) & _XID_MASK
        self.in_progress = {int(x) & _XID_MASK for x in xip.split(",") if x}

    def sees(self, xid: int | None) -> bool:
        if xid is None or xid in self.in_progress:
            return False
        return ((xid - self.xmax) & _XID_MASK) >= 0x80000000  # xid precedes xmax, modulo wraparound


@dataclass
class Chunk:
    table: SnapshotTable
    events: TableEvents
    watermark: str
    visibility: Visibility
    rows: dict[bytes, bytes]  # key -> row JSON
    last_key: list[str] | None
    exhausted: bool


def signal_message(slot: str, tables: list[str]) -> bytes:
    """The logical message `cdc snapshot` writes to ask the daemon on `slot` for a snapshot."""
    return orjson.dumps({"slot": slot, "type": "snapshot", "tables": tables, "id": uuid.uuid4().hex})


class IncrementalSnapshots:
    def __init__(self, config: Config, catalog: Catalog, tables: list[CapturedTable], durable: SnapshotState) -> None:
        self.config = config
        self.catalog = catalog
        self.captured = {t.display: t for t in tables}
        self.durable = durable
        self.live = copy.deepcopy(durable)
        self.chunk: Chunk | None = None
        self.closed_events: TableEvents | None = None  # the table of the chunk closed last
        self.progress: deque[tuple[int, SnapshotState]] = deque()  # (watermark LSN, state after that chunk)
        # xids of the last commits streamed, oldest first; an OrderedDict drops its oldest in
        # O(1), where a dict's first key is found past every slot deleted before it
        self.recent: OrderedDict[int, None] = OrderedDict()
        self._conn: psycopg.Connection | None = None

    # -- requests ----------------------------------------------------------------------------
    def request(self, tables: list[str]) -> bool:
        """Queue tables; True when the durable state changed (the caller writes it out)."""
        added = []
        for name in tables:
            if name not in self.captured:
                log.warning("incremental snapshot of %s ignored: it is not a captured table", name)
                continue
            queued = self.live.incremental.tables if self.live.incremental else []
            if name in queued:
                log.warning("incremental snapshot of %s is already running or queued", name)
                continue
            added.append(name)
        if not added:
            return False
        for state in (self.live, self.durable, *(s for _, s in self.progress)):
            if state.incremental is None:
                state.incremental = Incremental([])
            state.incremental.tables.extend(t for t in added if t not in state.incremental.tables)
        log.info("incremental snapshot queued for %s", ", ".join(added))
        return True

    def on_message(self, content: bytes, lsn: int, txn: Txn | None) -> tuple[list[Record], bool]:
        """A logical message with our prefix: (chunk records to send, durable state changed)."""
        try:
            body = orjson.loads(content)
        except orjson.JSONDecodeError:
            log.warning("ignoring a malformed %r logical message at %s", MESSAGE_PREFIX, format_lsn(lsn))
            return [], False
        if not isinstance(body, dict) or body.get("slot") != self.config.source.slot:
            return [], False  # for another daemon on the same database
        if body.get("type") == "snapshot":
            tables = body.get("tables")
            if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
                log.warning("ignoring a snapshot request at %s without a list of table names", format_lsn(lsn))
                return [], False
            return [], self.request(tables)
        if body.get("type") == "watermark" and self.chunk is not None and body.get("id") == self.chunk.watermark:
            assert txn is not None
            return self._close_chunk(txn, lsn), False
        return [], False  # a watermark of a chunk abandoned by a rewind

    # -- chunks ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.live.incremental is not None and bool(self.live.incremental.tables)

    def next_chunk(self) -> None:
        """Read the next chunk and write its watermark, unless one is already open."""
        if self.chunk is not None or not self.busy:
            return
        inc = self.live.incremental
        assert inc is not None
        name = inc.tables[0]
        captured = self.captured.get(name)
        if captured is None:
            log.warning("incremental snapshot of %s dropped: the table is no longer captured", name, extra={"table": name})
            inc.tables.pop(0)
            inc.after = None
            return
        conn = self._connection()
        watermark = uuid.uuid4().hex
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        try:
            table = describe(conn, captured)
            visible = conn.execute("SELECT pg_current_snapshot()::text").fetchone()[0]  # type: ignore[index]
            with conn.cursor().copy(table.copy_sql(after=inc.after, limit=self.config.snapshot.chunk_size)) as cp:
                lines = [parse_line(line) for line in cp]
            conn.execute(
                "SELECT pg_logical_emit_message(true, %s, %s::text)",
                (MESSAGE_PREFIX, orjson.dumps({"slot": self.config.source.slot, "type": "watermark", "id": watermark}).decode()),
            )
            conn.execute("COMMIT")
        except BaseException:
            if not conn.closed and not conn.broken:
                conn.execute("ROLLBACK")
            raise
        visibility = Visibility(visible)
        if not visibility.in_progress.isdisjoint(self.recent):
            log.info("chunk of %s read while a streamed commit was not yet visible: reading it again", name)
            return  # its watermark arrives without a chunk and is ignored
        events = table_events(self.catalog, self.config, table)
        rows = dict(events.encode(values) for values in lines)
        key_indexes = table.key_indexes
        last = [lines[-1][i] for i in key_indexes] if lines else None
        self.chunk = Chunk(
            table, events, watermark, visibility, rows, last,  # type: ignore[arg-type]
            exhausted=len(lines) < self.config.snapshot.chunk_size,
        )

    def note_commit(self, xid: int | None) -> None:
        """A commit was streamed. PostgreSQL streams a commit once it is flushed, but a snapshot
        sees it only a moment later (with synchronous replication, after the standby answered):
        a chunk whose snapshot still counts such a transaction as running is read again."""
        if xid is None:
            return
        recent = self.recent
        recent[xid] = None
        if len(recent) > RECENT_COMMITS:
            recent.popitem(last=False)

    def saw(self, records: list[Record], xid: int | None) -> None:
        """A streamed change: drop its keys from the open chunk if the chunk could not see it."""
        chunk = self.chunk
        if chunk is None or chunk.visibility.sees(xid):
            return
        for record in records:
            if record.topic == chunk.events.topic:
                if record.key == TRUNCATE_KEY:
                    chunk.rows.clear()
                else:
                    chunk.rows.pop(record.key, None)

    def _close_chunk(self, txn: Txn, lsn: int) -> list[Record]:
        chunk = self.chunk
        assert chunk is not None
        self.chunk = None
        events = chunk.events
        source = events.source(txn.commit_ts_us, "incremental", txn.commit_lsn, 0, None, txn.commit_lsn)
        self.closed_events = events  # the daemon publishes its shape, should it be new
        records = [
            Record(events.topic, key, events.envelope("r", None, after, source), events.name)
            for key, after in chunk.rows.items()
        ]
        inc = self.live.incremental
        assert inc is not None
        inc.chunks += 1
        inc.rows += len(records)
        inc.after = chunk.last_key
        if chunk.exhausted:
            name = inc.tables.pop(0)
            log.info("incremental snapshot of %s complete: %d chunks, %d rows", name, inc.chunks, inc.rows,
                     extra={"table": name})
            self.live.mark_done(name)
            inc.after, inc.chunks, inc.rows = None, 0, 0
            if not inc.tables:
                self.live.incremental = None
                if self.live.initial == "running":  # an interrupted initial snapshot, now finished
                    self.live.initial = "done"
        self.progress.append((lsn, copy.deepcopy(self.live)))
        return records

    # -- durability --------------------------------------------------------------------------
    def confirmed(self, lsn: int) -> SnapshotState | None:
        """The state to write once the slot is confirmed up to `lsn`, if it moved."""
        latest = None
        while self.progress and self.progress[0][0] < lsn:
            latest = self.progress.popleft()[1]
        if latest is not None:
            self.durable = latest
        return latest

    def rewind(self) -> None:
        """The stream restarts at the confirmed LSN: forget everything not yet durable."""
        self.live = copy.deepcopy(self.durable)
        self.chunk = None
        self.progress.clear()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(
                pinned_conninfo(self.config.source.dsn, application_name="cdc-incremental-snapshot"), autocommit=True
            )
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
