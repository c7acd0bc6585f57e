"""cdc against the real Debezium PostgreSQL connector, same machine, same run, alternating.

    python bench/debezium.py [--rows 300000] [--snapshot-rows 300000] [--rounds 2]
                             [--latency-tps 500] [--latency-s 10] [--keep]

One throwaway PostgreSQL (bench/capture.py's settings and 6-column table), one Apache
Kafka (cdc.local.kafka) and one Kafka Connect worker (cdc.local.connect, Debezium 3.3.1
on Connect 4.1.1). Debezium is tuned as its users would for throughput (max.batch.size,
max.queue.size, poll.interval.ms, producer linger and batch size through
producer.override.*); cdc runs with `[topic] client = "confluent"`. Both write 3-partition
topics with acks=all. Per round, each side in turn (the order alternates between rounds):

1. Snapshot: a new slot and prefix; `cdc snapshot` from start to exit, Debezium from the
   connector's creation until its topic holds every row (the connector's start included).
2. Streaming: the pipeline is stopped (cdc's daemon exits, Debezium's connector is
   deleted; its offsets and slot stay), N row changes are written (60 % inserts, 40 %
   updates, as bench/capture.py), then the pipeline starts again and is timed until its
   topic holds every change: a slot backlog, read as fast as each can.
3. Latency: the pipeline streams live while single-row UPDATE transactions are paced at
   --latency-tps for --latency-s seconds; commit-to-append is the record's LogAppendTime
   (the topic's message.timestamp.type) minus source.ts_us (the commit time).

CPU is utime + stime from /proc of every process group involved, sampled every 50 ms over each
phase: cdc's (the daemon or `cdc snapshot` and its readers), Connect's JVM, the broker's
JVM and PostgreSQL's (the walsenders and backends). Results go to stdout as tables.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture  # noqa: E402  (this checkout's cdc on sys.path, the /proc helpers, the table)
import figures  # noqa: E402

from cdc.local.connect import LocalKafkaConnect, debezium_connector  # noqa: E402
from cdc.local.kafka import LocalKafka  # noqa: E402
from cdc.local.postgres import LocalPostgres  # noqa: E402
from cdc.naming import topic_name  # noqa: E402

TABLE = capture.TABLE
PARTITIONS = 3
#: Debezium as a throughput-minded user would set it (defaults: 2048 / 8192 / 500 ms / 0 / 16 KiB)
DEBEZIUM_TUNING = {
    "max.batch.size": "8192",
    "max.queue.size": "65536",
    "poll.interval.ms": "10",
    "producer.override.linger.ms": "5",
    "producer.override.batch.size": "1048576",
    "producer.override.acks": "all",
    "topic.creation.default.partitions": str(PARTITIONS),
    "topic.creation.default.message.timestamp.type": "LogAppendTime",
}
WORKER = {"connector.client.config.override.policy": "All", "offset.flush.interval.ms": "1000"}


def cdc_slot(prefix: str) -> str:
    """The slot of cdc's pipeline writing under `prefix`."""
    return f"s_{prefix}"


def versions() -> dict[str, str]:
    """The versions the figures depend on, for the results file."""
    return {**figures.package_versions("psycopg", "confluent-kafka"),
            **figures.jvm_versions("kafka", "debezium-postgres"), **figures.postgres_version()}


@dataclass
class Measure:
    rows: int
    seconds: float  # from the start of the process or connector to the end (cdc snapshot: its exit)
    steady_s: float  # from the first record to the last: the rate once started
    cpu: dict[str, float] = field(default_factory=dict)  # process group -> CPU seconds, all of it
    steady_cpu: dict[str, float] = field(default_factory=dict)  # ... from the first record on

    @property
    def rate(self) -> float:
        return self.rows / self.steady_s

    @property
    def rate_with_start(self) -> float:
        return self.rows / self.seconds

    def cpu_us_per_row(self, *groups: str) -> float:
        return sum(self.steady_cpu.get(g, 0.0) for g in groups) / self.rows * 1e6


