"""`cdc top`: one live picture of a running pipeline, every stage side by side.

- the daemon: events/s and pending records from its `/metrics` when `[daemon] metrics_port`
  is set (else records/s from the table topics' end offsets), the slot's lag in bytes and
  seconds from PostgreSQL;
- each sink job, from its progress records in `<prefix>.__cdc_sinks`: records/s, the LSN its
  store is complete up to, how far that is behind the slot (bytes) and since when the topics
  hold something it lacks (seconds, from the daemon's heartbeats), dead letters, and its
  state against the newest heartbeat (cdc.status.sink_state; docs/monitoring.md);
- each table's rows in PostgreSQL next to each store's (counted every few seconds, in a
  thread of its own, so that the picture stays live while a count is slow).

`Watch.sample()` takes one picture (plain data); `render()` makes it rich renderables; the
CLI and the demo draw them. Nothing here writes to the terminal.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import psycopg

from cdc.config import Config
from cdc.kafka.follow import Follower, Heartbeats
from cdc.kafka.topics import TopicAdmin
from cdc.naming import is_table_topic, parse_topic_name, qualified, table_of_topic
from cdc.source.catalog import Catalog
from cdc.source.preflight import PreflightError, connect_catalog
from cdc.source.replication import format_lsn, parse_lsn
from cdc.status import sink_state, slot_status
from cdc.units import duration, size
from cdc.units import rate as per_second
from sinks.progress import sinks_topic
from sinks.stores import STORES  # the jobs whose store rows are counted (not a search rebuild)

if TYPE_CHECKING:
    from sinks.store import RowCounter

STATE_STYLES = {"caught up": "green", "catching up": "yellow", "no LSN yet": "yellow"}
RATE_WINDOW_S = 10.0  # rates are averages over this much of the recent past
COUNT_TIMEOUT_MS = 2000  # an exact count(*) slower than this falls back to the planner's estimate


# ------------------------------------------------------------------------------ the picture


@dataclass
class DaemonPicture:
    slot: str
    exists: bool = False
    active: bool = False
    pid: int | None = None
    wal_status: str | None = None
    confirmed_lsn: int | None = None
    server_lsn: int | None = None
    lag_bytes: int | None = None
    lag_seconds: float | None = None
    retained_bytes: int | None = None
    events_per_s: float | None = None
    events_total: int | None = None
    events_from: str = ""  # "metrics": the daemon's counters; "topics": the table topics' growth
    pending: int | None = None


@dataclass
class SinkPicture:
    job: str
    complete_lsn: int
    batch: int
    dead_letters: int
    updated_ms: int
    records_total: int | None = None
    records_per_s: float | None = None
    behind_bytes: int | None = None  # the slot's confirmed LSN minus `complete_lsn`
    lag_seconds: float | None = None  # since the topics first held a change the store lacks
    lag_at_least: bool = False  # the heartbeat of that moment is older than those held
    caught_up: bool = False  # complete up to the newest heartbeat: everything the topics are known to hold

    @property
    def state(self) -> str:
        return sink_state(self.complete_lsn, self.caught_up)


@dataclass
class TablePicture:
    topic: str
    table: str  # schema.table as SQL writes it
    source_rows: int | None = None
    source_estimated: bool = False
    stores: dict[str, int | None] = field(default_factory=dict)


@dataclass
class Picture:
    prefix: str
    taken_ms: int
    daemon: DaemonPicture
    sinks: list[SinkPicture]
    tables: list[TablePicture]
    counted_ms: int | None = None  # when the row counts were taken (None: not yet, or off)
    notes: list[str] = field(default_factory=list)

    def stores_equal_source(self) -> bool:
        """Every store's count equals the source's for every table (counts taken)."""
        return self.counted_ms is not None and all(
            t.source_rows is not None and not t.source_estimated
            and all(n == t.source_rows for job, n in t.stores.items())
            for t in self.tables
        )

    def caught_up(self, jobs: Iterable[str], lsn: int) -> bool:
        """Each of `jobs` is complete up to `lsn` and up to the newest heartbeat (caught up),
        and holds the source's row counts."""
        done = {s.job for s in self.sinks if s.complete_lsn >= lsn and s.caught_up}
        return set(jobs) <= done and self.stores_equal_source() and all(set(jobs) <= set(t.stores) for t in self.tables)


