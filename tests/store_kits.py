"""What the one suite every store passes (tests/test_every_store.py) needs of each store: a
throwaway server and the settings pointing at it, the rows a reader finds there, a fault of
that server under load, a backup and its restore, a reader counting during a rebuild, and
what the rebuild leaves behind. Everything here that is only about one store is in its kit;
a registered store without a kit fails the suite by name (`kit`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import orjson
import psycopg
import pytest
import redis

from cdc.config import load
from cdc.local.opensearch import LocalOpenSearch
from cdc.local.postgres import LocalPostgres
from cdc.local.redis import LocalRedis
from cdc.naming import topic_name
from tests.support import DEBUG_LOG, SINK_TIMEOUT_S, Sink, cdc_here, wait_for
from tests.test_sink_cache import _visible
from tests.test_sink_delta import STEPS
from tests.test_sink_search import HTTP, _ok, _rows

#: a table's rows as a reader finds them: id -> the values of the asked columns
Rows = dict[int, tuple]


@dataclass
class Reach:
    """One test's store: its `[name]` settings (a scenario may add its own), where it is (a
    URL, a DSN, a directory), the topics' prefix, and its server when the test owns one (for
    the fault)."""

    section: dict[str, Any]
    where: str
    prefix: str
    server: Any = None

    def topic(self, table: str) -> str:
        return topic_name(self.prefix, "public", table)


class Kit:
    """One store as the shared suite reaches it."""

    name = ""
    #: what the job's progress topic holds after a run: its own record, and its followers'
    progress: frozenset[str] = frozenset()
    #: whether a job that finds its store behind its checkpoint says so (the warehouse rebuilds
    #: its tables and says nothing: its rows are the check)
    says_behind = True
    #: the places a store restored from an old backup holds the source's rows again (None: all)
    restored: tuple[str, ...] | None = None
    #: settings the truncate scenario adds: followers that read as the job does
    truncate_settings: ClassVar[dict[str, Any]] = {}
    #: settings the rebuild scenario adds: followers that need not share the two cores meanwhile
    rebuild_settings: ClassVar[dict[str, Any]] = {}
    #: the environment of the streaming job under load (the fault may wait for a line it logs)
    job_env: ClassVar[dict[str, str]] = {}
    #: the streaming job's batch size under load: small enough that each kill lands mid-batch
    load_max_offsets = 700

    def reach(self, request: pytest.FixtureRequest, tmp_path: Path, prefix: str, own: bool) -> contextlib.AbstractContextManager[Reach]:
        """The store for one test: the session's server, or (`own`) one of the test's, which
        the test may kill."""
        raise NotImplementedError

    def views(self, reach: Reach, table: str, columns: tuple[str, ...]) -> dict[str, Rows]:
        """Every place a reader finds `public.<table>`'s rows, by the place's name."""
        raise NotImplementedError

    def kill_mid_batches(self, sink: Sink) -> None:
        """Three kills -9 of the streaming job, each in the middle of a batch: a moment into the
        batch after one it completed (a batch takes a fraction of a second)."""
        sink.kill9_mid_batches((0.5, 1.0, 2.0))

    def fault(self, reach: Reach, sink: Sink) -> None:
        """Its server's fault, while `sink` streams (after the batch the fault needs first); the
        job must ride it out."""
        raise NotImplementedError

    def faulted(self, reach: Reach, log: str) -> bool:
        """The job's log shows it met the fault."""
        raise NotImplementedError

    def backup(self, reach: Reach) -> Any:
        raise NotImplementedError

    def restore(self, reach: Reach, saved: Any) -> None:
        """Put the backup back, as an operator restoring an old one would: the job's bookkeeping too."""
        raise NotImplementedError

    def counting(self, reach: Reach, config: Path, table: str) -> contextlib.AbstractContextManager[Callable[[], Any]]:
        """A reader's count of the table's rows, as a reader asks while a rebuild runs."""
        raise NotImplementedError

    def rebuilt(self, reach: Reach, done: subprocess.CompletedProcess, sink: Sink, config: Path) -> None:
        """The rebuild said what it switched, and nothing of it is left but the new generation."""
        raise NotImplementedError


