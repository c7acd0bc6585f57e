"""Measure the Spark sink jobs against Spark's own read ceiling, in one run on one machine.

    python bench/sinks.py [--changes 1000000] [--tables 4] [--max-offsets 200000,1000000]
                          [--stores delta,search,cache,postgres] [--fresh-rate 1000] [--fresh-seconds 45]
                          [--fresh-warmup 15]
                          [--skip-freshness] [--skip-rebuild] [--skip-alone] [--driver-memory 2g]
                          [--keep]

It starts its own throwaway PostgreSQL (fsync off, synchronous_commit off) and Apache Kafka
(cdc.local.kafka: one KRaft broker/controller on these cores), creates --tables tables
(int key, text, numeric(12,2), timestamptz, bool, int) plus a small marker table for the
freshness phase, a publication and a slot, and writes a backlog of N changes (60 %
INSERT / 40 % UPDATE, transactions of 100-1000 rows, each on one random table). Then:

1. Capture: `cdc run` ([topic] client = "confluent") until the slot's confirmed_flush_lsn
   passes the end of the writes; the daemon is stopped. The records are counted from the
   topics' high watermarks (the sink phases must see exactly these).
   Then the search and cache servers alone (unless --skip-alone): the bench reads the
   backlog with confluent-kafka and hands it to the sink's own executor code
   (sinks.rows.PartitionWriter with the store's writer: the last change per key, then the job's writes) in
   its own process, with no Spark, into a new store; the server's CPU is a floor under
   its share of any apply run, and with the read ceiling's CPU per record it bounds the
   apply ratio these cores have room for.
2. Read ceiling: the sink jobs' own stream of the topics (sinks.topics.read_stream: the
   subscription, earliest offsets, maxOffsetsPerTrigger; until 2026-12-07 Spark's Kafka
   source, with the same options) and the available-now
   trigger into a foreachBatch that only counts, on local[2], in a child process (one
   SparkContext per process). Timed from the query's start to its end; the session (JVM)
   start is reported apart.
3. Apply, per store (--stores: delta, search, cache, postgres): the sink
   job (sinks.runner.keep_running with the store of sinks.stores.build: what `cdc sink <store>
   --once` runs) with a fresh checkpoint and a fresh store, in a child process, timed the
   same way; then the store is checked (Delta: current/changes/history row counts; cache:
   the rows under the topics' keys; search: the documents counted through the aliases).
   The executors' Python workers' CPU over the query is measured apart (PythonCpu): the
   sink's Python writer per record, and each apply run is set against the room its store's
   server alone leaves (the issue's target: at least 0.8 of it).
   The cache gets a Redis started here, a database per run; the search index an
   OpenSearch started here, the prefix's indexes deleted before each run.
   After the search apply run (unless --skip-rebuild): `cdc search rebuild` over the
   index it filled (sinks.stores.search.generations.rebuild_here, in a child, timed the same way):
   every record read again into new indexes, the swap, one more pass, the old ones dropped.
   Phases 2 and 3 run once per --max-offsets value; the ratio is apply (or rebuild) /
   ceiling at the same value.
4. Freshness, per store: `cdc run` and `cdc sink <store>` (streaming, [spark]
   trigger_interval_s = --trigger-interval) on the warehouse of the last apply run; a
   writer offers --fresh-rate single-row transactions/s for --fresh-warmup seconds (not
   measured: the JVMs compile the batch's hot code), then for --fresh-seconds (half insert
   a marker row into `public.zz_fresh`, half update a random row of the backlog tables,
   so every micro-batch also MERGEs into the big tables); the client time after each
   marker's COMMIT is its commit time. A reader child polls the store (Delta: the
   `_delta_log` of `current/public/zz_fresh` and the ids of its live files, read with
   pyarrow, since delta-rs 1.6.6 refuses these tables; cache: GETs of the next markers'
   keys; search: an `ids` search for them, so visible means searchable, after a refresh)
   every --poll-ms and records when
   each marker first appears: visible - commit, p50/p99.

CPU of a Spark phase = that of the child's process group (the Python driver and the JVM it
launched) over the timed window. Every process started here runs in its own process group
and is ended on exit, Ctrl-C and SIGTERM included.
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
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import figures
import orjson
import psycopg
from capture import (
    CLK_TCK,
    PG_SETTINGS,
    Bench,
    BenchError,
    CpuWindow,
    _f,
    drive,
    group_cpu_seconds,
    pct,
    proc_stat,
    recv,
)

from cdc.config import TopicConfig
from cdc.kafka.topics import TopicAdmin
from cdc.local.kafka import LocalKafka
from cdc.local.postgres import LocalPostgres
from cdc.naming import topic_name

PUBLICATION = "bench_sinks_pub"
SLOT = "bench_sinks"
PREFIX = "bsink"
PARTITIONS = 3  # per topic, unless --partitions says otherwise
SHARDS_PER_NODE = 5000  # the bench's OpenSearch node: room for 2,499 tables
FRESH_TABLE = "zz_fresh"  # the markers of the freshness phase
CHILD_MARK = "@@bench "  # a child's report lines on its stdout start with this

CREATE_TABLE = """
CREATE TABLE {t} (
    id     integer PRIMARY KEY,
    name   text NOT NULL,
    amount numeric(12, 2) NOT NULL,
    at     timestamptz NOT NULL,
    flag   boolean NOT NULL,
    qty    integer NOT NULL
)"""
CREATE_FRESH = f"CREATE TABLE {FRESH_TABLE} (id integer PRIMARY KEY, note text NOT NULL, at timestamptz NOT NULL)"
INSERT_ROWS = """
INSERT INTO {t} (id, name, amount, at, flag, qty)
SELECT g, substr(md5(g::text) || md5(random()::text), 1, 32), round((random() * 100000)::numeric, 2),
       clock_timestamp(), g %% 2 = 0, g %% 1000
FROM generate_series(%s::int, %s::int) AS g"""
UPDATE_ROWS = """
UPDATE {t} SET name = substr(md5(random()::text) || name, 1, 32), amount = amount + 0.01, at = clock_timestamp(),
       flag = NOT flag, qty = qty + 1
WHERE id = ANY(%s)"""
UPDATE_ONE = "UPDATE {t} SET amount = amount + 0.01, at = clock_timestamp(), qty = qty + 1 WHERE id = %s"
INSERT_MARKER = f"INSERT INTO {FRESH_TABLE} (id, note, at) VALUES (%s, 'marker', clock_timestamp())"
MARKER_RANGE = 10_000_000  # the markers of freshness phase k are k * MARKER_RANGE + 1, 2, ...; warm-up ones negative
WARMUP_IDS = 1_000  # the load's warm-up markers: -(k * MARKER_RANGE + WARMUP_IDS + 1), ...
KIND_LINE = re.compile(r"sinks\.delta DEBUG (\S+): ((?:\w+ [0-9.]+ s(?:, )?)+)")
# the job's batches (the CLI's log and a bench child's format), and Delta's history query's
BATCH_LINE = re.compile(r"(?:INFO |: )batch (\d+): (\d+) records of (\d+) tables in ([0-9.]+) s")
HISTORY_LINE = re.compile(r"delta-history batch (\d+): (\d+) records of \d+ tables in ([0-9.]+) s")


def table_names(n: int) -> list[str]:
    return [f"bench_t{i}" for i in range(n)]


# --------------------------------------------------------------------------- stores


class StoreBench:
    """What the bench needs of one store: its config section, a check after the apply run
    (in the Spark child), and a freshness reader (in a child of its own). Issue 11 adds
    the search index and the cache as subclasses: the phases stay the same."""

    name = ""
    served = False  # a server of its own, apart from Spark (measured alone too)
    apply_target = 0.5  # the issues' targets: apply rows/s over the read ceiling, freshness p99
    fresh_target_s = 10.0

    def sections(self, run_dir: Path) -> dict[str, dict[str, Any]]:
        """The config sections the store's sink needs, its data under `run_dir`."""
        raise NotImplementedError

    def check(self, config_path: Path, topics: list[str]) -> dict[str, Any]:
        """After the apply run, in the bench: what the store holds (reported next to `expected`)."""
        return {}

    def expected(self, bench: SinksBench) -> dict[str, Any]:
        """What `check` should find after applying the backlog."""
        return {}

    #: what the freshness readers look at, each apart (Delta: `current` and `history`)
    views: tuple[str, ...] = ("",)

    def visible(self, config_path: str, base: int, view: str) -> Any:
        """In the reader child: a callable returning the marker ids visible now (None: nothing
        new since the last call); this phase's are base+1, base+2, ... and -(base+1) ..."""
        raise NotImplementedError

    def streaming_argv(self, config: Path) -> list[str]:
        """The streaming sink of the freshness phase."""
        return [sys.executable, "-m", "cdc", "sink", self.name, "--config", str(config)]

    def commits(self, config_path: Path) -> dict[str, int]:
        """Delta: the commits in the logs of the store's tables so far, per kind (others: none)."""
        return {}

    def close(self) -> None:
        """Stop what `sections` started (the bench ends with os._exit: no atexit runs)."""

    @property
    def server_pid(self) -> int | None:
        """The process group of the store's own server (None: the store runs inside Spark)."""
        return None

    def write_alone(self, config_path: Path, rows: list[Any], registry: Any) -> None:
        """Write `rows` (Arrow batches of sinks.latest.ROWS, each key's in offset order) into a
        new store with the sink's own executor code, in the bench: no Spark."""
        raise NotImplementedError