class TreeCpu:
    """CPU seconds used by process groups over a window, processes that come and go included
    (snapshot readers, COPY backends, walsenders): a thread samples utime + stime of every
    member every 50 ms and keeps each pid's last reading, so a process that exits inside the
    window still counts up to its last sample."""

    def __init__(self, groups: dict[str, int | None]) -> None:
        self.groups = groups
        self._first: dict[int, float] = {}
        self._mark: dict[int, float] | None = None
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.used: dict[str, float] = {}
        self.steady: dict[str, float] = {}

    def _sample(self, first: bool) -> None:
        for name, pgid in self.groups.items():
            if pgid is None:
                continue
            for pid in capture.group_members(pgid):
                cpu = capture.cpu_seconds(pid)
                if cpu is None:
                    continue
                if first:
                    self._first[pid] = cpu
                self._last[pid] = (name, cpu)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample(False)

    def start(self) -> TreeCpu:
        self._sample(True)
        self._thread.start()
        return self

    def mark(self) -> None:
        """From here on `steady` counts (the first record is out: start-up is over)."""
        self._sample(False)
        self._mark = {pid: cpu for pid, (_, cpu) in self._last.items()}

    def stop(self) -> TreeCpu:
        self._stop.set()
        self._thread.join()
        self._sample(False)
        self.used, self.steady = {}, {}
        for pid, (name, cpu) in self._last.items():
            base = self._first.get(pid, 0.0)  # a process born in the window used all its CPU here
            self.used[name] = self.used.get(name, 0.0) + cpu - base
            marked = base if self._mark is None else self._mark.get(pid, 0.0 if pid not in self._first else base)
            self.steady[name] = self.steady.get(name, 0.0) + cpu - marked
        return self


