"""Measure `cdc verify` on a large table with all three stores, next to Spark reading its topic once.

    python bench/verify.py [--rows 1000000] [--stores delta,search,cache] [--client confluent] [--keep]

It starts its own throwaway PostgreSQL (the capture bench's settings), Apache Kafka, OpenSearch
and Redis (cdc.local), fills one table (int key, text, numeric(12,2), timestamptz, bool, int)
with --rows rows, runs `cdc run` (its initial snapshot puts every row in the topic; the daemon
keeps streaming: verify waits for its confirmed LSN) and fills each store with `cdc sink
<store> --once` (200,000 records a batch). Then, one after the other, each in a child process of its own on local[2]:

1. Spark reads the table's topic once: Spark's Kafka source in a batch read (the sinks' own
   Kafka options, earliest to latest) into `count()`; the session (JVM) start timed apart.
2. `cdc verify --json` against every store (the command a user runs, its Spark session
   included), timed from start to exit; its report gives each side's time.

The ratio is verify's time over the Spark read's, both with their session starts and without
Spark's. Every process started here runs in its own process group and ends with the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's cdc, not wherever `pip install -e` points

import figures  # noqa: E402
import psycopg  # noqa: E402
from capture import PG_SETTINGS  # noqa: E402

from cdc.local.kafka import LocalKafka  # noqa: E402
from cdc.local.opensearch import LocalOpenSearch  # noqa: E402
from cdc.local.postgres import LocalPostgres  # noqa: E402
from cdc.local.redis import LocalRedis  # noqa: E402

PREFIX = "bverify"
TABLE = """
CREATE TABLE public.bench (
    id     integer PRIMARY KEY,
    name   text NOT NULL,
    amount numeric(12, 2) NOT NULL,
    at     timestamptz NOT NULL,
    flag   boolean NOT NULL,
    qty    integer NOT NULL
)"""
FILL = """
INSERT INTO public.bench
SELECT g, substr(md5(g::text) || md5(random()::text), 1, 32), round((random() * 100000)::numeric, 2),
       clock_timestamp(), g %% 2 = 0, g %% 1000
FROM generate_series(1, %s) AS g"""

SPARK_READ = """
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from cdc.config import load
from sinks.spark import build_session
from sinks.topics import spark_options
config = load(sys.argv[1])
t0 = time.monotonic()
spark = build_session("bench-verify-read", master="local[2]")
spark.range(1).count()
session = time.monotonic() - t0
t1 = time.monotonic()
read = (spark.read.format("kafka").options(**spark_options(config.topic)).option("subscribe", sys.argv[3])
        .option("startingOffsets", "earliest").option("endingOffsets", "latest").load().count())