class DeltaLog:
    """A Delta table read from its own log, without Spark: delta-rs 1.6.6 refuses the sink's
    tables (reader features columnMapping and typeWidening), so the bench follows
    `_delta_log/<version>.json` itself: the live files (add minus remove), their row counts
    (stats.numRecords minus deletion vectors) and, on demand, one column (by its physical
    name under column mapping) read with pyarrow."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.version = -1
        self.files: dict[str, dict[str, Any]] = {}
        self.physical: dict[str, str] = {}

    def update(self) -> bool:
        """Apply the commits after the last one read; True when there were some."""
        changed = False
        while True:
            commit = self.path / "_delta_log" / f"{self.version + 1:020d}.json"
            try:
                actions = [json.loads(line) for line in commit.read_text().splitlines() if line.strip()]
            except (FileNotFoundError, ValueError):  # not there yet (or still being renamed into place)
                return changed
            for action in actions:
                if "add" in action:
                    self.files[action["add"]["path"]] = action["add"]
                elif "remove" in action:
                    self.files.pop(action["remove"]["path"], None)
                elif "metaData" in action:
                    schema = json.loads(action["metaData"]["schemaString"])
                    self.physical = {
                        f["name"]: f.get("metadata", {}).get("delta.columnMapping.physicalName", f["name"])
                        for f in schema["fields"]
                    }
            self.version += 1
            changed = True

    def file_path(self, name: str) -> Path:
        from urllib.parse import unquote, urlparse

        if "://" in name:
            return Path(unquote(urlparse(name).path))
        return self.path / unquote(name)

    def rows(self, keep: Callable[[dict[str, Any]], bool] = lambda add: True) -> int:
        """Rows of the live files (those `keep` takes: an add action, its partitionValues)."""
        total = 0
        for add in self.files.values():
            if not keep(add):
                continue
            stats = json.loads(add.get("stats") or "{}")
            if "numRecords" in stats:
                total += int(stats["numRecords"])
            else:
                import pyarrow.parquet as pq

                total += pq.ParquetFile(self.file_path(add["path"])).metadata.num_rows
            total -= int((add.get("deletionVector") or {}).get("cardinality", 0))
        return total

    def column(self, name: str, file: str) -> list[Any]:
        import pyarrow.parquet as pq

        if (self.files[file].get("deletionVector") or None) is not None:
            raise BenchError(f"{self.path}: deletion vectors are not read by this bench")
        physical = self.physical.get(name, name)
        return pq.read_table(self.file_path(file), columns=[physical]).column(physical).to_pylist()


def log_commits(table: Path) -> int:
    """The commits of a Delta table (its log's `<version>.json`)."""
    return len(list((table / "_delta_log").glob("[0-9]*.json")))


class DeltaBench(StoreBench):
    name = "delta"
    views = ("current", "history")
    history_interval_s = 30.0  # the bench's --history-interval
    kinds: tuple[str, ...] = ("current", "changes", "history")

    def commits(self, config_path: Path) -> dict[str, int]:
        from cdc.config import load as load_config

        root = Path(load_config(str(config_path)).delta.path)
        out = {}
        for kind in self.kinds:
            if kind == "changes":
                out[kind] = log_commits(root / "changes")
            else:
                out[kind] = sum(log_commits(t) for schema in (root / kind).glob("*") for t in schema.glob("*"))
        return out

    def sections(self, run_dir: Path) -> dict[str, dict[str, Any]]:
        return {"delta": {"path": str(run_dir / "warehouse"), "history_interval_s": self.history_interval_s}}

    def check(self, config_path: Path, topics: list[str]) -> dict[str, Any]:
        from cdc.config import load as load_config
        from sinks.stores.delta.store import log_path, table_path

        root = load_config(str(config_path)).delta.path
        out: dict[str, Any] = {}
        for kind in ("current", "changes", "history"):
            if kind == "changes":
                log = DeltaLog(log_path(root))
                log.update()
                out[kind] = log.rows(lambda add: add["partitionValues"]["_cdc_topic"] in topics)
                continue
            total = 0
            for topic in topics:
                log = DeltaLog(table_path(root, kind, topic))
                log.update()
                total += log.rows()
            out[kind] = total
        return out

    def expected(self, bench: SinksBench) -> dict[str, Any]:
        w = bench.workload
        return {"current": w.inserts, "changes": w.inserts + w.updates, "history": w.inserts + w.updates}

    def marker_table(self, config_path: str, view: str) -> str:
        from cdc.config import load as load_config
        from sinks.stores.delta.store import table_path

        return table_path(load_config(config_path).delta.path, view, topic_name(PREFIX, "public", FRESH_TABLE))

    def visible(self, config_path: str, base: int, view: str) -> Any:
        """The marker table's live files and their ids, from its Delta log (markers are only
        inserted: each has one version in `history`)."""
        log = DeltaLog(self.marker_table(config_path, view))
        ids_of: dict[str, list[int]] = {}  # live file -> its ids

        def poll() -> tuple[list[int], float] | None:
            if not log.update():
                return None
            now = time.time()  # the new version exists at least since now
            for name in list(ids_of):
                if name not in log.files:
                    del ids_of[name]
            for name in log.files:
                if name not in ids_of:
                    ids_of[name] = log.column("id", name)
            return [i for ids in ids_of.values() for i in ids], now

        return poll


class TextbookBench(DeltaBench):
    """The job a Spark user writes instead (bench/textbook.py): `foreachBatch`, the latest change
    per key, one Delta MERGE per source table; only the current state, at `<run>/textbook`."""

    name = "textbook"
    views = ("current",)
    kinds = ("current",)

    def sections(self, run_dir: Path) -> dict[str, dict[str, Any]]:
        return {"delta": {"path": str(run_dir / "textbook")}}

    def check(self, config_path: Path, topics: list[str]) -> dict[str, Any]:
        from cdc.config import load as load_config
        from sinks.stores.delta.store import table_path

        root = load_config(str(config_path)).delta.path
        total = 0
        for topic in topics:
            log = DeltaLog(table_path(root, "current", topic))
            log.update()
            total += log.rows()
        return {"current": total}

    def expected(self, bench: SinksBench) -> dict[str, Any]:
        return {"current": bench.workload.inserts}

    def streaming_argv(self, config: Path) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve().parent / "textbook.py"), "--config", str(config)]


class CacheBench(StoreBench):
    """Redis, started by the bench on first use; each run dir gets a database of its own."""

    name = "cache"
    served = True
    apply_target = 0.6
    fresh_target_s = 3.0

    def __init__(self) -> None:
        self.server: Any = None
        self.databases: dict[Path, int] = {}

    def sections(self, run_dir: Path) -> dict[str, dict[str, Any]]:
        from cdc.local.redis import LocalRedis

        if self.server is None:
            self.server = LocalRedis(run_dir.parent / "redis").start()
        number = self.databases.setdefault(run_dir, len(self.databases) + 1)  # 1..15
        return {"cache": {"url": f"redis://127.0.0.1:{self.server.port}/{number}"}}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    @property
    def server_pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    def write_alone(self, config_path: Path, rows: list[Any], registry: Any) -> None:
        from cdc.config import load as load_config
        from sinks.rows import PartitionWriter
        from sinks.stores.cache.store import CacheStore

        store = CacheStore(load_config(str(config_path)).cache, PREFIX)
        store.open(resumed=False)
        list(PartitionWriter(store.writer(registry), {})(iter(rows)))

    def check(self, config_path: Path, topics: list[str]) -> dict[str, Any]:
        import redis

        from cdc.config import load as load_config

        client = redis.Redis.from_url(load_config(str(config_path)).cache.url)
        return {"rows": sum(sum(1 for _ in client.scan_iter(match=f"{t}:*", count=10000)) for t in topics)}

    def expected(self, bench: SinksBench) -> dict[str, Any]:
        return {"rows": bench.workload.inserts}

    def visible(self, config_path: str, base: int, _view: str) -> Any:
        """GETs of the next markers (ids count up from base + 1; the warm-up ones are negative)."""
        import redis

        from cdc.config import load as load_config

        client = redis.Redis.from_url(load_config(config_path).cache.url)
        topic = topic_name(PREFIX, "public", FRESH_TABLE)
        first = base + 1  # every marker below it was seen

        def poll() -> tuple[list[int], float]:
            nonlocal first
            ids = [*range(-(base + 5), -base), *range(first, first + 5000)]
            now = time.time()
            found = [i for i, v in zip(ids, client.mget([f'{topic}:{{"id":{i}}}' for i in ids]), strict=True) if v]
            seen = set(found)
            while first in seen:
                first += 1
            return found, now

        return poll


class SearchBench(StoreBench):
    """OpenSearch, started by the bench on first use; each run dir starts from none of the
    prefix's indexes (the runs share the topics, so their aliases)."""

    name = "search"
    served = True
    tables_per_index = 1  # [search] tables_per_index (--search-tables-per-index)
    apply_target = 0.4
    fresh_target_s = 3.0

    def __init__(self) -> None:
        self.node: Any = None
        self.run_dirs: set[Path] = set()

    def sections(self, run_dir: Path) -> dict[str, dict[str, Any]]:
        from cdc.local.opensearch import LocalOpenSearch
        from sinks.stores.search.opensearch import Endpoint
        from sinks.stores.search.shapes import alias_name

        if self.node is None:
            self.node = LocalOpenSearch(run_dir.parent / "opensearch", full_jit=True).start()
            # each table takes an index and a delete markers' index: OpenSearch's default of 1,000
            # shards per node holds 499 tables, and the job refuses more in one line (a wide run);
            # shared indexes stay within the default
            if self.tables_per_index == 1:
                Endpoint(self.node.url).client().ok(
                    "PUT", "/_cluster/settings", {"persistent": {"cluster.max_shards_per_node": SHARDS_PER_NODE}})
        if run_dir not in self.run_dirs:  # a new run: a new store (the freshness phase reuses the last)
            self.run_dirs.add(run_dir)
            client = Endpoint(self.node.url).client()
            for row in client.ok("GET", f"/_cat/indices/{alias_name(PREFIX)}*?format=json&expand_wildcards=all"):
                client.ok("DELETE", f"/{row['index']}")
        return {"search": {"url": self.node.url, "replicas": 0, "tables_per_index": self.tables_per_index}}

    def close(self) -> None:
        if self.node is not None:
            self.node.close()

    @property
    def server_pid(self) -> int | None:
        return self.node.pid if self.node is not None else None

    def write_alone(self, config_path: Path, rows: list[Any], registry: Any) -> None:
        """The job's indexes (sinks.stores.search.SearchStore), the executors' writer, then the refresh
        the job makes after each batch."""
        from cdc.config import load as load_config
        from sinks.rows import PartitionWriter
        from sinks.stores.search.store import SearchStore

        store = SearchStore(load_config(str(config_path)).search, PREFIX)
        store.open(resumed=False)
        topics = sorted({topic for batch in rows for topic in batch["_cdc_topic"].unique().to_pylist()})
        store.prepare(topics, registry)
        rejected = [row for batch in PartitionWriter(store.writer(registry), {})(iter(rows)) for row in batch.to_pylist()]
        if rejected:
            raise BenchError(f"OpenSearch rejected {len(rejected):,} documents, the first: {rejected[0]}")
        store.after_batch(topics)

    @staticmethod
    def _client(config_path: str) -> Any:
        from cdc.config import load as load_config
        from sinks.stores.search.opensearch import Endpoint

        return Endpoint.of(load_config(config_path).search).client()

    def check(self, config_path: Path, topics: list[str]) -> dict[str, Any]:
        from sinks.stores.search.shapes import alias_name

        client = self._client(str(config_path))
        client.ok("POST", "/_refresh")
        # a table that got no rows has no index
        return {"rows": sum((client.ok("GET", f"/{alias_name(t)}/_count", missing_ok=True) or {"count": 0})["count"]
                            for t in topics)}

    def expected(self, bench: SinksBench) -> dict[str, Any]:
        return {"rows": bench.workload.inserts}

    def visible(self, config_path: str, base: int, _view: str) -> Any:
        """A search for the next markers by _id: visible means searchable (refreshed), not
        merely stored."""
        from cdc.config import load as load_config
        from sinks.stores.search.shapes import alias_name
        from sinks.stores.search.store import Settings, key_of

        client = self._client(config_path)
        settings = Settings.of(load_config(config_path).search, PREFIX)  # the `_id`s of the layout
        alias = alias_name(topic_name(PREFIX, "public", FRESH_TABLE))
        first = base + 1  # every marker below it was seen

        def poll() -> tuple[list[int], float] | None:
            nonlocal first
            ids = [*range(-(base + 5), -base), *range(first, first + 5000)]
            now = time.time()
            status, answer = client.request("POST", f"/{alias}/_search", {
                "query": {"ids": {"values": [settings.doc_id(alias, f'{{"id":{i}}}') for i in ids]}},
                "size": len(ids), "_source": False,
            })
            if status != 200:
                return None  # the index is not there yet
            found = [int(orjson.loads(key_of(alias, hit["_id"]))["id"]) for hit in answer["hits"]["hits"]]
            seen = set(found)
            while first in seen:
                first += 1
            return found, now

        return poll