class CacheKit(Kit):
    """Redis, a server of the test's own always: SWAPDB moves whole databases, a restore empties one."""

    name = "cache"
    progress = frozenset({"cache"})

    @contextlib.contextmanager
    def reach(self, request: pytest.FixtureRequest, tmp_path: Path, prefix: str, own: bool) -> Iterator[Reach]:
        with LocalRedis(tmp_path / "redis") as server:  # no persistence: a restart comes back empty
            url = server.url.rsplit("/", 1)[0] + "/0"
            yield Reach({"url": url}, url, prefix, server)

    def views(self, reach: Reach, table: str, columns: tuple[str, ...]) -> dict[str, Rows]:
        rows = [row for key, row in _visible(redis.Redis.from_url(reach.where), reach.prefix).items()
                if key.startswith(reach.topic(table) + ":")]
        return {"cache": {row["id"]: tuple(row.get(c) for c in columns) for row in rows}}

    def fault(self, reach: Reach, sink: Sink) -> None:  # every row the job wrote is gone
        sink.next_batch()
        reach.server.restart()
        wait_for(lambda: "rebuilding it from the topics" in sink.log.read_text(), SINK_TIMEOUT_S, "the job to rebuild")

    def faulted(self, reach: Reach, log: str) -> bool:
        return f"Redis at {reach.where} lost writes" in log

    def backup(self, reach: Reach) -> Any:
        client = redis.Redis.from_url(reach.where)
        return [(key, max(0, client.pttl(key)), client.dump(key)) for key in client.scan_iter(count=1000)]

    def restore(self, reach: Reach, saved: Any) -> None:
        client = redis.Redis.from_url(reach.where)
        client.flushdb()
        for key, ttl, dumped in saved:
            client.restore(key, ttl, dumped, replace=True)

    @contextlib.contextmanager
    def counting(self, reach: Reach, config: Path, table: str) -> Iterator[Callable[[], Any]]:
        reader = redis.Redis.from_url(reach.where)
        yield lambda: sum(1 for _ in reader.scan_iter(match=f"{reach.topic(table)}:*", count=1000))

    def rebuilt(self, reach: Reach, done: subprocess.CompletedProcess, sink: Sink, config: Path) -> None:
        assert re.fullmatch(r"cache rebuild: database 1 swapped in as database 0, 1 tables, \d+ rows",
                            done.stdout.strip()), done.stdout
        assert redis.Redis.from_url(reach.where.rsplit("/", 1)[0] + "/1").dbsize() == 0
        assert not redis.Redis.from_url(reach.where).exists(f"__cdc:{reach.prefix}:sink:cache-rebuild")


#: the index settings a restore gives the index again (the others are the node's own)
_KEPT_SETTINGS = ("index.number_of_shards", "index.number_of_replicas", "index.hidden", "index.gc_deletes",
                  "index.refresh_interval")


