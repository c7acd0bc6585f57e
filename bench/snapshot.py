"""Measure `cdc snapshot` against its physical limits, in one run on one machine.

    python bench/snapshot.py [--rows 2000000] [--clients kafka-python,confluent]
                             [--parallelism 1,2,4] [--split-rows N] [--keep]

It starts its own throwaway PostgreSQL and Apache Kafka (one KRaft node, shared by every
phase) with the helpers of bench/capture.py, creates the same 6-column table (integer primary key) and fills
it with N rows, then VACUUM (FREEZE, ANALYZE) so no reader pays for hint bits and the
snapshot can split the table from pg_class.reltuples. Then:

1. PostgreSQL's ceiling: `COPY bench TO STDOUT` into /dev/null, by psql and by psycopg
   (raw blocks, nothing parsed), best of --copy-repeats runs each; the faster is the ceiling.
2. cdc: `python -m cdc snapshot -c <config>` for each client and each parallelism, each run
   with a fresh slot and a fresh topic prefix, timed from the start of the
   process to its exit (exit 0 = every record acknowledged). /proc is polled for the peak
   resident set (VmHWM) of the main process and of each reader process it spawns; the
   main process is reaped with wait4, whose rusage gives the CPU of the main process and
   of every reader it reaped. The record count of the topic is read from its end offsets
   (cdc.kafka.topics.TopicAdmin.end_offsets) and must equal N.
3. The client's ceiling: kafka-python, then confluent-kafka, alone, producing N ready-made
   records sampled from the first snapshot topic (so: the snapshot events' size), acks=all,
   idempotent, configured like cdc/kafka/producer.py: bench/capture.py's own phase, reused.
   cdc(confluent) / confluent alone is the snapshot's target (0.8); cdc(confluent) / COPY
   is reported too (its 0.5 is out of reach with the broker on the same two cores).

The broker's CPU (its process group) is measured over each snapshot run.

Every process started here runs in its own process group and is ended on exit, Ctrl-C and
SIGTERM included. A `cdc snapshot` that fails, hangs (its log silent for --stall-seconds)
or writes a wrong count is reported in the table with its log tail; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from capture import (
    INSERT_ROWS,
    PARTITIONS,
    PG_SETTINGS,
    SAMPLE_RECORDS,
    SHORT,
    TABLE,
    Bench,
    BenchError,
    CpuWindow,
    _f,
    add_shared_args,
    broker_cpu,
    check_shared_args,
    cpu_seconds,
    drive,
    group_members,
    peak_rss_mb,
    proc_stat,
    read_topic_summary,
)

from cdc.config import TopicConfig
from cdc.kafka.topics import TopicAdmin
from cdc.local.postgres import find_pg_bin_dir
from cdc.naming import topic_name

FILL_CHUNK = 250_000  # rows per INSERT while filling the table
POLL_S = 0.05  # /proc polling period while a snapshot runs
SCAN_S = 0.25  # how often the process group is rescanned for new readers


# --------------------------------------------------------------------------- /proc helpers


def role_of(pid: int, main: int) -> str:
    if pid == main:
        return "main"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "resource_tracker" in cmdline:
        return "resource tracker"
    if "spawn_main" in cmdline or "multiprocessing-fork" in cmdline:
        return "reader"
    return "other"


def describe_processes(pids: list[int]) -> str:
    """One line per process: state, wchan and CPU, for a hang report (py-spy is not installed)."""
    lines = []
    for pid in pids:
        fields = proc_stat(pid)
        if fields is None:
            continue
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
        except OSError:
            wchan = "?"
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            cmd = "?"
        lines.append(f"  pid {pid} state {fields[0]} wchan {wchan} cpu {cpu_seconds(pid) or 0:.1f}s: {cmd}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- results


@dataclass
class CopyResult:
    name: str
    rows: int
    seconds: list[float]
    backend_cpu_s: float | None = None  # of the best run
    command: str = ""

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def rate(self) -> float:
        return self.rows / self.best


@dataclass
class SnapshotRun:
    client: str
    parallelism: int
    rows: int
    seconds: float = 0.0
    startup_s: float | None = None  # process start -> "snapshot of N tables" logged
    internal_s: float | None = None  # the snapshot's own "read N rows in X s"
    exit_code: int | None = None
    cpu_s: float | None = None  # main process + every reader it reaped (wait4 rusage)
    broker_cpu_s: float | None = None
    machine_busy_cores: float | None = None
    rss_main_mb: float | None = None
    rss_readers_mb: list[float] = field(default_factory=list)
    rss_max_mb: float | None = None  # wait4's ru_maxrss: the largest of main and its reaped readers
    readers_seen: int = 0
    records: int | None = None
    error: str = ""
    log_path: Path | None = None

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 and not self.error else 0.0

    @property
    def ok(self) -> bool:
        return not self.error


# --------------------------------------------------------------------------- the bench


class SnapshotBench(Bench):
    """bench/capture.py's Bench (process groups, PostgreSQL and the broker, clean-up, the client-alone phase)
    with its own setup, phases and report."""

    name = "snapshot"
    title = "cdc snapshot vs. its physical limits"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.copies: dict[str, CopyResult] = {}
        self.snapshots: dict[tuple[str, int], SnapshotRun] = {}
        self.table_mb = 0.0
        self.fill_s = 0.0

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        self.start_services()
        rows = self.args.rows
        self.log(f"filling {TABLE} with {rows:,} rows")
        t0 = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for first in range(1, rows + 1, FILL_CHUNK):
                conn.execute(INSERT_ROWS, (first, min(rows, first + FILL_CHUNK - 1)))
            conn.execute(f"VACUUM (FREEZE, ANALYZE) {TABLE}")
            conn.execute("CHECKPOINT")
            self.table_mb = conn.execute(f"SELECT pg_table_size('{TABLE}')").fetchone()[0] / 2**20
        self.fill_s = time.monotonic() - t0
        self.log(f"filled in {self.fill_s:.1f} s; table {self.table_mb:,.0f} MiB (shared_buffers {PG_SETTINGS['shared_buffers']})")

    # -- 1. COPY ------------------------------------------------------------------------------
    def run_copy(self) -> None:
        assert self.pg is not None
        rows, repeats = self.args.rows, self.args.copy_repeats
        query = f"COPY {TABLE} TO STDOUT"
        psql = [
            str(find_pg_bin_dir() / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(self.pg.port), "-U", "postgres",
            "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", query,
        ]
        self.log("COPY warm-up (untimed)")
        subprocess.run(psql, stdout=subprocess.DEVNULL, check=True)
        psql_result = CopyResult("COPY -> /dev/null (psql)", rows, [], command=shlex.join(psql) + " > /dev/null")
        for _ in range(repeats):
            t0 = time.monotonic()
            subprocess.run(psql, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True)
            psql_result.seconds.append(time.monotonic() - t0)
        self.copies["psql"] = psql_result
        self.log(f"{psql_result.name}: {psql_result.rate:,.0f} rows/s (best of {repeats})")

        py_result = CopyResult("COPY -> /dev/null (psycopg, raw blocks)", rows, [],
                               command=f"psycopg: with cursor.copy({query!r}) as copy: for block in copy: pass")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            backend = conn.info.backend_pid
            for _ in range(repeats):
                cpu0 = cpu_seconds(backend)
                t0 = time.monotonic()
                with conn.cursor().copy(query) as copy:
                    for _block in copy:
                        pass
                seconds = time.monotonic() - t0
                cpu1 = cpu_seconds(backend)
                if not py_result.seconds or seconds < min(py_result.seconds):
                    py_result.backend_cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
                py_result.seconds.append(seconds)
        self.copies["psycopg"] = py_result
        self.log(f"{py_result.name}: {py_result.rate:,.0f} rows/s (best of {repeats})")

    @property
    def copy_ceiling(self) -> CopyResult | None:
        return max(self.copies.values(), key=lambda r: r.rate, default=None)

    # -- 2. cdc snapshot ----------------------------------------------------------------------
    def run_snapshot(self, client: str, parallelism: int) -> None:
        rows = self.args.rows
        name = f"snap_{SHORT[client]}_p{parallelism}"  # slot and topic prefix: fresh every run
        result = SnapshotRun(client, parallelism, rows)
        self.snapshots[(client, parallelism)] = result
        topic = topic_name(name, "public", TABLE)
        snapshot: dict[str, Any] = {"parallelism": parallelism, "progress": "log"}
        if self.args.split_rows:
            snapshot["split_rows"] = self.args.split_rows
        config = self.write_config(client, name, name, snapshot)
        argv = [sys.executable, "-m", "cdc", "snapshot", "-c", str(config)]
        self.commands.setdefault(f"cdc snapshot ({client})", shlex.join(argv))
        log_path = result.log_path = self.workdir / f"{name}.log"
        self.log(f"cdc snapshot, {client}, parallelism {parallelism}: {rows:,} rows")
        assert self.broker is not None
        window = CpuWindow({"broker": self.broker.pid}).start()
        hwm: dict[int, tuple[str, float]] = {}
        timeout = max(600.0, rows / 500)
        with log_path.open("wb") as log:
            t0 = time.monotonic()
            proc = self.procs.start(f"cdc {name}", argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        pid = proc.pid
        members = [pid]
        last_scan = 0.0
        log_size, log_changed = 0, t0
        status = None
        rusage = None
        while True:
            done_pid, status, rusage = os.wait4(pid, os.WNOHANG)
            now = time.monotonic()
            if done_pid:
                result.seconds = now - t0
                break
            if now - last_scan >= SCAN_S:
                members = sorted(set(group_members(pid)) | {pid})
                last_scan = now
            for member in members:
                peak = peak_rss_mb(member)
                if peak is not None:
                    role = hwm[member][0] if member in hwm else role_of(member, pid)
                    hwm[member] = (role, peak)
            size = log_path.stat().st_size
            if size != log_size:
                log_size, log_changed = size, now
                if result.startup_s is None and b"snapshot of " in log_path.read_bytes():
                    result.startup_s = now - t0
            stalled = now - log_changed > self.args.stall_seconds
            if stalled or now - t0 > timeout:
                what = f"its log was silent for {self.args.stall_seconds:.0f} s" if stalled else f"it ran over {timeout:.0f} s"
                result.error = f"hung ({what}); killed"
                result.seconds = now - t0
                self.log(f"cdc snapshot {name}: {result.error}; processes:\n{describe_processes(members)}")
                result.error += "; processes: " + describe_processes(members).replace("\n", ";")
                self.procs.stop(proc, signal.SIGTERM, timeout=20)
                break
            time.sleep(POLL_S)
        window.stop()
        if status is not None and rusage is not None and not result.error:
            proc.returncode = os.waitstatus_to_exitcode(status)
            result.exit_code = proc.returncode
            result.cpu_s = rusage.ru_utime + rusage.ru_stime
            result.rss_max_mb = rusage.ru_maxrss / 1024
            self.procs.forget(proc)
        result.broker_cpu_s = window.used.get("broker")
        result.machine_busy_cores = window.machine_busy_cores
        result.rss_main_mb = hwm[pid][1] if pid in hwm else None
        result.rss_readers_mb = [peak for role, peak in hwm.values() if role == "reader"]
        result.readers_seen = len(result.rss_readers_mb)
        text = log_path.read_text(errors="replace")
        for line in text.splitlines():
            if "snapshot read " in line and " rows in " in line:
                with contextlib.suppress(ValueError, IndexError):
                    result.internal_s = float(line.split(" rows in ", 1)[1].split(" s", 1)[0])
        if not result.error and result.exit_code != 0:
            result.error = f"exited with {result.exit_code}"
        result.records = self.count_records(topic)
        if not result.error and result.records != rows:
            result.error = f"topic {topic} holds {result.records:,} records (end offsets), expected {rows:,}"
        if result.error:
            tail = "\n".join(text.splitlines()[-25:])
            self.log(f"cdc snapshot {name} FAILED: {result.error}\n  config {config}\n  log {log_path}, last lines:\n{tail}")
            self.failed = True  # keep the logs
        elif not self.samples:
            _, self.samples = read_topic_summary(self.servers, topic, SAMPLE_RECORDS)
        with contextlib.suppress(Exception):
            self.sql("SELECT pg_drop_replication_slot(%s)", (name,))
        self.log(
            f"cdc snapshot {client} p={parallelism}: {result.rate:,.0f} rows/s in {result.seconds:.1f} s, "
            f"records {result.records if result.records is not None else '?'}, peak RSS main "
            f"{_f(result.rss_main_mb, 0)} MiB / largest reader {_f(max(result.rss_readers_mb, default=None), 0)} MiB"
        )

    def count_records(self, topic: str) -> int | None:
        try:
            admin = TopicAdmin(TopicConfig(bootstrap_servers=self.servers))
        except Exception as exc:  # noqa: BLE001 - reported as a missing count
            self.log(f"warning: cannot reach the broker to count {topic}: {exc}")
            return None
        try:
            return sum(admin.end_offsets([topic]).get(topic, {}).values())
        except Exception as exc:  # noqa: BLE001 - reported as a missing count
            self.log(f"warning: cannot read the end offsets of {topic}: {exc}")
            return None
        finally:
            admin.close()

    # -- the whole run ------------------------------------------------------------------------
    def run(self) -> None:
        self.load_before = os.getloadavg()
        self.setup()
        self.run_copy()
        for parallelism in self.args.parallelism:
            for client in self.clients:
                self.run_snapshot(client, parallelism)
        if not self.samples:
            raise BenchError("no snapshot succeeded, so no event was sampled to size the client-alone records")
        for client in self.clients:
            self.run_client_alone(client)
        self.load_after = os.getloadavg()

    # -- the report ---------------------------------------------------------------------------
    def report(self) -> str:
        a = self.args
        out = self.report_head(
            self.title,
            f"Table: {a.rows:,} rows, 6 columns (integer primary key), {self.table_mb:,.0f} MiB, frozen and analyzed; "
            f"snapshot event values average {self.mean_sample_size():,.0f} B; {PARTITIONS} partitions; "
            f"[snapshot] split_rows = {a.split_rows or 'default (200000)'}.",
        )
        out.append("### Ceilings")
        out.append("")
        out.append("| pipeline | rows/s | wall s | CPU s | rows per CPU-s | broker CPU s (µs/record) | peak RSS MiB |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        ceiling = self.copy_ceiling
        for r in self.copies.values():
            mark = " **(ceiling)**" if r is ceiling else ""
            per_cpu = f"{r.rows / r.backend_cpu_s:,.0f}" if r.backend_cpu_s else "-"
            out.append(
                f"| {r.name}{mark}, best of {len(r.seconds)} ({', '.join(f'{s:.2f}' for s in r.seconds)} s) | "
                f"{r.rate:,.0f} | {r.best:,.2f} | {_f(r.backend_cpu_s)} | {per_cpu} | - | - |"
            )
        for client in self.clients:
            r = self.results.get(f"{client} alone")
            if r is None:
                continue
            label = f"{client} alone (client ceiling)" + (f" ({r.note})" if r.note else "")
            per_cpu = f"{r.rows / r.process_cpu_s:,.0f}" if r.process_cpu_s else "-"
            out.append(
                f"| {label} | {r.rate:,.0f} | {r.seconds:,.2f} | {_f(r.process_cpu_s)} | {per_cpu} | "
                f"{broker_cpu(r.broker_cpu_s, r.rows)} | {_f(r.peak_rss_mb, 0)} |"
            )
        out.append("")
        out.append(
            "COPY CPU s = the backend's CPU (psycopg run only). Client-alone CPU s = the producing process; its RSS "
            "holds all N ready-made records (and, for kafka-python, N futures), so it is no guide to cdc's."
        )
        out.append("")
        out.append("### cdc snapshot (process start to exit 0, every record acknowledged)")
        out.append("")
        out.append(
            "| client | parallelism | rows/s | wall s | start-up s | rows/s after start-up | snapshot's own s | cdc CPU s | rows per CPU-s | "
            "broker CPU s (µs/record) | machine busy (cores) | peak RSS main MiB | largest reader MiB | readers | sum of peaks MiB | largest, wait4 MiB | "
            "records (end offsets) | vs. parallelism 1 |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for (client, parallelism), r in self.snapshots.items():
            base = self.snapshots.get((client, 1))
            speedup = f"{r.rate / base.rate:.2f}x" if base is not None and base.rate and r.rate else "-"
            per_cpu = f"{r.rows / r.cpu_s:,.0f}" if r.cpu_s and r.ok else "-"
            total = (r.rss_main_mb or 0) + sum(r.rss_readers_mb)
            records = "?" if r.records is None else f"{r.records:,}" + ("" if r.records == r.rows else " **WRONG**")
            rate = f"{r.rate:,.0f}" if r.ok else f"**FAILED**: {r.error[:300]}"
            steady = r.seconds - r.startup_s if r.ok and r.startup_s is not None else None
            after_startup = f"{r.rows / steady:,.0f}" if steady else "-"
            out.append(
                f"| cdc+{client} | {parallelism} | {rate} | {r.seconds:,.1f} | {_f(r.startup_s)} | {after_startup} | {_f(r.internal_s)} | "
                f"{_f(r.cpu_s)} | {per_cpu} | {broker_cpu(r.broker_cpu_s, r.rows)} | {_f(r.machine_busy_cores)} | {_f(r.rss_main_mb, 0)} | "
                f"{_f(max(r.rss_readers_mb, default=None), 0)} | {r.readers_seen} | {total:,.0f} | {_f(r.rss_max_mb, 0)} | {records} | {speedup} |"
            )
        out.append("")
        out.append(
            "start-up = process start until the snapshot logs its plan (imports, preflight, topics, slot with exported "
            "snapshot), and rows/s after start-up = rows / (wall - start-up); snapshot's own s = its log line `snapshot read N rows in X s`. cdc CPU s = user+system of the "
            "main process and every reader it reaped (wait4 rusage); PostgreSQL's backends and the broker are not in it. "
            "Peak RSS = VmHWM polled every 50 ms per process (the readers are spawned processes; at parallelism 1 the "
            "single range still runs in one reader; readers = reader processes seen: a table of up to split_rows rows "
            "is one range, read by one reader whatever the parallelism); largest, wait4 = ru_maxrss of the main process "
            "and the readers it reaped, the exact peak of the largest of them. machine busy = all CPUs busy (other "
            "users included)."
        )
        out.append("")
        out.append("### Targets")
        out.append("")
        pars = list(a.parallelism)
        out.append("| ratio | " + " | ".join(f"parallelism {p}" for p in pars) + " | goal | verdict (best) |")
        out.append("|---|" + "---:|" * len(pars) + "---:|---|")
        ceiling_rate = ceiling.rate if ceiling else None
        alone = {c: self.results.get(f"{c} alone") for c in self.clients}
        specs = [
            ("cdc(kafka-python) / kafka-python alone", "kafka-python", alone.get("kafka-python"), 0.8),
            ("cdc(confluent) / confluent alone", "confluent", alone.get("confluent"), 0.8),
            ("cdc(confluent) / COPY", "confluent", ceiling_rate, 0.5),
            ("cdc(kafka-python) / COPY", "kafka-python", ceiling_rate, None),
        ]
        for label, client, den, goal in specs:
            if client not in self.clients or den is None:
                continue
            den_rate = den if isinstance(den, float) else den.rate
            ratios = []
            for p in pars:
                r = self.snapshots.get((client, p))
                ratios.append(r.rate / den_rate if r is not None and r.ok and den_rate else None)
            cells = [f"{x:.2f}" if x is not None else "-" for x in ratios]
            best = max((x for x in ratios if x is not None), default=None)
            if goal is None:
                verdict, goal_text = "-", "info"
            else:
                goal_text = f">= {goal}"
                verdict = "-" if best is None else ("met" if best >= goal else "**MISSED**")
            out.append(f"| {label} | " + " | ".join(cells) + f" | {goal_text} | {verdict} |")
        confluent = alone.get("confluent")
        if confluent is not None and ceiling_rate:
            out.append("")
            out.append(
                f"The COPY target is out of reach with the broker on the same {os.cpu_count()} CPUs whatever cdc does: "
                f"confluent-kafka alone, producing ready-made records, reaches {confluent.rate / ceiling_rate:.2f} of COPY."
            )
        out.append("")
        out.append("Commands:")
        for key, r in self.copies.items():
            out.append(f"- COPY ({key}): `{r.command}`")
        for name, command in self.commands.items():
            out.append(f"- {name}: `{command}`")
        failures = [r for r in self.snapshots.values() if not r.ok]
        if failures:
            out.append("")
            out.append("Failures:")
            for r in failures:
                out.append(f"- cdc+{r.client} parallelism {r.parallelism}: {r.error}; log {r.log_path}")
        return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows in the table (default 2000000)")
    add_shared_args(parser)
    parser.add_argument("--parallelism", default="1,2,4", help="comma-separated [snapshot] parallelism values (default 1,2,4)")
    parser.add_argument("--split-rows", type=int, default=None, help="[snapshot] split_rows (default: cdc's)")
    parser.add_argument("--copy-repeats", type=int, default=2, help="timed COPY runs per reader, best kept (default 2)")
    parser.add_argument("--stall-seconds", type=float, default=180.0,
                        help="a cdc snapshot whose log stays silent this long is reported hung and killed")
    args = parser.parse_args(argv)
    check_shared_args(parser, args)
    try:
        args.parallelism = [int(p) for p in args.parallelism.split(",") if p.strip()]
    except ValueError:
        parser.error("--parallelism takes comma-separated integers, e.g. 1,2,4")
    if not args.parallelism or min(args.parallelism) < 1:
        parser.error("--parallelism values must be at least 1")
    if args.copy_repeats < 1:
        parser.error("--copy-repeats must be at least 1")
    args.profile = None  # Bench (bench/capture.py) reads it
    return args


def main(argv: list[str] | None = None) -> int:
    bench = SnapshotBench(parse_args(argv))
    if not drive(bench, lambda: bool(bench.copies or bench.snapshots)):
        return 130
    return 1 if any(not r.ok for r in bench.snapshots.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
