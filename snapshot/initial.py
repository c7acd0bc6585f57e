"""The initial snapshot, aligned to the slot: every row as an `op: "r"` event at `(C, 0)`.

The slot is created with `SNAPSHOT 'export'` and its replication connection is kept idle
until the end, so every reader can import that snapshot: the rows are exactly the state at
the consistent point C, and streaming from C afterwards gives no gap and no duplicate.

Readers are processes (rendering is CPU-bound Python), one COPY each: whole small tables,
large ones split by primary-key ranges sampled inside the same snapshot. Each reader has
its own producer; the coordinator emits each table's final row itself, so the Debezium
markers ("last_in_data_collection", "last") land on rows that really are last.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field

import psycopg

from cdc.config import Config, secrets_of
from cdc.events.changes import ChangeRenderer
from cdc.events.records import TableEvents
from cdc.events.shapes import version_record
from cdc.kafka.acks import Acks
from cdc.kafka.producer import Producer, make_producer
from cdc.naming import qualified, quote_literal, topic_name
from cdc.redact import setup_logging
from cdc.source.catalog import CapturedTable, Catalog
from cdc.source.replication import format_lsn, pinned_conninfo
from snapshot.copy_text import parse_line
from snapshot.progress import Progress
from snapshot.state import SnapshotState, deliver, send_state
from snapshot.tables import SnapshotTable, describe

log = logging.getLogger(__name__)

SAMPLES_PER_RANGE = 1000  # keys sampled (whole pages, TABLESAMPLE SYSTEM) per range to place its bounds
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Task:
    """One COPY: a whole table, or the keys in (after, upto]."""

    table: SnapshotTable
    after: list[str] | None = None
    upto: list[str] | None = None


@dataclass
class RangeDone:
    rows: int
    bytes: int  # key and value bytes of those rows, for the daemon's metrics
    last: list[str | None] | None  # the final row, held back for the coordinator to mark


@dataclass
class _TableRun:
    table: SnapshotTable
    tasks: int
    rows: int = 0
    held: list[list[str | None]] = field(default_factory=list)


class SnapshotStopped(Exception):
    """SIGTERM/SIGINT during the snapshot: the state stays "running" and a restart finishes it."""


# -- readers (worker processes) ---------------------------------------------------------------
_progress_queue: multiprocessing.Queue | None = None


@dataclass
class _Reader:
    """What a reader process keeps from its first range to its last: one connection inside
    the exported snapshot (one transaction, every COPY in it), the catalog, one producer for
    every captured topic and each table's renderer. Opened per range, they cost more than
    reading a small table: a wide schema is mostly small tables."""

    config: Config
    snapshot_name: str
    partitions: dict[str, int]
    opened: tuple[Catalog, psycopg.Connection, Producer] | None = None
    events: dict[str, TableEvents] = field(default_factory=dict)

    def open(self) -> tuple[Catalog, psycopg.Connection, Producer]:
        if self.opened is None:
            catalog = Catalog(self.config.source.dsn)
            try:
                conn = import_snapshot(self.config.source.dsn, self.snapshot_name, "cdc-snapshot")
            except BaseException:
                catalog.close()
                raise
            self.opened = catalog, conn, make_producer(self.config.topic, self.partitions)
        return self.opened

    def table_events(self, table: SnapshotTable) -> TableEvents:
        found = self.events.get(table.display)
        if found is None:
            catalog = self.open()[0]
            found = self.events[table.display] = table_events(catalog, self.config, table)
        return found

    def close(self) -> None:
        if self.opened is not None:
            catalog, conn, producer = self.opened
            self.opened = None
            producer.close()
            conn.close()
            catalog.close()


_reader: _Reader | None = None


def _init_worker(
    queue: multiprocessing.Queue, parent: int, log_level: str, secrets: list[str],
    config: Config, snapshot_name: str, partitions: dict[str, int],
) -> None:
    """A reader must never outlive its coordinator: after a `kill -9` of the daemon, an
    orphan still producing snapshot rows would land them after the restarted daemon's
    newer events (docs/design.md: no snapshot rows from a second process while streaming).
    A spawned reader starts with no logging set up: it gets the daemon's level and masking."""
    global _progress_queue, _reader
    _progress_queue = queue
    setup_logging(log_level, secrets)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when to stop
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the coordinator died before the line above took effect
        os._exit(1)
    _reader = _Reader(config, snapshot_name, partitions)
    atexit.register(_reader.close)  # the pool's shutdown ends the process normally


def import_snapshot(dsn: str, snapshot_name: str, application_name: str) -> psycopg.Connection:
    """A connection inside the exported snapshot, with the walsender's pinned settings."""
    conn = psycopg.connect(pinned_conninfo(dsn, application_name=application_name), autocommit=True)
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    conn.execute(f"SET TRANSACTION SNAPSHOT {quote_literal(snapshot_name)}")
    return conn