class SearchKit(Kit):
    """OpenSearch: the session's node, or one of the test's own to kill -9."""

    name = "search"
    progress = frozenset({"search"})

    @contextlib.contextmanager
    def reach(self, request: pytest.FixtureRequest, tmp_path: Path, prefix: str, own: bool) -> Iterator[Reach]:
        if not own:
            url = request.getfixturevalue("opensearch").url
            yield Reach({"url": url, "replicas": 0}, url, prefix)
            return
        with LocalOpenSearch(tmp_path / "os") as node:
            yield Reach({"url": node.url, "replicas": 0}, node.url, prefix, node)

    def _alias(self, reach: Reach, table: str) -> str:
        from sinks.stores.search.shapes import alias_name

        return alias_name(reach.topic(table))

    def views(self, reach: Reach, table: str, columns: tuple[str, ...]) -> dict[str, Rows]:
        rows = _rows(reach.where, reach.topic(table)).values()
        return {"index": {row["id"]: tuple(row.get(c) for c in columns) for row in rows}}

    def fault(self, reach: Reach, sink: Sink) -> None:  # back once the job found it gone
        sink.next_batch()
        seen = sink.log.read_text().count(f"OpenSearch at {reach.where}: ")
        reach.server.kill9()
        wait_for(lambda: sink.log.read_text().count(f"OpenSearch at {reach.where}: ") > seen, SINK_TIMEOUT_S,
                 "the job to find OpenSearch gone", poll=0.2)
        reach.server.start()

    def faulted(self, reach: Reach, log: str) -> bool:
        return f"OpenSearch at {reach.where}: " in log

    def backup(self, reach: Reach) -> Any:
        """Every index of the prefix (the tables', the job's bookkeeping, the delete markers):
        its settings, mapping, aliases and documents with their versions."""
        base, saved = reach.where, []
        for entry in _ok(base, "GET", f"/_cat/indices/{reach.prefix}*?format=json&expand_wildcards=all"):
            index = entry["index"]
            settings = _ok(base, "GET", f"/{index}/_settings?flat_settings=true")[index]["settings"]
            _ok(base, "POST", f"/{index}/_refresh?expand_wildcards=all")
            hits = _ok(base, "POST", f"/{index}/_search", {"query": {"match_all": {}}, "size": 10000,
                                                          "version": True})["hits"]["hits"]
            saved.append((index, {k: v for k, v in settings.items() if k in _KEPT_SETTINGS},
                          _ok(base, "GET", f"/{index}/_mapping")[index]["mappings"],
                          _ok(base, "GET", f"/{index}/_alias")[index]["aliases"],
                          [(hit["_id"], hit["_version"], hit["_source"]) for hit in hits]))
        return saved

    def restore(self, reach: Reach, saved: Any) -> None:
        base = reach.where
        for entry in _ok(base, "GET", f"/_cat/indices/{reach.prefix}*?format=json&expand_wildcards=all"):
            _ok(base, "DELETE", f"/{entry['index']}")
        for index, settings, mappings, aliases, documents in saved:
            _ok(base, "PUT", f"/{index}", {"settings": settings, "mappings": mappings, "aliases": aliases})
            if documents:
                lines = []
                for id_, version, source in documents:
                    lines += [orjson.dumps({"index": {"_index": index, "_id": id_, "version": version,
                                                      "version_type": "external"}}), orjson.dumps(source)]
                resp = HTTP.request("POST", f"{base}/_bulk", body=b"\n".join(lines) + b"\n",
                                    headers={"Content-Type": "application/x-ndjson"})
                assert resp.status == 200 and not orjson.loads(resp.data)["errors"], resp.data[:500]
            _ok(base, "POST", f"/{index}/_refresh?expand_wildcards=all")

    @contextlib.contextmanager
    def counting(self, reach: Reach, config: Path, table: str) -> Iterator[Callable[[], Any]]:
        alias = self._alias(reach, table)

        def count() -> Any:
            resp = HTTP.request("GET", f"{reach.where}/{alias}/_count")
            return orjson.loads(resp.data)["count"] if resp.status == 200 else (resp.status, resp.data[:200])

        yield count

    def rebuilt(self, reach: Reach, done: subprocess.CompletedProcess, sink: Sink, config: Path) -> None:
        alias = self._alias(reach, "acct")
        lines = done.stdout.splitlines()
        assert re.fullmatch(rf"{re.escape(alias)}: {re.escape(alias)}-v1 -> {re.escape(alias)}-v2 \(\d+ documents\)",
                            lines[0]), lines
        assert lines[1:] == ["search rebuild: 1 indexes swapped"]
        assert _ok(reach.where, "GET", f"/_alias/{alias}*?expand_wildcards=all") == {f"{alias}-v2": {"aliases": {alias: {}}}}
        assert HTTP.request("HEAD", f"{reach.where}/{alias}-v1").status == 404


