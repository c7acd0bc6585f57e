"""Helpers for the end-to-end tests: configs, the daemon as a real process, reading topics."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg

from cdc.config import TopicConfig, load
from cdc.kafka.heartbeat import newest_heartbeat
from cdc.kafka.reader import read_topic
from cdc.naming import topic_name
from compaction.table import TopicTable, build, payload_of
from sinks.progress import read_progress

# The Debezium envelope's fields, and its source block's, in the order cdc writes them
ENVELOPE_KEYS = ["before", "after", "source", "transaction", "op", "ts_ms", "ts_us", "ts_ns"]
SOURCE_KEYS = [
    "version", "connector", "name", "ts_ms", "snapshot", "db", "sequence",
    "ts_us", "ts_ns", "schema", "table", "txId", "lsn", "xmin",
]


#: the environment of a `cdc sink` process that logs each step of a batch (its DEBUG lines)
DEBUG_LOG = {"CDC_DAEMON_LOG_LEVEL": "DEBUG"}


def slot_of(prefix: str) -> str:
    """The slot `write_config` gives a test with this topic prefix."""
    return "s_" + prefix.lower()


def write_config(path: Path, dsn: str, servers: str, prefix: str, tables: list[str], **sections: dict) -> Path:
    """A cdc.toml for one test: its own database, slot, publication and topic prefix."""
    source = {"dsn": dsn, "slot": slot_of(prefix), "publication": "p_" + prefix.lower(), "tables": tables}
    source.update(sections.pop("source", {}))
    topic = {"bootstrap_servers": servers, "prefix": prefix, "partitions": 3}
    topic.update(sections.pop("topic", {}))
    daemon = {"spill_dir": str(path.parent / "spill"), "log_level": "INFO"}
    daemon.update(sections.pop("daemon", {}))
    all_sections = {"source": source, "topic": topic, "daemon": daemon, **sections}
    lines = []
    for name, values in all_sections.items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml(value)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return orjson.dumps(str(value)).decode()  # a JSON string is a valid TOML basic string


def cdc(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the `cdc` command line to completion."""
    return subprocess.run(
        [sys.executable, "-m", "cdc", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


class DaemonProcess:
    """`cdc run` as a real OS process, so tests can SIGTERM and kill -9 it."""

    #: every one started in this test session; conftest kills those still alive after each test
    started: list[DaemonProcess] = []

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.config, self.log, self.env = config, log, env or {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        self._log = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc", "run", "--config", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
        )
        DaemonProcess.started.append(self)
        return self

    def stop(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.wait(30)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout)
        finally:
            self._log.close()
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.2,
             detail: Callable[[], str] | None = None) -> Any:
    """`predicate()`'s first true result, polled until `timeout`; else the error names `what`
    (and `detail()`: what the polls saw)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            said = f": {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{said}")
        time.sleep(poll)


def sleeps_of_this_thread(monkeypatch: Any) -> list[float]:
    """`time.sleep` patched for the calling thread only, its sleeps recorded, not slept.

    Patching the module for every thread turns each background thread's pause (a Kafka
    client's, a leftover job's) into a busy loop, and with a recorder into a list that grows
    for as long as the test runs: enough to fill a test worker's memory."""
    slept: list[float] = []
    sleep, caller = time.sleep, threading.get_ident()

    def recorded(seconds: float) -> None:
        if threading.get_ident() == caller:
            slept.append(seconds)
        else:
            sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    return slept


