"""Capture by table count: cdc against the real Debezium connector, from 1 to 10,000 tables.

    python bench/width.py [--tables 1,100,1000] [--changes 100000] [--writers 4]
                          [--skip-warmup] [--keep]

bench/debezium.py's services and machinery: one throwaway PostgreSQL (bench/capture.py's
settings, more lock slots for thousands of tables), one Apache Kafka broker and one Kafka
Connect worker with Debezium's PostgreSQL connector, tuned as bench/debezium.py tunes it; cdc
runs with `[topic] client = "confluent"`. Both write topics of ONE partition per table:
Debezium's default (`topic.creation.default.partitions=1`) and cdc's `[topic] partitions`
default. For each N in --tables, a new database holds N tables `public.t0 .. t{N-1}` (`id int
PRIMARY KEY, v int, note text`) and one publication of them, made before any pipeline starts.
Then each side in turn (the order alternates from one N to the next), with its own slot and
topic prefix:

1. Start-up: from launching `python -m cdc run` (`[snapshot] mode = "never"`: no initial
   snapshot) or creating the connector (`snapshot.mode=no_data`) until the pipeline streams
   into every table's topic: its slot is active in pg_replication_slots, then one transaction
   inserts a row into each table and the clock stops once every table's topic exists and holds
   that row. Debezium creates a table's topic at the table's first record, cdc creates them all
   before it streams: the inserts are what makes Debezium's exist, written for both sides alike.
2. Drain: the pipeline is stopped (cdc's daemon gets SIGTERM and exits; Debezium's connector is
   deleted, its offsets and slot stay, as in bench/debezium.py), pgbench writes --changes
   single-row INSERT transactions (autocommit: one commit each) spread round-robin over the N
   tables from --writers connections, then the pipeline starts again and is timed until its
   topics hold every change (the sum of their high watermarks). The rate runs from its first
   record to the last; the time from its start to the first record is shown apart (restart).
3. The slot is dropped and the side's topics deleted before the other side starts: the broker
   holds one side's N partitions at a time.

A warm-up pass of both sides over one table comes first, not recorded (--skip-warmup: none):
Debezium's and the broker's JVMs would otherwise be cold in the 1-table figures only.

CPU is utime + stime from /proc of the process groups during the drain (bench/debezium.py's
TreeCpu), reported per change: the side's (cdc's daemon, or Connect's JVM) and the broker's JVM
from the first record on, PostgreSQL's processes over the whole drain (the walsender decodes the
backlog from the moment the pipeline connects, mostly before the first record lands). While a
drain runs, the bench reads the high watermarks of two topics (the tables written first and
last) and, once the last is complete, those of every topic: polling a thousand partitions every
50 ms would cost the broker CPU of its own. Results go to stdout as tables and to
bench/results/width.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture  # noqa: E402  (this checkout's cdc on sys.path, the processes and /proc helpers)
import debezium  # noqa: E402  (the services, both pipelines, following their topics, TreeCpu)
import figures  # noqa: E402

from cdc.local.postgres import find_pg_bin_dir  # noqa: E402
from cdc.naming import topic_name  # noqa: E402

NAME = "width"
TITLE = "Capture by table count, cdc against Debezium"
PARTITIONS = 1  # per table, both sides: Debezium's default and cdc's [topic] partitions default
#: a transaction touching every table (the publication, the first rows) takes a lock on each
#: and its key index: 10,000 tables need more than the default 64 slots per connection
PG_SETTINGS = {**capture.PG_SETTINGS, "max_locks_per_transaction": "512"}
CREATE_AT_ONCE = 500  # tables created per transaction
START_TIMEOUT_S = 1800.0  # a start-up at 10,000 tables included
FULL_CHECK_S = 0.1  # between two reads of every topic's watermark, once the last table is complete
TARGET_TABLES = 1000  # the targets are stated at 1,000 tables
COLUMNS = "id integer PRIMARY KEY, v integer, note text"
SIDES = {"cdc": "cdc (confluent)", "debezium": "Debezium"}
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")


@dataclass
class SideRun:
    """One side at one table count."""

    tables: int
    side: str
    startup_s: float  # launch -> every table's topic holds its first row
    active_s: float  # launch -> the slot is active
    drain: debezium.Measure | None = None
    write_tps: float = 0.0  # pgbench's transactions/s while the pipeline was stopped
    held: int = 0  # records in the table topics after the drain
    expected: int = 0  # ... the rows written into the tables since the slot was made
    startup_log: str = ""  # cdc: where its start-up went, from its log


def changes_into(table: int, tables: int, changes: int) -> int:
    """Changes the round-robin writes put into table `table` (change k goes to table k % tables)."""
    return 0 if table >= changes else (changes - 1 - table) // tables + 1


class Probe:
    """Records in a side's table topics while it drains, as `DebeziumBench.records` answers:
    a lower bound from the two topics written first and last (their growth since the start),
    exact from the moment the last one is complete, when every topic's watermark is read (at
    most every FULL_CHECK_S). A read of every partition of a thousand topics every 50 ms
    would cost the broker as much CPU as a wide drain itself."""

    def __init__(self, marks: Callable[[list[str]], dict[str, int]], topics: list[str], first: str, last: str,
                 last_expected: int) -> None:
        self.marks, self.topics = marks, topics
        self.probes = sorted({first, last})
        self.last, self.last_expected = last, last_expected
        start = marks(topics)
        self.initial = sum(start.values())
        self.base = {t: start.get(t, 0) for t in self.probes}
        self.lower = self.initial
        self.complete = False
        self.checked = 0.0

    def count(self) -> int:
        if not self.complete:
            now = self.marks(self.probes)
            grown = sum(now.get(t, self.base[t]) - self.base[t] for t in self.probes)
            self.lower = max(self.lower, self.initial + grown)
            if now.get(self.last, 0) < self.last_expected:
                return self.lower
            self.complete = True
        if time.monotonic() - self.checked >= FULL_CHECK_S:
            self.checked = time.monotonic()
            self.lower = max(self.lower, sum(self.marks(self.topics).values()))
        return self.lower


class WidthBench(debezium.DebeziumBench):
    pg_settings = PG_SETTINGS

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.cdc_settings = {
            "source": {"tables": ["public.*"]},
            "topic": {"partitions": PARTITIONS},
            "snapshot": {"mode": "never"},  # a new slot streams from its creation: no initial snapshot
        }
        self.debezium_settings = {
            "table.include.list": "public\\.t[0-9]+",
            "snapshot.mode": "no_data",  # Debezium 3.x's name for "never": the schema only, no rows
            "topic.creation.default.partitions": str(PARTITIONS),
        }
        self.follow_timeout = 3600.0
        self.results: dict[int, dict[str, SideRun]] = {}
        self.probe: Probe | None = None
        self._admin: Any = None
        self.written = 0  # rows in the current database's tables

    # -- Kafka -----------------------------------------------------------------------------
    @property
    def admin(self) -> Any:
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            self._admin = AdminClient({"bootstrap.servers": self.servers, "log_level": 3})
        return self._admin

    def high_watermarks(self, topics: list[str]) -> dict[str, int]:
        """Partition 0's high watermark of each topic, in one ListOffsets request; a topic
        without a leader yet (or not there) is left out."""
        from confluent_kafka import KafkaException, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        if not topics:
            return {}
        futures = self.admin.list_offsets({TopicPartition(t, 0): OffsetSpec.latest() for t in topics},
                                          request_timeout=30)
        marks = {}
        for tp, future in futures.items():
            with contextlib.suppress(KafkaException):
                marks[tp.topic] = future.result().offset
        return marks

    def records(self, prefix: str) -> int:
        assert self.probe is not None, "records() is read while a drain is followed"
        return self.probe.count()

    @staticmethod
    def table_topics(prefix: str, tables: int) -> list[str]:
        return [topic_name(prefix, "public", f"t{i}") for i in range(tables)]

    def slot_of(self, side: str, prefix: str) -> str:
        return debezium.cdc_slot(prefix) if side == "cdc" else self.debezium_config(prefix)["slot.name"]

    # -- the database of one table count ---------------------------------------------------
    def create_database(self, tables: int) -> None:
        self.dbname = "postgres"
        self.sql(f"CREATE DATABASE w{tables}")
        self.dbname = f"w{tables}"
        self.written, self.next_id = 0, 1
        t0 = time.monotonic()
        with psycopg.connect(self.dsn) as conn:
            for start in range(0, tables, CREATE_AT_ONCE):
                conn.execute("; ".join(f"CREATE TABLE public.t{i} ({COLUMNS})"
                                       for i in range(start, min(tables, start + CREATE_AT_ONCE))))
                conn.commit()
            names = ", ".join(f"public.t{i}" for i in range(tables))
            conn.execute(f"CREATE PUBLICATION {capture.PUBLICATION} FOR TABLE {names} "
                         "WITH (publish_via_partition_root = true)")
            conn.commit()
        self.log(f"database w{tables}: {tables:,} tables and their publication in {time.monotonic() - t0:.1f} s")

    def drop_database(self, tables: int) -> None:
        self.dbname = "postgres"
        self.sql(f"DROP DATABASE w{tables} WITH (FORCE)")

    def row_count(self, tables: int) -> int:
        total = 0
        with psycopg.connect(self.dsn) as conn:
            for start in range(0, tables, CREATE_AT_ONCE):
                part = " UNION ALL ".join(f"SELECT count(*) FROM public.t{i}"
                                          for i in range(start, min(tables, start + CREATE_AT_ONCE)))
                total += int(conn.execute(f"SELECT sum(count) FROM ({part}) AS counts").fetchone()[0])  # type: ignore[index]
        return total

    def first_rows(self, tables: int) -> None:
        """One transaction inserting a row into each table, flushed at its commit."""
        inserts = "; ".join(f"INSERT INTO public.t{i} (id, v, note) VALUES ({self.next_id + i}, 0, 'first')"
                            for i in range(tables))
        with psycopg.connect(self.dsn) as conn:
            conn.execute("SET LOCAL synchronous_commit = on; " + inserts)
            conn.commit()
        self.next_id += tables
        self.written += tables

    def write_inserts(self, tables: int) -> float:
        """--changes single-row INSERT transactions, change k into table k % tables, by pgbench
        (autocommit: each its own transaction; each client counts its own k in a variable);
        returns the transactions/s."""
        assert self.pg is not None
        changes = self.args.changes
        writers = min(self.args.writers, changes)
        per_writer, rest = divmod(changes, writers)
        script = self.workdir / f"inserts-{tables}.sql"
        script.write_text(
            f"\\set k :i * {writers} + :client_id\n"
            "\\set i :i + 1\n"
            f"\\set t :k % {tables}\n"
            f"\\set id :k + {self.next_id}\n"
            "INSERT INTO public.t:t (id, v, note) VALUES (:id, :k, 'change');\n"
        )
        # clients 0..writers-1 write k = i * writers + client_id for i < per_writer; the rest,
        # k = per_writer * writers + client_id, one each
        runs = [(writers, per_writer, 0)] + ([(rest, 1, per_writer)] if rest else [])
        t0 = time.monotonic()
        for clients, each, first_i in runs:
            if not each:
                continue
            argv = [
                str(find_pg_bin_dir() / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(self.pg.port), "-U", "postgres",
                "-c", str(clients), "-j", str(min(clients, 2)), "-t", str(each), "-D", f"i={first_i}",
                "-f", str(script), self.dbname,
            ]
            log_path = self.workdir / f"pgbench-{tables}.log"
            with log_path.open("ab") as log:
                proc = self.procs.start("pgbench", argv, stdout=log, stderr=subprocess.STDOUT)
                try:
                    proc.wait(3600)
                except subprocess.TimeoutExpired:
                    self.procs.stop(proc)
                    raise capture.BenchError(f"pgbench did not finish in an hour; see {log_path}") from None
                self.procs.forget(proc)
            if proc.returncode != 0:
                raise capture.BenchError(f"pgbench exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        seconds = time.monotonic() - t0
        self.next_id += changes
        self.written += changes
        found = self.row_count(tables)
        if found != self.written:
            raise capture.BenchError(f"the tables hold {found:,} rows after the writes, expected {self.written:,}; "
                                     f"see {self.workdir}/pgbench-{tables}.log")
        return changes / seconds

    # -- one side --------------------------------------------------------------------------
    def check_side(self, side: str, prefix: str, proc: subprocess.Popen | None) -> None:
        """A pipeline that died during its start-up ends the wait with its reason."""
        if side == "cdc":
            assert proc is not None
            if proc.poll() is not None:
                log = (self.workdir / f"{prefix}-run.log").read_text(errors="replace")
                raise capture.BenchError(f"cdc run exited with {proc.returncode} during its start-up:\n{log[-3000:]}")
        else:
            assert self.connect is not None
            self.connect.task_running(prefix)  # raises with the task's trace once it FAILED

    def wait_active(self, side: str, prefix: str, t0: float, proc: subprocess.Popen | None) -> float:
        slot = self.slot_of(side, prefix)
        polls = 0
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
                now = time.monotonic()
                if row is not None and row[0]:
                    return now
                polls += 1
                if polls % 20 == 0:
                    self.check_side(side, prefix, proc)
                if now > t0 + START_TIMEOUT_S:
                    raise capture.BenchError(f"slot {slot} of {side} not active after {START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)

    def wait_topics(self, side: str, prefix: str, tables: int, t0: float, proc: subprocess.Popen | None) -> float:
        """Until every table's topic exists and holds its first row; checks they have one partition."""
        topics = self.table_topics(prefix, tables)
        while True:
            listed = self.admin.list_topics(timeout=30).topics
            now = time.monotonic()
            if all(t in listed and listed[t].error is None for t in topics):
                marks = self.high_watermarks(topics)
                now = time.monotonic()
                if all(marks.get(t, 0) >= 1 for t in topics):
                    wrong = [t for t in topics if len(listed[t].partitions) != PARTITIONS]
                    if wrong:
                        raise capture.BenchError(f"{len(wrong):,} topics of {side} have other than {PARTITIONS} "
                                                 f"partition(s), e.g. {wrong[0]}: {len(listed[wrong[0]].partitions)}")
                    return now
            self.check_side(side, prefix, proc)
            if now > t0 + START_TIMEOUT_S:
                have = sum(1 for t in topics if t in listed)
                raise capture.BenchError(f"{side}: {have:,} of {tables:,} topics after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.25)

    def start_up(self, side: str, prefix: str, tables: int) -> SideRun:
        """From launching the pipeline on a new slot until it streams into every table's topic; stopped after."""
        assert self.connect is not None
        proc = None
        launched = time.time()
        t0 = time.monotonic()
        try:
            if side == "cdc":
                proc = self.cdc_start(prefix, "run")
            else:
                self.connect.add_connector(prefix, self.debezium_config(prefix), timeout_s=START_TIMEOUT_S)
            active = self.wait_active(side, prefix, t0, proc)
            self.first_rows(tables)
            done = self.wait_topics(side, prefix, tables, t0, proc)
        finally:
            if proc is not None:
                self.procs.stop(proc)
            elif side == "debezium":
                self.connect.delete_connector(prefix)
        run = SideRun(tables, side, done - t0, active - t0)
        if side == "cdc":
            run.startup_log = startup_story(self.workdir / f"{prefix}-run.log", launched, tables)
        return run

    def drain(self, run: SideRun, prefix: str) -> None:
        """Restart the stopped pipeline and follow its topics until they hold every change."""
        tables, changes = run.tables, self.args.changes
        topics = self.table_topics(prefix, tables)
        last = (changes - 1) % tables
        self.probe = Probe(self.high_watermarks, topics, topics[0], topics[last],
                           1 + changes_into(last, tables, changes))
        initial = self.probe.initial
        if initial != tables:
            self.log(f"warning: {prefix}'s topics hold {initial:,} records before the drain, expected {tables:,}")
        try:
            if run.side == "cdc":
                run.drain = self.cdc_stream(prefix, initial, changes)
            else:
                run.drain = self.debezium_run(prefix, initial, changes)
        finally:
            self.probe = None
        time.sleep(1.0)  # anything still in flight (a duplicate) shows in the count below
        run.held = sum(self.high_watermarks(topics).values())
        run.expected = tables + changes

    def tear_down(self, side: str, prefix: str) -> None:
        """Drop the side's slot and delete its topics (the broker holds one side's at a time)."""
        slot = self.slot_of(side, prefix)
        deadline = time.monotonic() + 60
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while True:
                row = conn.execute("SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                   (slot,)).fetchone()
                if row is None:
                    break
                if not row[0]:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                    break
                if time.monotonic() > deadline - 50:  # a walsender left behind by a stopped pipeline
                    conn.execute("SELECT pg_terminate_backend(%s)", (row[1],))
                if time.monotonic() > deadline:
                    raise capture.BenchError(f"slot {slot} still active a minute after {side} stopped")
                time.sleep(0.2)
        topics = [t for t in self.admin.list_topics(timeout=30).topics if t.startswith(prefix + ".")]
        if topics:
            for future in self.admin.delete_topics(topics, operation_timeout=120).values():
                future.result()

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> None:
        self.start_services()
        if not self.args.skip_warmup:
            self.log("warm-up, not recorded: both sides over one table (JIT of Connect's and the broker's JVMs)")
            self.one_count(1, ["cdc", "debezium"], {}, suffix="warm")
        for index, tables in enumerate(self.args.tables):
            order = ["cdc", "debezium"] if index % 2 == 0 else ["debezium", "cdc"]
            self.results[tables] = {}
            self.one_count(tables, order, self.results[tables])

    def one_count(self, tables: int, order: list[str], runs: dict[str, SideRun], suffix: str = "") -> None:
        """Both sides over a new database of `tables` tables, in `order`, into `runs`."""
        self.create_database(tables)
        for side in order:
            prefix = f"{side[:3]}{tables}{suffix}"
            self.log(f"{tables:,} tables, {side}: start-up")
            run = self.start_up(side, prefix, tables)
            runs[side] = run
            self.log(f"  {side} streams into {tables:,} topics {run.startup_s:.1f} s after its start "
                     f"(slot active at {run.active_s:.1f} s) {run.startup_log}")
            run.write_tps = self.write_inserts(tables)
            self.log(f"  wrote {self.args.changes:,} single-row INSERT transactions at {run.write_tps:,.0f}/s")
            self.drain(run, prefix)
            m = run.drain
            assert m is not None
            self.log(f"  {side} drained them at {m.rate:,.0f} changes/s (first record {m.seconds - m.steady_s:.1f} s "
                     f"after its start); topics hold {run.held:,} of {run.expected:,}")
            self.tear_down(side, prefix)
        self.drop_database(tables)

    # -- the report ------------------------------------------------------------------------
    def report(self) -> str:
        versions = debezium.versions()
        loads = f"{min(self.loads):.2f}-{max(self.loads):.2f}" if self.loads else "?"
        argv = ["python", "bench/width.py", *self.args.argv]
        lines = [
            f"Command: `{shlex.join(argv)}`",
            "",
            f"cdc (`client = \"confluent\"`) and Debezium {versions.get('debezium-postgres', '?')} (Kafka Connect "
            f"standalone, tuned as in bench/debezium.py) on one PostgreSQL {versions.get('postgresql', '?')} and one "
            f"Apache Kafka {capture.KAFKA_VERSION} broker, {os.cpu_count()} cores, 1-minute load {loads}. Per table count "
            f"a new database of N tables (`{COLUMNS}`); each side in turn (the order alternates between table counts), "
            f"its own slot and prefix, topics of {PARTITIONS} partition per table for both (Debezium's default and "
            "cdc's `[topic] partitions` default).",
            "",
            "| tables | pipeline | start-up s (slot active) | restart s | drain changes/s | of its 1-table rate "
            "| side CPU µs/change | broker CPU µs/change | broker, × 1-table | PostgreSQL CPU µs/change, whole drain "
            "| cdc / Debezium |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        one = self.results.get(1, {})
        for tables, runs in self.results.items():
            for side in ("cdc", "debezium"):
                run = runs.get(side)
                if run is None:
                    continue
                m = run.drain
                label = SIDES[side]
                if m is None:
                    lines.append(f"| {tables:,} | {label} | {run.startup_s:.1f} ({run.active_s:.1f}) | - | - | - | - | - | - "
                                 "| - | - |")
                    continue
                if run.held != run.expected:
                    label += f" (topics hold {run.held:,} records, {run.expected:,} written)"
                base = one.get(side)
                base_m = base.drain if base is not None else None
                of_one = f"{m.rate / base_m.rate:.2f}" if base_m is not None else "-"
                broker = m.cpu_us_per_row("broker")
                broker_one = base_m.cpu_us_per_row("broker") if base_m is not None else 0.0
                broker_x = f"{broker / broker_one:.2f}" if broker_one else "-"
                other = runs.get("debezium")
                ratio = "-"
                if side == "cdc" and other is not None and other.drain is not None:
                    ratio = f"{m.rate / other.drain.rate:.2f}"
                elif side == "debezium":
                    ratio = ""
                lines.append(
                    f"| {tables:,} | {label} | {run.startup_s:.1f} ({run.active_s:.1f}) | {m.seconds - m.steady_s:.1f} "
                    f"| {m.rate:,.0f} | {of_one} | {m.cpu_us_per_row('side'):.1f} | {broker:.1f} | {broker_x} "
                    f"| {m.cpu.get('postgres', 0.0) / m.rows * 1e6:.1f} | {ratio} |"
                )
        writes = [run.write_tps for runs in self.results.values() for run in runs.values() if run.write_tps]
        lines += [
            "",
            "Start-up: from launching `cdc run` (`[snapshot] mode = \"never\"`) or creating the connector "
            "(`snapshot.mode=no_data`) on a new slot until the slot is active (in brackets) and then every table's "
            "topic exists and holds the row one transaction inserted into each table once the slot was active "
            "(Debezium creates a table's topic at its first record, cdc all of them before it streams). Drain: "
            f"{self.args.changes:,} single-row INSERT transactions written round-robin over the tables by pgbench "
            f"({self.args.writers} connections"
            + (f", {min(writes):,.0f}-{max(writes):,.0f} transactions/s" if writes else "")
            + ") while the pipeline was stopped, then the pipeline started again: changes/s from its first record to "
            "the last (restart: from its start to its first record). CPU per change from the first record on for the "
            "side's process group (cdc's daemon, Connect's JVM) and the broker's JVM; PostgreSQL's processes (the "
            "walsender decodes the backlog from the moment the pipeline connects, before its first record lands) over "
            "the whole drain, restart included."
            + ("" if self.args.skip_warmup else " A warm-up pass of both sides over one table, not shown, came first."),
        ]
        stories = [f"{plural(tables, 'table')}: {runs['cdc'].startup_log}" for tables, runs in self.results.items()
                   if "cdc" in runs and runs["cdc"].startup_log]
        if stories:
            lines += ["", "cdc's start-up from its log (seconds after launch): " + "; ".join(stories) + "."]
        lines += self.targets()
        return "\n".join(lines)

    def targets(self) -> list[str]:
        """The issue's targets, at 1,000 tables (or the widest count measured, said so)."""
        wide = [n for n, runs in self.results.items() if n > 1 and runs.get("cdc") and runs["cdc"].drain]
        if not wide:
            return []
        n = TARGET_TABLES if TARGET_TABLES in wide else max(wide)
        cdc, dbz, one = self.results[n]["cdc"], self.results[n].get("debezium"), self.results.get(1, {}).get("cdc")
        assert cdc.drain is not None
        rows: list[tuple[str, float, str, bool]] = []
        if one is not None and one.drain is not None:
            rows.append((f"cdc's drain rate over {n:,} tables / its 1-table rate",
                         cdc.drain.rate / one.drain.rate, ">= 0.5", cdc.drain.rate / one.drain.rate >= 0.5))
            broker = cdc.drain.cpu_us_per_row("broker") / one.drain.cpu_us_per_row("broker")
            rows.append((f"broker CPU per change with cdc at {n:,} tables / at 1 table", broker, "<= 2", broker <= 2))
        rows.append((f"cdc's start-up at {n:,} tables (s)", cdc.startup_s, "<= 10", cdc.startup_s <= 10))
        if dbz is not None and dbz.drain is not None:
            ratio = cdc.drain.rate / dbz.drain.rate
            rows.append((f"cdc's drain rate / Debezium's at {n:,} tables", ratio, ">= 2", ratio >= 2))
        out = ["", "### Targets", "", "| target (from the issue) | measured | goal | verdict |", "|---|---:|---:|---|"]
        for label, value, goal, met in rows:
            out.append(f"| {label} | {value:.2f} | {goal} | {'met' if met else '**MISSED**'} |")
        if n != TARGET_TABLES:
            out += ["", f"The targets are stated at {TARGET_TABLES:,} tables; this run's widest count is {n:,}."]
        return out

    def record(self, report: str) -> Path:
        during = (min(self.loads), max(self.loads)) if self.loads else None
        return figures.write(NAME, report, title=TITLE, versions=debezium.versions(), load_during=during,
                             argv=["width.py", *self.args.argv])

    def close(self) -> None:
        self._admin = None
        super().close()


def startup_story(log_path: Path, launched: float, tables: int) -> str:
    """Where cdc's start-up went, from the time stamps of its log: its first line (Python's
    start, the imports, the configuration, the preflight's queries before it), the topics
    created, the slot created, the capture set up, streaming."""
    seen: dict[str, float] = {}
    created = 0
    for line in log_path.read_text(errors="replace").splitlines():
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - launched
        message = match.group(2)
        seen.setdefault("first line", at)
        if message.startswith("created topic"):
            created += 1
            seen.setdefault("first topic", at)
            seen["last topic"] = at
        for key, start in (("capturing", "capturing "), ("slot", "created slot"), ("streaming", "streaming from")):
            if message.startswith(start):
                seen.setdefault(key, at)
    parts = [f"first line {seen['first line']:.1f}"] if "first line" in seen else []
    if created:
        parts.append(f"{created:,} topics created {seen['first topic']:.1f}-{seen['last topic']:.1f}")
    parts += [f"{label} {seen[key]:.1f}" for key, label in (("slot", "slot created"),
                                                           ("capturing", f"capturing {plural(tables, 'table')}"),
                                                           ("streaming", "streaming"))
              if key in seen]
    return ", ".join(parts)


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def table_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of table counts of at least 1")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=table_counts, default=[1, 100, 1000],
                        help="comma-separated table counts (default 1,100,1000; 10000 works too)")
    parser.add_argument("--changes", type=int, default=100_000, help="single-row INSERT transactions per drain")
    parser.add_argument("--writers", type=int, default=4, help="pgbench connections writing them")
    parser.add_argument("--skip-warmup", action="store_true",
                        help="no unrecorded pass of both sides over one table first (cold JVMs then count)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    args = parser.parse_args(argv)
    if args.changes < 1 or args.writers < 1:
        parser.error("--changes and --writers must be positive")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    bench = WidthBench(parse_args(argv))
    return 0 if capture.drive(bench, lambda: bool(bench.results)) else 130


if __name__ == "__main__":
    sys.exit(main())
