"""`cdc demo`: the pipeline on embedded defaults, end to end, on a fresh machine.

Starts a throwaway PostgreSQL with logical WAL, a local Apache Kafka (KRaft, its jars
fetched once from Maven Central) and each store's server (sinks.stores: a Delta warehouse
folder, a local OpenSearch, a local Redis), writes them one cdc.toml, runs `cdc run`, writes
rows (inserts, an update, a delete, a key change) and prints the events as they land in the
compacted topics; then starts every store's Spark sink job, streaming, and shows `cdc top`'s
live view until every store holds the source's rows, then what a reader finds in each
store and every store against the source. `--keep` leaves it all running.
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


def _config_file(path: Path, settings: dict[str, str]) -> Path:
    """A cdc.toml holding `settings` (as CDC_<SECTION>_<KEY> environment names): the file the
    demo's processes share, and the one `cdc top`, `cdc status` or `cdc report` take."""
    from cdc.config import SETTINGS

    sections: dict[str, list[str]] = {}
    for setting in SETTINGS:
        if setting.env in settings:
            value = setting.read(settings[setting.env], from_env=True)
            text = ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)
            sections.setdefault(setting.section, []).append(f"{setting.key} = {text}")
    path.write_text("".join(f"[{name}]\n" + "\n".join(lines) + "\n\n" for name, lines in sections.items()))
    return path


def _start(argv: list[str], base: Path, name: str) -> subprocess.Popen:
    """A `cdc` command in the background, its output in `<name>.log` under `base`."""
    log = open(base / f"{name}.log", "w", encoding="utf-8")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen([sys.executable, "-m", "cdc", *argv], stdout=log, stderr=subprocess.STDOUT, cwd=base)