class PostgresKit(Kit):
    """The read model: a database of the session's PostgreSQL, or a server of the test's own to kill -9."""

    name = "postgres"
    progress = frozenset({"postgres"})

    @contextlib.contextmanager
    def reach(self, request: pytest.FixtureRequest, tmp_path: Path, prefix: str, own: bool) -> Iterator[Reach]:
        if not own:
            dsn = request.getfixturevalue("read_model")
            yield Reach({"dsn": dsn}, dsn, prefix)
            return
        server = LocalPostgres(tmp_path / "read-model").start()
        try:
            dsn = server.create_database("read_model")
            yield Reach({"dsn": dsn}, dsn, prefix, server)
        finally:
            server.close()

    def views(self, reach: Reach, table: str, columns: tuple[str, ...]) -> dict[str, Rows]:
        with psycopg.connect(reach.where, autocommit=True) as conn:
            names = {r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns WHERE "
                                                "table_schema = 'cdc_public' AND table_name = %s", (table,))}
            select = ", ".join(c if c in names else "NULL" for c in columns)
            rows = conn.execute(f"SELECT id, {select} FROM cdc_public.{table}").fetchall()
        return {"table": {r[0]: tuple(r[1:]) for r in rows}}

    def fault(self, reach: Reach, sink: Sink) -> None:
        """Killed -9 (the postmaster and every backend, its process group) for 10 s: batches
        meet a refused connection, and are retried, not lost."""
        sink.next_batch()
        server = reach.server
        pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        wait_for(lambda: not server.running, 60, "the killed PostgreSQL to be gone")
        time.sleep(10)  # the outage itself
        server.start()

    def faulted(self, reach: Reach, log: str) -> bool:
        return any(line in log for line in ("is unreachable", "terminating connection", "server closed the connection"))

    def backup(self, reach: Reach) -> Any:
        with psycopg.connect(reach.where, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA backup")
            for live, aside in (("cdc_public.acct", "backup.acct"), ("_cdc.bookkeeping", "backup.bookkeeping")):
                conn.execute(f"CREATE TABLE {aside} AS TABLE {live}")

    def restore(self, reach: Reach, saved: Any) -> None:
        with psycopg.connect(reach.where, autocommit=True) as conn:
            for live, aside in (("cdc_public.acct", "backup.acct"), ("_cdc.bookkeeping", "backup.bookkeeping")):
                conn.execute(f"TRUNCATE {live}")
                conn.execute(f"INSERT INTO {live} SELECT * FROM {aside}")

    @contextlib.contextmanager
    def counting(self, reach: Reach, config: Path, table: str) -> Iterator[Callable[[], Any]]:
        with psycopg.connect(reach.where, autocommit=True) as reader:
            yield lambda: reader.execute(f"SELECT count(*) FROM cdc_public.{table}").fetchone()[0]  # type: ignore[index]

    def rebuilt(self, reach: Reach, done: subprocess.CompletedProcess, sink: Sink, config: Path) -> None:
        assert re.fullmatch(r"postgres rebuild: 1 tables switched in, \d+ rows", done.stdout.strip()), done.stdout
        with psycopg.connect(reach.where, autocommit=True) as conn:
            schemas = [r[0] for r in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'cdc%' ORDER BY 1")]
            records = [r[0] for r in conn.execute("SELECT name FROM _cdc.bookkeeping")]
            stages = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = '_cdc' AND "
                                                 "tablename LIKE 'stage%' ORDER BY 1")]
        # nothing of the rebuild is left, its staging tables (a batch's rows each) included
        assert (schemas, records, stages) == (["cdc_public"], ["postgres"], ["stage_postgres"])


_READ_DELTA = """
import json, os, sys
from deltalake import DeltaTable
path, history, columns = sys.argv[1], sys.argv[2] == "history", json.loads(sys.argv[3])
table = DeltaTable(path)
names = {f.name for f in table.schema().fields}
rows = table.to_pyarrow_table(columns=[c for c in ["id", *columns, "_cdc_is_current"] if c in names]).to_pylist()
rows = [r for r in rows if not history or r["_cdc_is_current"]]
sys.stdout.write(json.dumps([[r["id"], *(r.get(c) for c in columns)] for r in rows]))
sys.stdout.flush()
os._exit(0)
"""

#: the warehouse's fault kills the job there: between two commits of one batch
BETWEEN_COMMITS = STEPS["current"]


