"""`cdc demo`: the pipeline on embedded defaults, end to end, on a fresh machine.

Starts a throwaway PostgreSQL with logical WAL and a local Apache Kafka (KRaft, its jars
fetched once from Maven Central), runs `cdc run` against them, writes rows (inserts, an
update, a delete, a key change) and prints the events as they land in the compacted topics,
then runs the Spark sink job (`--once`) of every store sinks.stores lists (a Delta
warehouse, a local OpenSearch index, a local Redis cache), each into a throwaway one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import psycopg

from cdc.config import TopicConfig
from cdc.config import load as load_config
from cdc.kafka.reader import read_topic
from cdc.local.kafka import LocalKafka
from cdc.local.postgres import LocalPostgres
from cdc.naming import topic_name
from compaction.table import build, payload_of

PREFIX = "demo"
SCRIPT = [
    ("create two tables", "CREATE TABLE public.customers (id int PRIMARY KEY, name text NOT NULL, email text);"
     "CREATE TABLE public.orders (id bigint PRIMARY KEY, customer_id int NOT NULL, total numeric(10,2), "
     "placed_at timestamptz NOT NULL DEFAULT now(), tags text[])"),
    ("insert customers", "INSERT INTO public.customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Grace', NULL)"),
    ("insert orders", "INSERT INTO public.orders (id, customer_id, total, tags) VALUES "
     "(100, 1, 12.50, '{gift}'), (101, 2, 99.99, NULL), (102, 1, 5.00, '{}')"),
    ("update an email", "UPDATE public.customers SET email = 'grace@example.com' WHERE id = 2"),
    ("delete an order", "DELETE FROM public.orders WHERE id = 101"),
    ("change a primary key", "UPDATE public.orders SET id = 200 WHERE id = 102"),
]
BEFORE_CDC = 2  # the tables and the first customers exist before the daemon: they arrive as snapshot reads


def _step(title: str) -> None:
    click.secho(f"\n== {title}", bold=True)


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise click.ClickException(f"timed out waiting for {what}")
        time.sleep(0.2)


def _search_example(url: str) -> None:
    """One full-text search, as a search user would try the index."""
    from sinks.opensearch import Endpoint
    from sinks.search_shapes import alias_name

    query = {"query": {"match": {"email": "example.com"}}}
    client = Endpoint(url).client()
    hits = client.ok("POST", f"/{alias_name(topic_name(PREFIX, 'public', 'customers'))}/_search", query)["hits"]["hits"]
    click.echo(f"  search customers for email 'example.com': {sorted(h['_id'] for h in hits)}")


def _sink(store: str, env: dict[str, str], base: Path) -> None:
    """`cdc sink <store> --once`, its summary line shown."""
    sink = subprocess.run(
        [sys.executable, "-m", "cdc", "sink", store, "--once"], env=env, capture_output=True, text=True, cwd=base,
    )
    if sink.returncode != 0:
        raise click.ClickException(f"the {store} sink failed:\n" + sink.stderr[-2000:])
    click.echo(f"  {sink.stdout.strip()}")


def run_demo(workdir: Path | None, keep: bool) -> None:
    base = Path(workdir or tempfile.mkdtemp(prefix="cdc-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    from sinks.stores import STORES

    _step(f"starting PostgreSQL (wal_level=logical), Apache Kafka (KRaft) and each store's server under {base}")
    pg = LocalPostgres(base / "postgres").start()
    broker = LocalKafka(base / "broker").start()
    servers: list[Any] = []
    settings: dict[str, str] = {}
    daemon: subprocess.Popen | None = None
    try:
        for registration in STORES.values():
            server, env_of = registration.load().local(base)
            servers += [server] if server is not None else []
            settings.update(env_of)
        dsn = pg.dsn()
        click.echo(f"PostgreSQL: {dsn}\nbroker:     {broker.bootstrap_servers}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for title, sql in SCRIPT[:BEFORE_CDC]:
                click.echo(f"  SQL ({title}, before cdc starts): {sql}")
                conn.execute(sql)
        env = {
            **os.environ,
            "CDC_SOURCE_DSN": dsn,
            "CDC_SOURCE_TABLES": "public.*",
            "CDC_TOPIC_BOOTSTRAP_SERVERS": broker.bootstrap_servers,
            "CDC_TOPIC_PREFIX": PREFIX,
            "CDC_DAEMON_SPILL_DIR": str(base / "spill"),
        }
        _step(
            "cdc run (the daemon): creates the publication, the slot and one compacted topic per table, reads the "
            "existing rows in a snapshot aligned to the slot (op=r), then streams"
        )
        log = open(base / "cdc.log", "w", encoding="utf-8")  # noqa: SIM115 (lives as long as the daemon)
        daemon = subprocess.Popen([sys.executable, "-m", "cdc", "run"], env=env, stdout=log, stderr=subprocess.STDOUT)
        with psycopg.connect(dsn, autocommit=True) as conn:
            _wait(
                lambda: daemon.poll() is not None or bool(conn.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'cdc' AND active").fetchone()),
                60, "the daemon to stream",
            )
            if daemon.poll() is not None:
                raise click.ClickException("the daemon exited:\n" + (base / "cdc.log").read_text()[-2000:])
            for title, sql in SCRIPT[BEFORE_CDC:]:
                click.echo(f"  SQL ({title}): {sql}")
                conn.execute(sql)
            target = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
            _wait(
                lambda: bool(conn.execute(
                    "SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots WHERE slot_name = 'cdc'", (target,)
                ).fetchone()[0]),  # type: ignore[index]
                60, "the broker to acknowledge every change",
            )
        topic_config = TopicConfig(bootstrap_servers=broker.bootstrap_servers, prefix=PREFIX)
        for table in ("customers", "orders"):
            topic = topic_name(PREFIX, "public", table)
            _step(f"topic {topic}: every record, in offset order per partition")
            records = list(read_topic(topic_config, topic))
            for r in sorted(records, key=lambda r: (r.partition, r.offset)):
                key = r.key.decode() if r.key else None
                if r.value is None:
                    click.echo(f"  [{r.partition}@{r.offset}] key={key}  tombstone")
                    continue
                event = payload_of(r.value)
                row = event["after"] if event["after"] is not None else event["before"]
                click.echo(
                    f"  [{r.partition}@{r.offset}] key={key}  op={event['op']}  "
                    f"position={event['source']['sequence']}  row={json.dumps(row)}"
                )
            state = build(records).state()
            click.echo(f"  read as a table (what compaction keeps): {sorted(json.dumps(v) for v in state.values())}")
        _step("one full event (Debezium envelope)")
        first = next(iter(read_topic(topic_config, topic_name(PREFIX, "public", "customers"))))
        click.echo(json.dumps(payload_of(first.value), indent=2))  # type: ignore[arg-type]
        env.update(settings)
        env["CDC_SPARK_CHECKPOINT_DIR"] = str(base / "checkpoints")
        config = load_config(environ=env)
        tables = [topic_name(PREFIX, "public", table) for table in ("customers", "orders")]
        for name, registration in STORES.items():
            _step(f"cdc sink {name} --once (a Spark job): the topics into {registration.story}")
            _sink(name, env, base)
            for line in registration.load().show(config, tables):
                click.echo(f"  {line}")
            if name == "search":
                _search_example(config.search.url)
        _step("cdc status")
        status = subprocess.run([sys.executable, "-m", "cdc", "status"], env=env, capture_output=True, text=True)
        click.echo(status.stdout or status.stderr)
        if keep:
            _step("keeping everything running; press Ctrl-C to stop")
            click.echo(f"  try: CDC_SOURCE_DSN='{dsn}' CDC_TOPIC_BOOTSTRAP_SERVERS={broker.bootstrap_servers} "
                       f"CDC_TOPIC_PREFIX={PREFIX} cdc tail public.customers --follow")
            try:
                while daemon.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
        for server in servers:
            server.close()
        broker.stop()
        pg.close()  # stops the server and removes a cluster that had to live outside `base`
    _step(f"done: logs in {base}")