def slot_active(dsn: str, slot: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return bool(row and row[0])


def slot_streaming(dsn: str, slot: str) -> bool:
    """The slot is held by a walsender past START_REPLICATION. A slot only `active` may be held
    by the initial snapshot's connection: a daemon stopped then has no complete snapshot."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT r.state FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid"
            " WHERE s.slot_name = %s",
            (slot,),
        ).fetchone()
    return bool(row and row[0] in ("catchup", "streaming"))


def start_streaming(
    config: Path, log: Path, dsn: str, slot: str, env: dict[str, str] | None = None
) -> DaemonProcess:
    """`cdc run` as a process, returned once its walsender streams from the slot (its initial
    snapshot, if any, is complete)."""
    daemon = DaemonProcess(config, log, env).start()
    try:
        wait_for(lambda: not daemon.alive() or slot_streaming(dsn, slot), 60, "the daemon to stream")
    except AssertionError:
        daemon.stop()
        raise AssertionError(f"the daemon did not start streaming:\n{daemon.output()[-3000:]}") from None
    assert daemon.alive(), daemon.output()[-3000:]
    return daemon


def current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()[0])


def confirmed_lsn(dsn: str, slot: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def wait_caught_up(dsn: str, slot: str, daemon: DaemonProcess | None = None, timeout: float = 90) -> None:
    """Until the slot confirmed everything written so far: every record is acknowledged."""
    target = current_lsn(dsn)

    def done() -> bool:
        if daemon is not None and not daemon.alive():
            raise AssertionError(f"daemon exited early:\n{daemon.output()[-3000:]}")
        lsn = confirmed_lsn(dsn, slot)
        return lsn is not None and lsn >= target

    wait_for(done, timeout, f"slot {slot} to confirm LSN {target}")


def topic_records(servers: str, prefix: str, schema: str, table: str) -> list[tuple[bytes | None, dict | None]]:
    """Every record of the table's topic as (key, envelope or None for a tombstone), per partition order."""
    topic = topic_name(prefix, schema, table)
    records = read_topic(TopicConfig(bootstrap_servers=servers), topic)
    return [(r.key, None if r.value is None else payload_of(r.value)) for r in records]


def topic_table(servers: str, prefix: str, schema: str, table: str) -> TopicTable:
    return build(read_topic(TopicConfig(bootstrap_servers=servers), topic_name(prefix, schema, table)))


def source_table(dsn: str, sql: str, key: str = "id") -> dict[bytes, dict[str, Any]]:
    """Rows of a query keyed like the topic: {"<key>":value} -> row dict."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(sql)
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return {orjson.dumps({key: row[key]}): row for row in rows}


# Segments roll after a second, a 1% dirty ratio makes a log cleanable, and tombstones may go
# two seconds after the segment holding them was first cleaned (with `eager_broker`).
EAGER_COMPACTION = {
    "cleanup.policy": "compact",
    "segment.ms": "1000",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
    "delete.retention.ms": "2000",
}

ACCT = "CREATE TABLE public.acct (id int PRIMARY KEY, version int NOT NULL, note text)"


class Writers:
    """Concurrent inserts, updates and deletes on public.acct until stopped. Every update
    raises `version` by one; an insert starts a row at version 1."""

    def __init__(self, dsn: str, threads: int = 2, keys: int = 1000, hot: int = 200, pause_s: float = 0.002) -> None:
        self.dsn, self.keys, self.hot, self.pause_s = dsn, keys, hot, pause_s
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.commits = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not self.errors, self.errors

    def _key(self, rng: random.Random) -> int:
        return rng.randrange(self.hot) if rng.random() < 0.6 else rng.randrange(self.keys)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    key = self._key(rng)
                    roll = rng.random()
                    try:
                        with conn.transaction():
                            if roll < 0.4:
                                conn.execute(
                                    "INSERT INTO public.acct VALUES (%s, 1, %s) ON CONFLICT (id) "
                                    "DO UPDATE SET version = acct.version + 1, note = excluded.note",
                                    (key, f"w{seed}-{rng.random()}"),
                                )
                            elif roll < 0.88:
                                conn.execute(
                                    "UPDATE public.acct SET version = version + 1, note = %s WHERE id = %s",
                                    (f"u{seed}-{rng.random()}", key),
                                )
                            else:
                                conn.execute("DELETE FROM public.acct WHERE id = %s", (key,))
                            if rng.random() < 0.2:  # some multi-row transactions
                                conn.execute(
                                    "UPDATE public.acct SET version = version + 1 WHERE id = %s", (self._key(rng),)
                                )
                    except psycopg.errors.DeadlockDetected:
                        continue  # the multi-row transactions lock in random order; rolled back whole
                    self.commits += 1
                    time.sleep(self.pause_s)
        except BaseException as exc:  # noqa: BLE001 (reported by __exit__)
            self.errors.append(exc)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the daemon's snapshot readers)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        found = re.search(r"^PPid:\s+(\d+)$", text, re.M)
        if found and int(found.group(1)) == pid:
            out.append(int(status.parent.name))
    return out


def peak_rss_mb(pid: int) -> float:
    """The peak resident set (VmHWM) of a process plus its children's (snapshot readers), in MiB."""
    total = 0.0
    for proc in (pid, *children_of(pid)):
        try:
            lines = Path(f"/proc/{proc}/status").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM:"))
    return total


SINK_TIMEOUT_S = 900


def cdc_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`cdc <args>` in this process, as its own process would run it (its stdout, its stderr
    with the log, its exit code), with `env` added: a Spark job reuses the tests' driver JVM,
    warm, instead of starting one (10-20 s each). The process-wide state the command sets
    (the root logger, the signal handlers, the exception hooks, the environment) is put back."""
    from cdc.cli import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    hooks = sys.excepthook, threading.excepthook
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    environ = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    root.handlers = []  # the command's own logging set-up then logs to `err`
    os.environ.update(env or {})
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args), prog_name="cdc")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except Exception:  # what the process would print before exiting 1
                err.write(traceback.format_exc())
                code = 1
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        sys.excepthook, threading.excepthook = hooks
        for sig, previous in signals.items():
            signal.signal(sig, previous)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["cdc", *args], code, out.getvalue(), err.getvalue())


class Sink:
    """`cdc sink <store>` for one test's config: `--once` runs, or a streaming process."""

    def __init__(self, config: Path, log: Path, store: str = "delta", env: dict[str, str] | None = None) -> None:
        self.config, self.log, self.store = config, log, store
        self.env = env or {}  # for every streaming start
        self.proc: subprocess.Popen | None = None

    def once(self, exit_code: int = 0, env: dict[str, str] | None = None, process: bool = False) -> str:
        """`--once` to the end; its stdout (its stderr when it is to fail). In this process's
        Spark session (`cdc_here`), unless `process`: where the test reads the JVM's own output,
        and on a cluster (spark-submit's driver prints to the process's own stdout)."""
        args = ("sink", self.store, "--once", "--config", str(self.config))
        if process or load(self.config).spark.master.startswith("spark://"):
            done = subprocess.run(
                [sys.executable, "-m", "cdc", *args], capture_output=True, text=True, timeout=SINK_TIMEOUT_S,
                cwd=self.config.parent, env={**os.environ, **(env or {})},
            )
        else:
            done = cdc_here(*args, env=env)
        with open(self.log, "a", encoding="utf-8") as out:
            out.write(done.stdout + done.stderr)
        assert done.returncode == exit_code, done.stdout + done.stderr[-4000:]
        return done.stdout if exit_code == 0 else done.stderr

    def start(self, env: dict[str, str] | None = None) -> None:
        self._out = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cdc", "sink", self.store, "--config", str(self.config)],
            stdout=self._out, stderr=subprocess.STDOUT, cwd=self.config.parent, start_new_session=True,
            env={**os.environ, **self.env, **(env or {})},
        )

    def stop(self, timeout: float = 300) -> int:
        """SIGTERM to the command (not its JVM): it lets the running batch finish, then exits."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.close()

    @property
    def streaming(self) -> bool:
        """A streaming process was started and is still running."""
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)  # the driver and its JVM
        self.proc.wait(30)
        self._out.close()

    def complete_lsn(self) -> int:
        """The LSN up to which the job's latest progress record says its store is complete."""
        return int(read_progress(load(self.config).topic).get(self.store, {}).get("complete_lsn", 0))

    def batches(self) -> int:
        """The micro-batches the job's log reports so far."""
        return self.log.read_text().count("INFO sinks.pipeline: batch ") if self.log.exists() else 0

    def next_batch(self, what: str = "a batch") -> None:
        """Wait until the streaming job completes one more micro-batch."""
        before = self.batches()
        wait_for(lambda: self.batches() > before, SINK_TIMEOUT_S, what)

    def kill9_mid_batches(self, delays_s: tuple[float, ...]) -> None:
        """Per delay: start streaming, wait for a completed batch, then kill -9 the job that
        long into the next one."""
        for delay_s in delays_s:
            self.start()
            self.next_batch()
            time.sleep(delay_s)
            self.kill9()

    def kill9_after(self, lines: tuple[str, ...]) -> None:
        """Per line: start streaming (logging at DEBUG), wait for a completed batch, then kill -9
        the job as soon as its log has one more `line`: a step of a batch that the job logs
        when it is done (`sinks.stores.delta.store: public.acct: current`: between the `current` MERGE and the
        change log's append), so the kill lands between two of the batch's commits."""
        for line in lines:
            self.start(env=DEBUG_LOG)
            self.next_batch()
            self.kill9_at(line)

    def kill9_at(self, line: str) -> None:
        """kill -9 the running job (logging at DEBUG) as soon as its log has one more `line`."""
        seen = self.log.read_text().count(line)
        wait_for(lambda: self.log.read_text().count(line) > seen, SINK_TIMEOUT_S, line, poll=0.05)
        self.kill9()