def table_events(catalog: Catalog, config: Config, table: SnapshotTable) -> TableEvents:
    """The same renderer the stream uses, fed the relation described from the catalog."""
    renderer = ChangeRenderer(catalog, config.topic.prefix, catalog.database(), [table.display], config.events.schemas)
    captured = table.captured
    renderer.describe(captured.oid, captured.schema, captured.table, list(table.columns))
    events = renderer.table(captured.oid)
    assert events is not None
    return events


def read_range(task: Task, position: int, ts_us: int, limit: int) -> RangeDone:
    """COPY one range in this reader's snapshot, produce every row but the last, wait for
    the acknowledgements."""
    assert _reader is not None, "read_range runs in a reader process (_init_worker)"
    config = _reader.config
    _, conn, producer = _reader.open()
    events = _reader.table_events(task.table)
    source = events.source(ts_us, "true", position, 0, None, position)
    send = _sender(Acks(config.daemon.max_pending_records, {events.topic: limit}, producer=producer), events)
    rows, sent_bytes, held = 0, 0, None
    with conn.cursor().copy(task.table.copy_sql(task.after, task.upto)) as copy:
        for line in copy:
            values = parse_line(line)
            if held is not None:
                sent_bytes += send(held, source)
                rows += 1
                if rows % 5000 == 0 and _progress_queue is not None:
                    _progress_queue.put((task.table.display, 5000))
            held = values
    deliver(producer, config.topic.delivery_timeout_ms / 1000)
    if _progress_queue is not None and rows % 5000:
        _progress_queue.put((task.table.display, rows % 5000))
    return RangeDone(rows, sent_bytes, held)


def _sender(acks: Acks, events: TableEvents) -> Callable[[list, bytes], int]:
    """Render and send one row as a snapshot read (size check and backpressure: `acks`);
    the sender returns the row's key and value bytes."""
    topic, name = events.topic, events.name
    envelope, encode, send = events.envelope, events.encode, acks.send

    def emit(values: list, source: bytes) -> int:
        key, after = encode(values)
        return send(((topic, key, envelope("r", None, after, source), name),))

    return emit


