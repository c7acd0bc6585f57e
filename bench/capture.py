"""Measure the capture pipeline against its physical limits, in one run on one machine.

    python bench/capture.py [--rows 500000] [--clients kafka-python,confluent]
                            [--skip-latency] [--profile DIR] [--keep]

It starts its own throwaway PostgreSQL (fsync off, synchronous_commit off) and its own
Apache Kafka (cdc.local.kafka: one KRaft broker/controller on this machine, shared by every
phase, each phase writing its own topic), creates a publication and one logical slot per
reader, and only then writes N row changes (60% INSERT / 40% UPDATE, transactions of
100-1000 rows) into a 6-column table. Every reader below then decodes that SAME WAL:

1. PostgreSQL's ceiling: pg_recvlogical (pgoutput, proto 1) to /dev/null up to --endpos,
   once before the cdc runs and once after them (own slot each); the faster pass counts.
2. The client's ceiling: kafka-python, then confluent-kafka, producing N ready-made
   records the size of cdc's events (sampled from cdc's own topic) to a fresh
   3-partition topic configured like cdc's, with producer settings copied from
   cdc/kafka/producer.py; timed until every record is acknowledged. Each runs in a child process.
3. cdc: `python -m cdc run` per client, from its own slot until the slot's
   confirmed_flush_lsn reaches the end of the writes (every record acknowledged).
4. Latency: with the daemon streaming, pgbench offers a paced 2,000 single-row
   UPDATE transactions/s for 15 s; a confluent-kafka consumer computes
   consume time - source.ts_us (the commit time) per event. A "broker floor" run
   first measures the same consumer against a paced confluent-kafka producer alone.
5. --profile DIR: one more cdc run per client (own slot, same WAL) under py-spy.

The broker's CPU is that of its process group (the JVM leads it) while a phase runs.
Record counts are read from the topics' high watermarks. cdc runs from this checkout
(its directory goes first on sys.path and on the children's PYTHONPATH), not from
wherever pip installed the package.

Every process started here runs in its own process group and is ended on exit, Ctrl-C
and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg

# This checkout's cdc, here and in every child (the daemon starts in the work directory),
# rather than the copy an editable install may point at.
REPO = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

import figures  # noqa: E402  (bench/figures.py: bench/ is on sys.path when a bench runs)

from cdc.accel import native  # noqa: E402
from cdc.config import TopicConfig  # noqa: E402
from cdc.jars import BUNDLES  # noqa: E402
from cdc.kafka.producer import RECORD_OVERHEAD  # noqa: E402
from cdc.local.kafka import LocalKafka  # noqa: E402
from cdc.local.postgres import LocalPostgres, find_pg_bin_dir  # noqa: E402
from cdc.naming import topic_name  # noqa: E402

TABLE = "bench"
PUBLICATION = "bench_pub"
CLIENTS = ("kafka-python", "confluent")
SHORT = {"kafka-python": "kp", "confluent": "cf"}
PARTITIONS = 3
RECV_SLOTS = ("bench_recv", "bench_recv2")  # pg_recvlogical's passes before and after cdc
# cdc's [topic] defaults, mirrored by the client-alone runs
LINGER_MS = TopicConfig.linger_ms
BATCH_SIZE = TopicConfig.batch_size
MAX_MESSAGE_BYTES = TopicConfig.max_message_bytes
CLK_TCK = os.sysconf("SC_CLK_TCK")
SAMPLE_RECORDS = 3000  # cdc events kept as templates for the client-alone runs
KAFKA_VERSION = next(c for c in BUNDLES["kafka"] if c.startswith("org.apache.kafka:")).rsplit(":", 1)[1]

PG_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "512MB",
    "wal_buffers": "64MB",
    "max_wal_size": "20GB",
    "min_wal_size": "1GB",
    "checkpoint_timeout": "1d",  # no checkpoint in the middle of a measurement
    "autovacuum": "off",  # no background work competing for the two cores
    "max_connections": "100",
}

CREATE_TABLE = f"""
CREATE TABLE {TABLE} (
    id integer PRIMARY KEY,
    i  integer NOT NULL,
    b  bigint NOT NULL,
    t  text NOT NULL,
    ts timestamptz NOT NULL,
    n  numeric(12, 2) NOT NULL
)"""
INSERT_ROWS = f"""
INSERT INTO {TABLE} (id, i, b, t, ts, n)
SELECT g, g %% 1000, g::bigint * 1000003, substr(md5(g::text) || md5(random()::text), 1, 40),
       clock_timestamp(), round((random() * 100000)::numeric, 2)
FROM generate_series(%s::int, %s::int) AS g"""
UPDATE_ROWS = f"""
UPDATE {TABLE} SET i = i + 1, b = b + 7, t = substr(md5(random()::text) || t, 1, 40),
       ts = clock_timestamp(), n = n + 0.01
WHERE id = ANY(%s)"""
PGBENCH_SCRIPT = f"""\\set id random(1, :maxid)
UPDATE {TABLE} SET i = i + 1, ts = clock_timestamp() WHERE id = :id;
"""


class BenchError(RuntimeError):
    """A phase failed; the message says which and points at its log."""


# --------------------------------------------------------------------------- /proc helpers


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state is [0], ppid [1], pgrp [2])."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads), or None once it is gone."""
    fields = proc_stat(pid) if pid is not None else None
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLK_TCK


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group (a service's children, a snapshot's readers), and the
    group leader's children that left it (PostgreSQL's backends each start a session of their own)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = proc_stat(int(name))
            if fields is not None and str(pgid) in (fields[2], fields[1]) and fields[0] != "Z":
                out.append(int(name))
    return out