def rebuild_while_streaming(
    dsn: str, sink: Sink, command: tuple[str, ...], read: Callable[[], Any], every_s: float, pause_s: float,
    batches_after: int = 1,
) -> tuple[subprocess.CompletedProcess, list[Any]]:
    """`cdc <command>` while writers change public.acct, the live job streams them and a
    reader samples the store every `every_s` (`read`, in a thread of its own); then
    `batches_after` batches of the live job. (The rebuild's result, the samples.)"""
    samples: list[Any] = []
    reading = threading.Event()

    def sample() -> None:
        while not reading.is_set():
            samples.append(read())
            time.sleep(every_s)

    reader = threading.Thread(target=sample, daemon=True)
    with Writers(dsn, keys=400, pause_s=pause_s):
        sink.start()
        sink.next_batch()
        reader.start()
        done = cdc_here(*command)
        for n in range(batches_after):
            sink.next_batch(f"batch {n + 1} of the job after the switch")
    reading.set()
    reader.join(30)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, samples


def acct_changes_captured(db: Any, run_daemon: Any) -> Any:
    """`public.acct`: 500 rows, then updates and deletes, all in the topics; the daemon."""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'n' || g FROM generate_series(1, 500) g")
    daemon, slot = run_daemon(["public.*"])
    db.execute("UPDATE public.acct SET version = 2, note = 'u' WHERE id % 5 = 0")
    db.execute("DELETE FROM public.acct WHERE id % 7 = 0")
    wait_caught_up(db.dsn, slot, daemon)
    return daemon