class PostgresBench(StoreBench):
    """The PostgreSQL read model, in a PostgreSQL cluster of its own started by the bench (apart
    from the source's, so its CPU is its own); each run dir gets a database of its own."""

    name = "postgres"
    served = True
    apply_target = 0.8
    fresh_target_s = 2.0

    def __init__(self) -> None:
        self.server: Any = None
        self.databases: dict[Path, str] = {}

    def sections(self, run_dir: Path) -> dict[str, dict[str, Any]]:
        from cdc.local.postgres import LocalPostgres

        if self.server is None:
            self.server = LocalPostgres(run_dir.parent / "read-model").start()
        if run_dir not in self.databases:
            self.databases[run_dir] = self.server.create_database(f"read_model_{len(self.databases) + 1}")
        return {"postgres": {"dsn": self.databases[run_dir]}}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    @property
    def server_pid(self) -> int | None:
        if self.server is None:
            return None
        return os.getpgid(int((self.server.data_dir / "postmaster.pid").read_text().split()[0]))

    def write_alone(self, config_path: Path, rows: list[Any], registry: Any) -> None:
        """The job's driver-side writes: staged, merged and committed as one batch."""
        from cdc.config import load as load_config
        from sinks.stores.postgres.store import PostgresStore

        store = PostgresStore(load_config(str(config_path)).postgres)
        store.open(resumed=False)
        store.prepare(sorted({topic for batch in rows for topic in batch["_cdc_topic"].unique().to_pylist()}), registry)
        store.write_changes(iter(rows), {})
        store.save({"batch": 0})
        # the connection stays open: its backend's CPU counts only while the backend lives

    def check(self, config_path: Path, topics: list[str]) -> dict[str, Any]:
        import psycopg

        from cdc.config import load as load_config
        from sinks.stores.postgres.store import table_of

        with psycopg.connect(load_config(str(config_path)).postgres.dsn, autocommit=True) as conn:
            tables = [table_of(conn, t) for t in topics]
            return {"rows": sum(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables if t)}

    def expected(self, bench: SinksBench) -> dict[str, Any]:
        return {"rows": bench.workload.inserts}

    def visible(self, config_path: str, base: int, _view: str) -> Any:
        """A SELECT of the next markers' ids (visible means committed in the read model)."""
        import psycopg

        from cdc.config import load as load_config

        conn = psycopg.connect(load_config(config_path).postgres.dsn, autocommit=True)
        first = base + 1  # every marker below it was seen

        def poll() -> tuple[list[int], float] | None:
            nonlocal first
            ids = [*range(-(base + 5), -base), *range(first, first + 5000)]
            now = time.time()
            if conn.execute("SELECT to_regclass(%s)", (f"cdc_public.{FRESH_TABLE}",)).fetchone() == (None,):
                return None  # the table is not there yet
            found = [r[0] for r in conn.execute(f"SELECT id FROM cdc_public.{FRESH_TABLE} WHERE id = ANY(%s)", (ids,))]
            seen = set(found)
            while first in seen:
                first += 1
            return found, now

        return poll


STORES: dict[str, type[StoreBench]] = {
    "delta": DeltaBench, "search": SearchBench, "cache": CacheBench, "postgres": PostgresBench, "textbook": TextbookBench,
}


# --------------------------------------------------------------------------- results


@dataclass
class SparkRun:
    """One Spark child: a read-ceiling or an apply run."""

    phase: str
    store: str
    max_offsets: int
    records: int = 0  # table records in the topics (the backlog)
    seconds: float | None = None  # query start to end
    session_s: float | None = None  # SparkSession (JVM) start
    cpu_s: float | None = None  # the child's process group over the query
    machine_busy_cores: float | None = None
    batches: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, records, seconds)
    read: int | None = None  # records the query saw (ceiling: counted, heartbeats included)
    kinds: dict[str, float] = field(default_factory=dict)  # Delta: seconds per written table kind, summed
    store_s: float | None = None  # Delta: the batches' writes of their decoded rows (StoreCpu)
    store_cpu_s: float | None = None
    python_cpu_s: float | None = None  # the executors' Python workers over the query (PythonCpu)
    server_cpu_s: float | None = None  # the store's own server (search, cache) over the query
    broker_cpu_s: float | None = None  # the Kafka broker over the query
    current_s: float | None = None  # Delta: the job's query alone (current and the change log), then history's
    current_cpu_s: float | None = None
    check: dict[str, Any] = field(default_factory=dict)
    expected: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    log_path: Path | None = None
    command: str = ""

    @property
    def rate(self) -> float | None:
        return self.records / self.seconds if self.seconds and not self.error else None