def group_cpu_seconds(pgid: int | None) -> float | None:
    """CPU seconds of the live processes of a process group (its leader and any children)."""
    if pgid is None:
        return None
    used = [cpu_seconds(pid) for pid in group_members(pgid)]
    return sum(u for u in used if u is not None) if used else None


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread: the main thread (tid == pid) and the others summed by name."""
    out: Counter[str] = Counter()
    try:
        main_comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return {}
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
                comm = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(task) == pid:
                name = "main thread"
            elif comm == main_comm:
                name = "other Python threads"  # Python threads keep the process's name
            else:
                name = comm  # librdkafka names its threads (rdk:main, rdk:broker1, ...)
            out[name] += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return dict(out)


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, in MiB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return (total - idle) / CLK_TCK, total / CLK_TCK


class CpuWindow:
    """CPU used between `start` and `stop` by some process groups (every process started
    here leads its own) and by the whole machine."""

    def __init__(self, groups: dict[str, int | None]) -> None:
        self.groups = groups
        self.used: dict[str, float] = {}
        self.machine_busy_cores = 0.0

    def start(self) -> CpuWindow:
        self._t0 = time.monotonic()
        self._m0 = machine_cpu()
        self._p0 = {name: group_cpu_seconds(pgid) for name, pgid in self.groups.items()}
        return self

    def stop(self) -> CpuWindow:
        elapsed = time.monotonic() - self._t0
        m1 = machine_cpu()
        self.machine_busy_cores = (m1[0] - self._m0[0]) / elapsed if elapsed > 0 else 0.0
        for name, pgid in self.groups.items():
            now, before = group_cpu_seconds(pgid), self._p0.get(name)
            if now is not None and before is not None:
                self.used[name] = now - before
        return self


# --------------------------------------------------------------------------- processes


class Processes:
    """Every child started here gets its own process group; `close` ends every group."""

    def __init__(self) -> None:
        self._groups: dict[int, str] = {}
        self._children: list[multiprocessing.process.BaseProcess] = []

    def start(self, name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self._groups[proc.pid] = name
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Signal the group, wait, SIGKILL what is left of it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the leader left behind in its group
        self._groups.pop(proc.pid, None)
        return proc.returncode

    def forget(self, proc: subprocess.Popen) -> None:
        """The process exited by itself; still sweep its group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self._groups.pop(proc.pid, None)

    def child(self, process: multiprocessing.process.BaseProcess) -> None:
        self._children.append(process)

    def close(self) -> None:
        for child in self._children:
            if child.is_alive():
                child.terminate()
        for pgid in list(self._groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pgid in list(self._groups):
            while time.monotonic() < deadline:
                try:
                    os.killpg(pgid, 0)
                except (ProcessLookupError, PermissionError):
                    break
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            self._groups.pop(pgid, None)
        for child in self._children:
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join(5)
        self._children.clear()


# --------------------------------------------------------------------------- results


@dataclass
class Throughput:
    name: str
    rows: int
    seconds: float
    process_cpu_s: float | None = None
    peak_rss_mb: float | None = None
    broker_cpu_s: float | None = None
    walsender_cpu_s: float | None = None
    machine_busy_cores: float | None = None
    records: int | None = None  # records found in the topic afterwards (cdc) or acknowledged
    threads: dict[str, float] = field(default_factory=dict)
    startup_s: float | None = None
    note: str = ""

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Latency:
    client: str
    offered_tps: int
    achieved_tps: float
    transactions: int
    events: int
    consumed_ms: list[float]  # consume time - commit time
    record_ts_ms: list[float]  # record timestamp - commit time
    timestamp_type: str
    daemon_cpu_cores: float | None = None


@dataclass
class Workload:
    inserts: int = 0
    updates: int = 0
    transactions: int = 0
    seconds: float = 0.0
    start_lsn: int = 0
    end_lsn: int = 0
    end_lsn_text: str = ""


@contextlib.contextmanager
def signals_ignored(*signals: signal.Signals) -> Iterator[None]:
    """`signals` ignored inside (a second Ctrl-C must not stop a cleanup), as they were after:
    left ignored, every process started later would inherit it (a JVM then never sees a
    SIGTERM: the bench's own report test left the test session's servers unstoppable)."""
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# --------------------------------------------------------------------------- the bench


class Bench:
    name = "capture"  # of its results file, bench/results/capture.json
    title = "Capture pipeline vs. its physical limits"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.clients: list[str] = args.clients
        self.procs = Processes()
        self.workdir = Path(tempfile.mkdtemp(prefix="cdc-bench-"))
        os.chmod(self.workdir, 0o755)  # the postgres OS user must reach the cluster below it
        self.pg: LocalPostgres | None = None
        self.broker: LocalKafka | None = None
        self.loads: list[float] = []  # the 1-minute load average at every log line
        self.results: dict[str, Throughput] = {}
        self.recv_rates: list[float] = []  # pg_recvlogical passes, changes/s
        self.latencies: dict[str, Latency] = {}
        self.profiles: dict[str, tuple[Throughput, Path]] = {}
        self.samples: list[bytes] = []
        self.workload = Workload()
        self.commands: dict[str, str] = {}
        self.failed = False

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def dsn(self) -> str:
        assert self.pg is not None
        return self.pg.dsn()

    @property
    def servers(self) -> str:
        assert self.broker is not None
        return self.broker.bootstrap_servers

    def log(self, message: str) -> None:
        load = os.getloadavg()[0]
        self.loads.append(load)
        print(f"[{time.strftime('%H:%M:%S')}] (load {load:.2f}) {message}", file=sys.stderr, flush=True)

    def sql(self, query: str, params: tuple | None = None) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    def close(self) -> None:
        """End everything this run started, whatever state it is in."""
        with signals_ignored(signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self.procs.close()
            if self.broker is not None:
                with contextlib.suppress(Exception):
                    self.broker.stop()
            if self.pg is not None:
                with contextlib.suppress(Exception):
                    self.pg.stop(mode="immediate")
                with contextlib.suppress(Exception):
                    self.pg.close()
        if self.args.keep or self.failed:
            print(f"logs kept in {self.workdir}", file=sys.stderr)
            shutil.rmtree(self.workdir / "pg", ignore_errors=True)
            shutil.rmtree(self.workdir / "kafka" / "logs", ignore_errors=True)  # the topics' data
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- setup ------------------------------------------------------------------------------
    def start_services(self) -> None:
        """PostgreSQL with the bench table and publication, and the broker of every phase."""
        self.log(f"work dir {self.workdir}")
        self.pg = LocalPostgres(self.workdir / "pg", settings=PG_SETTINGS).start()
        self.log(f"PostgreSQL on port {self.pg.port}")
        self.sql(CREATE_TABLE)
        self.sql(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE} WITH (publish_via_partition_root = true)")
        self.broker = LocalKafka(self.workdir / "kafka", full_jit=True).start()
        self.log(f"Apache Kafka {KAFKA_VERSION} on {self.broker.bootstrap_servers}, JVM pid {self.broker.pid}")

    def setup(self) -> None:
        self.start_services()
        slots = [*RECV_SLOTS, *(f"bench_{SHORT[c]}" for c in self.clients)]
        if self.args.profile:
            slots += [f"bench_prof_{SHORT[c]}" for c in self.clients]
        for slot in slots:  # all before the writes: every reader decodes the same WAL
            self.sql("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))

    def generate(self) -> None:
        """N row changes, 60% inserts / 40% updates, in transactions of 100-1000 rows."""
        rows = self.args.rows
        rng = random.Random(self.args.seed)
        w = self.workload
        self.log(f"writing {rows:,} row changes")
        with psycopg.connect(self.dsn) as conn:
            w.start_lsn = int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0])
            conn.commit()
            t0 = time.monotonic()
            done = 0
            while done < rows:
                size = min(rng.randint(100, 1000), rows - done)
                n_upd = min(round(size * 0.4), w.inserts)
                n_ins = size - n_upd
                if n_ins:
                    conn.execute(INSERT_ROWS, (w.inserts + 1, w.inserts + n_ins))
                if n_upd:
                    conn.execute(UPDATE_ROWS, (rng.sample(range(1, w.inserts + 1), n_upd),))
                done += size
                if done >= rows:
                    conn.execute("SET LOCAL synchronous_commit = on")  # the WAL is flushed to here
                conn.commit()
                w.inserts += n_ins
                w.updates += n_upd
                w.transactions += 1
            w.seconds = time.monotonic() - t0
            row = conn.execute(
                "SELECT pg_current_wal_insert_lsn() - '0/0', pg_current_wal_insert_lsn()::text"
            ).fetchone()
            w.end_lsn, w.end_lsn_text = int(row[0]), row[1]
            conn.commit()
            # WAL past the end, flushed: readers see the server move beyond end_lsn even when
            # the last commit ended on a page boundary (pgoutput drops this empty transaction).
            conn.execute("SET synchronous_commit = on")
            conn.execute("SELECT pg_logical_emit_message(true, 'bench', 'end')")
            conn.commit()
        self.sql("CHECKPOINT")
        self.log(
            f"wrote {w.inserts:,} inserts + {w.updates:,} updates in {w.transactions:,} transactions "
            f"in {w.seconds:.1f} s ({rows / w.seconds:,.0f} changes/s); "
            f"{(w.end_lsn - w.start_lsn) / 2**20:,.0f} MiB of WAL"
        )

    def mark_end(self) -> int:
        """The current end of WAL, then a flushed empty transaction past it (see `generate`)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            end = int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0])
            conn.execute("SET synchronous_commit = on")
            conn.execute("SELECT pg_logical_emit_message(true, 'bench', 'end')")
        return end

    def confirmed_lsn(self, conn: psycopg.Connection, slot: str) -> tuple[int | None, int | None]:
        row = conn.execute(
            "SELECT confirmed_flush_lsn - '0/0', active_pid FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
        if row is None or row[0] is None:
            return None, None
        return int(row[0]), row[1]

    # -- 1. pg_recvlogical ------------------------------------------------------------------
    def run_recvlogical(self, slot: str) -> None:
        """One pass of pg_recvlogical over the workload; the faster pass is the ceiling
        (the walsender's rate differs by up to 1.5x between passes over the same WAL)."""
        assert self.pg is not None
        argv = [
            str(find_pg_bin_dir() / "pg_recvlogical"), "-d", self.dsn, "--slot", slot, "--start",
            "-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}", "-f", "/dev/null",
            "--endpos", self.workload.end_lsn_text, "--no-loop",
        ]
        self.commands["pg_recvlogical"] = shlex.join(argv)
        self.log("pg_recvlogical")
        log_path = self.workdir / "pg_recvlogical.log"
        window = CpuWindow({}).start()
        walsender_cpu = None
        with log_path.open("wb") as log, psycopg.connect(self.dsn, autocommit=True) as conn:
            t0 = time.monotonic()
            proc = self.procs.start("pg_recvlogical", argv, stdout=log, stderr=subprocess.STDOUT)
            walsender = None
            while proc.poll() is None:
                if walsender is None:
                    _, walsender = self.confirmed_lsn(conn, slot)
                else:
                    walsender_cpu = cpu_seconds(walsender) or walsender_cpu
                time.sleep(0.02)
            elapsed = time.monotonic() - t0
        window.stop()
        self.procs.forget(proc)
        if proc.returncode != 0:
            raise BenchError(f"pg_recvlogical exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        self.recv_rates.append(self.args.rows / elapsed)
        best = self.results.get("pg_recvlogical")
        if best is None or elapsed < best.seconds:
            self.results["pg_recvlogical"] = Throughput(
                "pg_recvlogical", self.args.rows, elapsed, walsender_cpu_s=walsender_cpu,
                machine_busy_cores=window.machine_busy_cores,
            )
        self.log(f"pg_recvlogical: {self.args.rows / elapsed:,.0f} changes/s")

    # -- 3. cdc -------------------------------------------------------------------------------
    def write_config(self, client: str, slot: str, prefix: str, snapshot: dict[str, Any]) -> Path:
        """`<workdir>/<prefix>.toml`: cdc's config for one run (its own slot and topic prefix)."""
        sections: dict[str, dict[str, Any]] = {
            "source": {"dsn": self.dsn, "slot": slot, "publication": PUBLICATION, "tables": [f"public.{TABLE}"]},
            "topic": {"bootstrap_servers": self.servers, "prefix": prefix, "partitions": PARTITIONS, "client": client},
            "snapshot": snapshot,
            "daemon": {"spill_dir": str(self.workdir / f"spill-{prefix}"), "log_level": "INFO"},
        }
        return write_toml(self.workdir / f"{prefix}.toml", sections)

    def start_daemon(self, client: str, slot: str, prefix: str) -> tuple[subprocess.Popen, Path, float]:
        # the slot is made before the workload: stream it, read nothing else
        config = self.write_config(client, slot, prefix, {"mode": "never"})
        argv = [sys.executable, "-m", "cdc", "run", "--config", str(config)]
        self.commands.setdefault(f"cdc ({client})", shlex.join(argv))
        log_path = self.workdir / f"{prefix}.log"
        with log_path.open("wb") as log:
            t0 = time.monotonic()
            proc = self.procs.start(f"cdc {prefix}", argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + 120
        while True:  # streaming starts after imports, preflight, topic creation
            text = log_path.read_text(errors="replace")
            if "streaming from" in text:
                return proc, log_path, time.monotonic() - t0
            if proc.poll() is not None or time.monotonic() > deadline:
                self.procs.stop(proc)
                raise BenchError(f"cdc ({client}) did not start streaming; its log {log_path}:\n{text[-3000:]}")
            time.sleep(0.01)

    def stop_daemon(self, proc: subprocess.Popen, log_path: Path) -> None:
        code = self.procs.stop(proc, signal.SIGTERM, timeout=60)
        if code not in (0, -signal.SIGTERM):
            self.log(f"warning: daemon exited with {code}; see {log_path}")

    def wait_confirmed(self, slot: str, lsn: int, proc: subprocess.Popen, log_path: Path, timeout: float) -> int | None:
        """Until the slot's confirmed_flush_lsn reaches `lsn`; returns the walsender's pid."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while True:
                confirmed, walsender = self.confirmed_lsn(conn, slot)
                if confirmed is not None and confirmed >= lsn:
                    return walsender
                if proc.poll() is not None:
                    raise BenchError(f"daemon exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise BenchError(f"slot {slot} did not reach the end of the writes in {timeout:.0f} s; see {log_path}")
                time.sleep(0.02)

    def run_cdc(self, client: str, *, profile_dir: Path | None = None) -> None:
        short = SHORT[client]
        name = f"cdc+{client}"
        slot, prefix = (f"bench_prof_{short}", f"prof_{short}") if profile_dir else (f"bench_{short}", f"bench_{short}")
        topic = topic_name(prefix, "public", TABLE)
        self.log(f"{name}{' under py-spy' if profile_dir else ''}: streaming {self.args.rows:,} changes")
        proc, log_path, startup = self.start_daemon(client, slot, prefix)
        spy = None
        profile_path = None
        if profile_dir:
            profile_path = profile_dir / f"cdc-{client}.txt"
            spy = self.procs.start(
                "py-spy",
                ["py-spy", "record", "--idle" if self.args.profile_idle else "--gil", "--threads", "--nolineno",
                 "--format", "raw", "--rate", "100", "-o", str(profile_path), "-p", str(proc.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        assert self.broker is not None
        window = CpuWindow({"daemon": proc.pid, "broker": self.broker.pid}).start()
        threads0 = thread_cpu(proc.pid)
        t0 = time.monotonic()
        try:
            walsender = self.wait_confirmed(slot, self.workload.end_lsn, proc, log_path, timeout=max(600, self.args.rows / 100))
            elapsed = time.monotonic() - t0
            window.stop()
            threads1 = thread_cpu(proc.pid)
            result = Throughput(
                name, self.args.rows, elapsed,
                process_cpu_s=window.used.get("daemon"), peak_rss_mb=peak_rss_mb(proc.pid),
                broker_cpu_s=window.used.get("broker"), walsender_cpu_s=cpu_seconds(walsender),
                machine_busy_cores=window.machine_busy_cores, startup_s=startup,
                threads={k: v - threads0.get(k, 0.0) for k, v in threads1.items()},
            )
        finally:
            if spy is not None:
                self.procs.stop(spy, signal.SIGINT, timeout=30)  # py-spy writes its file on SIGINT
            self.stop_daemon(proc, log_path)
        result.records, samples = read_topic_summary(self.servers, topic, 0 if self.samples else SAMPLE_RECORDS)
        if samples:
            self.samples = samples
        if profile_dir:
            assert profile_path is not None
            self.profiles[client] = (result, profile_path)
        else:
            self.results[name] = result
        if result.records != self.args.rows:
            result.note = f"topic got {result.records:,} records, expected {self.args.rows:,}"
        self.log(f"{name}: {result.rate:,.0f} changes/s, peak RSS {result.peak_rss_mb or 0:.0f} MiB {result.note}")

    # -- 2. the clients alone --------------------------------------------------------------
    def run_client_alone(self, client: str) -> None:
        if not self.samples:
            raise BenchError("no cdc events were sampled to size the client-alone records")
        topic = f"alone_{SHORT[client]}"
        create_topic(self.servers, topic)
        name = f"{client} alone"
        self.log(f"{name}: producing {self.args.rows:,} records")
        ctx = multiprocessing.get_context("spawn")
        parent, child_end = ctx.Pipe()
        child = ctx.Process(
            target=produce_child, args=(child_end, client, self.servers, topic, self.samples, self.args.rows),
            name=f"bench-{client}-alone",
        )
        self.procs.child(child)
        child.start()
        child_end.close()
        assert self.broker is not None
        try:
            ready = recv(parent, child, 120)
            if ready.get("error"):
                raise BenchError(f"{name}: {ready['error']}")
            window = CpuWindow({"broker": self.broker.pid}).start()
            done = recv(parent, child, max(600, self.args.rows / 100))
            window.stop()
            if done.get("error"):
                raise BenchError(f"{name}: {done['error']}")
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
        records, _ = read_topic_summary(self.servers, topic, 0)
        result = Throughput(
            name, self.args.rows, done["seconds"], process_cpu_s=done["cpu_s"], peak_rss_mb=done["maxrss_mb"],
            broker_cpu_s=window.used.get("broker"), machine_busy_cores=window.machine_busy_cores,
            records=records, threads=done.get("threads", {}),
        )
        if done["failed"] or records != self.args.rows:
            result.note = f"{done['failed']:,} records failed, topic got {records:,}"
        self.results[name] = result
        self.log(f"{name}: {result.rate:,.0f} records/s {result.note}")

    # -- 5. latency -------------------------------------------------------------------------
    def run_broker_floor(self) -> None:
        """The same consumer reading records a paced confluent producer sends: no cdc, no PostgreSQL."""
        topic = "latency_floor"
        create_topic(self.servers, topic)
        rate, seconds = self.args.latency_rate, self.args.latency_seconds
        self.log(f"latency floor of the broker: confluent-kafka producer at {rate:,} records/s for {seconds} s")
        consumer = LatencyConsumer(self.servers, topic)
        consumer.start()
        stop = threading.Event()
        try:
            consumer.ready.wait(30)
            if consumer.error is not None:
                raise BenchError(f"latency consumer failed: {consumer.error!r}")
            time.sleep(1.0)
            sizes = [len(v) for v in self.samples] or [550]
            sent, elapsed = paced_produce(self.servers, topic, rate, seconds, sum(sizes) // len(sizes), stop)
            achieved = sent / elapsed
            deadline = time.monotonic() + 30
            while consumer.count < sent and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            consumer.stopping.set()
            consumer.join(15)
        self.latencies["broker floor"] = Latency(
            "broker floor", rate, achieved, sent, consumer.count,
            [(c - s) / 1000 for c, _, s in consumer.samples],
            [r - s / 1000 for _, r, s in consumer.samples if r is not None],
            consumer.timestamp_type,
        )

    def run_latency(self, client: str) -> None:
        short = SHORT[client]
        slot, prefix = f"bench_lat_{short}", f"lat_{short}"
        rate, seconds = self.args.latency_rate, self.args.latency_seconds
        self.log(f"latency with cdc+{client}: {rate:,} single-row UPDATE transactions/s for {seconds} s")
        proc, log_path, _ = self.start_daemon(client, slot, prefix)
        consumer = LatencyConsumer(self.servers, topic_name(prefix, "public", TABLE))
        consumer.start()
        try:
            consumer.ready.wait(30)
            if consumer.error is not None:
                raise BenchError(f"latency consumer failed: {consumer.error!r}")
            time.sleep(1.0)  # the consumer's first fetch is in flight
            script = self.workdir / "pgbench-update.sql"
            script.write_text(PGBENCH_SCRIPT)
            assert self.pg is not None
            argv = [
                str(find_pg_bin_dir() / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(self.pg.port), "-U", "postgres",
                "-c", "4", "-j", "2", "-R", str(rate), "-T", str(seconds), "--protocol=prepared",
                "-D", f"maxid={self.workload.inserts}", "-f", str(script), "postgres",
            ]
            self.commands.setdefault("pgbench (latency load)", "PGOPTIONS='-c synchronous_commit=on' " + shlex.join(argv))
            pg_log = self.workdir / f"pgbench-{short}.log"
            window = CpuWindow({"daemon": proc.pid}).start()
            with pg_log.open("wb") as out:
                # Commits wait for their WAL flush (free with fsync off) so a commit's WAL is
                # visible to the walsender at once and latency measures the pipeline, not
                # walwriter's schedule under synchronous_commit=off.
                env = {**os.environ, "PGOPTIONS": "-c synchronous_commit=on"}
                bench = self.procs.start("pgbench", argv, stdout=out, stderr=subprocess.STDOUT, env=env)
                try:
                    bench.wait(seconds + 120)
                except subprocess.TimeoutExpired:
                    self.procs.stop(bench)
                    raise BenchError(f"pgbench did not finish; see {pg_log}") from None
                self.procs.forget(bench)
            window.stop()
            text = pg_log.read_text(errors="replace")
            if bench.returncode != 0:
                raise BenchError(f"pgbench exited with {bench.returncode}: {text[-2000:]}")
            processed = int(re.search(r"number of transactions actually processed: (\d+)", text).group(1))
            tps_match = re.search(r"tps = ([\d.]+)", text)
            end = self.mark_end()
            self.wait_confirmed(slot, end, proc, log_path, timeout=300)
            deadline = time.monotonic() + 30
            while consumer.count < processed and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            consumer.stopping.set()
            consumer.join(15)
            self.stop_daemon(proc, log_path)
            with contextlib.suppress(Exception):
                self.sql("SELECT pg_drop_replication_slot(%s)", (slot,))
        lat = Latency(
            f"cdc+{client}", rate, float(tps_match.group(1)) if tps_match else processed / seconds, processed,
            consumer.count,
            [(c - s) / 1000 for c, _, s in consumer.samples],
            [r - s / 1000 for _, r, s in consumer.samples if r is not None],
            consumer.timestamp_type,
            daemon_cpu_cores=(window.used.get("daemon") or 0) / seconds,
        )
        self.latencies[f"cdc+{client}"] = lat
        self.log(
            f"latency cdc+{client}: p50 {pct(lat.consumed_ms, 50):.1f} ms, p99 {pct(lat.consumed_ms, 99):.1f} ms "
            f"over {lat.events:,} events ({processed:,} transactions)"
        )

    # -- the whole run -----------------------------------------------------------------------
    def run(self) -> None:
        self.load_before = os.getloadavg()
        self.setup()
        self.generate()
        before, after = RECV_SLOTS
        self.run_recvlogical(before)
        for client in self.clients:
            self.run_cdc(client)
        self.run_recvlogical(after)
        for client in self.clients:
            self.run_client_alone(client)
        if self.args.profile:
            self.args.profile.mkdir(parents=True, exist_ok=True)
            for client in self.clients:
                self.run_cdc(client, profile_dir=self.args.profile)
        for slot in [*RECV_SLOTS, *(f"bench_{SHORT[c]}" for c in self.clients)]:
            with contextlib.suppress(Exception):
                self.sql("SELECT pg_drop_replication_slot(%s)", (slot,))
        if not self.args.skip_latency:
            self.run_broker_floor()
            for client in self.clients:
                self.run_latency(client)
        self.load_after = os.getloadavg()

    # -- the report ---------------------------------------------------------------------------
    def mean_sample_size(self) -> float:
        """Average value size of the events sampled from cdc's topic."""
        return sum(len(s) for s in self.samples) / max(1, len(self.samples))

    def report_head(self, title: str, what: str) -> list[str]:
        """Title, the command, what was measured, then the broker and the machine it ran on."""
        after = getattr(self, "load_after", None)
        during = f", {min(self.loads):.2f}-{max(self.loads):.2f} during" if self.loads else ""
        return [
            "", f"## {title}", "",
            f"Command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`, {time.strftime('%Y-%m-%d %H:%M %Z')}", "",
            f"{what} Broker: Apache Kafka {KAFKA_VERSION} (one KRaft broker/controller on the same cores, JVM "
            f"-Xmx{self.broker.heap if self.broker else '?'}). Machine: {os.cpu_count()} CPUs, 1-minute load average "
            f"{self.load_before[0]:.2f} before{during}{f', {after[0]:.2f} after' if after else ''} (other users of the "
            f"machine keep running: see machine busy); {versions()}.",
            "",
        ]

    def report(self) -> str:
        a, w = self.args, self.workload
        res = self.results
        out = self.report_head(
            self.title,
            f"Workload: {a.rows:,} row changes ({w.inserts:,} INSERT, {w.updates:,} UPDATE) in {w.transactions:,} "
            f"transactions of 100-1000 rows on a 6-column table, {(w.end_lsn - w.start_lsn) / 2**20:,.0f} MiB of WAL; "
            f"cdc event values average {self.mean_sample_size():,.0f} B.",
        )
        out.append("| pipeline | rows/s | wall s | CPU s | rows per CPU-s | broker CPU s (µs/record) | walsender CPU s | machine busy (cores) | peak RSS MiB |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for key in ("pg_recvlogical", "kafka-python alone", "confluent alone", "cdc+kafka-python", "cdc+confluent"):
            r = res.get(key)
            if r is None:
                continue
            cpu = r.walsender_cpu_s if key == "pg_recvlogical" else r.process_cpu_s
            per_cpu = f"{r.rows / cpu:,.0f}" if cpu else "-"
            passes = ", ".join(f"{rate:,.0f}" for rate in self.recv_rates)
            label = {
                "pg_recvlogical": f"pg_recvlogical (PostgreSQL ceiling, best of passes before and after cdc: {passes}; CPU = walsender)"
            }.get(key, key)
            if r.note:
                label += f" ({r.note})"
            out.append(
                f"| {label} | {r.rate:,.0f} | {r.seconds:,.2f} | {_f(cpu)} | {per_cpu} | {broker_cpu(r.broker_cpu_s, r.rows)} | "
                f"{_f(r.walsender_cpu_s)} | {_f(r.machine_busy_cores)} | {_f(r.peak_rss_mb, 0)} |"
            )
        out.append("")
        out.append(
            "CPU s = CPU used by the measured process while the clock ran (the walsender for pg_recvlogical, all "
            "threads of the producer process or the daemon otherwise); rows per CPU-s is what that process would do "
            "with a core of its own. machine busy = all CPUs busy (incl. other users of the machine) during the phase."
        )
        if "pure-Python CRC32C" in versions():
            out.append("")
            out.append(
                "Note: kafka-python found no `crc32c` module, so it checksums every record batch in pure Python "
                "(kafka/record/_crc32c.py); `pip install crc32c` makes kafka-python several times faster."
            )
        out.append("")
        out.append("| target | measured | goal | verdict | same ratio in rows per CPU-s |")
        out.append("|---|---:|---:|---|---:|")

        def cpu_of(key: str) -> float | None:
            r = res[key]
            return r.walsender_cpu_s if key == "pg_recvlogical" else r.process_cpu_s

        for label, num, den, goal in (
            ("cdc(kafka-python) / kafka-python alone", "cdc+kafka-python", "kafka-python alone", 0.8),
            ("cdc(confluent) / pg_recvlogical", "cdc+confluent", "pg_recvlogical", 0.5),
            ("cdc(confluent) / confluent alone", "cdc+confluent", "confluent alone", None),
            ("cdc(kafka-python) / pg_recvlogical", "cdc+kafka-python", "pg_recvlogical", None),
        ):
            if num not in res or den not in res:
                continue
            ratio = res[num].rate / res[den].rate
            verdict = "-" if goal is None else ("met" if ratio >= goal else "**MISSED**")
            cn, cd = cpu_of(num), cpu_of(den)
            cpu_ratio = f"{cd / cn:.2f}" if cn and cd else "-"
            out.append(f"| {label} | {ratio:.2f} | {'>= ' + str(goal) if goal else 'info'} | {verdict} | {cpu_ratio} |")
        for name, lat in self.latencies.items():
            if name.startswith("cdc+"):
                p99 = pct(lat.consumed_ms, 99)
                out.append(f"| latency p99 {name}, commit -> consumed | {p99:,.1f} ms | < 100 ms | {'met' if p99 < 100 else '**MISSED**'} | |")
        for client in self.clients:
            r = res.get(f"cdc+{client}")
            if r and r.peak_rss_mb:
                out.append(f"| peak RSS cdc+{client} | {r.peak_rss_mb:.0f} MiB | info | - | |")
        if self.latencies:
            out.append("")
            out.append(
                f"Latency: pgbench offers {a.latency_rate:,} single-row UPDATE transactions/s (Poisson-paced, "
                f"{a.latency_seconds} s; these sessions run synchronous_commit=on, so a commit's WAL is flushed when "
                "it commits); a confluent-kafka consumer (fetch.wait.max.ms=5) reads the topic; commit time = "
                "`source.ts_us`. The broker floor row sends records from a paced confluent-kafka producer (cdc's "
                "settings) straight to the broker: the same consumer's latency with no PostgreSQL and no cdc."
            )
            out.append("")
            out.append("| pipeline | tx/s achieved | events / tx | commit -> consumed p50 | p99 | max | commit -> record timestamp p50 | p99 | daemon CPU (cores) |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, lat in self.latencies.items():
                floor = not name.startswith("cdc+")  # its record timestamp is its send time: nothing to show
                record_ts = "- | -" if floor else f"{pct(lat.record_ts_ms, 50):,.1f} ms | {pct(lat.record_ts_ms, 99):,.1f} ms"
                out.append(
                    f"| {name} | {lat.achieved_tps:,.0f} | {lat.events:,} / {lat.transactions:,} | "
                    f"{pct(lat.consumed_ms, 50):,.1f} ms | {pct(lat.consumed_ms, 99):,.1f} ms | "
                    f"{max(lat.consumed_ms, default=float('nan')):,.1f} ms | {record_ts} | {_f(lat.daemon_cpu_cores, 2)} |"
                )
            out.append("")
            kinds = {lat.timestamp_type for lat in self.latencies.values()}
            out.append(f"Record timestamps are {', '.join(sorted(kinds))}: the time the daemon handed the record to its producer.")
        for key in ("kafka-python alone", "confluent alone", "cdc+kafka-python", "cdc+confluent"):
            r = res.get(key)
            if r and r.threads:
                busy = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(r.threads.items(), key=lambda kv: -kv[1]) if v >= 0.05)
                start = f"; start-up before streaming {r.startup_s:.1f} s (not timed)" if r.startup_s else ""
                out.append(f"\n{key}: CPU by thread: {busy}{start}")
        if self.profiles:
            for client, (result, path) in self.profiles.items():
                out.append("")
                what = "all threads, idle included" if self.args.profile_idle else "GIL holder only"
                out.append(f"### py-spy profile of cdc+{client} ({what}; {result.rate:,.0f} changes/s under the profiler; raw: {path})")
                out.append("")
                out.extend(summarize_profile(path, top=self.args.profile_top, idle=self.args.profile_idle,
                                             seconds=result.seconds))
        out.append("")
        out.append("Commands:")
        for name, command in self.commands.items():
            out.append(f"- {name}: `{command}`")
        return "\n".join(out)


    # -- the results file ---------------------------------------------------------------------------
    def results_variant(self) -> str:
        """What this run's figures compare across, in the results file's name (none here)."""
        return ""

    def results_versions(self) -> dict[str, str]:
        """The versions the figures depend on, for the results file."""
        return {**figures.package_versions("psycopg", "kafka-python", "crc32c", "confluent-kafka", "orjson"),
                **figures.jvm_versions("kafka"), **figures.postgres_version(),
                "accelerator": "C" if native else "pure Python"}

    def record(self, report: str, directory: Path | None = None) -> Path:
        """Write the printed report's figures to bench/results/ (bench/figures.py)."""
        during = (min(self.loads), max(self.loads)) if self.loads else None
        return figures.write(self.name, report, title=self.title, versions=self.results_versions(), variant=self.results_variant(),
                             load_during=during, directory=directory)


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """A cdc configuration file from its sections (JSON scalars and lists are TOML)."""
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def broker_cpu(seconds: float | None, records: int) -> str:
    """The broker's CPU seconds in a phase and per record, e.g. `2.1 (4.2)`."""
    return "-" if seconds is None else f"{seconds:,.1f} ({seconds / records * 1e6:.1f})"


def versions() -> str:
    parts = [f"Python {sys.version.split()[0]}", f"cdc from {REPO} ({'C accelerator' if native else 'pure Python'})"]
    with contextlib.suppress(Exception):
        import kafka
        from kafka.record import util

        crc = "C crc32c" if getattr(util, "crc32c_c", None) else "pure-Python CRC32C: the crc32c package is missing"
        parts.append(f"kafka-python {kafka.__version__} ({crc})")
    with contextlib.suppress(Exception):
        import confluent_kafka

        version = confluent_kafka.version()  # a str in recent releases, (str, int) in older ones
        version = version[0] if isinstance(version, tuple) else version
        parts.append(f"confluent-kafka {version} / librdkafka {confluent_kafka.libversion()[0]}")
    with contextlib.suppress(Exception):
        out = subprocess.run([str(find_pg_bin_dir() / "postgres"), "--version"], capture_output=True, text=True, timeout=10)
        parts.append(out.stdout.strip().replace("postgres (PostgreSQL) ", "PostgreSQL "))
    return ", ".join(parts)


# --------------------------------------------------------------------------- Kafka helpers


def create_topic(servers: str, topic: str) -> None:
    """A topic configured like the ones cdc creates (3 partitions, compacted)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": servers, "log_level": 4})
    config = {"cleanup.policy": "compact", "min.insync.replicas": "1", "max.message.bytes": str(MAX_MESSAGE_BYTES)}
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1, config=config)]).values():
        future.result(30)
    deadline = time.monotonic() + 30
    while True:  # Kafka lists a topic just created a moment after CreateTopics returns
        found = admin.list_topics(topic, timeout=10).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) == PARTITIONS:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"topic {topic} was created but is not listed after 30 s")
        time.sleep(0.1)


def read_topic_summary(servers: str, topic: str, sample: int) -> tuple[int, list[bytes]]:
    """(records in the topic = the sum of its high watermarks, up to `sample` of their values)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": servers, "group.id": f"bench-sample-{os.getpid()}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "log_level": 4,
    })
    try:
        total, available, start = 0, 0, []
        for p in range(PARTITIONS):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30, cached=False)
            total += high
            available += high - low
            start.append(TopicPartition(topic, p, low))
        values: list[bytes] = []
        if sample and available:
            consumer.assign(start)
            deadline = time.monotonic() + 60
            while len(values) < min(sample, available) and time.monotonic() < deadline:
                for msg in consumer.consume(1000, 1.0):
                    if msg.error() is None and msg.value() is not None:
                        values.append(msg.value())
        return total, values[:sample]
    finally:
        consumer.close()


class LatencyConsumer(threading.Thread):
    """Reads a topic from the start; per event (consume time µs, record timestamp ms, commit µs)."""

    def __init__(self, servers: str, topic: str) -> None:
        super().__init__(name="latency-consumer", daemon=True)
        self.servers, self.topic = servers, topic
        self.samples: list[tuple[int, float | None, int]] = []
        self.count = 0
        self.timestamp_type = "?"
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from confluent_kafka import (
            OFFSET_BEGINNING,
            TIMESTAMP_CREATE_TIME,
            TIMESTAMP_LOG_APPEND_TIME,
            Consumer,
            TopicPartition,
        )

        kinds = {TIMESTAMP_CREATE_TIME: "CreateTime", TIMESTAMP_LOG_APPEND_TIME: "LogAppendTime"}
        consumer = Consumer({
            "bootstrap.servers": self.servers, "group.id": f"bench-latency-{os.getpid()}-{self.topic}",
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 5, "fetch.min.bytes": 1, "fetch.error.backoff.ms": 5,
        })
        try:
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
            self.ready.set()
            while not self.stopping.is_set():
                batch = consumer.consume(10000, 0.05)
                now_us = time.time_ns() // 1000
                for msg in batch:
                    if msg.error() is not None:
                        continue
                    if msg.value() is None:
                        continue
                    event = orjson.loads(msg.value())
                    payload = event.get("payload", event) if "schema" in event else event
                    if not isinstance(payload, dict) or "source" not in payload:
                        continue  # the floor producer's warm-up record
                    kind, ts = msg.timestamp()
                    self.timestamp_type = kinds.get(kind, "none")
                    self.samples.append((now_us, float(ts) if kind in kinds else None, int(payload["source"]["ts_us"])))
                    self.count += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc
            self.ready.set()
        finally:
            consumer.close()


def paced_produce(servers: str, topic: str, rate: int, seconds: float, size: int, stop: threading.Event) -> tuple[int, float]:
    """The broker's own latency floor: confluent-kafka configured like cdc, `rate` records/s,
    each carrying its send time where cdc puts the commit time (source.ts_us)."""
    from confluent_kafka import Producer

    producer = Producer({
        "bootstrap.servers": servers, "client.id": "bench-floor", "acks": "all", "enable.idempotence": True,
        "partitioner": "murmur2_random", "linger.ms": LINGER_MS, "batch.size": BATCH_SIZE,
    })
    pad = "x" * max(0, size - 60)
    producer.list_topics(topic, timeout=10)
    producer.produce(topic, b"{}", b"warm-up")  # connection and producer id before the clock starts
    producer.flush(10)
    t0 = time.monotonic()
    sent = 0
    total = int(rate * seconds)
    while sent < total and not stop.is_set():
        due = t0 + sent / rate
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        value = orjson.dumps({"source": {"ts_us": time.time_ns() // 1000}, "pad": pad})
        producer.produce(topic, value, b'{"id":%d}' % sent)
        producer.poll(0)
        sent += 1
    elapsed = time.monotonic() - t0
    producer.flush(30)
    return sent, elapsed


def recv(conn: Any, child: multiprocessing.process.BaseProcess, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not child.is_alive():
            raise BenchError(f"{child.name} exited with {child.exitcode} before reporting")
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} did not report in {timeout:.0f} s")
    return conn.recv()


def produce_child(conn: Any, client: str, servers: str, topic: str, values: list[bytes], rows: int) -> None:
    """Child process: produce `rows` records (values cycled from cdc's events, keys like cdc's)
    with the library alone, configured like cdc/kafka/producer.py; time until all are acknowledged."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent cleans up
    try:
        keys = [b'{"id":%d}' % (i + 1) for i in range(rows)]
        nvalues = len(values)
        records = [(keys[i], values[i % nvalues]) for i in range(rows)]
        del keys
        if client == "kafka-python":
            from kafka import KafkaProducer

            producer = KafkaProducer(
                bootstrap_servers=servers.split(","), client_id="bench", acks="all", enable_idempotence=True,
                max_in_flight_requests_per_connection=5, linger_ms=LINGER_MS, batch_size=BATCH_SIZE,
                max_request_size=max(MAX_MESSAGE_BYTES + RECORD_OVERHEAD, BATCH_SIZE),
                max_block_ms=10000, allow_auto_create_topics=False,
            )
            producer.partitions_for(topic)  # metadata before the clock starts
            send = producer.send
            conn.send({"ready": True})
            threads0 = thread_cpu(os.getpid())
            cpu0, t0 = time.process_time(), time.perf_counter()
            futures = [send(topic, value=value, key=key) for key, value in records]
            producer.flush(timeout=600)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            threads1 = thread_cpu(os.getpid())
            failed = sum(1 for f in futures if not f.is_done or f.exception is not None)
            producer.close(timeout=5)
        else:
            from confluent_kafka import Producer

            producer = Producer({
                "bootstrap.servers": servers, "client.id": "bench", "acks": "all", "enable.idempotence": True,
                "partitioner": "murmur2_random", "linger.ms": LINGER_MS, "batch.size": BATCH_SIZE,
                "message.max.bytes": max(MAX_MESSAGE_BYTES + RECORD_OVERHEAD, BATCH_SIZE),
                "queue.buffering.max.messages": 1000000,
            })
            producer.list_topics(topic, timeout=10)
            outcome = [0, 0]

            def delivered(err: Any, _msg: Any) -> None:
                outcome[err is not None] += 1

            produce, poll = producer.produce, producer.poll
            conn.send({"ready": True})
            threads0 = thread_cpu(os.getpid())
            cpu0, t0 = time.process_time(), time.perf_counter()
            for n, (key, value) in enumerate(records):
                while True:
                    try:
                        produce(topic, value, key, on_delivery=delivered)
                        break
                    except BufferError:
                        poll(0.05)
                if n & 1023 == 0:
                    poll(0)
            producer.flush(600)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            threads1 = thread_cpu(os.getpid())
            failed = rows - outcome[0]
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        threads = {k: v - threads0.get(k, 0.0) for k, v in threads1.items()}
        conn.send({"seconds": seconds, "cpu_s": cpu, "maxrss_mb": maxrss, "failed": failed, "threads": threads})
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which fails the phase
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


# --------------------------------------------------------------------------- profile summary


_ROOT_FRAMES = re.compile(r"^(<module>|_run_module_as_main|_run_code|main|run|invoke|wrapper|Thread\._bootstrap\w*|Thread\.run)\b")


def summarize_profile(path: Path, top: int = 20, idle: bool = False, seconds: float | None = None) -> list[str]:
    """Self and inclusive shares of a py-spy raw file (`--threads --nolineno`)."""
    if not path.exists():
        return [f"(no profile at {path}: did py-spy fail to attach?)"]
    self_samples: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = "?"
        if frames and frames[0].startswith("thread ("):
            thread = frames.pop(0).split(": ", 1)[-1]
        threads[thread] += n
        total += n
        if frames:
            self_samples[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    if not total:
        return ["(empty profile)"]
    what = "samples (idle included)" if idle else "samples holding the GIL"
    if seconds and not idle:  # --rate 100: one sample per 10 ms, taken only while a thread holds the GIL
        what += f" (the GIL was held {min(1.0, total / (100 * seconds)):.0%} of the time)"
    out = [f"{total:,} {what}; by thread: " + ", ".join(f"{t} {c / total:.0%}" for t, c in threads.most_common())]
    out += ["", "| self % | function (file) |", "|---:|---|"]
    out += [f"| {c / total:.1%} | `{frame}` |" for frame, c in self_samples.most_common(top)]
    interesting = [
        (frame, c) for frame, c in inclusive.most_common()
        if not _ROOT_FRAMES.match(frame) and c / total < 0.995 and ("cdc/" in frame or "kafka/" in frame or "confluent" in frame)
    ]
    out += ["", "| inclusive % | function (file) |", "|---:|---|"]
    out += [f"| {c / total:.1%} | `{frame}` |" for frame, c in interesting[:top]]
    return out


# --------------------------------------------------------------------------- main


def add_shared_args(parser: argparse.ArgumentParser) -> None:
    """The options both benches take (bench/snapshot.py too)."""
    parser.add_argument("--clients", default="kafka-python,confluent", help="comma-separated: kafka-python,confluent")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")


def check_shared_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turn --clients into a list of known clients and require positive --rows."""
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    for client in args.clients:
        if client not in CLIENTS:
            parser.error(f"--clients: unknown client {client!r}; choose from {', '.join(CLIENTS)}")
    if not args.clients:
        parser.error("--clients is empty")
    if args.rows < 1:
        parser.error("--rows must be positive")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500_000, help="row changes to write and capture (default 500000)")
    add_shared_args(parser)
    parser.add_argument("--skip-latency", action="store_true", help="skip the latency phase")
    parser.add_argument("--latency-rate", type=int, default=2000, help="offered transactions/s in the latency phase")
    parser.add_argument("--latency-seconds", type=int, default=15, help="length of the latency load")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="also stream the WAL once more per client under py-spy; raw profiles go to DIR")
    parser.add_argument("--profile-idle", action="store_true", help="profile every thread, waiting ones included, instead of the GIL holder only")
    parser.add_argument("--profile-top", type=int, default=20, help="functions listed per profile table")
    parser.add_argument("--seed", type=int, default=42, help="seed of the workload generator")
    args = parser.parse_args(argv)
    check_shared_args(parser, args)
    if args.profile and not shutil.which("py-spy"):
        parser.error("--profile needs py-spy: pip install py-spy")
    return args


def drive(bench: Any, has_results: Callable[[], bool]) -> bool:
    """Run a bench; Ctrl-C, SIGTERM and SIGHUP stop everything it started. Prints its report
    (what was measured so far) in any case, and writes its results file when the run completed
    without a failure; False when interrupted."""

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    try:
        bench.run()
    except KeyboardInterrupt:
        bench.failed = True
        print("\ninterrupted: stopping everything this run started", file=sys.stderr)
        return False
    except BaseException:
        bench.failed = True
        raise
    finally:
        bench.close()
        if has_results():
            report = bench.report()
            print(report)
            if not bench.failed:
                bench.record(report)
    return True


def main(argv: list[str] | None = None) -> int:
    bench = Bench(parse_args(argv))
    return 0 if drive(bench, lambda: bool(bench.results)) else 130


if __name__ == "__main__":
    sys.exit(main())
