"""Truncate clean-up: tombstones for the rows a truncate removed, so the log cleaner drops them.

A truncate is one `t` record: every row of the table with a lower position counts as deleted
(compaction.table), but each row's last record stays in the compacted topic for good, and a
new reader replays them all. A tombstone per such key lets the cleaner drop them. A tombstone
carries no position, though: written after a newer record of the same key (a row inserted
again after the truncate), it would delete a live row. So tombstones are only ever written in
the daemon's own ordered producer path, between transactions (`TruncateCleanups`):

1. at the commit of the transaction that truncated (or that carried a clean-up request, a
   logical message from `cdc topics clean-truncated`), a clean-up starts *tracking*: every key
   of the table the daemon sends from then on is noted;
2. once the slot is confirmed past that commit (every earlier record is acknowledged, so it
   is in the topic), a thread reads the topic to its current end as a table and finds the
   keys whose latest record is a live row older than the truncate;
3. the daemon sends a tombstone for each of them that it has not sent a record for since
   step 1, a chunk at a time between transactions. A key written again after step 1 has its
   newer record ahead of where the tombstone would go: it is skipped; a key written between
   step 1 and the tombstone is in the tracked set, so no tombstone can land after a newer record.

With no daemon streaming, `cdc topics clean-truncated` holds the slot's lock (no daemon can
start meanwhile) and writes the tombstones itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import takewhile

import orjson

from cdc.config import TopicConfig
from cdc.events.records import TRUNCATE_KEY, Record
from cdc.kafka.reader import read_topic
from compaction.table import TopicTable

log = logging.getLogger(__name__)

REQUEST = "clean-truncated"  # the logical message's type (prefix: snapshot.incremental.MESSAGE_PREFIX)
CHUNK = 5000  # tombstones sent per pause between transactions
SHUTDOWN_WAIT_S = 5.0  # at shutdown, how long a read that was told to stop may take to let go of its table


def request_message(slot: str, tables: list[str]) -> bytes:
    """The logical message `cdc topics clean-truncated` writes for the daemon on `slot`."""
    return orjson.dumps({"slot": slot, "type": REQUEST, "tables": tables})


def requested_tables(content: bytes, slot: str) -> list[str] | None:
    """The tables a clean-up request names, if `content` is one for `slot`."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or body.get("slot") != slot or body.get("type") != REQUEST:
        return None
    tables = body.get("tables")
    return [t for t in tables if isinstance(t, str)] if isinstance(tables, list) else None


def truncated_keys(table: TopicTable) -> Iterator[bytes]:
    """Keys whose latest record is a live row older than the table's newest truncate."""
    return table.keys_older_than_truncate()


def read_truncated(config: TopicConfig, topic: str) -> tuple[TopicTable, int]:
    """The topic read as a table, and how many of its keys a truncate removed."""
    table = TopicTable(threadsafe=True).extend(read_topic(config, topic))
    return table, sum(1 for _ in truncated_keys(table))


@dataclass
class _Cleanup:
    topic: str
    table: str  # schema.table, for messages
    after_lsn: int  # read once the slot is confirmed past this commit
    touched: set[bytes] = field(default_factory=set)  # keys sent since the clean-up started
    thread: threading.Thread | None = None
    result: TopicTable | None = None
    failure: BaseException | None = None
    keys: Iterator[bytes] | None = None
    sent: int = 0
    ended: bool = False  # the daemon dropped it (rewind, shutdown): a read still running stops and cleans up
    lock: threading.Lock = field(default_factory=threading.Lock)  # `ended` against the read's `result`

    def end(self) -> None:
        """Drop the read's table, or have the read drop it when it is done: nobody waits for it."""
        with self.lock:
            self.ended = True
            if self.result is not None:
                self.result.close()
                self.result = None


