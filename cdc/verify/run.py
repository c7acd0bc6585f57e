"""`cdc verify`: PostgreSQL, read in a snapshot whose LSN is known, against the topics read as
tables and every store, once each side has applied everything up to that LSN.

1. A REPEATABLE READ snapshot of the captured tables and its LSN L; a logical message
   committed right after it moves the daemon's confirmed LSN past L at once.
2. The topics are complete up to L once the slot is confirmed past it; a store once its sink's
   progress says `complete_lsn` >= L, or (a `--once` run that caught up) when it is complete
   past the last change its table's topic holds. Each wait has the timeout.
3. Per table and side: the digests, then the narrowing and the rounds at newer snapshots of
   compaction.verify, with every side's reader (compaction.verify_topic, sinks.read_*).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from cdc.config import Config, ConfigError
from cdc.kafka.policy import duration
from cdc.source.preflight import check_server, connect_catalog, resolve_tables
from cdc.source.replication import format_lsn
from cdc.verify.postgres import Snapshot, SourceSide, SourceTable
from compaction.verify import EXAMPLES, Digest, Outcome, Side, candidates, differing, example, judge
from compaction.verify_topic import TopicSide
from sinks import stores as registry
from sinks.progress import read_progress

log = logging.getLogger(__name__)

ROUNDS = 3  # looks again at differing keys, each at a newer snapshot
IDLE_S = 10.0  # a slot without a walsender this long: its daemon is not running
RECHECK_LIMIT = 10000  # differing keys per table and side looked at again (beyond: reported as found)


@dataclass
class Report:
    lsn: int
    sides: list[str]
    tables: list[tuple[SourceTable, int, list[Outcome]]] = field(default_factory=list)  # (table, rows, outcomes)
    seconds: float = 0.0
    postgres_seconds: dict[str, float] = field(default_factory=dict)  # topic -> PostgreSQL's digest

    @property
    def ok(self) -> bool:
        return all(o.ok for _, _, outcomes in self.tables for o in outcomes)

    def as_json(self) -> dict[str, Any]:
        return {
            "lsn": format_lsn(self.lsn), "ok": self.ok, "sides": self.sides, "seconds": round(self.seconds, 1),
            "tables": [
                {
                    "table": t.spec.display, "postgres_rows": rows,
                    "postgres_hashed": "in SQL" if t.why_python is None else f"in Python (columns {t.why_python})",
                    "postgres_seconds": round(self.postgres_seconds.get(t.spec.topic, 0.0), 2),
                    "sides": [o.as_json() for o in outcomes],
                }
                for t, rows, outcomes in self.tables
            ],
        }

    def render(self) -> str:
        lines = [f"verify: PostgreSQL at LSN {format_lsn(self.lsn)} against {', '.join(self.sides)}"]
        width = max((len(s) for s in self.sides), default=5)
        bad = 0
        for table, rows, outcomes in self.tables:
            how = "" if table.why_python is None else f" (hashed in Python: columns {table.why_python})"
            lines.append(f"{table.spec.display}: postgres {rows:,} rows{how}")
            for o in outcomes:
                if o.error is not None:
                    lines.append(f"  {o.side:<{width}}  not compared: {o.error}")
                    bad += 1
                    continue
                counts = f"{o.count('missing')} missing, {o.count('extra')} extra, {o.count('different')} different"
                state = ("ok" if o.ok else f"MISMATCH: {counts}") + self._in_flight(o)
                lines.append(f"  {o.side:<{width}}  {o.rows:,} rows  {state}")
                bad += len(o.mismatches)
                for shown in o.examples:
                    detail = "".join(
                        f"; {name}: postgres {_shown(v['postgres'])}, {o.side} {_shown(v[o.side])}"
                        for name, v in shown.get("columns", {}).items()
                    )
                    lines.append(f"    {shown['kind']} {shown['key']}{detail}")
                if o.changing:
                    lines.append(f"    {len(o.changing)} keys changed while they were checked (not compared)")
        if self.ok:
            lines.append(f"verify: every side agrees with PostgreSQL ({self.seconds:.1f} s)")
        else:
            lines.append(f"verify: {bad} mismatches ({self.seconds:.1f} s)")
        return "\n".join(lines)

    def _in_flight(self, o: Outcome) -> str:
        """Why a side's count may differ from PostgreSQL's: the side was counted after the
        snapshot, and the keys that changed in between were checked again at newer ones."""
        changed = o.settled + len(o.changing)
        if not changed:
            return ""
        keys = "1 key" if changed == 1 else f"{changed:,} keys"
        text = f"; counted after the snapshot at LSN {format_lsn(self.lsn)}: {keys} changed in between"
        if o.settled:
            each = f"{o.settled:,} " if o.changing else "each " if o.settled > 1 else ""
            text += f", {each}equal to PostgreSQL when checked again (up to LSN {o.rechecked_at})"
        return text


def _shown(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 80 else text[:77] + "..."


class _Waiter:
    """Waits, with one deadline for the whole run, until a side is complete up to an LSN."""

    def __init__(self, config: Config, source: SourceSide, topic: TopicSide, timeout_s: float) -> None:
        from sinks.progress import read_progress

        self.config, self.source, self.topic = config, source, topic
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self._progress = read_progress

    def _until(self, done: Callable[[], bool]) -> bool:
        while not done():
            if time.monotonic() > self.deadline:
                return False
            time.sleep(0.5)
        return True

    def confirmed(self) -> tuple[int | None, bool]:
        row = self.source.catalog.conn.execute(
            "SELECT confirmed_flush_lsn - '0/0', active FROM pg_replication_slots WHERE slot_name = %s",
            (self.config.source.slot,),
        ).fetchone()
        return (None, False) if row is None else (None if row[0] is None else int(row[0]), bool(row[1]))

    def topics(self, lsn: int) -> str | None:
        """None once the slot is confirmed past `lsn`; else why not (a slot nobody streams from
        for 10 s will not move: no need to wait out the timeout)."""
        idle_since: list[float] = []

        def done() -> bool:
            confirmed, active = self.confirmed()
            if confirmed is None or confirmed >= lsn:
                return True
            if active:
                idle_since.clear()
            elif not idle_since:
                idle_since.append(time.monotonic())
            return bool(idle_since) and time.monotonic() - idle_since[0] > IDLE_S

        self._until(done)
        confirmed, active = self.confirmed()
        if confirmed is not None and confirmed >= lsn:
            return None
        slot = self.config.source.slot
        if confirmed is None:
            return f"slot {slot} does not exist: start cdc run, which creates it and fills the topics"
        why = "no daemon streams from it" if not active else f"not within {self.timeout_s:.0f} s"
        return (
            f"the topics are complete up to {format_lsn(confirmed)} (slot {slot}), not up to the snapshot at "
            f"{format_lsn(lsn)}: {why}; start cdc run (or raise --timeout)"
        )

    def store(self, store: str, table: SourceTable, lsn: int) -> str | None:
        """None once `store` has applied every change of the table up to `lsn`; else why not."""
        def complete() -> int:
            record = self._progress(self.config.topic).get(store) or {}
            return int(record.get("complete_lsn", 0))

        def done() -> bool:
            if complete() >= lsn:
                return True
            # a sink that caught up and stopped (`--once`): nothing in the topic beyond what it applied
            return complete() >= self.topic.newest_commit(table.spec)

        if self._until(done):
            return None
        return (
            f"the sink's progress says the store is complete up to {format_lsn(complete())}, not up to the snapshot "
            f"at {format_lsn(lsn)}, after {duration(int(self.timeout_s * 1000))}: start cdc sink {store} "
            "(or raise --timeout)"
        )


def _sides(config: Config, stores: list[str] | None) -> list[str]:
    """The stores to compare: those asked for (their settings checked before any server is
    asked), or those whose sink has recorded progress."""
    unknown = [s for s in stores or [] if s not in registry.STORES]
    if unknown:
        raise ConfigError(f"unknown store {unknown[0]!r} in --stores: use {', '.join(registry.STORES)}")
    if stores is None:
        ran = read_progress(config.topic)
        stores = [s for s in registry.STORES if s in ran]
    for name in stores:
        registry.check_reader(name, config)
    return stores


def verify(config: Config, patterns: list[str], stores: list[str] | None, timeout_s: float,
           spark: Callable[[], Any] | None = None) -> Report:
    """The whole comparison. `spark`: gives the Spark session for the warehouse (made on first use)."""
    from snapshot.plan import chosen_names

    started = time.monotonic()
    chosen = _sides(config, stores)
    catalog = connect_catalog(config)
    source = SourceSide(config, catalog)
    topic = TopicSide(config.topic)
    made: list[Side] = []
    try:
        check_server(catalog)
        captured = resolve_tables(catalog, config)
        names = chosen_names(captured, patterns)
        lsn = _snapshot(source, config).lsn
        tables = [source.describe(t) for t in captured if t.display in names]
        waiter = _Waiter(config, source, topic, timeout_s)
        sides: list[Side] = [topic]
        for name in chosen:
            made.append(registry.reader(name, config, spark or _local_spark(config)))
            sides.append(made[-1])
        report = Report(lsn, [s.name for s in sides])
        late = waiter.topics(lsn)
        pending: dict[tuple[str, str], dict[bytes, str]] = {}
        with ThreadPoolExecutor(len(sides) + 1, thread_name_prefix="cdc-verify") as pool:
            for table in tables:  # every side's digest at once: each waits on its own server
                ours = pool.submit(_timed, lambda t=table: source.digest(t))
                theirs = [pool.submit(_digest, side, table, lsn, late, waiter) for side in sides]
                reference, seconds = ours.result()
                report.postgres_seconds[table.spec.topic] = seconds
                outcomes = []
                for side, future in zip(sides, theirs, strict=True):
                    outcome, digest = future.result()
                    outcome.reference_rows = sum(n for n, _ in reference.values())
                    if digest is not None:
                        found = _narrow(source, side, table, reference, digest, outcome)
                        if found:
                            pending[(side.name, table.spec.topic)] = found
                    outcomes.append(outcome)
                report.tables.append((table, sum(n for n, _ in reference.values()), outcomes))
        _rounds(report, source, sides, waiter, pending, catalog)
        report.seconds = time.monotonic() - started
        return report
    finally:
        for side in made:
            side.close()  # type: ignore[attr-defined]
        topic.close()
        source.close()
        catalog.close()


def _snapshot(source: SourceSide, config: Config) -> Snapshot:
    """A new snapshot, then a logical message that the daemon commits past it right away."""
    taken = source.snapshot()
    message = orjson.dumps({"slot": config.source.slot, "type": "verify"}).decode()
    source.catalog.conn.execute("SELECT pg_logical_emit_message(true, 'cdc', %s::text)", (message,))
    return taken


T = TypeVar("T")


def _timed(work: Callable[[], T]) -> tuple[T, float]:
    started = time.monotonic()
    return work(), time.monotonic() - started


def _store(side: Side) -> str:
    """The store whose job's progress a side waits for: its name, unless it shows another one
    (the read model's side: "postgres" is the source's name in the report)."""
    return str(getattr(side, "store", side.name))


def _digest(side: Side, table: SourceTable, lsn: int, late: str | None, waiter: _Waiter) -> tuple[Outcome, Digest | None]:
    """One side's digest of a table, once it is complete up to the snapshot (None: it is not)."""
    outcome = Outcome(side.name, table.spec.display, 0, 0)
    started = time.monotonic()
    error = late if late is not None else None if side.name == "topic" else waiter.store(_store(side), table, lsn)
    outcome.waited = time.monotonic() - started
    if error is not None:
        outcome.error = error
        return outcome, None
    digest, outcome.seconds = _timed(lambda: side.digest(table.spec))
    outcome.rows = sum(n for n, _ in digest.values())
    how = getattr(side, "how", None)  # the warehouse reads a table with delta-rs or Spark
    outcome.reader = None if how is None else how(table.spec)
    return outcome, digest