class DeltaKit(Kit):
    """The warehouse: a directory of the test's own."""

    name = "delta"
    progress = frozenset({"delta", "delta-history"})
    says_behind = False
    #: history/ keeps what its change log holds, and a restored change log lacks the deletes the
    #: compacted topic no longer has: those rows stay current in history/ (docs/sinks/delta.md)
    restored = ("current",)
    #: history's query reads one file of the change log per batch: a truncate and the rows it
    #: removes fall into different history batches, as they do into the job's
    truncate_settings: ClassVar[dict[str, Any]] = {"history_batch_bytes": 1}
    rebuild_settings: ClassVar[dict[str, Any]] = {"history_interval_s": 3600}  # `--once` runs bring history/ along
    job_env: ClassVar[dict[str, str]] = DEBUG_LOG  # its kills and its fault wait for STEPS it logs
    load_max_offsets = 2100  # a batch takes seconds whatever its size: fewer of them drain the load

    @contextlib.contextmanager
    def reach(self, request: pytest.FixtureRequest, tmp_path: Path, prefix: str, own: bool) -> Iterator[Reach]:
        path = tmp_path / "warehouse"
        yield Reach({"path": str(path)}, str(path), prefix)

    def views(self, reach: Reach, table: str, columns: tuple[str, ...]) -> dict[str, Rows]:
        out = {}
        for kind in ("current", "history"):
            done = subprocess.run([sys.executable, "-c", _READ_DELTA, str(Path(reach.where) / kind / "public" / table),
                                   kind, json.dumps(columns)], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            out[kind] = {r[0]: tuple(r[1:]) for r in json.loads(done.stdout)}
        return out

    def kill_mid_batches(self, sink: Sink) -> None:
        """A warehouse batch takes seconds, a fresh job's first the most: each run is killed -9
        in its first batch, after another step (decoded; the change log appended; a history
        MERGE, which reads what the run before appended)."""
        for step in ("decoded", "changes", "history"):
            sink.start()
            sink.kill9_at(STEPS[step])

    def fault(self, reach: Reach, sink: Sink) -> None:
        """The warehouse has no server to lose: the job is killed -9 between two commits of its
        first batch (its `current` MERGE and its change log's append), then streams again."""
        sink.kill9_at(BETWEEN_COMMITS)
        sink.start()

    def faulted(self, reach: Reach, log: str) -> bool:
        return BETWEEN_COMMITS in log

    def backup(self, reach: Reach) -> Any:
        shutil.copytree(reach.where, reach.where + ".backup")

    def restore(self, reach: Reach, saved: Any) -> None:
        shutil.rmtree(reach.where)
        shutil.copytree(reach.where + ".backup", reach.where)

    @contextlib.contextmanager
    def counting(self, reach: Reach, config: Path, table: str) -> Iterator[Callable[[], Any]]:
        from sinks.stores import counter

        rows, topic = counter("delta", load(str(config))), reach.topic(table)
        try:
            yield lambda: rows.count([topic])[topic]
        finally:
            rows.close()

    def rebuilt(self, reach: Reach, done: subprocess.CompletedProcess, sink: Sink, config: Path) -> None:
        assert re.fullmatch(r"delta rebuild: 1 tables of current/ replaced, \d+ rows", done.stdout.strip()), done.stdout
        # the live job paused between two batches for the switch, and went on after it
        assert "cdc sink delta paused; the rebuilt tables catch up to its offsets" in done.stderr, done.stderr[-3000:]
        assert "paused between batches for the Delta rebuild's switch" in sink.log.read_text()
        verified = cdc_here("verify", "--stores", "delta", "--tables", "public.acct", "--config", str(config))
        assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
        # the version before the switch is still there for time travel; nothing of the rebuild is left
        history = subprocess.run(
            [sys.executable, "-c", "import sys, json; from deltalake import DeltaTable; "
             "print(json.dumps([h['operation'] for h in DeltaTable(sys.argv[1]).history()])); import os; os._exit(0)",
             str(Path(reach.where) / "current" / "public" / "acct")], capture_output=True, text=True)
        assert "WRITE" in history.stdout and "MERGE" in history.stdout, history.stdout + history.stderr
        assert not (Path(reach.where) / "_cdc" / "rebuild").exists()


KITS: dict[str, Kit] = {kit.name: kit for kit in (CacheKit(), SearchKit(), PostgresKit(), DeltaKit())}


def kit(name: str) -> Kit:
    """The kit of a registered store; a store registered without one fails its tests here."""
    assert name in KITS, f"the store {name!r} is registered but tests/store_kits.py has no kit for it: add one"
    return KITS[name]
