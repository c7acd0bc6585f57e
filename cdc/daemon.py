"""`cdc run`: stream committed changes from the slot into the compacted topics.

The durability rule: an LSN is confirmed to PostgreSQL only after the broker acknowledged
every record up to that commit, so a crash anywhere re-sends and never skips. The ordering
rule: after any producer error the daemon drops the producer and rewinds the replication
stream to the last confirmed LSN (resending is harmless, reordering is not).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import psycopg
from kafka.errors import KafkaError

from cdc import accel
from cdc.config import Config, TopicConfig
from cdc.events.changes import ChangeRenderer, NoKey
from cdc.events.records import TRUNCATE_KEY, KeyUnavailable, Record, TableEvents, Txn
from cdc.events.shapes import schemas_topic, version_record
from cdc.kafka.acks import Acks, WaitStopped
from cdc.kafka.heartbeat import INTERVAL_S as HEARTBEAT_INTERVAL_S
from cdc.kafka.heartbeat import heartbeat_record, heartbeat_topic
from cdc.kafka.history import RETENTION_MS as HISTORY_RETENTION_MS
from cdc.kafka.history import Sample, metrics_topic
from cdc.kafka.policy import kind_of, problems
from cdc.kafka.producer import Producer, ProducerError, RecordTooLarge, make_producer
from cdc.kafka.topics import TopicAdmin, TopicError
from cdc.metrics import Metrics
from cdc.naming import topic_name
from cdc.oneline import first_line
from cdc.source import pgoutput
from cdc.source.preflight import PreflightError, check_server, connect_catalog, resolve_tables
from cdc.source.publication import ensure_publication
from cdc.source.replication import (
    KEEPALIVE,
    XLOG_DATA,
    ReplicationConnection,
    ReplicationLost,
    format_lsn,
    parse_keepalive,
    parse_lsn,
    parse_xlogdata,
)
from cdc.source.slots import (
    SlotState,
    check_slot,
    claim_slot,
    slot_holder,
    slot_state,
    try_claim_slot,
)
from cdc.source.spill import SpillStore
from compaction.truncates import TruncateCleanups, requested_tables
from snapshot.incremental import MESSAGE_PREFIX, IncrementalSnapshots
from snapshot.initial import InitialSnapshot, SnapshotStopped, table_events
from snapshot.plan import SnapshotRefused, captured_names
from snapshot.plan import plan as plan_snapshot
from snapshot.state import SnapshotState, deliver, load_state, send_state, state_topic
from snapshot.tables import describe

log = logging.getLogger(__name__)

ProducerFactory = Callable[[TopicConfig, dict[str, int]], Producer]
_CHANGES = frozenset((pgoutput.Insert, pgoutput.Update, pgoutput.Delete, pgoutput.Truncate))


class FatalError(Exception):
    """Stop without confirming past the failure; the message names the fix."""


class _Backoff:
    """Exponential backoff that logs once per state change, not once per attempt."""

    def __init__(self, what: str, first_s: float = 0.5, max_s: float = 30.0) -> None:
        self.what, self.first_s, self.max_s = what, first_s, max_s
        self.delay = 0.0
        self.failing_since: float | None = None

    def failed(self, reason: str) -> float:
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.warning("%s lost (%s); retrying with backoff", self.what, reason)
            self.delay = self.first_s
        else:
            self.delay = min(self.delay * 2, self.max_s)
        return self.delay

    def recovered(self) -> None:
        if self.failing_since is not None:
            log.warning("%s back after %.1f s", self.what, time.monotonic() - self.failing_since)
            self.failing_since = None


class Daemon:
    """The streaming pipeline of one slot: preflight, the initial snapshot, then changes into
    the topics until stopped, surviving lost connections and broker failures.

    `prepare()` turns every bad input into one line before anything is streamed; `run()`
    streams. What may be confirmed to PostgreSQL is `acks.confirmed` (cdc.kafka.acks); the daemon
    reconnects after a lost connection and rewinds after a producer error, never skips.
    """

    def __init__(self, config: Config, producer_factory: ProducerFactory = make_producer) -> None:
        self.config = config
        self.producer_factory = producer_factory
        self.metrics = Metrics()
        self.stopping = False
        self.server_wal_end = 0
        self.repl: ReplicationConnection | None = None
        self.last_status = 0.0
        self.sent_confirmed = -1
        self.topic_limits: dict[str, int] = {}
        self.partition_counts: dict[str, int] = {}
        self.acks = Acks(
            config.daemon.max_pending_records, self.topic_limits,
            on_commit=self.metrics.transactions.inc, while_waiting=self._answer_server,
            stopping=lambda: self.stopping,
        )
        self._txn: Txn | None = None
        self._stream_xid: int | None = None
        self._table_counts: dict[str, int] = {}
        self._versions: dict[str, bytes] = {}  # topic -> the shape last sent to the schema topic
        self._heartbeat: tuple[int, float] = (0, 0.0)  # (LSN, monotonic time) of the last heartbeat
        self._bytes = 0
        self._totals = [0, 0]  # events and bytes produced since the start, for the metrics history
        self._sampled_at = 0.0  # monotonic time of the last history sample
        self._exported: tuple[ReplicationConnection, str] | None = None
        self.cleanups = TruncateCleanups(config.topic)  # tombstones for the rows truncates removed

    # -- start-up -------------------------------------------------------------------------
    def prepare(self, only_tables: list[str] | None = None, stop_when_done: bool = False) -> None:
        """Preflight and setup: every bad input fails here with one line. For `cdc snapshot`:
        `only_tables` limits the snapshot (not the capture), `stop_when_done` exits after it."""
        self._install_signals()
        self._serve_metrics()
        self._connect_source()
        with _refused(ValueError):
            only = captured_names(self.tables, only_tables)
        state = self._ensure_topics()
        slot = self._plan_snapshot(state, only, stop_when_done)
        self._resume_or_drop_slot(slot)
        self._set_up_capture()
        log.info(
            "capturing %d tables from slot %s at %s%s", len(self.tables), self.config.source.slot,
            format_lsn(self.acks.confirmed),
            "" if accel.native is not None else f" ({accel.describe()}: every row takes the slower path)",
        )

    def _serve_metrics(self) -> None:
        """Before anything is created: a metrics port in use is a start-up mistake."""
        cfg = self.config.daemon
        if not cfg.metrics_port:
            return
        try:
            self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            raise PreflightError(
                f"cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port} ({exc.strerror or exc}): "
                "set [daemon] metrics_port to a free port (0 turns metrics off) or fix metrics_host"
            ) from None

    def _connect_source(self) -> None:
        """The catalog connection, the server's settings, the slot's lock and the captured tables."""
        cfg = self.config
        self.catalog = connect_catalog(cfg)
        check_server(self.catalog)
        claim_slot(self.catalog, cfg)
        self.tables = resolve_tables(self.catalog, cfg)

    def _ensure_topics(self) -> SnapshotState | None:
        """Every table's topic and the state topic exist; returns the slot's durable state."""
        cfg = self.config
        with _refused(TopicError):
            self.admin = TopicAdmin(cfg.topic)
            by_count: dict[int, list[str]] = {}  # [topic] partitions, or the table's table_partitions entry
            for t in self.tables:
                by_count.setdefault(cfg.topic.partitions_of(t.schema, t.table), []).append(
                    topic_name(cfg.topic.prefix, t.schema, t.table)
                )
            infos = {}
            for count, topics in sorted(by_count.items()):
                infos.update(self.admin.ensure(topics, count))
            internal = [state_topic(cfg.topic.prefix), schemas_topic(cfg.topic.prefix), heartbeat_topic(cfg.topic.prefix)]
            infos.update(self.admin.ensure(internal, partitions=1))
            if cfg.daemon.metrics_interval_s:
                history = [metrics_topic(cfg.topic.prefix)]
                infos.update(self.admin.ensure(history, 1, log_only=True, retention_ms=HISTORY_RETENTION_MS))
            state = load_state(cfg)
        self._remember_topics(infos)
        for name, info in sorted(infos.items()):
            for problem in problems(name, kind_of(cfg.topic.prefix, name), info.configs, info.replication_factor, cfg.topic):
                if problem.setting != "cleanup.policy" or "compact" in info.cleanup_policy.split(","):
                    log.warning("%s", problem.line())  # (a topic not compacted was refused, or allowed, above)
        return state

    def _plan_snapshot(self, state: SnapshotState | None, only: list[str] | None, stop_when_done: bool) -> SlotState:
        """Which snapshot to take, from the slot and the durable state; returns the slot as found."""
        cfg = self.config
        slot = slot_state(self.catalog, cfg.source.slot)
        with _refused(SnapshotRefused):
            self.plan = plan_snapshot(
                cfg.snapshot.mode, cfg.source.slot, cfg.topic.prefix, slot.exists, slot.wal_status == "lost", state,
                [t.display for t in self.tables], only,
            )
        self.plan.stop_when_done |= stop_when_done
        return slot

    def _resume_or_drop_slot(self, slot: SlotState) -> None:
        """Stream on from an existing slot's confirmed LSN, or drop one the plan replaces."""
        name = self.config.source.slot
        if self.plan.drop_lost_slot:
            log.warning("dropping slot %s, which lost WAL it needed, to take a new snapshot", name)
            self.catalog.conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
        elif slot.exists:
            slot = check_slot(self.catalog, self.config)
            self.acks.confirmed = slot.confirmed_flush_lsn or 0

    def _set_up_capture(self) -> None:
        """Publication, renderer and spill store; a new slot when the plan needs one."""
        cfg = self.config
        ensure_publication(self.catalog, cfg, self.tables)
        self.renderer = ChangeRenderer(
            self.catalog, cfg.topic.prefix, self.catalog.database(), cfg.source.tables, cfg.events.schemas,
            skip_truncates=cfg.events.skipped_operations == "t",
        )
        self.spill = SpillStore(Path(cfg.daemon.spill_dir) / cfg.source.slot)
        if self.plan.create_slot:
            self._create_slot()
        self.incremental = IncrementalSnapshots(cfg, self.catalog, self.tables, self.plan.state)
        if self.plan.incremental:
            self.incremental.request(self.plan.incremental)

    def _create_slot(self) -> None:
        """The durable state says "running" before the slot exists, so no crash from here on
        can leave a slot whose snapshot counts as done."""
        cfg, plan = self.config, self.plan
        producer = self._producer()
        if plan.truncate_first:  # acknowledged before the state: until it is replaced, a restart cuts off again
            self._cut_off_older_rows(producer)
            deliver(producer, cfg.topic.delivery_timeout_ms / 1000)
        send_state(producer, cfg.topic.prefix, plan.state)
        deliver(producer, cfg.topic.delivery_timeout_ms / 1000)
        repl = self._connect_replication()
        created = repl.create_slot(cfg.source.slot, export_snapshot=bool(plan.initial))
        log.info("created slot %s at %s", cfg.source.slot, format_lsn(created.consistent_point),
                 extra={"lsn": format_lsn(created.consistent_point)})
        self.acks.confirmed = plan.state.consistent_point = created.consistent_point
        if plan.initial:
            assert created.snapshot_name is not None  # asked for with export_snapshot
            self._exported = (repl, created.snapshot_name)  # kept idle until the snapshot is read
        else:
            repl.close()
        send_state(producer, cfg.topic.prefix, plan.state)  # from here on a snapshot was started through the slot
        deliver(producer, cfg.topic.delivery_timeout_ms / 1000)

    def _cut_off_older_rows(self, producer: Producer) -> None:
        """A re-snapshot after a lost slot: rows deleted while the slot was gone would survive in
        the compacted topic, so a truncate event below the new snapshot's position cuts off
        everything older (every earlier commit is below the current WAL position)."""
        if self.config.events.skipped_operations == "t":
            log.warning(
                "re-snapshot: truncate events are skipped ([events] skipped_operations = \"t\"), so rows deleted while "
                "the slot was gone stay in the topics"
            )
            return
        row = self.catalog.conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        position = parse_lsn(row[0]) - 1  # type: ignore[index]
        for table in self.tables:
            if table.display not in self.plan.initial:
                continue
            renderer_table = table_events(self.catalog, self.config, describe(self.catalog.conn, table))
            source = renderer_table.source(time.time_ns() // 1000, "false", position, 0, None)
            producer.send(renderer_table.topic, TRUNCATE_KEY, renderer_table.envelope("t", None, None, source))
        log.warning("re-snapshot: older rows in the topics are cut off by truncate events at %s", format_lsn(position),
                    extra={"lsn": format_lsn(position)})

    def _producer(self) -> Producer:
        if self.acks.producer is None:
            self.acks.producer = self.producer_factory(self.config.topic, dict(self.partition_counts))
        return self.acks.producer

    def _initial_snapshot(self) -> None:
        cfg, state = self.config, self.plan.state
        assert self._exported is not None  # _create_slot exported it
        repl, snapshot_name = self._exported
        try:
            producer = self._producer()
            chosen = [t for t in self.tables if t.display in self.plan.initial]
            InitialSnapshot(
                cfg, self.catalog, state, self.acks, self.partition_counts, lambda: self.stopping, self._snapshot_produced
            ).run(snapshot_name, self.acks.confirmed, chosen)
            state.initial = "done"
            send_state(producer, cfg.topic.prefix, state)
            deliver(producer, cfg.topic.delivery_timeout_ms / 1000)
        finally:
            repl.close()
            self._exported = None

    def _remember_topics(self, infos: dict) -> None:
        for name, info in infos.items():
            known = self.partition_counts.get(name)
            if known is not None and known != info.partitions:
                raise FatalError(
                    f"topic {name} changed from {known} to {info.partitions} partitions under a running pipeline: "
                    "per-key order is lost; recreate the topic and re-snapshot"
                )
            self.partition_counts[name] = info.partitions
            self.topic_limits[name] = info.max_message_bytes

    def _connect_replication(self) -> ReplicationConnection:
        return ReplicationConnection(self.config.source.dsn)

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Run until SIGTERM/SIGINT, or until a fatal error, raised as FatalError once the
        acknowledged changes are confirmed (its message is the one line for the user)."""
        self._install_signals()
        cfg = self.config
        try:
            if self._exported is not None and not self._initial_snapshot_completed():
                self._finish(10)
                return
            self._stream_until_stopped()
            if not self.stopping:
                log.info("snapshot complete (initial_only, or cdc snapshot): stopping")
            log.info("stopping: flushing and confirming")
            self._finish(cfg.topic.delivery_timeout_ms / 1000)
        except _FATAL as exc:
            log.error("%s", exc)
            self._finish(10)
            raise FatalError(str(exc)) from None

    def _initial_snapshot_completed(self) -> bool:
        """Take the initial snapshot; False when a signal stopped it. A database or broker
        failure is fatal here: the next start resumes the snapshot incrementally."""
        try:
            self._initial_snapshot()
        except (SnapshotStopped, WaitStopped):
            log.info("stopped during the initial snapshot: the next start finishes it incrementally")
            return False
        except (psycopg.Error, *_PRODUCER_ERRORS) as exc:
            raise FatalError(
                f"the initial snapshot failed ({first_line(exc)}): fix the cause and start again; the tables "
                "not yet complete are then snapshotted incrementally while streaming"
            ) from None
        return True

    def _stream_until_stopped(self) -> None:
        """Stream until stopped (or the snapshot of `cdc snapshot` is done): reconnect after a
        lost connection, rewind to the confirmed LSN after a producer error."""
        cfg = self.config
        repl_backoff = _Backoff("PostgreSQL replication connection")
        broker_backoff = _Backoff("Kafka broker")
        while not self.stopping and not self._snapshot_finished():
            try:
                if self.acks.producer is None:
                    self._producer()
                    broker_backoff.recovered()
                self._reclaim_slot()
                self._start_replication()
                repl_backoff.recovered()
                log.info("streaming from %s", format_lsn(self.acks.confirmed), extra={"lsn": format_lsn(self.acks.confirmed)})
                self._stream()
            except (ReplicationLost, psycopg.OperationalError) as exc:
                self.metrics.errors.labels("replication").inc()
                self._stop_if_unrecoverable(exc)
                self._close_replication()
                try:  # confirm what the broker has before reconnecting; it may be away too
                    self.acks.drain(cfg.topic.delivery_timeout_ms / 1000)
                except _PRODUCER_ERRORS as broker_exc:
                    self._producer_failed(broker_exc, broker_backoff)
                self._sleep(repl_backoff.failed(first_line(exc)))
            except _PRODUCER_ERRORS as exc:
                self._producer_failed(exc, broker_backoff)
            except WaitStopped:
                pass  # stopping while the broker held the window full: _finish drains what it can

    def _producer_failed(self, exc: BaseException, backoff: _Backoff) -> None:
        """Rewind to the confirmed LSN: a record the broker did not acknowledge is sent again
        with everything after it, never alone (DESIGN: a lone retry reorders a key)."""
        self.metrics.errors.labels("producer").inc()
        log.error(
            "producer error (%s): rewinding to the last confirmed LSN %s",
            first_line(exc), format_lsn(self.acks.confirmed), extra={"lsn": format_lsn(self.acks.confirmed)},
        )
        self._rewind()
        self._sleep(backoff.failed(first_line(exc)))

    def _reclaim_slot(self) -> None:
        """After the catalog connection was re-established, its advisory lock on the slot is
        new: another cdc process may have taken the slot in between."""
        slot = self.config.source.slot
        if self.catalog.ensure_connected() and not try_claim_slot(self.catalog, slot):
            raise FatalError(
                f"slot {slot} was claimed by another cdc process (PostgreSQL backend PID "
                f"{slot_holder(self.catalog, slot)}) while this one reconnected: stop one of them"
            )

    def _start_replication(self) -> None:
        """A fresh stream from the confirmed LSN; everything decoded after it is forgotten."""
        cfg = self.config
        self.repl = self._connect_replication()
        self.renderer.reset()
        self._versions.clear()
        self.incremental.rewind()
        self.spill.clear()
        self.decoder = pgoutput.Decoder()
        self._txn = None
        self._stream_xid = None
        self.repl.start(
            cfg.source.slot, self.acks.confirmed, cfg.source.publication,
            cfg.source.protocol_version, cfg.source.streaming,
        )

    def _stop_if_unrecoverable(self, exc: ReplicationLost | psycopg.OperationalError) -> None:
        """Raise FatalError when the server's error code says reconnecting cannot help."""
        slot = self.config.source.slot
        if exc.sqlstate == _UNDEFINED_OBJECT:
            raise FatalError(
                f"streaming stopped ({first_line(exc)}): changes after LSN {format_lsn(self.acks.confirmed)} "
                "were not captured; check [source] slot and publication, then start again with a fresh "
                "snapshot of the tables (cdc run recreates a missing slot and publication)"
            ) from None
        if exc.sqlstate == _SLOT_INVALIDATED:
            raise FatalError(
                f"slot {slot} can no longer stream ({first_line(exc)}): its WAL is gone; "
                f"drop it with SELECT pg_drop_replication_slot('{slot}') and start again "
                "with a fresh snapshot of the tables"
            ) from None

    def _stream(self) -> None:
        repl = self.repl
        assert repl is not None
        status_interval = self.config.source.status_interval_s
        handle, send, advance = self._handle, self._send, self.acks.advance
        incremental, cleanups = self.incremental, self.cleanups
        while not self.stopping and not self._snapshot_finished():
            advance()
            if cleanups.tracking and self._txn is None and self._stream_xid is None:
                tombstones = cleanups.poll(self.acks.confirmed)  # only between transactions, in stream order
                if tombstones:
                    send(tombstones)
            if incremental.busy and incremental.chunk is None:
                incremental.next_chunk()
            messages = repl.read(0.2)
            render_xlogdata = self.renderer.render_xlogdata
            for message in messages:
                kind = message[0]
                if kind == XLOG_DATA:
                    txn = self._txn
                    if render_xlogdata is not None and txn is not None and self._stream_xid is None:
                        # an insert, update or delete rendered in C; None for everything else
                        records = render_xlogdata(message, txn)
                        if records is not None:
                            if incremental.chunk is not None:
                                incremental.saw(records, txn.xid)
                            send(records)
                            continue
                    start, _, payload = parse_xlogdata(message)
                    handle(start, payload)
                elif kind == KEEPALIVE:
                    wal_end, reply = parse_keepalive(message)
                    self._server_at(wal_end)
                    if reply:
                        advance()
                        self._send_status(force=True)
            now = time.monotonic()
            if now - self.last_status >= min(1.0, status_interval) or (
                self.acks.confirmed != self.sent_confirmed and now - self.last_status >= 0.1
            ):
                advance()
                self._send_status()

    def _server_at(self, wal_end: int) -> None:
        """Idle advance: with nothing pending and no open transaction, every commit below the
        walsender's position was already received and acknowledged, so the slot may move on
        (no WAL pile-up while the captured tables are idle and others write)."""
        self.server_wal_end = max(self.server_wal_end, wal_end)
        if self._txn is None and self._stream_xid is None:
            self.acks.caught_up(wal_end)

    # -- messages -------------------------------------------------------------------------
    def _handle(self, change_lsn: int, payload: memoryview) -> None:
        if self._stream_xid is not None and payload[0] != pgoutput.STREAM_STOP:
            self.spill.append(self._stream_xid, change_lsn, payload)  # may still abort: disk, not topic
            return
        msg = self.decoder.decode(payload)
        kind = type(msg)
        if kind in _CHANGES:
            self._change(msg, self._txn, change_lsn)  # type: ignore[arg-type]
        elif isinstance(msg, pgoutput.Begin):
            self._txn = Txn(msg.final_lsn, msg.commit_ts_us, msg.xid)
        elif isinstance(msg, pgoutput.Commit):
            self._committed(self._txn.xid, msg.end_lsn, msg.commit_ts_us)  # type: ignore[union-attr,arg-type]
            self._txn = None
        elif isinstance(msg, pgoutput.Relation):
            self._relation(msg, self._txn)
        elif isinstance(msg, pgoutput.StreamStart):
            self._stream_xid = msg.xid
        elif isinstance(msg, pgoutput.StreamStop):
            self._stream_xid = None
        elif isinstance(msg, pgoutput.StreamCommit):
            self._replay(msg)
        elif isinstance(msg, pgoutput.StreamAbort):
            self.spill.abort(msg.xid, msg.subxid)
        elif isinstance(msg, pgoutput.Message) and msg.prefix == MESSAGE_PREFIX:
            self._message(msg)
        # Origin, Type and other logical decoding messages carry nothing for the topics

    def _message(self, msg: pgoutput.Message) -> None:
        """A snapshot signal or one of our watermarks. A signal's new state goes out with the
        signal's own transaction, so the slot is never confirmed past an unrecorded request."""
        tables = requested_tables(msg.content, self.config.source.slot)
        if tables is not None:  # `cdc topics clean-truncated`: clean up after this transaction commits
            prefix, captured = self.config.topic.prefix, {t.display: t for t in self.tables}
            known = [captured[name] for name in tables if name in captured]
            self.cleanups.requested({topic_name(prefix, t.schema, t.table): t.display for t in known})
            return
        records, changed = self.incremental.on_message(msg.content, msg.lsn, self._txn)
        if records:
            self._publish_version(self.incremental.closed_events, self._txn)
            self._send(records)
        if changed:
            send_state(self.acks.producer, self.config.topic.prefix, self.incremental.durable)  # type: ignore[arg-type]

    def _snapshot_finished(self) -> bool:
        """`initial_only` and `cdc snapshot`: stop once the snapshot is complete and acknowledged."""
        return self.plan.stop_when_done and not self.incremental.busy and self.acks.settled()

    def _replay(self, commit: pgoutput.StreamCommit) -> None:
        """A streamed transaction committed: produce it from its spill file, in order."""
        txn = Txn(commit.commit_lsn, commit.commit_ts_us, commit.xid)
        decoder = pgoutput.Decoder(in_stream=True)
        n = -1
        for n, (change_lsn, payload) in enumerate(self.spill.replay(commit.xid)):
            msg = decoder.decode(payload)
            if type(msg) in _CHANGES:
                self._change(msg, txn, change_lsn)
            elif isinstance(msg, pgoutput.Relation):
                self._relation(msg, txn)
            if n % 5000 == 4999:
                self.acks.advance()
                self._send_status()
        log.info(
            "streamed transaction %d committed at %s: produced from %d spilled messages",
            commit.xid, format_lsn(commit.commit_lsn), n + 1, extra={"lsn": format_lsn(commit.commit_lsn)},
        )
        self._committed(commit.xid, commit.end_lsn, commit.commit_ts_us)

    def _change(self, msg: object, txn: Txn, change_lsn: int) -> None:
        """One Insert, Update, Delete or Truncate of `txn`, as it streams or from a spill file."""
        records = self.renderer.records(msg, txn, change_lsn)
        if self.incremental.chunk is not None:
            self.incremental.saw(records, txn.xid)
        self._send(records)
        if type(msg) is pgoutput.Truncate:
            self.cleanups.truncated(records)

    def _relation(self, msg: pgoutput.Relation, txn: Txn | None) -> None:
        """A table's shape: the renderer's from now on, and the schema topic's (once per shape)."""
        self.renderer.relation(msg)
        self._publish_version(self.renderer.tables.get(msg.oid), txn)

    def _committed(self, xid: int, end_lsn: int, commit_ts_us: int) -> None:
        """A transaction's commit: its acknowledgement, and what waited for it to commit."""
        self.acks.commit(end_lsn, commit_ts_us)
        self.incremental.note_commit(xid)
        self.cleanups.committed(end_lsn)

    def _publish_version(self, events: TableEvents | None, txn: Txn | None) -> None:
        """A table's new shape goes to the schema topic ahead of its first event (once per
        shape and connection: a reconnect resends every Relation, and the shape again)."""
        if events is None:
            return
        shape = orjson.dumps(events.shape)
        if self._versions.get(events.topic) == shape:
            return
        from_lsn = txn.commit_lsn if txn is not None else self.acks.confirmed
        self._bytes += self.acks.send([version_record(events, from_lsn)])  # not a table's event: not counted
        self._versions[events.topic] = shape

    def _send(self, records: list[Record]) -> None:
        """The records of one change (all of one table, except a multi-table truncate)."""
        self._bytes += self.acks.send(records)
        if self.cleanups.tracking:
            self.cleanups.saw(records)
        counts = self._table_counts
        for _, _, _, table in records:
            counts[table] = counts.get(table, 0) + 1

    def _snapshot_produced(self, table: str, rows: int, size: int) -> None:
        """Snapshot rows count as the table's events at once: the readers send them through
        producers of their own, and no walsender answer flushes counts during the snapshot."""
        self.metrics.events.labels(table).inc(rows)
        self.metrics.bytes.inc(size)
        self._totals[0] += rows
        self._totals[1] += size

    def _send_status(self, force: bool = False) -> None:
        """Answer the walsender, then send the records that report progress (snapshot
        progress, heartbeat, metrics sample). Only from the stream loop: these sends may wait
        for room themselves, so `Acks.make_room` calls `_answer_server` alone."""
        lag_seconds = self._answer_server(force)
        if lag_seconds is None:
            return
        confirmed, now = self.sent_confirmed, self.last_status
        if self.incremental.progress and self.incremental.progress[0][0] < confirmed:
            self._record_progress()
        self._beat(confirmed, now)
        self._sample(confirmed, now, lag_seconds)

    def _answer_server(self, force: bool = False) -> float | None:
        """Confirm `acks.confirmed` to the walsender (at most every 0.1 s unless `force`) and
        bring the gauges up to date; returns the lag in seconds, or None when throttled.

        This is all the daemon does while it waits for the broker to make room, so it sends
        no record and waits on nothing: a send here would wait for room again, and again."""
        repl = self.repl
        if repl is None:
            return None
        now = time.monotonic()
        if not force and now - self.last_status < 0.1:
            return None
        confirmed = self.acks.confirmed
        repl.send_status(confirmed)
        self.last_status = now
        self.sent_confirmed = confirmed
        m = self.metrics
        m.acked_lsn.set(confirmed)
        m.server_lsn.set(self.server_wal_end)
        m.lag_bytes.set(max(0, self.server_wal_end - confirmed))
        oldest = self.acks.oldest_commit_ts_us()
        lag_seconds = max(0.0, time.time() - oldest / 1e6) if oldest is not None else 0.0
        m.lag_seconds.set(lag_seconds)
        m.pending.set(self.acks.in_flight())
        for table, count in self._table_counts.items():
            m.events.labels(table).inc(count)
            self._totals[0] += count
        self._table_counts.clear()
        m.bytes.inc(self._bytes)
        self._totals[1] += self._bytes
        self._bytes = 0
        return lag_seconds

    def _sample(self, confirmed: int, now: float, lag_seconds: float) -> None:
        """A point of the daemon's history every `metrics_interval_s` (see cdc.kafka.history)."""
        interval = self.config.daemon.metrics_interval_s
        if not interval or now - self._sampled_at < interval or self.acks.producer is None:
            return
        sample = Sample(
            self.config.source.slot, int(time.time() * 1000), confirmed, max(self.server_wal_end, confirmed),
            round(lag_seconds, 3), self._totals[0], self._totals[1], self.acks.in_flight(),
        )
        self.acks.send([sample.record(self.config.topic.prefix)])
        self._sampled_at = now

    def _beat(self, confirmed: int, now: float) -> None:
        """Tell consumers how far the topics are complete (see cdc.kafka.heartbeat)."""
        lsn, sent_at = self._heartbeat
        if confirmed > lsn and now - sent_at >= HEARTBEAT_INTERVAL_S and self.acks.producer is not None:
            self.acks.send([heartbeat_record(self.config.topic.prefix, self.config.source.slot, confirmed)])
            self._heartbeat = (confirmed, now)

    def _record_progress(self, wait_s: float = 0.0) -> None:
        """Incremental snapshot progress becomes durable only once the server's slot is past the
        chunk's watermark: a restart from below it would resend older changes after the chunk."""
        deadline = time.monotonic() + wait_s
        while True:
            confirmed = slot_state(self.catalog, self.config.source.slot).confirmed_flush_lsn
            state = None if confirmed is None else self.incremental.confirmed(confirmed)
            if state is not None:
                if self.acks.producer is not None:
                    send_state(self.acks.producer, self.config.topic.prefix, state)
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    # -- recovery and shutdown --------------------------------------------------------------
    def _rewind(self) -> None:
        """Drop the producer and everything unconfirmed: the stream restarts at `acks.confirmed`."""
        self._close_replication()
        self.acks.rewind()
        self.cleanups.rewind()

    def _close_replication(self) -> None:
        if self.repl is not None:
            self.repl.close()
            self.repl = None

    def _finish(self, timeout_s: float) -> None:
        """Wait for outstanding acknowledgements, confirm what was acknowledged, let go."""
        drained = True
        try:
            self.acks.drain(timeout_s)
        except _PRODUCER_ERRORS as exc:
            drained = False
            log.error("records not acknowledged at shutdown (%s): they will be sent again on restart", exc)
        try:  # the last heartbeat and sample only through a broker that answers: they may wait for room
            if drained:
                self._send_status(force=True)
            else:
                self._answer_server(force=True)
        except (ReplicationLost, WaitStopped, *_PRODUCER_ERRORS):
            pass
        self._close_replication()
        if self.incremental.progress and self.acks.producer is not None:
            try:  # the walsender applies the last status as it goes: then the progress behind it is safe
                self._record_progress(wait_s=5)
                self.acks.drain(timeout_s)
            except (ProducerError, psycopg.Error) as exc:
                log.warning("snapshot progress not recorded at shutdown (%s): the last chunks are read again", exc)
        self.incremental.close()
        self.cleanups.close()
        if self.acks.producer is not None:
            self.acks.producer.close()
        log.info("stopped at confirmed LSN %s", format_lsn(self.acks.confirmed), extra={"lsn": format_lsn(self.acks.confirmed)})

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))

    def _install_signals(self) -> None:
        def stop(signum, _frame) -> None:
            log.info("received %s", signal.Signals(signum).name)
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


_FATAL = (FatalError, NoKey, KeyUnavailable, RecordTooLarge)
# a record not acknowledged, or the Kafka client failing outright (no broker, metadata timeout)
_PRODUCER_ERRORS = (ProducerError, KafkaError)
# SQLSTATEs after which reconnecting cannot help: the slot or the publication was dropped
# (undefined_object), the slot was invalidated and its WAL is gone (object_not_in_prerequisite_state)
_UNDEFINED_OBJECT, _SLOT_INVALIDATED = "42704", "55000"


@contextmanager
def _refused(*errors: type[Exception]) -> Iterator[None]:
    """Preflight: these errors already name the fix, so they stop the start with their one line."""
    try:
        yield
    except errors as exc:
        raise PreflightError(str(exc)) from None