class DebeziumBench:
    #: PostgreSQL's settings (bench/width.py adds lock slots for its thousands of tables)
    pg_settings: dict[str, str] = capture.PG_SETTINGS

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs = capture.Processes()
        self.workdir = Path(tempfile.mkdtemp(prefix="cdc-bench-dbz-"))
        os.chmod(self.workdir, 0o755)
        self.pg: LocalPostgres | None = None
        self.broker: LocalKafka | None = None
        self.connect: LocalKafkaConnect | None = None
        self.snapshot: dict[str, list[Measure]] = {"cdc": [], "debezium": []}
        self.stream: dict[str, list[Measure]] = {"cdc": [], "debezium": []}
        self.latency: dict[str, list[float]] = {"cdc": [], "debezium": []}
        self.next_id = 1
        self._counter: Any = None
        self.loads: list[float] = []
        self.failed = False  # set by capture.drive: the work directory is then kept
        # what bench/width.py changes to capture many tables with the same machinery:
        self.dbname = "postgres"  # the database captured
        self.cdc_settings: dict[str, dict[str, Any]] = {}  # added to (or overriding) each section of cdc's config
        self.debezium_settings: dict[str, str] = {}  # added to (or overriding) the connector's properties
        self.follow_timeout = 900.0  # seconds a pipeline has to bring its topics to the count awaited

    # -- plumbing --------------------------------------------------------------------------
    def log(self, message: str) -> None:
        load = os.getloadavg()[0]
        self.loads.append(load)
        print(f"[{time.strftime('%H:%M:%S')}] (load {load:.2f}) {message}", file=sys.stderr, flush=True)

    @property
    def dsn(self) -> str:
        assert self.pg is not None
        return self.pg.dsn(self.dbname)

    @property
    def servers(self) -> str:
        assert self.broker is not None
        return self.broker.bootstrap_servers

    def sql(self, query: str, params: tuple | None = None) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(query, params)

    def groups(self, side_pgid: int | None) -> dict[str, int | None]:
        assert self.pg is not None and self.broker is not None and self.connect is not None
        return {"side": side_pgid, "broker": self.broker.pid, "postgres": _postmaster_pgid(self.pg)}

    def topic_count(self, topic: str) -> int:
        """Records in `topic` (high minus low watermarks); 0 while it is not there or has no
        leader yet. One long-lived consumer: polling must not cost the pipelines their CPU."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        if self._counter is None:
            self._counter = Consumer({"bootstrap.servers": self.servers, "group.id": "bench-count"})
        try:
            meta = self._counter.list_topics(topic, timeout=10).topics.get(topic)
            if meta is None or meta.error is not None:
                return 0
            total = 0
            for p in meta.partitions:
                low, high = self._counter.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                total += high - low
            return total
        except KafkaException:
            return 0

    def records(self, prefix: str) -> int:
        """Records in the topics of the pipeline writing under `prefix`: here its one table's
        (bench/width.py counts many tables, from a lower bound that is exact once complete)."""
        return self.topic_count(topic_name(prefix, "public", TABLE))

    def follow(
        self, pgid: int | None, t0: float, prefix: str, initial: int, rows: int,
        proc: subprocess.Popen | None = None, timeout: float | None = None,
    ) -> Measure:
        """Poll the pipeline's topics until they hold `rows` more records than `initial`; CPU of
        the pipeline's group (and the broker's and PostgreSQL's) from `t0` and from the first record."""
        timeout = self.follow_timeout if timeout is None else timeout
        window = TreeCpu(self.groups(pgid)).start()
        first: float | None = None
        while True:
            count, now = self.records(prefix), time.monotonic()
            if first is None and count > initial:
                first = now
                window.mark()
            if count >= initial + rows:
                break
            if now > t0 + timeout:
                window.stop()
                raise capture.BenchError(f"the topics of {prefix} did not reach {initial + rows} records in {timeout:.0f} s")
            time.sleep(0.05)
        done = now
        if proc is not None:
            proc.wait()  # `cdc snapshot` ends once every record is acknowledged and its state written
        end = time.monotonic()
        window.stop()
        assert first is not None
        return Measure(rows, end - t0, max(done - first, 1e-3), dict(window.used), dict(window.steady))

    # -- setup -----------------------------------------------------------------------------
    def start(self) -> None:
        self.start_services()
        self.sql(capture.CREATE_TABLE)
        self.sql(f"CREATE PUBLICATION {capture.PUBLICATION} FOR TABLE {TABLE}")
        self.insert(self.args.snapshot_rows)

    def start_services(self) -> None:
        """PostgreSQL, the broker and the Connect worker."""
        self.log(f"work dir {self.workdir}")
        self.pg = LocalPostgres(self.workdir / "pg", settings=self.pg_settings).start()
        self.broker = LocalKafka(self.workdir / "kafka", full_jit=True).start()
        self.connect = LocalKafkaConnect(self.workdir / "connect", self.servers, worker=WORKER, heap="1g").start()
        self.log(f"PostgreSQL {self.pg.port}, Kafka {self.servers}, Connect {self.connect.url}")

    def insert(self, rows: int) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(capture.INSERT_ROWS, (self.next_id, self.next_id + rows - 1))
        self.next_id += rows

    def write_changes(self, rows: int) -> None:
        """60 % inserts, 40 % updates, transactions of 100-1000 rows (as bench/capture.py)."""
        rng = random.Random(rows)
        done = 0
        with psycopg.connect(self.dsn) as conn:
            while done < rows:
                size = min(rng.randint(100, 1000), rows - done)
                n_upd = round(size * 0.4)
                conn.execute(capture.INSERT_ROWS, (self.next_id, self.next_id + size - n_upd - 1))
                self.next_id += size - n_upd
                conn.execute(capture.UPDATE_ROWS, (rng.sample(range(1, self.next_id), n_upd),))
                conn.commit()
                done += size

    # -- cdc -------------------------------------------------------------------------------
    def cdc_config(self, prefix: str) -> Path:
        sections: dict[str, dict[str, Any]] = {
            "source": {"dsn": self.dsn, "slot": cdc_slot(prefix), "publication": capture.PUBLICATION,
                       "tables": [f"public.{TABLE}"]},
            "topic": {"bootstrap_servers": self.servers, "prefix": prefix, "partitions": PARTITIONS,
                      "client": "confluent"},
            "daemon": {"spill_dir": str(self.workdir / f"spill-{prefix}"), "log_level": "INFO"},
        }
        for name, values in self.cdc_settings.items():
            sections[name] = {**sections.get(name, {}), **values}
        return capture.write_toml(self.workdir / f"{prefix}.toml", sections)

    def cdc_start(self, prefix: str, verb: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "cdc", verb, "--config", str(self.cdc_config(prefix))]
        log = (self.workdir / f"{prefix}-{verb}.log").open("ab")
        return self.procs.start(f"cdc {verb}", argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)

    def cdc_snapshot(self, prefix: str) -> Measure:
        t0 = time.monotonic()
        proc = self.cdc_start(prefix, "snapshot")
        measure = self.follow(proc.pid, t0, prefix, 0, self.next_id - 1, proc)
        self.procs.forget(proc)
        if proc.returncode != 0:
            raise capture.BenchError(f"cdc snapshot failed; see {self.workdir}/{prefix}-snapshot.log")
        return measure

    def cdc_stream(self, prefix: str, initial: int, rows: int) -> Measure:
        t0 = time.monotonic()
        proc = self.cdc_start(prefix, "run")
        measure = self.follow(proc.pid, t0, prefix, initial, rows)
        self.procs.stop(proc)
        return measure

    # -- Debezium --------------------------------------------------------------------------
    def debezium_config(self, prefix: str) -> dict[str, str]:
        assert self.pg is not None
        return debezium_connector(
            prefix, dsn_host="127.0.0.1", dsn_port=self.pg.port, dbname=self.dbname, prefix=prefix,
            tables=[f"public\\.{TABLE}"], schemas=False,
            extra={**DEBEZIUM_TUNING, "publication.name": capture.PUBLICATION,
                   "publication.autocreate.mode": "disabled", "snapshot.mode": "initial", **self.debezium_settings},
        )

    def debezium_run(self, prefix: str, initial: int, rows: int) -> Measure:
        """Create the connector (the same config every time: its offsets say whether the
        snapshot is done), follow its topic, delete it (offsets and slot stay)."""
        assert self.connect is not None and self.connect.pid is not None
        t0 = time.monotonic()
        self.connect.add_connector(prefix, self.debezium_config(prefix))
        measure = self.follow(self.connect.pid, t0, prefix, initial, rows)
        self.connect.delete_connector(prefix)
        return measure

    # -- latency ---------------------------------------------------------------------------
    def paced_updates(self, stop: threading.Event) -> None:
        rng = random.Random(7)
        interval = 1.0 / self.args.latency_tps
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            # the server runs with synchronous_commit off, and a walsender sends only flushed
            # WAL: without this the WAL writer's 200 ms rhythm would be the latency measured
            conn.execute("SET synchronous_commit = on")
            due = time.monotonic()
            while not stop.is_set():
                conn.execute(f"UPDATE {TABLE} SET i = i + 1 WHERE id = %s", (rng.randrange(1, self.next_id),))
                due += interval
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)

    def caught_up(self, topic: str, timeout: float = 300) -> None:
        """Until the topic stops growing for a second: the pipeline is past the backlog the other
        side's phases left in its slot, and idles before the paced writes start. (Debezium
        confirms no LSN beyond its last event without heartbeats, so the slot cannot tell.)"""
        deadline = time.monotonic() + timeout
        last = -1
        while (count := self.topic_count(topic)) != last or count == 0:
            if time.monotonic() > deadline:
                raise capture.BenchError(f"{topic} still growing after {timeout:.0f} s")
            last = count
            time.sleep(1.0)

    def measure_latency(self, topic: str) -> list[float]:
        """commit -> append (LogAppendTime) of every update committed while the writer runs."""
        from confluent_kafka import OFFSET_END, Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.servers, "group.id": f"lat-{topic}",
                             "enable.auto.commit": False})
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in meta.partitions])
        consumer.poll(0.5)
        stop = threading.Event()
        writer = threading.Thread(target=self.paced_updates, args=(stop,), daemon=True)
        started_us = time.time_ns() // 1000  # the backlog of earlier phases never counts
        writer.start()
        samples: list[float] = []
        end = time.monotonic() + self.args.latency_s
        while time.monotonic() < end + 3:
            if time.monotonic() >= end:
                stop.set()
            msg = consumer.poll(0.2)
            if msg is None or msg.error() or msg.value() is None:
                continue
            event = json.loads(msg.value())
            if event.get("op") == "u" and event["source"]["ts_us"] >= started_us:
                samples.append(msg.timestamp()[1] - event["source"]["ts_us"] / 1000)
        stop.set()
        writer.join(5)
        consumer.close()
        return samples

    def set_log_append_time(self, topic: str) -> None:
        from confluent_kafka.admin import (
            AdminClient,
            AlterConfigOpType,
            ConfigEntry,
            ConfigResource,
        )

        admin = AdminClient({"bootstrap.servers": self.servers})
        entry = ConfigEntry("message.timestamp.type", "LogAppendTime",
                            incremental_operation=AlterConfigOpType.SET)
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
        for future in admin.incremental_alter_configs([resource]).values():
            future.result(30)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        for rnd in range(self.args.rounds):
            order = ["cdc", "debezium"] if rnd % 2 == 0 else ["debezium", "cdc"]
            prefixes = {side: f"{side[:3]}{rnd}" for side in order}
            self.log(f"round {rnd + 1}: snapshot of {self.next_id - 1:,} rows, order {order}")
            for side in order:
                m = (self.cdc_snapshot(prefixes[side]) if side == "cdc"
                     else self.debezium_run(prefixes[side], 0, self.next_id - 1))
                self.snapshot[side].append(m)
                self.log(f"  {side} snapshot: {m.rate:,.0f} rows/s")
            self.log(f"round {rnd + 1}: writing {self.args.rows:,} changes with both pipelines stopped")
            self.write_changes(self.args.rows)
            for side in order:
                initial = self.topic_count(topic_name(prefixes[side], "public", TABLE))
                m = (self.cdc_stream(prefixes[side], initial, self.args.rows) if side == "cdc"
                     else self.debezium_run(prefixes[side], initial, self.args.rows))
                self.stream[side].append(m)
                self.log(f"  {side} streaming: {m.rate:,.0f} changes/s")
            for side in order:
                topic = topic_name(prefixes[side], "public", TABLE)
                self.set_log_append_time(topic)
                if side == "cdc":
                    proc = self.cdc_start(prefixes[side], "run")
                    self.caught_up(topic)
                    self.latency[side] += self.measure_latency(topic)
                    self.procs.stop(proc)
                else:
                    assert self.connect is not None
                    self.connect.add_connector(prefixes[side], self.debezium_config(prefixes[side]))
                    self.caught_up(topic)
                    self.latency[side] += self.measure_latency(topic)
                    self.connect.delete_connector(prefixes[side])
                self.log(f"  {side} latency: p50 {capture.pct(self.latency[side], 50):.1f} ms")

    def report(self) -> str:
        def best(ms: list[Measure]) -> Measure:
            return max(ms, key=lambda m: m.rate)

        lines = [
            f"cdc vs Debezium 3.3.1.Final (Kafka Connect 4.1.1), Apache Kafka {capture.KAFKA_VERSION}, "
            f"{os.cpu_count()} cores, load {min(self.loads):.2f}-{max(self.loads):.2f}; {self.args.rounds} rounds, "
            "alternating; rates from the first record to the last, best round (every round in brackets); "
            "CPU per row in that round, from the first record on",
            "",
            "| measure | cdc (confluent) | Debezium | cdc / Debezium |",
            "|---|---:|---:|---:|",
        ]
        for label, data in (("streaming changes/s", self.stream), ("snapshot rows/s", self.snapshot)):
            c, d = best(data["cdc"]), best(data["debezium"])
            all_c = ", ".join(f"{m.rate:,.0f}" for m in data["cdc"])
            all_d = ", ".join(f"{m.rate:,.0f}" for m in data["debezium"])
            kind = label.split()[0]
            lines.append(f"| {label} | {c.rate:,.0f} ({all_c}) | {d.rate:,.0f} ({all_d}) | {c.rate / d.rate:.2f} |")
            cs, ds = c.rate_with_start, d.rate_with_start
            lines.append(f"| {kind}, start-up included | {cs:,.0f} | {ds:,.0f} | {cs / ds:.2f} |")
            cc, dc = c.cpu_us_per_row("side"), d.cpu_us_per_row("side")
            lines.append(f"| {kind}: CPU µs per row, cdc's / Connect's process tree | {cc:.1f} | {dc:.1f} | "
                         f"{cc / dc:.2f} |")
            cb = c.cpu_us_per_row("side", "broker", "postgres")
            db = d.cpu_us_per_row("side", "broker", "postgres")
            lines.append(f"| {kind}: CPU µs per row, with the broker and PostgreSQL | {cb:.1f} | {db:.1f} | "
                         f"{cb / db:.2f} |")
        for q in (50, 99):
            c, d = capture.pct(self.latency["cdc"], q), capture.pct(self.latency["debezium"], q)
            lines.append(f"| commit-to-append p{q} (ms), {self.args.latency_tps} tx/s | {c:.1f} | {d:.1f} | {c / d:.2f} |")
        lines.append(f"| latency samples | {len(self.latency['cdc']):,} | {len(self.latency['debezium']):,} | |")
        return "\n".join(lines)

    def close(self) -> None:
        with capture.signals_ignored(signal.SIGINT, signal.SIGTERM):
            self.procs.close()
            if self._counter is not None:
                self._counter.close()
            for service in (self.connect, self.broker, self.pg):
                if service is not None:
                    try:
                        service.stop()
                    except Exception as exc:  # noqa: BLE001 (cleanup goes on)
                        print(f"stopping {service!r}: {exc}", file=sys.stderr)
        if self.args.keep or self.failed:
            print(f"kept {self.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _postmaster_pgid(pg: LocalPostgres) -> int | None:
    """PostgreSQL's process group (postmaster, walsenders, backends): from its pid file."""
    try:
        pid = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
        return os.getpgid(pid)
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300_000, help="streamed row changes per round")
    parser.add_argument("--snapshot-rows", type=int, default=300_000, help="rows in the table before round 1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-tps", type=int, default=500)
    parser.add_argument("--latency-s", type=float, default=10.0)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    bench = DebeziumBench(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        bench.run()
        print("command: " + shlex.join(["python", "bench/debezium.py", *(argv or sys.argv[1:])]))
        report = bench.report()
        print(report)
        figures.write("debezium", report, title="cdc against Debezium", versions=versions(),
                      load_during=(min(bench.loads), max(bench.loads)) if bench.loads else None,
                      argv=["debezium.py", *(argv or sys.argv[1:])])
        return 0
    finally:
        bench.close()


if __name__ == "__main__":
    sys.exit(main())