print(json.dumps({"session": session, "read": time.monotonic() - t1, "records": read}), flush=True)
spark.stop()
"""


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="cdc-bench-verify-"))
        os.chmod(self.work, 0o755)  # the postgres OS user must reach the cluster below it
        self.children: list[subprocess.Popen] = []
        self.services: list[Any] = []
        self.loads: list[float] = []

    def cdc(self, *argv: str, timeout: float = 3600, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "cdc", *argv, "--config", str(self.config)], env=env,
                              capture_output=True, text=True, timeout=timeout, cwd=self.work, start_new_session=True)
        self.loads.append(os.getloadavg()[0])
        if done.returncode not in ok:
            causes = [line for line in done.stderr.splitlines() if line.startswith(("Caused by", "error:"))]
            raise RuntimeError(f"cdc {' '.join(argv)} failed ({done.returncode}): {' | '.join(causes[-4:])}\n"
                               f"{done.stderr[-3000:]}")
        done.seconds = time.monotonic() - started  # type: ignore[attr-defined]
        return done

    def start(self) -> None:
        a = self.args
        log(f"work dir {self.work}")
        self.pg = LocalPostgres(self.work / "pg", settings=PG_SETTINGS).start()
        self.kafka = LocalKafka(self.work / "kafka", full_jit=True).start()
        self.search = LocalOpenSearch(self.work / "opensearch", full_jit=True).start()
        self.redis = LocalRedis(self.work / "redis").start()
        self.services = [self.redis, self.search, self.kafka, self.pg]
        with psycopg.connect(self.pg.dsn(), autocommit=True) as conn:
            conn.execute(TABLE)
            started = time.monotonic()
            conn.execute(FILL, (a.rows,))
            conn.execute("ANALYZE public.bench")
        log(f"{a.rows:,} rows written in {time.monotonic() - started:.1f} s")
        self.config = self.work / "cdc.toml"
        self.config.write_text(
            f'[source]\ndsn = "{self.pg.dsn()}"\ntables = ["public.bench"]\n'
            f'[topic]\nbootstrap_servers = "{self.kafka.bootstrap_servers}"\nprefix = "{PREFIX}"\n'
            f'partitions = 3\nclient = "{a.client}"\n'
            f'[daemon]\nspill_dir = "{self.work / "spill"}"\n'
            f'[spark]\ncheckpoint_dir = "{self.work / "checkpoints"}"\nmax_offsets_per_trigger = 200000\n'
            f'[delta]\npath = "{self.work / "warehouse"}"\n'
            f'[search]\nurl = "{self.search.url}"\nreplicas = 0\n[cache]\nurl = "{self.redis.url}"\n'
        )

    def capture(self) -> float:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        daemon_log = (self.work / "daemon.log").open("w")
        started = time.monotonic()
        daemon = subprocess.Popen([sys.executable, "-m", "cdc", "run", "--config", str(self.config)], env=env,
                                  stdout=daemon_log, stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append(daemon)
        while "snapshot read" not in (self.work / "daemon.log").read_text():
            if daemon.poll() is not None:
                raise RuntimeError("the daemon exited:\n" + (self.work / "daemon.log").read_text()[-3000:])
            time.sleep(0.5)
        seconds = time.monotonic() - started
        log(f"cdc run: {self.args.rows:,} rows in the topic after {seconds:.1f} s")
        return seconds

    def fill(self) -> dict[str, float]:
        out = {}
        for store in self.args.stores:
            done = self.cdc("sink", store, "--once")
            out[store] = done.seconds  # type: ignore[attr-defined]
            log(f"cdc sink {store} --once: {(done.stdout.strip() or done.stderr.strip()).splitlines()[-1]} ({out[store]:.1f} s)")
        return out

    def spark_read(self) -> dict[str, Any]:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", SPARK_READ, str(self.config), str(ROOT), f"{PREFIX}.public.bench"],
            capture_output=True, text=True, timeout=3600, cwd=self.work, start_new_session=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the Spark read failed:\n{done.stderr[-3000:]}")
        found = json.loads(done.stdout.strip().splitlines()[-1])
        found["total"] = time.monotonic() - started
        self.loads.append(os.getloadavg()[0])
        log(f"Spark read: {found['records']:,} records in {found['read']:.1f} s (session {found['session']:.1f} s)")
        return found

    def verify(self) -> tuple[float, dict[str, Any]]:
        done = self.cdc("verify", "--json", "--stores", ",".join(self.args.stores), ok=(0, 1))
        report = json.loads(done.stdout)
        log(f"cdc verify: ok={report['ok']} in {done.seconds:.1f} s")  # type: ignore[attr-defined]
        if not report["ok"]:
            raise RuntimeError(f"cdc verify found differences:\n{done.stdout[-3000:]}")
        return done.seconds, report  # type: ignore[attr-defined]

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
                child.wait(60)
        for service in self.services:
            service.close() if hasattr(service, "close") else service.stop()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def report(rows: int, capture_s: float, fills: dict[str, float], read: dict[str, Any], wall: float,
           verified: dict[str, Any], loads: list[float]) -> str:
    table = verified["tables"][0]
    sides = {s["side"]: s for s in table["sides"]}
    lines = [
        f"cdc verify on {rows:,} rows, stores {', '.join(fills)}; 1-minute load average {min(loads):.1f}-{max(loads):.1f}",
        "",
        "| phase | records | seconds | records/s | ratio to the Spark read |",
        "|---|---:|---:|---:|---:|",
        f"| Spark reads the topic once: session start | - | {read['session']:.1f} | - | - |",
        f"| Spark reads the topic once: `count()` | {read['records']:,} | {read['read']:.1f} | "
        f"{read['records'] / read['read']:,.0f} | 1.00 |",
        f"| Spark reads the topic once, session included | {read['records']:,} | {read['session'] + read['read']:.1f} | - | 1.00 |",
        f"| `cdc verify` (exit 0), process start to exit | {rows:,} | {wall:.1f} | {rows / wall:,.0f} | "
        f"**{wall / (read['session'] + read['read']):.2f}** (session included), {wall / read['read']:.2f} (read alone) |",
        f"| - PostgreSQL's digest, in SQL | {rows:,} | {table['postgres_seconds']:.1f} | | |",
    ]
    for name, side in sides.items():
        lines.append(f"| - {name}: digest and narrowing (waited {side['waited_seconds']:.1f} s) | "
                     f"{side['rows'][name]:,} | {side['seconds']:.1f} | | |")
    lines += ["", "| setup | seconds |", "|---|---:|", f"| `cdc run`: the snapshot of {rows:,} rows into the topic | {capture_s:.1f} |"]
    lines += [f"| `cdc sink {store} --once` | {seconds:.1f} |" for store, seconds in fills.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--stores", type=lambda s: s.split(","), default=["delta", "search", "cache"])
    parser.add_argument("--client", default="confluent", choices=("confluent", "kafka-python"))
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, warehouse) afterwards")
    args = parser.parse_args()
    bench = Bench(args)
    try:
        bench.start()
        capture_s = bench.capture()
        fills = bench.fill()
        read = bench.spark_read()
        wall, verified = bench.verify()
        printed = report(args.rows, capture_s, fills, read, wall, verified, bench.loads)
        print(printed)
        print(f"\ncommand: python bench/verify.py --rows {args.rows} --stores {','.join(args.stores)} --client {args.client}")
        versions = {**figures.package_versions("psycopg", "confluent-kafka", "kafka-python", "pyspark", "pyarrow",
                                               "redis", "opensearch-py", "deltalake"),
                    **figures.jvm_versions("kafka", "spark", "opensearch"), **figures.postgres_version(),
                    **figures.program_version("redis", ["redis-server", "--version"])}
        figures.write("verify", printed, title="cdc verify against one Spark read of the topic", versions=versions,
                      load_during=(min(bench.loads), max(bench.loads)) if bench.loads else None)
        return 0
    finally:
        bench.close()


if __name__ == "__main__":
    sys.exit(main())