# -- the coordinator ----------------------------------------------------------------------
class InitialSnapshot:
    """The coordinator of the initial snapshot: plans the reads inside the exported snapshot,
    runs them in reader processes, emits each table's final row with its Debezium marker and
    records a table done in the durable state only once all its rows are acknowledged.

    Sends through the daemon's `acks` (its producer, topic limits and backpressure); each
    reader has a producer and an `Acks` of its own, so the rows they produce reach the
    daemon's metrics through `produced(table, rows, bytes)`, one call per finished range."""

    def __init__(
        self, config: Config, catalog: Catalog, state: SnapshotState, acks: Acks,
        partitions: dict[str, int], stopping: Callable[[], bool], produced: Callable[[str, int, int], None],
    ) -> None:
        assert acks.producer is not None
        self.config = config
        self.catalog = catalog
        self.state = state
        self.acks = acks
        self.producer = acks.producer
        self.partitions = partitions
        self.stopping = stopping
        self.produced = produced
        self._events: dict[str, TableEvents] = {}  # per table, its renderer (built by run)

    def run(self, snapshot_name: str, consistent_point: int, tables: list[CapturedTable]) -> None:
        """Snapshot `tables` at C; each table is recorded done in the state once acknowledged."""
        cfg = self.config
        ts_us = time.time_ns() // 1000
        with import_snapshot(cfg.source.dsn, snapshot_name, "cdc-snapshot-plan") as conn:
            described = [describe(conn, t) for t in tables]
            estimates = {t.display: _estimate(conn, t) for t in described}
            tasks = [task for t in described for task in self._split(conn, t, estimates[t.display])]
        log.info(
            "snapshot of %d tables (~%d rows) at %s with %d readers",
            len(described), sum(estimates.values()), format_lsn(consistent_point), cfg.snapshot.parallelism,
        )
        # the shapes the readers render with reach the schema topic before any row
        events_of = self._events = {t.display: table_events(self.catalog, cfg, t) for t in described}
        self.acks.send([version_record(events, consistent_point) for events in events_of.values()])
        deliver(self.producer, cfg.topic.delivery_timeout_ms / 1000)
        runs = {t.display: _TableRun(t, sum(1 for task in tasks if task.table is t)) for t in described}
        progress = Progress(estimates, cfg.snapshot.progress)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        pool = ProcessPoolExecutor(
            cfg.snapshot.parallelism, mp_context=ctx, initializer=_init_worker,
            initargs=(queue, os.getpid(), cfg.daemon.log_level, secrets_of(cfg), cfg, snapshot_name, self.partitions),
        )
        futures: dict[Future, Task] = {}
        try:
            for task in tasks:
                limit = self.acks.limits.get(_topic(cfg, task.table), cfg.topic.max_message_bytes)
                futures[pool.submit(read_range, task, consistent_point, ts_us, limit)] = task
            held: tuple[SnapshotTable, list[str | None]] | None = None
            outstanding = set(futures)
            while outstanding:
                if self.stopping():
                    raise SnapshotStopped()
                finished, outstanding = wait(outstanding, timeout=0.5, return_when=FIRST_COMPLETED)
                _drain(queue, progress)
                complete: list[SnapshotTable] = []
                for future in finished:
                    task = futures[future]
                    done = future.result()  # a reader's error stops the snapshot here
                    run = runs[task.table.display]
                    run.tasks -= 1
                    run.rows += done.rows
                    self.produced(events_of[task.table.display].name, done.rows, done.bytes)
                    if done.last is not None:
                        run.held.append(done.last)
                        progress.add(task.table.display, 1)
                    if run.tasks == 0:
                        held = self._table_complete(run, held, consistent_point, ts_us, complete)
                self._mark_done(complete)
                progress.show()
            self._finish(held, consistent_point, ts_us)
            progress.close()
        finally:
            for process in list(getattr(pool, "_processes", {}).values()):
                if process.is_alive() and self.stopping():
                    process.kill()
            pool.shutdown(wait=True, cancel_futures=True)

    def _split(self, conn: psycopg.Connection, table: SnapshotTable, estimate: int) -> list[Task]:
        """Ranges of about `split_rows` rows from a sample of the keys (inside the same snapshot)."""
        ranges = min(64, math.ceil(estimate / self.config.snapshot.split_rows))
        if ranges < 2 or self.config.snapshot.parallelism < 2:
            return [Task(table)]
        percent = min(100.0, 100.0 * ranges * SAMPLES_PER_RANGE / max(estimate, 1))
        with conn.cursor().copy(table.sample_keys_sql(percent)) as copy:
            sample = [parse_line(line) for line in copy]
        bounds: list[list[str]] = []
        for i in range(1, ranges):
            bound = sample[len(sample) * i // ranges] if sample else None
            if bound is not None and (not bounds or bound != bounds[-1]):
                bounds.append(bound)  # type: ignore[arg-type]
        edges: list[list[str] | None] = [None, *bounds, None]
        return [Task(table, edges[i], edges[i + 1]) for i in range(len(edges) - 1)]

    def _table_complete(
        self, run: _TableRun, held: tuple[SnapshotTable, list[str | None]] | None, position: int, ts_us: int,
        complete: list[SnapshotTable],
    ) -> tuple[SnapshotTable, list[str | None]] | None:
        """Emit a table's held-back rows; keep its very last one until we know whether it is the
        snapshot's last. The previous table's last row is now known to be "last_in_data_collection".
        Tables whose rows are all sent are added to `complete`, for `_mark_done`."""
        rows = run.held
        log.info("snapshot of %s: %d rows", run.table.display, run.rows + len(rows), extra={"table": run.table.display})
        if not rows:  # an empty table: the previous table's last row may still be the snapshot's last
            complete.append(run.table)
            return held
        if held is not None:
            self._emit(held[0], held[1], "last_in_data_collection", position, ts_us)
            complete.append(held[0])
        for values in rows[:-1]:
            self._emit(run.table, values, "true", position, ts_us)
        return run.table, rows[-1]

    def _finish(self, held: tuple[SnapshotTable, list[str | None]] | None, position: int, ts_us: int) -> None:
        if held is not None:
            self._emit(held[0], held[1], "last", position, ts_us)
            self._mark_done([held[0]])

    def _emit(self, table: SnapshotTable, values: list[str | None], marker: str, position: int, ts_us: int) -> None:
        events = self._events[table.display]
        size = _sender(self.acks, events)(values, events.source(ts_us, marker, position, 0, None, position))
        self.produced(events.name, 1, size)

    def _mark_done(self, tables: list[SnapshotTable]) -> None:
        """Durable before the next tables count: their records and then the state acknowledged.
        The tables that finished together share the two round trips (a wide schema's small
        tables finish many at a time)."""
        if not tables:
            return
        deliver(self.producer, self.config.topic.delivery_timeout_ms / 1000)
        for table in tables:
            self.state.mark_done(table.display)
        send_state(self.producer, self.config.topic.prefix, self.state)
        deliver(self.producer, self.config.topic.delivery_timeout_ms / 1000)


def _topic(config: Config, table: SnapshotTable) -> str:
    return topic_name(config.topic.prefix, table.captured.schema, table.captured.table)


def _estimate(conn: psycopg.Connection, table: SnapshotTable) -> int:
    """pg_class.reltuples when the table was ever analyzed, else a count in the snapshot."""
    row = conn.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s", (table.captured.oid,)).fetchone()
    if row is not None and row[0] >= 0:
        return int(row[0])
    counted = conn.execute(f"SELECT count(*) FROM {qualified(table.captured.schema, table.captured.table)}").fetchone()
    return int(counted[0]) if counted else 0


def _drain(queue: multiprocessing.Queue, progress: Progress) -> None:
    while True:
        try:
            table, rows = queue.get_nowait()
        except Exception:
            return
        progress.add(table, rows)