def acct_under_load(
    db: Any, run_daemon: Any, sink: Sink, meanwhile: Callable[[Sink], None],
    stored: Callable[[], dict[int, tuple[int, str]]],
) -> str:
    """Writers change `public.acct` (2,000 rows) while `meanwhile` does its worst to the job
    (kills, its store's fault); afterwards the store equals the table. A job still streaming
    then completes what it read by itself and stops cleanly; `--once` brings the store to the
    end of the topics. The job's log. (The sink's config is a file of its own: the daemon
    writes cdc.toml.)"""
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 2000) g")
    daemon, slot = run_daemon(["public.acct"])
    with Writers(db.dsn, keys=3000, pause_s=0.05):
        meanwhile(sink)
    wait_caught_up(db.dsn, slot, daemon)
    if sink.streaming:
        # the writers stopped: once the heartbeats stop too, no batch comes to complete the
        # last one the job read, so the job does it itself
        topics = load(sink.config).topic
        wait_for(lambda: sink.complete_lsn() == newest_heartbeat(topics) > 0, 120,
                 "the streaming job to be complete up to the last heartbeat")
        assert sink.stop() == 0
    sink.once(env={"CDC_SPARK_MAX_OFFSETS_PER_TRIGGER": "1000000"})
    assert stored() == acct_rows(db)
    assert daemon.stop() == 0
    return sink.log.read_text()


def acct_on_a_cluster(
    db: Any, run_daemon: Any, sink: Sink, cluster: Any, stored: Callable[[], dict[int, tuple[int, str]]]
) -> None:
    """The job on a standalone cluster (the sink's config names its master) fills its store
    with `public.acct`: the driver registered with the cluster, whose executors wrote."""
    daemon = acct_changes_captured(db, run_daemon)
    assert "0 dead letters" in sink.once()
    assert stored() == acct_rows(db)
    assert f"Registering app cdc-sink-{sink.store}" in (cluster.work_dir / "master.log").read_text()
    assert daemon.stop() == 0


def acct_rows(db: Any) -> dict[int, tuple[int, str]]:
    """`public.acct` in PostgreSQL: id -> (version, note)."""
    return {r[0]: (r[1], r[2]) for r in db.fetchall("SELECT id, version, note FROM public.acct")}


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed scanlines of a PNG (no imaging library needed)."""
    import struct
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", data[16:24])
    chunks, i = [], 8
    while i < len(data):
        length, kind = struct.unpack(">I4s", data[i:i + 8])
        if kind == b"IDAT":
            chunks.append(data[i + 8:i + 8 + length])
        i += 12 + length
    return width, height, zlib.decompress(b"".join(chunks))