def _stop(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (a sink job finishes its running batch, the daemon confirms what it sent)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def _watch(config: Any, sinks: dict[str, subprocess.Popen], base: Path, target: int, timeout_s: float) -> None:
    """`cdc top`'s live view until every store is complete up to `target` (the LSN of the
    script's last change) and holds PostgreSQL's rows."""
    from rich.console import Console
    from rich.live import Live

    from cdc.top import Watch, render

    watch = Watch(config, counts_every_s=1.0)
    deadline = time.monotonic() + timeout_s
    console = Console()
    if not console.is_terminal:  # a pipe or a file: the last picture only, wide enough for every column
        console = Console(width=140)
    try:
        picture = watch.sample()
        with Live(render(picture, "cdc demo"), console=console, auto_refresh=False) as live:
            while not picture.caught_up(sinks, target):
                for name, process in sinks.items():
                    if process.poll() is not None:
                        raise click.ClickException(
                            f"the {name} sink exited:\n" + (base / f"sink-{name}.log").read_text()[-2000:])
                if time.monotonic() > deadline:
                    raise click.ClickException(f"the stores did not catch up within {timeout_s:.0f} s")
                time.sleep(0.5)
                picture = watch.sample()
                live.update(render(picture, "cdc demo"), refresh=True)
        if not console.is_terminal:
            console.line()  # Live leaves the last line open there
    finally:
        watch.close()


def _verify(config_path: Path) -> None:
    """`cdc verify`: PostgreSQL at one snapshot against the topics read as tables and every
    store, row by row content (hashes), once each store is complete up to that snapshot."""
    done = subprocess.run([sys.executable, "-m", "cdc", "verify", "--config", str(config_path), "--timeout", "300"],
                          capture_output=True, text=True)
    for line in (done.stdout or done.stderr).splitlines():
        click.echo(f"  {line}")
    if done.returncode != 0:
        raise click.ClickException(f"cdc verify found the stores different from the source (exit {done.returncode})")


def run_demo(workdir: Path | None, keep: bool) -> None:
    began = time.monotonic()
    base = Path(workdir or tempfile.mkdtemp(prefix="cdc-demo-")).absolute()
    base.mkdir(parents=True, exist_ok=True)
    from cdc.local.process import free_port
    from sinks.stores import STORES

    _step(f"starting PostgreSQL (wal_level=logical), Apache Kafka (KRaft) and each store's server under {base}")
    pg = LocalPostgres(base / "postgres").start()
    broker = LocalKafka(base / "broker").start()
    servers: list[Any] = []
    processes: list[tuple[subprocess.Popen, float]] = []  # stopped last-started first, with their grace
    try:
        settings = {
            "CDC_SOURCE_DSN": pg.dsn(), "CDC_SOURCE_TABLES": "public.*",
            "CDC_TOPIC_BOOTSTRAP_SERVERS": broker.bootstrap_servers, "CDC_TOPIC_PREFIX": PREFIX,
            "CDC_DAEMON_SPILL_DIR": str(base / "spill"), "CDC_DAEMON_METRICS_PORT": str(free_port()),
            "CDC_DAEMON_METRICS_INTERVAL_S": "1", "CDC_SPARK_CHECKPOINT_DIR": str(base / "checkpoints"),
        }
        for registration in STORES.values():
            server, env_of = registration.load().local(base)
            servers += [server] if server is not None else []
            settings.update(env_of)
        config_path = _config_file(base / "cdc.toml", settings)
        config = load_config(config_path, environ={})
        dsn = config.source.dsn
        click.echo(f"PostgreSQL: {dsn}\nbroker:     {broker.bootstrap_servers}\nconfig:     {config_path}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for title, sql in SCRIPT[:BEFORE_CDC]:
                click.echo(f"  SQL ({title}, before cdc starts): {sql}")
                conn.execute(sql)
        _step(
            "cdc run (the daemon): creates the publication, the slot and one compacted topic per table, reads the "
            "existing rows in a snapshot aligned to the slot (op=r), then streams"
        )
        daemon = _start(["run", "--config", str(config_path)], base, "cdc")
        processes.append((daemon, 60))
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
            row = conn.execute("SELECT pg_current_wal_lsn(), pg_current_wal_lsn() - '0/0'").fetchone()
            assert row is not None
            target_text, target = row[0], int(row[1])
            _wait(
                lambda: bool(conn.execute(
                    "SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots WHERE slot_name = 'cdc'", (target_text,)
                ).fetchone()[0]),  # type: ignore[index]
                60, "the broker to acknowledge every change",
            )
        topic_config = config.topic
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
        _step("the Spark sink jobs, streaming: " + "; ".join(f"cdc sink {name}: {r.story}" for name, r in STORES.items()))
        started = time.monotonic()
        sinks = {}
        for name in STORES:
            sinks[name] = _start(["sink", name, "--config", str(config_path)], base, f"sink-{name}")
            processes.append((sinks[name], 180))
        _watch(config, sinks, base, target, timeout_s=900)
        caught_up = time.monotonic()
        click.echo(
            f"every store caught up: {caught_up - started:.0f} s after the sink jobs started, "
            f"{caught_up - began:.0f} s after cdc demo started"
        )
        tables = [topic_name(PREFIX, "public", table) for table in ("customers", "orders")]
        for name, registration in STORES.items():
            _step(f"what a reader finds in the {name} store")
            store = registration.load()
            for line in store.show(config, tables):
                click.echo(f"  {line}")
            if hasattr(store, "find"):  # a store that answers queries on a field's text
                click.echo(f"  search customers for email 'example.com': {store.find(config, tables[0], 'email', 'example.com')}")
        _step("every store against the source: cdc verify")
        _verify(config_path)
        _step("cdc status")
        status = subprocess.run([sys.executable, "-m", "cdc", "status", "--config", str(config_path)],
                                capture_output=True, text=True)
        click.echo(status.stdout or status.stderr)
        if keep:
            _step("everything keeps running: PostgreSQL, Kafka, the stores, cdc run and the sink jobs")
            click.echo(f"  watch it:      cdc top --config {config_path}")
            click.echo(f"  write rows:    psql '{dsn}'")
            click.echo(f"  a report:      cdc report --config {config_path} --html {base / 'report.html'}")
            click.echo(f"  the events:    cdc tail public.customers --follow --config {config_path}")
            click.echo(f"  stop it all:   Ctrl-C here (or kill -INT {os.getpid()}); the logs stay in {base}")
            try:
                while daemon.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        _step("stopping the sink jobs (SIGTERM: each finishes its running batch)")
        for name, process in sinks.items():
            _stop(process, 180)
            said = (base / f"sink-{name}.log").read_text(errors="replace").splitlines()
            click.echo("  " + next((line for line in reversed(said) if line.startswith(f"sink {name}: ")),
                                   f"sink {name}: exit {process.returncode}"))
    finally:
        for process, grace in reversed(processes):
            _stop(process, grace)
        for server in servers:
            server.close()
        broker.stop()
        pg.close()  # stops the server and removes a cluster that had to live outside `base`
    _step(f"done: logs in {base}")