def _narrow(source: SourceSide, side: Side, table: SourceTable, reference: Digest, digest: Digest,
            outcome: Outcome) -> dict[bytes, str]:
    """The keys of the segments whose digests differ that differ (looked at again in rounds)."""
    started = time.monotonic()
    segments = differing(reference, digest)
    if not segments:
        return {}
    found = candidates(source.hashes(table, segments), side.hashes(table.spec, segments))
    if len(found) > RECHECK_LIMIT:  # a store far from its table: no change in flight explains it, no round needed
        beyond = list(found)[RECHECK_LIMIT:]
        outcome.mismatches.update((k, found.pop(k)) for k in beyond)
    outcome.seconds += time.monotonic() - started
    return found


def _rounds(report: Report, source: SourceSide, sides: list[Side], waiter: _Waiter,
            pending: dict[tuple[str, str], dict[bytes, str]], catalog: Any) -> None:
    """Look again at the differing keys, each round at a newer snapshot (compaction.verify.judge).
    A key the side holds no position for is judged only if PostgreSQL's row did not change from
    the snapshot until after the side was read: the side cannot have applied a newer change."""
    by_name = {s.name: s for s in sides}
    outcomes = {(o.side, t.spec.topic): o for t, _, os in report.tables for o in os}
    tables = {t.spec.topic: t for t, _, _ in report.tables}
    for _ in range(ROUNDS):
        if not pending:
            return
        lsn, visible = _snapshot(source, waiter.config)
        late = waiter.topics(lsn)
        for (name, topic), keys in list(pending.items()):
            table, side, outcome = tables[topic], by_name[name], outcomes[(name, topic)]
            error = late if late is not None else None if name == "topic" else waiter.store(_store(side), table, lsn)
            if error is not None:
                outcome.error = error
                del pending[(name, topic)]
                continue
            wanted = list(keys)
            ours = source.fetch(table, wanted)
            theirs = side.fetch(table.spec, wanted)
            row = catalog.conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()
            wal = int(row[0])
            later = source.fetch(table, wanted, now=True)
            for key in wanted:
                reference = ours[key].values if key in ours else None
                stable = reference == (later[key].values if key in later else None)
                verdict = judge(reference, theirs.get(key), visible, wal, stable)
                if verdict == "changing":
                    continue
                del keys[key]
                if verdict == "agree":  # it changed after the snapshot the side was counted at
                    outcome.settled += 1
                    outcome.rechecked_at = format_lsn(lsn)
                else:
                    outcome.mismatches[key] = verdict
                    if len(outcome.examples) < EXAMPLES:
                        found = theirs.get(key)
                        outcome.examples.append(example(
                            key, verdict, table.spec.columns, reference, None if found is None else found.values, name,
                        ))
            if not keys:
                del pending[(name, topic)]
    for (name, topic), keys in pending.items():
        outcomes[(name, topic)].changing = sorted(keys)


def _local_spark(config: Config) -> Callable[[], Any]:
    """A Spark session for the warehouse's side, made on first use, in whichever thread needs it
    (the caller's, if it has one: looked up now, in the caller's thread, where it is active)."""
    made: list[Any] = []
    lock = threading.Lock()
    loaded = sys.modules.get("pyspark.sql")  # no pyspark loaded: no session to look up
    if loaded is not None and (active := loaded.SparkSession.getActiveSession()) is not None:
        made.append(active)

    def session() -> Any:
        with lock:
            if not made:
                from sinks.spark import build_session, job_conf

                made.append(build_session("cdc-verify", master=config.spark.master, conf=job_conf(config.spark)))
            return made[0]

    return session