class TruncateCleanups:
    """The daemon's side (see the module docstring). The daemon calls `truncated`/`requested`
    as it renders, `committed` at each commit, `saw` for every record it sends while `tracking`,
    `poll` between transactions (it returns tombstones to send), and `rewind` after a rewind."""

    def __init__(self, config: TopicConfig) -> None:
        self.config = config
        self._pending: dict[str, str] = {}  # topic -> table, from the open transaction
        self._active: dict[str, _Cleanup] = {}
        self._next: dict[str, str] = {}  # clean-ups asked for while one of the same table read
        self._last_commit = 0
        self.tracking = False

    def truncated(self, records: Iterable[Record]) -> None:
        """Records of a truncate (one per table): clean each table up after the commit, unless
        `[topic] truncate_cleanup` is off (a request from `cdc topics clean-truncated` still is)."""
        if not self.config.truncate_cleanup:
            return
        for record in records:
            if record.key == TRUNCATE_KEY:
                self._pending[record.topic] = record.table

    def requested(self, tables: dict[str, str]) -> None:
        """A clean-up request (topic -> table) in the open transaction."""
        self._pending.update(tables)

    def committed(self, end_lsn: int) -> None:
        """The open transaction committed: its clean-ups start tracking now."""
        self._last_commit = end_lsn
        for topic, table in self._pending.items():
            running = self._active.get(topic)
            if running is None:
                self._active[topic] = _Cleanup(topic, table, end_lsn)
            elif running.thread is not None:  # it read the topic before this truncate: another one follows
                self._next[topic] = table
        self._pending.clear()
        self.tracking = bool(self._active)

    def saw(self, records: Iterable[tuple[str, bytes, bytes | None, str]]) -> None:
        active = self._active
        for topic, key, _, _ in records:
            cleanup = active.get(topic)
            if cleanup is not None:
                cleanup.touched.add(key)

    def poll(self, confirmed: int) -> list[Record]:
        """Between transactions: start the reads whose commit is confirmed, and return the next
        tombstones of a read that finished."""
        out: list[Record] = []
        for topic, cleanup in list(self._active.items()):
            if cleanup.thread is None and confirmed >= cleanup.after_lsn:
                cleanup.thread = threading.Thread(
                    target=self._read, args=(cleanup,), name=f"cdc-truncate-cleanup-{topic}", daemon=True
                )
                cleanup.thread.start()
            if cleanup.thread is None or cleanup.thread.is_alive():
                continue
            if cleanup.failure is not None:
                log.warning(
                    "truncate clean-up of %s failed (%s): run cdc topics clean-truncated --tables %s",
                    cleanup.table, cleanup.failure, cleanup.table,
                )
                self._end(topic)
                continue
            assert cleanup.result is not None
            if cleanup.keys is None:
                cleanup.keys = truncated_keys(cleanup.result)
            for key in cleanup.keys:
                if key not in cleanup.touched:
                    out.append(Record(topic, key, None, cleanup.table))
                    cleanup.sent += 1
                    if len(out) >= CHUNK:
                        return out
            log.info("truncate clean-up of %s: %d tombstones for rows the truncate removed", cleanup.table, cleanup.sent)
            self._end(topic)
        return out

    def _read(self, cleanup: _Cleanup) -> None:
        """In its own thread. It stops at the next record once the clean-up ended: a rewind after a
        broker failure must not wait for a read of the same broker."""
        table = None
        try:
            table = TopicTable(threadsafe=True)
            table.extend(takewhile(lambda _: not cleanup.ended, read_topic(self.config, cleanup.topic)))
        except Exception as exc:  # noqa: BLE001 (reported by poll, in the daemon's thread)
            cleanup.failure = exc
        with cleanup.lock:
            if cleanup.ended or cleanup.failure is not None:
                if table is not None:
                    table.close()
            else:
                cleanup.result = table

    def _end(self, topic: str) -> None:
        self._active.pop(topic).end()
        table = self._next.pop(topic, None)
        if table is not None:  # between transactions: everything sent so far is in commits up to the last
            self._active[topic] = _Cleanup(topic, table, self._last_commit)
        self.tracking = bool(self._active)

    def rewind(self) -> None:
        """The stream restarts at the confirmed LSN: every clean-up starts over at the next commit
        (tombstones not yet acknowledged may be lost; the records it tracked are sent again). A
        read still running is left to stop by itself: it may be waiting on the broker that failed."""
        self._pending.update(self._next)
        self._next.clear()
        for topic, cleanup in list(self._active.items()):
            self._pending[topic] = cleanup.table
            self._end(topic)

    def close(self) -> None:
        """At shutdown: reads still running are told to stop, and given SHUTDOWN_WAIT_S to let go
        of their tables (a read waiting on a broker that is down does not hold the stop)."""
        self._next.clear()
        reads = [c.thread for c in self._active.values() if c.thread is not None]
        for topic, cleanup in list(self._active.items()):
            if cleanup.sent or cleanup.thread is not None:
                log.warning(
                    "truncate clean-up of %s stopped by the shutdown: run cdc topics clean-truncated --tables %s",
                    cleanup.table, cleanup.table,
                )
            self._end(topic)
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for thread in reads:
            thread.join(max(0.0, deadline - time.monotonic()))