# ------------------------------------------------------------------------------ rates


def rate(points: deque[tuple[float, int]], now: float) -> float | None:
    """Per second over the last RATE_WINDOW_S, from (time, running total) points in time order:
    from the newest point at or before the window's start (or the oldest held) to the newest.
    A counter that went down (a restart) counts from 0 after the point before it."""
    if len(points) < 2:
        return None
    start = now - RATE_WINDOW_S
    base = points[0]
    for point in points:
        if point[0] <= start:
            base = point
    newest = points[-1]
    drops = [i for i in range(len(points) - 1) if points[i + 1][1] < points[i][1]]
    if drops and points[drops[-1]][0] >= base[0]:  # counting began again after that point
        base = (points[drops[-1]][0], 0)
    elapsed = max(now - base[0], 1e-3)
    return max(0, newest[1] - base[1]) / elapsed


# ------------------------------------------------------------------------------ the watch


class Watch:
    """Takes pictures of one deployment (the configuration of its daemon and sinks)."""

    def __init__(self, config: Config, counts_every_s: float | None = 5.0) -> None:
        self.config = config
        self.prefix = config.topic.prefix
        self.catalog = connect_catalog(config)
        self.admin = TopicAdmin(config.topic)
        self.progress = Follower(config.topic, sinks_topic(self.prefix), client_id="cdc-top")
        self.heartbeats = Heartbeats(config.topic, config.source.slot)
        self.latest: dict[str, dict[str, Any]] = {}
        self.sink_points: dict[str, deque[tuple[float, int]]] = {}
        self.event_points: deque[tuple[float, int]] = deque(maxlen=600)
        daemon = config.daemon
        host = "127.0.0.1" if daemon.metrics_host in ("0.0.0.0", "::", "") else daemon.metrics_host
        self.metrics_url = f"http://{host}:{daemon.metrics_port}/metrics" if daemon.metrics_port else None
        self.table_topics: list[str] = []
        self.counts: dict[str, Any] = {}  # the counting thread's last result
        self.counts_every_s = counts_every_s
        self._stop = threading.Event()
        self._counter: threading.Thread | None = None
        if counts_every_s is not None:
            self._counter = threading.Thread(target=self._count_loop, name="cdc-top-counts", daemon=True)
            self._counter.start()

    # -- one picture ----------------------------------------------------------------------
    def sample(self) -> Picture:
        now = time.time()
        notes: list[str] = []
        self.table_topics = [t for t in self.admin.topics_with_prefix(self.prefix) if is_table_topic(self.prefix, t)]
        daemon = self._daemon(now, notes)
        sinks = self._sinks(now, daemon)
        counts = dict(self.counts)
        tables = []
        for topic in self.table_topics:
            name = table_of_topic(topic)
            source = counts.get("source", {}).get(topic, (None, False))
            stores = {s.job: counts.get(s.job, {}).get(topic) for s in sinks if s.job in STORES}
            tables.append(TablePicture(topic, name, source[0], source[1], stores))
        if counts.get("error"):
            notes.append(f"counting rows: {counts['error']}")
        return Picture(self.prefix, int(now * 1000), daemon, sinks, tables, counts.get("taken_ms"), notes)

    def _daemon(self, now: float, notes: list[str]) -> DaemonPicture:
        picture = DaemonPicture(self.config.source.slot)
        self.catalog.ensure_connected()
        slot = slot_status(self.catalog.conn, self.config.source.slot)
        if slot is not None:
            picture.exists, picture.active, picture.pid = True, bool(slot["active"]), slot["active_pid"]
            picture.wal_status = slot["wal_status"]
            if slot["confirmed_flush_lsn"]:
                picture.confirmed_lsn = parse_lsn(slot["confirmed_flush_lsn"])
            picture.server_lsn = parse_lsn(slot["server_lsn"])
            picture.lag_bytes, picture.lag_seconds = slot["lag_bytes"], slot["lag_seconds"]
            picture.retained_bytes = slot["retained_wal_bytes"]
        total = None
        if self.metrics_url is not None:
            try:
                scraped = scrape(self.metrics_url)
                total = int(sum(v for (name, _), v in scraped.items() if name == "cdc_events_total"))
                picture.pending = int(scraped.get(("cdc_pending_records", ()), 0))
                picture.events_from = "metrics"
            except OSError as exc:
                notes.append(f"daemon metrics at {self.metrics_url}: {exc}")
        if total is None:
            offsets = self.admin.end_offsets(self.table_topics) if self.table_topics else {}
            total = sum(o for parts in offsets.values() for o in parts.values())
            picture.events_from = "topics"
        if self.event_points and self.event_points[-1][1] > total and picture.events_from == "metrics":
            self.event_points.clear()  # the daemon restarted: its counters began again
        self.event_points.append((now, total))
        picture.events_total = total
        picture.events_per_s = rate(self.event_points, now)
        return picture

    def _sinks(self, now: float, daemon: DaemonPicture) -> list[SinkPicture]:
        for record in self.progress.poll():
            if record.key is None:
                continue
            job = record.key.decode()
            if record.value is None:  # a finished rebuild's tombstone
                self.latest.pop(job, None)
                self.sink_points.pop(job, None)
                continue
            value = orjson.loads(record.value)
            self.latest[job] = value
            if value.get("records") is not None:
                points = self.sink_points.setdefault(job, deque(maxlen=600))
                points.append((value["ts_ms"] / 1000, int(value["records"])))
        self.heartbeats.poll()
        newest_beat = self.heartbeats.newest
        out = []
        for job, value in sorted(self.latest.items()):
            complete = int(value["complete_lsn"])
            sink = SinkPicture(
                job, complete, int(value.get("batch", 0)), int(value.get("dead_letters", 0)), int(value["ts_ms"]),
            )
            if value.get("records") is not None:
                sink.records_total = int(value["records"])
                points = self.sink_points.get(job, deque())
                sink.records_per_s = rate(deque([*points, (now, sink.records_total)]), now) if points else None
            if not complete:  # no LSN known yet: nothing to measure a distance from
                out.append(sink)
                continue
            if daemon.confirmed_lsn is not None:
                sink.behind_bytes = max(0, daemon.confirmed_lsn - complete)
            _, sink.lag_seconds, sink.lag_at_least = self.heartbeats.lag(complete, now)
            sink.caught_up = newest_beat is not None and complete >= newest_beat
            out.append(sink)
        return out

    # -- the row counts ---------------------------------------------------------------------
    def _count_loop(self) -> None:
        from sinks.stores import counter as store_counter

        counters: dict[str, RowCounter] = {}
        catalog: Catalog | None = None
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                topics, jobs = list(self.table_topics), [j for j in list(self.latest) if j in STORES]
                result: dict[str, Any] = {}
                try:
                    if catalog is None:
                        catalog = connect_catalog(self.config)
                    catalog.ensure_connected()
                    result["source"] = count_source(catalog.conn, topics)
                    for job in jobs:
                        if job not in counters:
                            counters[job] = store_counter(job, self.config)
                        counter = counters[job]
                        try:
                            result[job] = counter.count(topics)
                        except Exception as exc:  # a store down: its column shows "?" and why
                            result[job] = {}
                            result["error"] = f"{job}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                    result["taken_ms"] = int(time.time() * 1000) if topics else None
                except (psycopg.Error, PreflightError) as exc:
                    result["error"] = f"PostgreSQL: {str(exc).strip().splitlines()[0]}"
                self.counts = result
                assert self.counts_every_s is not None
                self._stop.wait(max(0.5, self.counts_every_s - (time.monotonic() - started)))
        finally:
            for counter in counters.values():
                counter.close()
            if catalog is not None:
                catalog.close()

    def close(self) -> None:
        self._stop.set()
        if self._counter is not None:
            self._counter.join(30)
        self.progress.close()
        self.heartbeats.close()
        self.admin.close()
        self.catalog.close()