class PythonCpu:
    """CPU of the executors' Python workers of a Spark child: Spark's `pyspark.daemon`, which
    its JVM (in the child's process group) starts, and the workers it forks. The daemon moves
    itself into a process group of its own (`os.setpgid(0, 0)`), so these are found by their
    parent, not in the child's group: none of them is in the child's group's CPU. The workers
    that ended are counted in the daemon's children's time once it reaped them. What runs
    there is the sink's writer: rows from the JVM into Python, the fold, the packing, the clients."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self._p0: dict[int, float] = {}

    @staticmethod
    def _sample(pgid: int) -> dict[int, float]:
        stats: dict[int, list[str]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and (fields := proc_stat(int(name))) is not None:
                stats[int(name)] = fields

        def command(pid: int) -> bytes:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                return b""

        # the daemons: a pyspark.daemon whose parent (the JVM) is in the child's process group
        daemons = {pid for pid, fields in stats.items() if b"pyspark.daemon" in command(pid)
                   and fields[2] == str(pid) and stats.get(int(fields[1]), ["", "", ""])[2] == str(pgid)}
        out: dict[int, float] = {}
        for pid, fields in stats.items():
            if int(fields[2]) not in daemons:  # the daemon's group: the daemon and its workers
                continue
            used = int(fields[11]) + int(fields[12])
            if pid in daemons:  # its reaped workers too
                used += int(fields[13]) + int(fields[14])
            out[pid] = used / CLK_TCK
        return out

    def start(self, pgid: int) -> None:
        self.pgid, self._p0 = pgid, self._sample(pgid)

    def stop(self) -> float | None:
        if self.pgid is None:
            return None
        now = self._sample(self.pgid)
        return sum(used - self._p0.get(pid, 0.0) for pid, used in now.items())


@dataclass
class Alone:
    """A store's server applying the backlog with nothing of Spark: the bench reads the
    records itself and hands them to the sink's executor code. The server's CPU here is
    a floor under its share of any apply run: the run writes at least these keys."""

    store: str
    keys: int  # the backlog's keys: one write each (the last change per key)
    seconds: float = 0.0
    server_cpu_s: float | None = None  # the server's process group
    writer_cpu_s: float = 0.0  # the bench process: the sink's Python writer (and its parsing)
    error: str = ""


@dataclass
class Freshness:
    store: str
    offered_tps: int
    view: str = ""  # what the reader looked at (Delta: current, history)
    run: int = 0  # the freshness phase's number (runs alternate between stores)
    seconds: float = 0.0
    transactions: int = 0
    markers: int = 0
    latencies_s: list[float] = field(default_factory=list)
    missing: int = 0
    startup_s: float | None = None  # sink process start until the warm-up marker was visible
    sink_cpu_s: float | None = None
    machine_busy_cores: float | None = None
    batches: list[tuple[int, int, float]] = field(default_factory=list)
    history_batches: list[tuple[int, int, float]] = field(default_factory=list)  # Delta's history query
    commits: dict[str, int] = field(default_factory=dict)  # Delta: commits per table kind while the sink ran
    tables: list[int] = field(default_factory=list)  # the job's batches: the tables each read
    error: str = ""
    command: str = ""

    @property
    def label(self) -> str:
        return f"{self.store} {self.view}" if self.view and self.view != "current" else self.store

    @property
    def achieved_tps(self) -> float:
        return self.transactions / self.seconds if self.seconds else 0.0


# --------------------------------------------------------------------------- the bench


class SinksBench(Bench):
    """bench/capture.py's Bench (process groups, services, clean-up, daemon helpers) with the
    sink phases."""

    name = "sinks"
    title = "Sink jobs vs. Spark's read ceiling"

    def results_variant(self) -> str:
        """The stores, and the tables when not the default 4: runs of other stores or table
        counts measure other things, and keep results files of their own."""
        tables = "" if self.args.tables == 4 else f"-{self.args.tables}-tables"
        return "-".join(self.args.stores) + tables

    def results_versions(self) -> dict[str, str]:
        return {**super().results_versions(),
                **figures.package_versions("pyspark", "pyarrow", "redis", "opensearch-py", "deltalake"),
                **figures.jvm_versions("spark", "opensearch"),
                **figures.program_version("redis", ["redis-server", "--version"])}

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        DeltaBench.history_interval_s = args.history_interval
        SearchBench.tables_per_index = args.search_tables_per_index
        self.tables = table_names(args.tables)
        self.topics = [topic_name(PREFIX, "public", t) for t in self.tables]
        self.stores = [STORES[s]() for s in args.stores]
        self.capture: dict[str, Any] = {}
        self.records = 0
        self.table_records: dict[str, int] = {}
        self.runs: list[SparkRun] = []
        self.fresh: dict[str, Freshness] = {}
        self.alone: dict[str, Alone] = {}
        self.inserted: dict[str, int] = {}
        self.last_dir: dict[str, Path] = {}  # store -> run dir of its last apply run
        self.run_counter = 0

    def close(self) -> None:
        """The stores' servers too, then what Bench.close ends."""
        for store in self.stores:
            with contextlib.suppress(Exception):
                store.close()
        super().close()

    # -- setup ------------------------------------------------------------------------------
    def start_services(self) -> None:
        self.log(f"work dir {self.workdir}")
        self.pg = LocalPostgres(self.workdir / "pg", settings=PG_SETTINGS).start()
        self.log(f"PostgreSQL on port {self.pg.port}")
        for table in self.tables:
            self.sql(CREATE_TABLE.format(t=table))
        self.sql(CREATE_FRESH)
        names = ", ".join([*self.tables, FRESH_TABLE])
        self.sql(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {names}")
        self.sql("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
        self.broker = LocalKafka(self.workdir / "kafka", full_jit=True).start()
        self.log(f"Apache Kafka on {self.broker.bootstrap_servers}, JVM pid {self.broker.pid}")

    def config(self, name: str, store: StoreBench | None = None, **spark: Any) -> Path:
        """`<workdir>/<name>.toml`: the daemon's settings plus, for a sink, [spark] and the store's."""
        run_dir = self.workdir / name
        run_dir.mkdir(exist_ok=True)
        sections: dict[str, dict[str, Any]] = {
            "source": {"dsn": self.dsn, "slot": SLOT, "publication": PUBLICATION,
                       "tables": [f"public.{t}" for t in [*self.tables, FRESH_TABLE]]},
            "topic": {"bootstrap_servers": self.servers, "prefix": PREFIX, "partitions": self.args.partitions,
                      "client": "confluent"},
            "snapshot": {"mode": "never"},  # the slot is made before the writes: stream it, read nothing else
            "daemon": {"spill_dir": str(self.workdir / "spill"), "log_level": "INFO"},
            "spark": {"master": "local[2]", "checkpoint_dir": str(run_dir / "checkpoints"), **spark},
        }
        if store is not None:
            sections.update(store.sections(run_dir))
        lines = []
        for section, values in sections.items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]  # JSON scalars/lists are TOML
        path = self.workdir / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    def generate(self) -> None:
        """N changes, 60 % inserts / 40 % updates, transactions of 100-1000 rows on one random table.
        A wide run (more tables than such transactions reach) first gives every table an even
        share of half the changes, one transaction per table."""
        n = self.args.changes
        rng = random.Random(self.args.seed)
        w = self.workload
        inserted = self.inserted = dict.fromkeys(self.tables, 0)
        self.log(f"writing {n:,} changes into {len(self.tables)} tables")
        with psycopg.connect(self.dsn) as conn:
            w.start_lsn = int(conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'").fetchone()[0])
            conn.commit()
            t0 = time.monotonic()
            done = 0
            if len(self.tables) * 100 > n:
                each = max(1, n // (2 * len(self.tables)))
                for table in self.tables:
                    conn.execute(INSERT_ROWS.format(t=table), (1, each))
                    conn.commit()
                    inserted[table] = each
                    done += each
                    w.inserts += each
                    w.transactions += 1
            while done < n:
                table = rng.choice(self.tables)
                size = min(rng.randint(100, 1000), n - done)
                n_upd = min(round(size * 0.4), inserted[table])
                n_ins = size - n_upd
                if n_ins:
                    conn.execute(INSERT_ROWS.format(t=table), (inserted[table] + 1, inserted[table] + n_ins))
                if n_upd:
                    conn.execute(UPDATE_ROWS.format(t=table), (rng.sample(range(1, inserted[table] + 1), n_upd),))
                done += size
                conn.commit()
                inserted[table] += n_ins
                w.inserts += n_ins
                w.updates += n_upd
                w.transactions += 1
            w.seconds = time.monotonic() - t0
        w.end_lsn = self.mark_end()
        self.log(
            f"wrote {w.inserts:,} inserts + {w.updates:,} updates in {w.transactions:,} transactions in "
            f"{w.seconds:.1f} s; {(w.end_lsn - w.start_lsn) / 2**20:,.0f} MiB of WAL"
        )

    def count_records(self) -> dict[str, int]:
        admin = TopicAdmin(TopicConfig(bootstrap_servers=self.servers))
        try:
            ends = admin.end_offsets(self.topics)
        finally:
            admin.close()
        return {t: sum(ends.get(t, {}).values()) for t in self.topics}

    # -- 1. capture -------------------------------------------------------------------------
    def run_capture(self) -> None:
        config = self.config("capture")
        self.log(f"cdc run: capturing the backlog ({self.args.changes:,} changes)")
        proc, log_path, startup = self.start_daemon_config(config, "capture")
        assert self.broker is not None
        window = CpuWindow({"daemon": proc.pid, "broker": self.broker.pid}).start()
        t0 = time.monotonic()
        try:
            self.wait_confirmed(SLOT, self.workload.end_lsn, proc, log_path, timeout=max(600, self.args.changes / 100))
            elapsed = time.monotonic() - t0
            window.stop()
        finally:
            self.stop_daemon(proc, log_path)
        self.table_records = self.count_records()
        self.records = sum(self.table_records.values())
        self.capture = {"seconds": elapsed, "startup_s": startup, "daemon_cpu_s": window.used.get("daemon"),
                        "broker_cpu_s": window.used.get("broker"), "machine": window.machine_busy_cores}
        expected = self.workload.inserts + self.workload.updates
        note = "" if self.records == expected else f" (expected {expected:,}!)"
        self.log(f"cdc run: {expected / elapsed:,.0f} changes/s; topics hold {self.records:,} records{note}")
        if self.records != expected:
            raise BenchError(f"the topics hold {self.records:,} records, expected {expected:,}")

    def start_daemon_config(self, config: Path, name: str) -> tuple[subprocess.Popen, Path, float]:
        argv = [sys.executable, "-m", "cdc", "run", "--config", str(config)]
        self.commands.setdefault("cdc run", shlex.join(argv))
        log_path = self.workdir / f"{name}-daemon.log"
        with log_path.open("ab") as log:
            t0 = time.monotonic()
            proc = self.procs.start(f"cdc {name}", argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + 180
        while True:
            text = log_path.read_text(errors="replace")
            if "streaming from" in text:
                return proc, log_path, time.monotonic() - t0
            if proc.poll() is not None or time.monotonic() > deadline:
                self.procs.stop(proc)
                raise BenchError(f"cdc run did not start streaming; its log {log_path}:\n{text[-3000:]}")
            time.sleep(0.02)

    # -- the stores' servers alone -----------------------------------------------------------
    def backlog_rows(self) -> list[Any]:
        """Every backlog record as the cache and search executors get it (Arrow batches of
        sinks.latest.ROWS, Spark's 10,000 rows each, each topic partition's in offset order),
        read with confluent-kafka and parsed here."""
        from confluent_kafka import Consumer, TopicPartition

        from compaction.table import payload_of
        from sinks.latest import as_rows

        admin = TopicAdmin(TopicConfig(bootstrap_servers=self.servers))
        try:
            ends = admin.end_offsets(self.topics)
        finally:
            admin.close()
        consumer = Consumer({"bootstrap.servers": self.servers, "group.id": f"bench-alone-{os.getpid()}",
                             "enable.auto.commit": False, "log_level": 4})
        rows: list[tuple[Any, ...]] = []
        try:
            consumer.assign([TopicPartition(t, p, 0) for t, partitions in ends.items() for p in partitions])
            deadline = time.monotonic() + 600
            while len(rows) < self.records:
                if time.monotonic() > deadline:
                    raise BenchError(f"read {len(rows):,} of the backlog's {self.records:,} records in 600 s")
                for msg in consumer.consume(10_000, 1.0):
                    if msg.error() is not None:
                        raise BenchError(f"reading the backlog: {msg.error()}")
                    env = payload_of(msg.value())
                    lsn, seq = (int(x) for x in orjson.loads(env["source"]["sequence"]))
                    after = orjson.dumps(env["after"]).decode() if env["after"] is not None else None
                    rows.append((msg.topic(), msg.key().decode(), env["op"], lsn, seq, msg.partition(), msg.offset(),
                                 False, after))
        finally:
            consumer.close()
        rows.sort(key=lambda row: (row[0], row[5], row[6]))  # whole topic partitions, as Spark hands them over
        return as_rows(rows).to_batches(max_chunksize=10_000)

    def run_alone(self, rows: list[Any], registry: Any, store: StoreBench) -> None:
        """The store's server alone: the backlog's last change per key written by the sink's
        executor code (sinks.rows.PartitionWriter) from the bench, into a new store."""
        config = self.config(f"alone-{store.name}", store)
        keys = len({(t, k) for batch in rows for t, k in zip(batch["_cdc_topic"].to_pylist(),
                                                              batch["_cdc_key"].to_pylist(), strict=True)})
        result = self.alone[store.name] = Alone(store.name, keys)
        self.log(f"{store.name} server alone: writing the last change of {result.keys:,} keys from the bench")
        window = CpuWindow({"server": store.server_pid}).start()
        cpu0, t0 = time.process_time(), time.monotonic()
        try:
            store.write_alone(config, rows, registry)
        except Exception as exc:  # the report says so; the Spark phases still run
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            self.failed = True
            self.log(f"{store.name} server alone FAILED: {result.error}")
            return
        result.seconds, result.writer_cpu_s = time.monotonic() - t0, time.process_time() - cpu0
        result.server_cpu_s = window.stop().used.get("server")
        self.log(f"{store.name} server alone: {result.keys / result.seconds:,.0f} keys/s, server CPU "
                 f"{_f(result.server_cpu_s)} s, the sink's writer {_f(result.writer_cpu_s)} s")

    # -- 2./3. Spark children -----------------------------------------------------------------
    def spark_child(self, run: SparkRun, config: Path) -> None:
        """Run `bench/sinks.py _child <phase>` and time its query; fills `run`."""
        argv = [sys.executable, str(Path(__file__).resolve()), "_child", run.phase, "--config", str(config),
                "--store", run.store]
        if self.args.driver_memory:
            argv += ["--driver-memory", self.args.driver_memory]
        run.command = shlex.join(argv)
        run.log_path = config.with_suffix(".rebuild.log" if run.phase == "rebuild" else ".log")
        marks: dict[str, Any] = {}
        events: dict[str, dict[str, Any]] = {}
        window = CpuWindow({})
        python = PythonCpu()
        server = next((s.server_pid for s in self.stores if s.name == run.store), None)
        broker = self.broker.pid if self.broker is not None else None
        with run.log_path.open("wb") as log:
            proc = self.procs.start(f"spark {run.phase}", argv, stdout=subprocess.PIPE, stderr=log,
                                    cwd=config.parent / config.stem)
        assert proc.stdout is not None
        timeout = self.args.spark_timeout
        deadline = time.monotonic() + timeout

        def read() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace")
                if not line.startswith(CHILD_MARK):
                    continue
                event = json.loads(line[len(CHILD_MARK):])
                kind = event["event"]
                if kind == "query_start":  # CPU from here, in this thread, as soon as it is said
                    window.groups = {"spark": proc.pid, "server": server, "broker": broker}
                    window.start()
                    python.start(proc.pid)
                elif kind == "current_end":  # Delta: the job's query ended, history's starts
                    now, before = group_cpu_seconds(proc.pid), window._p0.get("spark")
                    marks["current_cpu"] = now - before if now is not None and before is not None else None
                elif kind == "query_end":
                    window.stop()
                    marks["python"] = python.stop()
                    marks["server"], marks["broker"] = window.used.get("server"), window.used.get("broker")
                    marks["cpu"] = window.used.get("spark")
                    marks["machine"] = window.machine_busy_cores
                events[kind] = event

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            run.error = f"ran over --spark-timeout {timeout:.0f} s; killed"
            self.procs.stop(proc)
        else:
            self.procs.forget(proc)
        reader.join(10)
        end = events.get("query_end", {})
        run.session_s = events.get("session", {}).get("seconds")
        run.seconds = end.get("seconds")
        run.cpu_s, run.machine_busy_cores = marks.get("cpu"), marks.get("machine")
        run.python_cpu_s = marks.get("python")
        run.server_cpu_s, run.broker_cpu_s = marks.get("server"), marks.get("broker")
        run.read = end.get("read")
        run.store_s, run.store_cpu_s = end.get("store_s"), end.get("store_cpu")
        run.current_s, run.current_cpu_s = events.get("current_end", {}).get("seconds"), marks.get("current_cpu")
        if run.phase in ("apply", "rebuild") and not run.error and proc.returncode == 0:
            store = STORES[run.store]()
            run.check = store.check(config, self.topics)
        text = run.log_path.read_text(errors="replace")
        for _table, kinds in KIND_LINE.findall(text):
            for kind, seconds in re.findall(r"(\w+) ([0-9.]+) s", kinds):
                run.kinds[kind] = run.kinds.get(kind, 0.0) + float(seconds)
        if not run.error and proc.returncode != 0:
            error = events.get("error", {}).get("message") or f"exited with {proc.returncode}"
            run.error = error.splitlines()[0][:300]
        run.batches = [(int(b), int(n), float(s)) for b, n, _t, s in BATCH_LINE.findall(text)]
        if run.error:
            self.failed = True
            tail = "\n".join(text.splitlines()[-20:])
            self.log(f"{run.phase} ({run.store}, {run.max_offsets:,}) FAILED: {run.error}; log {run.log_path}:\n{tail}")

    def run_ceiling(self, max_offsets: int) -> SparkRun:
        self.run_counter += 1
        config = self.config(f"ceiling-{self.run_counter}", None, max_offsets_per_trigger=max_offsets)
        return self.timed(
            SparkRun("ceiling", "-", max_offsets, self.records), config,
            f"read ceiling, maxOffsetsPerTrigger {max_offsets:,}",
            lambda r: f"read ceiling: {_f(r.rate, 0)} rows/s ({r.read:,} records read in {_f(r.seconds)} s; "
                      f"session start {_f(r.session_s)} s)",
        )

    def run_apply(self, store: StoreBench, max_offsets: int) -> SparkRun:
        self.run_counter += 1
        config = self.config(f"apply-{store.name}-{self.run_counter}", store, max_offsets_per_trigger=max_offsets)
        self.last_dir[store.name] = config
        return self.timed(
            SparkRun("apply", store.name, max_offsets, self.records, expected=store.expected(self)), config,
            f"apply ({store.name}), maxOffsetsPerTrigger {max_offsets:,}: {self.records:,} records",
            lambda r: f"apply ({store.name}): {_f(r.rate, 0)} rows/s in {_f(r.seconds)} s, {len(r.batches)} "
                      f"batches; store holds {r.check}" + ("" if r.check == r.expected else f" (expected {r.expected})"),
        )

    def run_rebuild(self, max_offsets: int) -> SparkRun:
        """`cdc search rebuild` over the index the last search apply run filled."""
        return self.timed(
            SparkRun("rebuild", "search", max_offsets, self.records, expected=STORES["search"]().expected(self)),
            self.last_dir["search"], f"rebuild (search), maxOffsetsPerTrigger {max_offsets:,}: {self.records:,} records",
            lambda r: f"rebuild (search): {_f(r.rate, 0)} rows/s in {_f(r.seconds)} s, {len(r.batches)} batches; "
                      f"the index holds {r.check}",
        )

    def timed(self, run: SparkRun, config: Path, starting: str, finished: Callable[[SparkRun], str]) -> SparkRun:
        """One Spark child, logged as it starts and (unless it failed) as it finished."""
        self.log(starting)
        self.spark_child(run, config)
        self.runs.append(run)
        if not run.error:
            self.log(finished(run))
        return run

    # -- 4. freshness ------------------------------------------------------------------------------
    def run_freshness(self, store: StoreBench) -> None:
        a = self.args
        applied = self.last_dir.get(store.name)
        name = applied.stem if applied is not None else f"fresh-{store.name}"
        run = len({f.run for f in self.fresh.values()}) + 1  # this phase's number: its marker ids, its logs
        # the apply run's checkpoint and store: the sink goes on from the end of the backlog
        config = self.config(name, store, trigger_interval_s=a.trigger_interval,
                             max_offsets_per_trigger=a.max_offsets[0])
        results = {view: Freshness(store.name, a.fresh_rate, view=view, run=run) for view in store.views}
        for result in results.values():
            self.fresh[f"{run}: {result.label}"] = result
        result = next(iter(results.values()))  # the first view's holds what the views share
        self.log(f"freshness ({store.name}, run {run}): {a.fresh_rate:,} tx/s for {a.fresh_warmup} s of warm-up, "
                 f"then {a.fresh_seconds} s measured")
        daemon, daemon_log, _ = self.start_daemon_config(config, f"fresh-{run}-{store.name}")
        argv = store.streaming_argv(config)
        result.command = shlex.join(argv)
        sink_log = self.workdir / f"fresh-{run}-{store.name}-sink.log"
        commits_before = store.commits(config)
        with sink_log.open("wb") as log:
            t_sink = time.monotonic()
            sink = self.procs.start(f"sink {store.name}", argv, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.workdir / name)
        ctx = multiprocessing.get_context("spawn")
        base = MARKER_RANGE * run  # this phase's marker ids: the table keeps the earlier phases'
        readers = {}
        for view in store.views:
            parent, child_end = ctx.Pipe()
            reader = ctx.Process(target=reader_child, name=f"bench-{store.name}-{view}-reader",
                                 args=(child_end, store.name, view, str(config), a.poll_ms / 1000, base))
            self.procs.child(reader)
            reader.start()
            child_end.close()
            readers[view] = (parent, reader)
        commits: dict[int, float] = {}
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                for warm in range(1, 6):  # negative ids: not measured
                    conn.execute(INSERT_MARKER, (-(base + warm),))
                deadline = time.monotonic() + 900
                parent, reader = readers[store.views[0]]  # the load starts when the first view has caught up
                while not parent.poll(0.5):
                    if sink.poll() is not None:
                        raise BenchError(f"the sink exited with {sink.returncode}: see {sink_log}")
                    if not reader.is_alive():
                        raise BenchError(f"the reader exited with {reader.exitcode}")
                    if time.monotonic() > deadline:
                        raise BenchError(f"the warm-up markers were not visible after 900 s: see {sink_log}")
                warm_msg = parent.recv()
                if warm_msg.get("error"):
                    raise BenchError(f"reader: {warm_msg['error']}")
                result.startup_s = time.monotonic() - t_sink
                self.log(f"freshness: sink streaming, warm-up visible {result.startup_s:.0f} s after its start")
                time.sleep(2)
                result.transactions, result.seconds, commits = self.paced_writes(conn, sink, result, base)
            self.log(f"freshness: offered {result.transactions:,} transactions in {result.seconds:.1f} s "
                     f"({result.achieved_tps:,.0f}/s); waiting for the last markers")
            for parent, _ in readers.values():
                parent.send({"wait_for": len(commits), "timeout": a.drain_seconds})
            for view, (parent, reader) in readers.items():
                done = recv(parent, reader, a.drain_seconds + 120)
                while "warm" in done:  # a later view's warm-up sighting, before its answer
                    done = recv(parent, reader, a.drain_seconds + 120)
                if done.get("error"):
                    raise BenchError(f"reader ({view}): {done['error']}")
                seen: dict[int, float] = done["seen"]
                shown = results[view]
                shown.markers = len(commits)
                shown.latencies_s = [seen[i] - t for i, t in commits.items() if i in seen]
                shown.missing = sum(1 for i in commits if i not in seen)
        except BenchError as exc:
            result.error = str(exc)
            self.failed = True
            self.log(f"freshness FAILED: {exc}")
        finally:
            for parent, reader in readers.values():
                with contextlib.suppress(Exception):
                    parent.send({"stop": True})
                reader.join(30)
                if reader.is_alive():
                    reader.kill()
            # SIGTERM to the driver alone: the job's StopSignal lets the running batch finish.
            # Not to the group: the JVM would die under the running batch. Not SIGINT: pyspark's
            # SparkContext replaces the SIGINT handler (cancel every job, KeyboardInterrupt).
            with contextlib.suppress(ProcessLookupError):
                os.kill(sink.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                sink.wait(240)
            code = self.procs.stop(sink, signal.SIGKILL, timeout=10)  # sweeps the group (the JVM)
            if code not in (0, -signal.SIGTERM):
                self.log(f"warning: the sink exited with {code}; see {sink_log}")
            self.stop_daemon(daemon, daemon_log)
        text = sink_log.read_text(errors="replace")
        result.batches = [(int(b), int(n), float(s)) for b, n, _t, s in BATCH_LINE.findall(text)]
        result.commits = {k: v - commits_before.get(k, 0) for k, v in store.commits(config).items()}
        result.tables = [int(t) for _b, _n, t, _s in BATCH_LINE.findall(text)]
        for shown in results.values():
            shown.transactions, shown.seconds = result.transactions, result.seconds
            shown.sink_cpu_s, shown.machine_busy_cores = result.sink_cpu_s, result.machine_busy_cores
            shown.startup_s, shown.batches, shown.command = result.startup_s, result.batches, result.command
            shown.commits, shown.tables = result.commits, result.tables
            shown.history_batches = [(int(b), int(n), float(s)) for b, n, s in HISTORY_LINE.findall(text)]
            if shown.latencies_s:
                self.log(f"freshness ({shown.label}): p50 {pct(shown.latencies_s, 50):.2f} s, p99 "
                         f"{pct(shown.latencies_s, 99):.2f} s over {len(shown.latencies_s):,} markers, "
                         f"{shown.missing} missing")

    def paced_writes(self, conn: psycopg.Connection, sink: subprocess.Popen,
                     result: Freshness, base: int) -> tuple[int, float, dict[int, float]]:
        """--fresh-rate single-row autocommit transactions/s; even ones insert a marker. The
        first --fresh-warmup seconds are the same load, not measured (their markers have
        negative ids): the JVMs compile the batch's hot code meanwhile."""
        a = self.args
        rng = random.Random(a.seed + 1)
        rate, warmup = a.fresh_rate, int(a.fresh_rate * a.fresh_warmup)
        total = warmup + int(a.fresh_rate * a.fresh_seconds)
        updates = [(UPDATE_ONE.format(t=t), self.inserted[t]) for t in self.tables if self.inserted.get(t)]
        commits: dict[int, float] = {}
        execute = conn.execute
        assert self.broker is not None
        window = CpuWindow({"sink": sink.pid})
        t0 = time.monotonic()
        measured_from = t0
        sent, marker, warm = 0, 0, 0
        while sent < total:
            if sent == warmup:
                window.start()
                measured_from = time.monotonic()
            due = t0 + sent / rate
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            if sent % 2 == 0 or not updates:
                if sent < warmup:
                    warm += 1
                    execute(INSERT_MARKER, (-(base + WARMUP_IDS + warm),))
                else:
                    marker += 1
                    execute(INSERT_MARKER, (base + marker,))
                    commits[base + marker] = time.time()
            else:
                sql, top = updates[rng.randrange(len(updates))]
                execute(sql, (rng.randint(1, top),))
            sent += 1
        elapsed = time.monotonic() - measured_from
        window.stop()
        result.sink_cpu_s = window.used.get("sink")
        result.machine_busy_cores = window.machine_busy_cores
        return sent - warmup, elapsed, commits

    # -- the whole run ----------------------------------------------------------------------------
    def run(self) -> None:
        self.load_before = os.getloadavg()
        self.start_services()
        self.generate()
        self.run_capture()
        alone = [store for store in self.stores if store.served and not self.args.skip_alone]
        if alone:
            from sinks.topics import SchemaFeed

            feed = SchemaFeed(TopicConfig(bootstrap_servers=self.servers, prefix=PREFIX))
            try:
                registry = feed.refresh()
            finally:
                feed.close()
            rows = self.backlog_rows()
            for store in alone:
                self.run_alone(rows, registry, store)
            del rows
        for max_offsets in self.args.max_offsets:
            self.run_ceiling(max_offsets)
            for _ in range(self.args.repeat):  # A/B/A/B: the stores alternate, back to back
                for store in self.stores:
                    self.run_apply(store, max_offsets)
            if "search" in self.last_dir and not self.args.skip_rebuild:
                self.run_rebuild(max_offsets)
        if not self.args.skip_freshness:
            for _ in range(self.args.repeat):
                for store in self.stores:
                    self.run_freshness(store)
        self.load_after = os.getloadavg()

    # -- the report ---------------------------------------------------------------------------------
    def report(self) -> str:
        a, w = self.args, self.workload
        after = getattr(self, "load_after", None)
        during = f", {min(self.loads):.2f}-{max(self.loads):.2f} during" if self.loads else ""
        out = [
            "", f"## {self.title}", "",
            f"Command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`, {time.strftime('%Y-%m-%d %H:%M %Z')}", "",
            f"Backlog: {w.inserts + w.updates:,} changes ({w.inserts:,} INSERT, {w.updates:,} UPDATE) in "
            f"{w.transactions:,} transactions over {len(self.tables)} tables (int key, text, numeric(12,2), timestamptz, "
            f"bool, int), {(w.end_lsn - w.start_lsn) / 2**20:,.0f} MiB of WAL; {self.args.partitions} partitions per topic; "
            f"Spark local[2]{f', driver memory {a.driver_memory}' if a.driver_memory else ''}. Machine: "
            f"{os.cpu_count()} CPUs shared by PostgreSQL, the Kafka broker and Spark; 1-minute load average "
            f"{self.load_before[0]:.2f} before{during}{f', {after[0]:.2f} after' if after else ''}.", "",
            "| phase | maxOffsetsPerTrigger | records | seconds | rows/s | ratio to read ceiling | session start s | "
            "batches (slowest s) | Spark CPU s (cores) | machine busy (cores) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        c = self.capture
        if c:
            out.append(
                f"| capture: `cdc run` (confluent), backlog to acknowledged | - | {self.records:,} | {c['seconds']:.1f} | "
                f"{self.records / c['seconds']:,.0f} | - | {c['startup_s']:.1f} (to streaming) | - | "
                f"daemon {_f(c['daemon_cpu_s'])}, broker {_f(c['broker_cpu_s'])} | {_f(c['machine'])} |"
            )
        ceilings = {r.max_offsets: r for r in self.runs if r.phase == "ceiling"}
        for r in self.runs:
            label = {
                "ceiling": "read ceiling: the jobs' Kafka stream -> foreachBatch count()",
                "apply": f"apply: {r.store} sink job (`cdc sink {r.store} --once`'s run)",
                "rebuild": "rebuild: `cdc search rebuild` over the filled index (fill, swap, one more pass, drop)",
            }[r.phase]
            ceiling = ceilings.get(r.max_offsets)
            ratio = "-"
            if r.phase != "ceiling" and r.rate and ceiling is not None and ceiling.rate:
                ratio = f"**{r.rate / ceiling.rate:.2f}**"
            if r.error:
                done = sum(n for _b, n, _s in r.batches)
                partial = f"; {done:,} records applied in {len(r.batches)} finished batches" if r.batches else ""
                out.append(f"| {label} | {r.max_offsets:,} | {r.records:,} | **FAILED**: {r.error}{partial} | | | | | | |")
                continue
            slowest = max((s for _b, _n, s in r.batches), default=None)
            batches = f"{len(r.batches)} ({_f(slowest)})" if r.batches else "-"
            cores = f"{_f(r.cpu_s)} ({r.cpu_s / r.seconds:.2f})" if r.cpu_s and r.seconds else "-"
            out.append(
                f"| {label} | {r.max_offsets:,} | {r.records:,} | {_f(r.seconds)} | {_f(r.rate, 0)} | {ratio} | "
                f"{_f(r.session_s)} | {batches} | {cores} | {_f(r.machine_busy_cores)} |"
            )
        for f in self.fresh.values():
            lat = f.latencies_s
            if f.error and not lat:
                out.append(f"| freshness: {f.label} (run {f.run}) | | | **FAILED**: {f.error[:300]} | | | | | | |")
                continue
            if f.view not in ("", "current"):  # its run's row is the current view's
                continue
            cores = f"{_f(f.sink_cpu_s)} ({f.sink_cpu_s / f.seconds:.2f})" if f.sink_cpu_s and f.seconds else "-"
            slowest = max((s for _b, _n, s in f.batches), default=None)
            out.append(
                f"| freshness: {f.store} (run {f.run}), {f.offered_tps:,} tx/s offered ({f.achieved_tps:,.0f} achieved) after "
                f"{_f(a.fresh_warmup)} s of warm-up | "
                f"{a.max_offsets[0]:,} | {f.transactions:,} tx | {f.seconds:.1f} | - | - | {_f(f.startup_s)} (to first "
                f"visible) | {len(f.batches)} ({_f(slowest)}) | {cores} | {_f(f.machine_busy_cores)} |"
            )
        out.append("")
        out.append("| measure | measured | target |")
        out.append("|---|---:|---|")
        for r in self.runs:
            if r.phase != "apply" or not r.rate:
                continue
            ceiling = ceilings.get(r.max_offsets)
            if ceiling is None or not ceiling.rate:
                continue
            ratio = r.rate / ceiling.rate
            goal = STORES[r.store].apply_target
            out.append(f"| {r.store} apply / read ceiling, maxOffsetsPerTrigger {r.max_offsets:,} | {ratio:.2f} "
                       f"({r.rate:,.0f} / {ceiling.rate:,.0f} rows/s) | >= {goal} "
                       f"({'met' if ratio >= goal else '**missed**'}) |")
        for f in self.fresh.values():
            if not f.latencies_s:
                continue
            p99 = pct(f.latencies_s, 99)
            goal = STORES[f.store].fresh_target_s if f.store in ("delta", "search", "cache") and f.view in (
                "", "current") else None
            verdict = "-" if goal is None else (
                f"p99 < {goal} s ({'met' if p99 < goal and not f.missing else '**missed**'})")
            out.append(
                f"| {f.label} commit-to-visible p50 / p99 / max (run {f.run}), {len(f.latencies_s):,} markers"
                f"{f', {f.missing} never seen' if f.missing else ''} | {pct(f.latencies_s, 50):.2f} / {p99:.2f} / "
                f"{max(f.latencies_s):.2f} s | {verdict} |"
            )
        out += self.room_measures(ceilings)
        out += self.commits_report()
        out += self.textbook_report()
        out += self.alone_report(ceilings)
        out += self.python_report()
        out.append("")
        for r in self.runs:
            if r.kinds:
                out.append(
                    f"{r.store} apply at {r.max_offsets:,}: per batch "
                    + ", ".join(f"{b}: {n:,} records in {sec:.1f} s" for b, n, sec in r.batches)
                    + "; summed over tables and batches: "
                    + ", ".join(f"{kind} {sec:.1f} s" for kind, sec in r.kinds.items())
                    + " (the rest of a batch: decoding, statistics, progress)."
                )
                out.append("")
        checks = [r for r in self.runs if r.phase in ("apply", "rebuild") and not r.error]
        if checks:
            out.append("Store contents after each apply and rebuild run (expected): " + "; ".join(
                f"{r.store if r.phase == 'apply' else 'search rebuild'}/{r.max_offsets:,}: " + ", ".join(
                    f"{k} {v:,}" + ("" if r.expected.get(k) == v else f" (**expected {r.expected.get(k, '?'):,}**)")
                    for k, v in r.check.items())
                for r in checks
            ) + ".")
            out.append("")
        out.append(
            "seconds = the query's start to its end (apply: sinks.runner.keep_running with the available-now trigger, so what "
            "`cdc sink <store> --once` does after its session started); session start = the SparkSession (JVM) start "
            "before it, not counted; rows/s = table records in the topics / seconds (the read ceiling also reads the "
            "daemon's heartbeat records). Spark CPU = the child's process group (Python driver + JVM, not the executors' Python workers: pyspark's daemon has a group of its own) over the query. "
            f"Freshness: half of the transactions insert a marker into public.{FRESH_TABLE} (a table of its own, "
            "applied beside the others in each batch), half update a random backlog row; commit time = the writer's clock right after COMMIT returned "
            f"(autocommit), visible = the reader's clock when it first found the marker (polled every {a.poll_ms} ms: "
            "Delta: `current`'s Delta log, read by the bench itself; cache: GETs of the next markers; "
            "search: an `ids` search, so searchable); "
            f"[spark] trigger_interval_s = {a.trigger_interval}."
        )
        out.append("")
        out.append("Commands:")
        for key, command in self.commands.items():
            out.append(f"- {key}: `{command}`")
        shown = set()
        for r in self.runs:
            if r.phase not in shown:
                shown.add(r.phase)
                out.append(f"- {r.phase} (child): `{r.command}`")
        for f in self.fresh.values():
            out.append(f"- streaming sink ({f.store}): `{f.command}`")
        return "\n".join(out)

    def cheapest_read(self, ceilings: dict[int, SparkRun]) -> SparkRun | None:
        """The read ceiling with the least Spark CPU per record (the room's reading share)."""
        return min((r for r in ceilings.values() if r.cpu_s and r.rate), key=lambda r: r.cpu_s / r.records,
                   default=None)

    def room(self, ceilings: dict[int, SparkRun], store_cpu_s: float | None) -> float | None:
        """The apply ratio these cores have room for: cores / (Spark's CPU per record in the
        cheapest read ceiling + the store's CPU per backlog record), over that ceiling's rows/s."""
        read = self.cheapest_read(ceilings)
        if read is None or store_cpu_s is None or not read.cpu_s or not read.rate:
            return None
        return (os.cpu_count() or 1) / (read.cpu_s / read.records + store_cpu_s / self.records) / read.rate

    def python_report(self) -> list[str]:
        """The sink's Python writer per record: the executors' Python workers in each cache and
        search apply run, and the writer alone (its own CPU, in the bench's process)."""
        runs = [r for r in self.runs if r.phase == "apply" and r.store in ("search", "cache") and not r.error]
        if not self.runs and not self.alone:
            return []
        out = [
            "", "| where the CPU of each run went, µs per record | Spark (JVM and driver) | the executors' Python "
            "workers | the store's server | the Kafka broker | all four |", "|---|---:|---:|---:|---:|---:|",
        ]
        for r in self.runs:
            if r.error or not r.cpu_s or r.phase not in ("ceiling", "apply"):
                continue
            python = r.python_cpu_s or 0.0
            parts = [r.cpu_s, python, r.server_cpu_s or 0.0, r.broker_cpu_s or 0.0]
            label = "read ceiling" if r.phase == "ceiling" else f"apply: {r.store}"
            out.append(f"| {label}, maxOffsetsPerTrigger {r.max_offsets:,} | "
                       + " | ".join(f"{1e6 * p / r.records:.1f}" for p in parts)
                       + f" | {1e6 * sum(parts) / r.records:.1f} |")
        out += ["", "| the sink's Python writer | records | CPU s | µs per record |", "|---|---:|---:|---:|"]
        for r in runs:
            if r.python_cpu_s is not None:
                out.append(f"| {r.store}: the executors' Python workers in the apply run at {r.max_offsets:,} | "
                           f"{r.records:,} | {r.python_cpu_s:.1f} | {1e6 * r.python_cpu_s / r.records:.1f} |")
        for a in self.alone.values():
            if not a.error:
                out.append(f"| {a.store}: the writer alone (`sinks.rows.PartitionWriter` in the bench's process) | "
                           f"{self.records:,} | {a.writer_cpu_s:.1f} | {1e6 * a.writer_cpu_s / self.records:.1f} |")
        out += ["", (
            "Spark = the child's process group (the Python driver and the JVM: reading, parsing, the batch's own "
            "jobs, handing rows to Python; not its Python workers, which pyspark's daemon puts in a process group of "
            "its own); the store's server and the broker: their process "
            "groups; all over the query. "
            "Python workers = Spark's `pyspark.daemon` started by the apply child's JVM and the workers it forks, "
            "over the query (the workers that ended counted in the daemon's children's time): rows from the JVM "
            "into Python, the fold, the packing and the store's client. The writer alone: the bench process's CPU "
            "while `sinks.rows.PartitionWriter` writes the whole backlog into a new store (the rows read and "
            "parsed before the clock starts)."
        )]
        return out

    def room_measures(self, ceilings: dict[int, SparkRun]) -> list[str]:
        """Each cache and search apply run as a fraction of the room its store's own work leaves."""
        out = []
        for r in self.runs:
            a = self.alone.get(r.store)
            ceiling = ceilings.get(r.max_offsets)
            if r.phase != "apply" or a is None or a.error or not r.rate or ceiling is None or not ceiling.rate:
                continue
            room = self.room(ceilings, a.server_cpu_s)
            if not room:
                continue
            share = r.rate / ceiling.rate / room
            out.append(f"| {r.store} apply / the room its server alone leaves, maxOffsetsPerTrigger {r.max_offsets:,} "
                       f"| {share:.2f} ({r.rate / ceiling.rate:.2f} / {room:.2f}) | >= 0.8 "
                       f"({'met' if share >= 0.8 else '**missed**'}) |")
        return out

    def commits_report(self) -> list[str]:
        """Delta commits of each freshness run (the sink's whole life: its start, the warm-up, the
        load, the drain), per micro-batch of the job that wrote them."""
        runs = [f for f in self.fresh.values() if f.commits and f.view in ("", "current")]
        if not runs:
            return []
        out = ["", "| Delta commits while streaming (run) | job batches with records | tables touched per batch "
               "(mean) | `current` commits | change log commits | commits per job batch | history batches | "
               "history commits (per history batch) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for f in runs:
            book = f.store == "textbook"  # its log says nothing of its records: every batch counts
            batches = f.batches if book else [b for b in f.batches if b[1] > 0]
            touched = "-" if book or not f.tables else f"{statistics.mean(t for t in f.tables if t):.1f}"
            current, log = f.commits.get("current", 0), f.commits.get("changes", 0)
            per_batch = f"{(current + log) / len(batches):.2f}" if batches else "-"
            hist, hist_commits = len(f.history_batches), f.commits.get("history")
            history = "-" if hist_commits is None else (
                f"{hist_commits} ({hist_commits / hist:.2f})" if hist else str(hist_commits))
            out.append(f"| {f.store} (run {f.run}) | {len(batches)} | {touched} | {current} | "
                       f"{log if 'changes' in f.commits else '-'} | {per_batch} | {hist if not book else '-'} | "
                       f"{history} |")
        out += ["", "Commits counted as the `<version>.json` files the tables' `_delta_log` gained from the sink's "
                "start to its stop (the job's compaction every 50 writes of a table included)."]
        return out

    def textbook_report(self) -> list[str]:
        """cdc's whole warehouse against the textbook job (current state only), run by run: CPU per
        change of the backlog, and of the freshness load."""
        applies = [r for r in self.runs if r.phase == "apply" and r.store in ("delta", "textbook") and r.cpu_s]
        fresh = [f for f in self.fresh.values() if f.store in ("delta", "textbook") and f.view in ("", "current")]
        if not any(r.store == "textbook" for r in applies) and not any(f.store == "textbook" for f in fresh):
            return []
        out = ["", "| A/B run (in the order run) | seconds | Spark CPU s | CPU µs per change | of it, the job's "
               "query (current + change log): s, CPU s | history query: s, CPU s |", "|---|---:|---:|---:|---:|---:|"]
        for r in applies:
            assert r.cpu_s is not None and r.seconds is not None
            split = hist = "-"
            if r.current_s is not None and r.current_cpu_s is not None:
                split = f"{r.current_s:.1f}, {r.current_cpu_s:.1f}"
                hist = f"{r.seconds - r.current_s:.1f}, {r.cpu_s - r.current_cpu_s:.1f}"
            out.append(f"| apply {r.store}, maxOffsetsPerTrigger {r.max_offsets:,} | {r.seconds:.1f} | {r.cpu_s:.1f} | "
                       f"{r.cpu_s / r.records * 1e6:,.0f} | {split} | {hist} |")
        for f in fresh:
            if f.sink_cpu_s and f.transactions:
                out.append(f"| freshness {f.store} (run {f.run}), {f.transactions:,} transactions | {f.seconds:.1f} | "
                           f"{f.sink_cpu_s:.1f} | {f.sink_cpu_s / f.transactions * 1e6:,.0f} | - | - |")

        def ratios(items: list[Any], pick: Callable[[Any], float]) -> str:
            cdc = [pick(x) for x in items if x.store == "delta"]
            book = [pick(x) for x in items if x.store == "textbook"]
            if not cdc or not book:
                return "-"
            middle = statistics.median(cdc) / statistics.median(book)
            return f"{middle:.2f} (medians; {min(cdc) / max(book):.2f}-{max(cdc) / min(book):.2f} over the runs)"

        busy = [f for f in fresh if f.sink_cpu_s and f.transactions]
        out += ["", "cdc's CPU per change (the whole warehouse: current, the change log and history) over the "
                "textbook job's (current only): backlog " + ratios(applies, lambda r: r.cpu_s / r.records)
                + "; freshness load " + ratios(busy, lambda f: f.sink_cpu_s / f.transactions) + "; target ≤ 1.5."]
        return out

    def alone_report(self, ceilings: dict[int, SparkRun]) -> list[str]:
        """The stores' own work apart from Spark's reading (the search and cache servers alone,
        the Delta writes inside the apply runs), and the apply ratio it and the read leave
        room for on these cores."""
        writes = [r for r in self.runs if r.phase == "apply" and r.store_cpu_s is not None and not r.error]
        if not self.alone and not writes:
            return []
        read = self.cheapest_read(ceilings)
        cores = os.cpu_count() or 1

        def room(store_cpu_s: float | None) -> str:
            found = self.room(ceilings, store_cpu_s)
            return "-" if found is None else f"{found:.2f}"

        out = [
            "", "| the store's own work, apart from Spark's reading | writes | seconds | writes/s | store CPU s | "
            "the sink's Python writer CPU s | apply ratio these cores have room for | target |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for a in self.alone.values():
            label = f"{a.store}: its server alone, the bench writing the last change of each key"
            if a.error:
                out.append(f"| {label} | {a.keys:,} | **FAILED**: {a.error} | | | | | |")
                continue
            out.append(
                f"| {label} | {a.keys:,} | {a.seconds:.1f} | {a.keys / a.seconds:,.0f} | {_f(a.server_cpu_s)} | "
                f"{_f(a.writer_cpu_s)} | {room(a.server_cpu_s)} | >= {STORES[a.store].apply_target} |"
            )
        for r in writes:
            assert r.store_s is not None
            out.append(
                f"| delta: the job's writes of its decoded rows, in the apply run at {r.max_offsets:,} | "
                f"{r.records:,} | {r.store_s:.1f} | {r.records / r.store_s:,.0f} | {_f(r.store_cpu_s)} | - | "
                f"{room(r.store_cpu_s)} | >= {STORES['delta'].apply_target} |"
            )
        out += ["", (
            "Server alone: the bench reads the backlog with confluent-kafka and hands it to the sink's own executor "
            "code (`sinks.rows.PartitionWriter`: the last change per key, then the writes the job makes), in one "
            "process, into a new store; store CPU = the server's process group. Delta's writes: the apply child's "
            "CPU (Spark's) from each batch's first Delta write to its last (the job has decoded and stored the "
            f"batch's rows by then). Room = {cores} cores / (Spark's CPU per record in the read ceiling"
            + (f" at maxOffsetsPerTrigger {read.max_offsets:,}" if read is not None else "")
            + " + the store's CPU per backlog record), over the read ceiling's rows/s: the fastest apply that these "
            "two costs leave CPU for on this machine. Nothing else is counted (not the broker serving the reads, "
            "not parsing the envelopes, not moving rows into Python, not the sink's Python writer), so an apply "
            "ratio above it cannot fit in these cores with these writes."
        )]
        return out


# --------------------------------------------------------------------------- children


def reader_child(conn: Any, store_name: str, view: str, config_path: str, poll_s: float, base: int) -> None:
    """Poll the store; report the first warm-up sighting, then every marker's first-seen time
    (this phase's markers only: ids base+1, base+2, ...; warm-up ones -(base+1) ...)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen: dict[int, float] = {}

    def mine(i: int) -> bool:
        return base < abs(i) <= base + MARKER_RANGE

    try:
        poll = STORES[store_name]().visible(config_path, base, view)
        warm = False
        wait_for, deadline = None, None
        while True:
            if conn.poll(0):
                msg = conn.recv()
                if msg.get("stop"):
                    break
                wait_for = msg["wait_for"]
                deadline = time.monotonic() + msg["timeout"]
            got = poll()
            if got is not None:
                ids, now = got
                for i in ids:
                    if i not in seen and mine(i):
                        seen[i] = now
                if not warm and any(i < 0 and mine(i) for i in ids):
                    warm = True
                    conn.send({"warm": now})
            if wait_for is not None and deadline is not None:
                positives = sum(1 for i in seen if i > 0)
                if positives >= wait_for or time.monotonic() > deadline:
                    conn.send({"seen": {i: t for i, t in seen.items() if i > 0}})
                    wait_for = deadline = None
            time.sleep(poll_s)
    except Exception as exc:  # noqa: BLE001 - sent to the parent
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # pyarrow/Parquet readers may abort at interpreter exit: skip it, output flushed


def emit(event: str, **fields: Any) -> None:
    print(CHILD_MARK + json.dumps({"event": event, **fields}), flush=True)


def measured_delta(spark: Any, config: Any) -> Any:
    """The Delta store, measured: the child's CPU (its process group: the driver and the JVM)
    and time from a batch's first store write to the bookkeeping written after its writes.
    The job has decoded and stored the batch's rows by then, so this is the writes alone."""
    from sinks.stores.delta.store import DeltaStore

    class StoreCpu(DeltaStore):
        seconds = cpu_s = 0.0
        _from: tuple[float, float] | None = None
        _measure = threading.Lock()

        @staticmethod
        def _now() -> tuple[float, float]:
            return time.monotonic(), group_cpu_seconds(os.getpgid(0)) or 0.0

        def steps(self) -> tuple[Callable[[Any], None], ...]:
            def measured(step: Callable[[Any], None]) -> Callable[[Any], None]:
                def write(batch: Any) -> None:
                    with self._measure:
                        if self._from is None:
                            self._from = self._now()
                    step(batch)
                return write
            return tuple(measured(step) for step in super().steps())

        def save(self, record: dict[str, Any]) -> None:
            if self._from is not None:
                (t0, c0), (t1, c1) = self._from, self._now()
                self.seconds, self.cpu_s, self._from = self.seconds + t1 - t0, self.cpu_s + c1 - c0, None
            super().save(record)

    return StoreCpu(spark, config.delta.path)


def child_main(argv: list[str]) -> int:
    """`bench/sinks.py _child ceiling|apply --config F --store S`: one Spark session, one query."""
    import logging

    parser = argparse.ArgumentParser(prog="bench/sinks.py _child")
    parser.add_argument("phase", choices=("ceiling", "apply", "rebuild"))
    parser.add_argument("--config", required=True)
    parser.add_argument("--store", default="delta")
    parser.add_argument("--driver-memory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("sinks.stores.delta.store", "sinks.pipeline", "sinks.stores.delta.history"):
        logging.getLogger(name).setLevel(logging.DEBUG)  # seconds per table kind and batch
    try:
        from cdc.config import load as load_config
        from sinks import stores, topics
        from sinks.query import ensure_topics
        from sinks.runner import checkpoint, keep_running
        from sinks.spark import build_session

        config = load_config(args.config)
        conf = {"spark.driver.memory": args.driver_memory} if args.driver_memory else None
        if args.phase == "apply":
            ensure_topics(config)
        t0 = time.monotonic()
        spark = build_session(f"bench-sinks-{args.phase}", master=config.spark.master, conf=conf)
        spark.range(1).count()  # the executors are up before the clock starts
        emit("session", seconds=time.monotonic() - t0)
        if args.phase == "ceiling":
            counts: list[int] = []

            def count(df: Any, batch_id: int) -> None:
                started = time.monotonic()
                n = df.count()
                counts.append(n)
                logging.getLogger("bench").info(
                    "batch %d: %d records of %d tables in %.1f s", batch_id, n, 0, time.monotonic() - started
                )

            query = (
                topics.read_stream(spark, config.topic, config.spark.max_offsets_per_trigger)
                .writeStream.foreachBatch(count)
                .option("checkpointLocation", checkpoint(config, "ceiling"))
                .trigger(availableNow=True)
            )
            emit("query_start")
            t1 = time.monotonic()
            started = query.start()
            started.awaitTermination()
            seconds = time.monotonic() - t1
            emit("query_end", seconds=seconds, read=sum(counts))
            if started.exception() is not None:
                raise RuntimeError(str(started.exception()))
        elif args.phase == "rebuild":
            from sinks.query import StopSignal
            from sinks.stores.search.generations import rebuild_here as rebuild_search_here

            emit("query_start")
            t1 = time.monotonic()
            moved = rebuild_search_here(config, StopSignal())  # stops the session when done
            emit("query_end", seconds=time.monotonic() - t1, swapped=len(moved), read=None)
            return 0
        elif args.store == "textbook":
            import textbook

            emit("query_start")
            t1 = time.monotonic()
            batches = textbook.run(spark, config, once=True)
            emit("query_end", seconds=time.monotonic() - t1, batches=batches, read=None)
        else:
            store_name = args.store
            measured = measured_delta(spark, config) if store_name == "delta" else None
            store, *followers = stores.build_all(store_name, spark, config)  # Delta: then its history query
            store = measured or store
            emit("query_start")
            t1 = time.monotonic()
            progress = keep_running(spark, config, store, True, lambda: False)
            if followers:
                emit("current_end", seconds=time.monotonic() - t1)
            for follower in followers:
                keep_running(spark, config, follower, True, lambda: False)
            seconds = time.monotonic() - t1
            emit("query_end", seconds=seconds, batches=progress.batches, read=None,
                 store_s=measured and measured.seconds, store_cpu=measured and measured.cpu_s)
        spark.stop()
        return 0
    except BaseException as exc:
        emit("error", message=f"{type(exc).__name__}: {exc}")
        raise


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=1_000_000, help="backlog of changes (default 1000000)")
    parser.add_argument("--tables", type=int, default=4, help="backlog tables (default 4)")
    parser.add_argument("--partitions", type=int, default=PARTITIONS,
                        help=f"partitions per topic (default {PARTITIONS}; cdc's own default is 1)")
    parser.add_argument("--max-offsets", default="200000,1000000",
                        help="comma-separated [spark] max_offsets_per_trigger values: a ceiling and an apply run each")
    parser.add_argument("--stores", default="delta,search,cache", help=f"comma-separated stores: {', '.join(STORES)}")
    parser.add_argument("--driver-memory", help="spark.driver.memory of the ceiling and apply runs (default Spark's 1g)")
    parser.add_argument("--spark-timeout", type=float, default=3600,
                        help="a ceiling or apply child running longer is killed and reported (default 3600 s)")
    parser.add_argument("--skip-freshness", action="store_true", help="skip the freshness phase")
    parser.add_argument("--skip-alone", action="store_true",
                        help="skip the search and cache servers alone, fed by the bench without Spark")
    parser.add_argument("--skip-rebuild", action="store_true",
                        help="skip `cdc search rebuild` after each search apply run")
    parser.add_argument("--fresh-rate", type=int, default=1000, help="offered transactions/s (default 1000)")
    parser.add_argument("--fresh-seconds", type=float, default=45, help="length of the freshness load (default 45)")
    parser.add_argument("--fresh-warmup", type=float, default=15,
                        help="seconds of the same load before the measured part (default 15)")
    parser.add_argument("--trigger-interval", type=float, default=0.5, help="[spark] trigger_interval_s while streaming")
    parser.add_argument("--history-interval", type=float, default=30.0,
                        help="Delta's [delta] history_interval_s while streaming (default 30)")
    parser.add_argument("--search-tables-per-index", type=int, default=1,
                        help="[search] tables_per_index: tables packed into each shared index (default 1: an index each)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="apply and freshness runs per store, the stores alternating (A/B/A/B; default 1)")
    parser.add_argument("--poll-ms", type=int, default=100, help="the freshness reader's polling period")
    parser.add_argument("--drain-seconds", type=float, default=300, help="wait this long for the last markers")
    parser.add_argument("--seed", type=int, default=42, help="seed of the workload generator")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    args = parser.parse_args(argv)
    try:
        args.max_offsets = [int(v) for v in args.max_offsets.split(",") if v.strip()]
    except ValueError:
        parser.error("--max-offsets takes comma-separated integers")
    if not args.max_offsets or min(args.max_offsets) < 1:
        parser.error("--max-offsets values must be positive")
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = [s for s in args.stores if s not in STORES]
    if unknown or not args.stores:
        parser.error(f"--stores: choose from {', '.join(STORES)}")
    if args.changes < 1 or args.tables < 1:
        parser.error("--changes and --tables must be positive")
    args.clients, args.profile, args.rows = ["confluent"], None, args.changes  # what Bench (capture.py) reads
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child_main(argv[1:])
    try:
        import confluent_kafka  # noqa: F401 (the daemon's producer here, and the bench's reader)
    except ImportError:
        print("error: bench/sinks.py needs confluent-kafka (the daemon's producer and the bench's reader): "
              "pip install -e '.[sinks,confluent]'", file=sys.stderr)
        return 2
    bench = SinksBench(parse_args(argv))
    if not drive(bench, lambda: bool(self_results(bench))):
        return 130
    return 1 if bench.failed else 0


def self_results(bench: SinksBench) -> bool:
    return bool(bench.capture or bench.runs or bench.fresh or bench.alone)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a Spark child's Python or delta-rs may abort at interpreter exit: skip it, output flushed