def count_source(conn: psycopg.Connection, topics: list[str]) -> dict[str, tuple[int | None, bool]]:
    """Each captured table's rows: (count, estimated). An exact count(*) unless it takes longer
    than COUNT_TIMEOUT_MS, then the planner's estimate (pg_class.reltuples)."""
    out: dict[str, tuple[int | None, bool]] = {}
    conn.autocommit = True
    for topic in topics:
        try:
            _, schema, table = parse_topic_name(topic)
        except ValueError:
            continue
        name = qualified(schema, table)
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL statement_timeout = {COUNT_TIMEOUT_MS}")
                row = conn.execute(f"SELECT count(*) FROM {name}").fetchone()
            out[topic] = (int(row[0]) if row else None, False)
        except psycopg.errors.QueryCanceled:
            row = conn.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", (name,)).fetchone()
            out[topic] = (max(0, int(row[0])) if row else None, True)
        except psycopg.errors.UndefinedTable:
            out[topic] = (None, False)  # a topic whose table was dropped
    return out


def scrape(url: str, timeout_s: float = 2.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus endpoint's samples: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


# ------------------------------------------------------------------------------ rendering


def seconds(s: float | None, at_least: bool = False) -> str:
    return ("≥ " if at_least and s is not None else "") + duration(s)


def render(picture: Picture, title: str = "cdc top") -> Any:
    """The picture as rich renderables: the daemon and its slot, the sinks, the rows."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def table(name: str, columns: list[str], left: tuple[str, ...] = ()) -> Table:
        out = Table(title=name, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for column in columns:
            out.add_column(column, justify="left" if column in left else "right", no_wrap=True)
        return out

    d = picture.daemon
    when = time.strftime("%H:%M:%S", time.localtime(picture.taken_ms / 1000))
    head = Text.assemble((title, "bold"), f"   prefix {picture.prefix}   slot {d.slot}   {when}")
    daemon = table("daemon", ["slot", "events/s", "events", "confirmed", "slot lag", "lag", "WAL kept", "pending"],
                   ("slot",))
    if not d.exists:
        state = Text("absent", style="red")
    elif d.active:
        state = Text("active" + (f" pid {d.pid}" if d.pid else ""), style="green")
    else:
        state = Text("inactive", style="yellow")
    if d.wal_status and d.wal_status not in ("reserved", "extended"):
        state.append(f" WAL {d.wal_status}", style="red")
    daemon.add_row(
        state, per_second(d.events_per_s) + (" (topics)" if d.events_from == "topics" else ""),
        "-" if d.events_total is None else f"{d.events_total:,}",
        "-" if d.confirmed_lsn is None else format_lsn(d.confirmed_lsn), size(d.lag_bytes), seconds(d.lag_seconds),
        size(d.retained_bytes), "-" if d.pending is None else f"{d.pending:,}",
    )
    sinks = table("sinks", ["sink", "records/s", "records", "complete up to", "behind slot", "lag", "dead letters",
                            "batch", "updated", "state"], ("sink", "state"))
    for s in picture.sinks:
        age = max(0.0, (picture.taken_ms - s.updated_ms) / 1000)
        sinks.add_row(
            s.job, per_second(s.records_per_s), "-" if s.records_total is None else f"{s.records_total:,}",
            format_lsn(s.complete_lsn) if s.complete_lsn else "-", size(s.behind_bytes),
            seconds(s.lag_seconds, s.lag_at_least),
            Text(f"{s.dead_letters:,}", style="red" if s.dead_letters else ""), str(s.batch), seconds(age) + " ago",
            Text(s.state, style=STATE_STYLES[s.state]),
        )
    if not picture.sinks:
        sinks.add_row("none yet", *[""] * 9)
    jobs = [s.job for s in picture.sinks if s.job in STORES]
    rows = table("rows", ["table", "PostgreSQL", *jobs, ""], ("table", ""))
    for t in picture.tables:
        source = "…" if t.source_rows is None else ("~" if t.source_estimated else "") + f"{t.source_rows:,}"
        cells = []
        for job in jobs:
            n = t.stores.get(job)
            style = "" if n is None or t.source_rows is None else "green" if n == t.source_rows else "yellow"
            cells.append(Text("…" if n is None else f"{n:,}", style=style))
        equal = t.source_rows is not None and all(t.stores.get(j) == t.source_rows for j in jobs)
        mark = Text("") if not jobs else Text("=", style="green") if equal else Text("≠", style="yellow")
        rows.add_row(t.table, source, *cells, mark)
    if picture.counted_ms is not None:
        rows.caption = f"counted {max(0.0, (picture.taken_ms - picture.counted_ms) / 1000):.0f} s ago"
        rows.caption_justify = "left"
    parts: list[Any] = [head, daemon, sinks, rows]
    parts += [Text(f"note: {n}", style="yellow") for n in picture.notes]
    return Group(*parts)
