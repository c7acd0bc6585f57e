"""The `cdc` command. Every failure a user can cause ends in one `error: ...` line and exit 1."""

from __future__ import annotations

import itertools
import json
import logging
import sys
from collections.abc import Callable, Iterable
from functools import wraps
from pathlib import Path
from typing import Any

import click
import orjson

from cdc import __version__, accel
from cdc.config import Config, ConfigError, as_dict, load, secrets_of, settings_markdown
from cdc.redact import redact, setup_logging
from sinks.stores import STORES, Registration, Verb

CONFIG_HELP = "TOML config file; every key can be overridden by CDC_<SECTION>_<KEY> environment variables."


def _fail(message: str) -> None:
    click.echo(f"error: {redact(message)}", err=True)
    sys.exit(1)


def _on_the_cluster(config: Config, store: str, command: list[str], in_driver: bool) -> None:
    """With [spark] master = spark://...: submit `cdc <command>` to the cluster, where its
    driver runs it (`--in-driver`), and exit with its status; else return to run it here."""
    from sinks.runner import run_submitted

    if config.spark.master.startswith("spark://") and not in_driver:
        config_path = click.get_current_context().params.get("config_path")
        sys.exit(run_submitted(config, store, command, config_path))


def _with_config(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --config, loads it, and turns the project's one-line errors into exit 1."""

    # A plain string: load() reports a missing or unreadable file in the project's one-line form.
    @click.option("--config", "-c", "config_path", metavar="FILE", default=None, help=CONFIG_HELP)
    @wraps(func)
    def wrapper(config_path: str | None, **kwargs: Any) -> Any:
        from cdc.kafka.topics import TopicError
        from cdc.source.preflight import PreflightError

        try:
            config = load(config_path)
            component, log_format = _component(config, kwargs)
            setup_logging(config.daemon.log_level, secrets_of(config), log_format, component)
            return func(config, **kwargs)
        except (ConfigError, PreflightError, TopicError, TimeoutError) as exc:
            _fail(str(exc))
        except LookupError as exc:
            if type(exc) is not LookupError:  # a KeyError or IndexError is a bug: its traceback, redacted
                raise
            _fail(str(exc))

    return wrapper


def _component(config: Config, params: dict[str, Any]) -> tuple[str, str]:
    """Who logs (the JSON lines' `component`) and in which format: the sink jobs (and the
    rebuilds) take `[spark] log_format`, every other command `[daemon] log_format`."""
    ctx = click.get_current_context()
    name = ctx.command.name or "cdc"
    if name == "sink":
        return f"sink-{params.get('store')}", config.spark.log_format
    if ctx.parent is not None and ctx.parent.command.name in STORES and name == "rebuild":
        return f"{ctx.parent.command.name}-rebuild", config.spark.log_format
    return ("daemon" if name in ("run", "snapshot") else name), config.daemon.log_format


class _Group(click.Group):
    """Usage mistakes (unknown verb or option, missing argument) end like every other user
    error: one `error: ...` line pointing at --help and exit 1, not click's three-line form."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `cdc`: the help, as click shows it
                exc.show()
                sys.exit(exc.exit_code)
            where = exc.ctx.command_path if exc.ctx is not None else "cdc"
            _fail(f"{exc.format_message().rstrip('.')} (run {where} --help)")
        except click.ClickException as exc:
            _fail(exc.format_message())
        except click.Abort:
            _fail("aborted")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__, prog_name="cdc", message=f"%(prog)s %(version)s ({accel.describe()})"
)
def main() -> None:
    """Change data capture: PostgreSQL logical decoding into compacted Kafka topics.

    Every committed change of the captured tables becomes a Debezium-compatible event in
    the topic <prefix>.<schema>.<table>, keyed by the row's primary key."""


@main.command()
@_with_config
def run(config: Config) -> None:
    """Stream changes from the replication slot into the topics until SIGTERM/SIGINT.

    Creates the publication, the slot and the compacted topics when absent. The slot's
    LSN is confirmed only after the broker acknowledged every record up to it, so a
    restart resumes with nothing lost."""
    import psycopg

    from cdc.daemon import Daemon
    from cdc.source.preflight import start_failure
    from cdc.source.replication import ReplicationLost

    daemon = Daemon(config)
    try:
        daemon.prepare()
    except (psycopg.Error, ReplicationLost) as exc:  # what the checks cannot foresee: full slots, ...
        raise start_failure(config, exc) from None
    _run_to_the_end(daemon)


def _run_to_the_end(daemon: Any) -> None:
    """The daemon's loop; a fatal error is the one line it ends with, exit 1."""
    from cdc.daemon import FatalError

    try:
        daemon.run()
    except FatalError as exc:
        _fail(str(exc))


@main.command()
@click.option("--tables", "-t", "tables", multiple=True, metavar="TABLE",
              help="Snapshot only these captured tables (schema.table, SQL-quoted where needed); repeatable.")
@click.option("--incremental", is_flag=True, help="Require an existing slot: ask its daemon, never create a slot.")
@_with_config
def snapshot(config: Config, tables: tuple[str, ...], incremental: bool) -> None:
    """Snapshot the captured tables.

    With no slot yet: the one-shot snapshot aligned to a new slot, then exit, so a later
    `cdc run` continues exactly after it. With the slot in place: ask its daemon for an
    incremental snapshot (a logical message to a streaming daemon, which takes it while
    streaming; a request queued in the snapshot state for a stopped one, which takes it
    when it next starts)."""
    import psycopg

    from cdc.daemon import Daemon
    from cdc.source.preflight import start_failure
    from cdc.source.replication import ReplicationLost
    from snapshot.request import request_incremental

    requested = request_incremental(config, list(tables), incremental)
    if requested is not None:
        click.echo(requested)
        return
    if config.snapshot.mode == "never":
        config.snapshot.mode = "initial"  # asked for explicitly
    daemon = Daemon(config)
    try:
        daemon.prepare(only_tables=list(tables) or None, stop_when_done=True)
    except (psycopg.Error, ReplicationLost) as exc:
        raise start_failure(config, exc) from None
    _run_to_the_end(daemon)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--check", is_flag=True,
              help="Exit 1 when a sink is past half of the tombstone horizon (delete.retention.ms), 2 when past it.")
@_with_config
def status(config: Config, as_json: bool, check: bool) -> None:
    """Slot state (active, confirmed LSN, wal_status, WAL retained), lag, topic end offsets, and
    each sink's progress, with a warning well before it falls further behind than the topics
    keep tombstones (delete.retention.ms)."""
    from cdc.status import check_code, collect, render

    result = collect(config)
    click.echo(redact(json.dumps(result, indent=2) if as_json else render(result)))
    if check:
        sys.exit(check_code(result))


@main.command()
@click.option("--interval", "-n", type=click.FloatRange(0.2, 3600), default=1.0, show_default=True,
              help="Seconds between pictures.")
@click.option("--counts-every", type=click.FloatRange(1, 86400), default=5.0, show_default=True,
              help="Seconds between row counts of the source and the stores.")
@click.option("--no-counts", is_flag=True, help="Count no rows (a count(*) per table and a count per store).")
@click.option("--once", is_flag=True, help="Print one picture (after the first row counts) and exit.")
@_with_config
def top(config: Config, interval: float, counts_every: float, no_counts: bool, once: bool) -> None:
    """A live view of the whole pipeline until Ctrl-C: the daemon (events/s, slot lag in bytes
    and seconds), each sink job (records/s, the LSN its store is complete up to, its lag
    behind the slot, dead letters) and each table's rows in PostgreSQL and in every store.

    Reads what the daemon and the sink jobs publish (the daemon's /metrics when [daemon]
    metrics_port is set, the progress records in <prefix>.__cdc_sinks, the heartbeats) and
    counts rows: run it with the deployment's config file."""
    import time

    from rich.console import Console
    from rich.live import Live

    from cdc.top import Watch, render

    watch = Watch(config, None if no_counts else counts_every)
    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide enough for every column
        console = Console(width=140)
    try:
        if once:
            deadline = time.monotonic() + 60
            picture = watch.sample()
            while not no_counts and picture.counted_ms is None and time.monotonic() < deadline:
                time.sleep(0.5)
                picture = watch.sample()
            console.print(render(picture))
            return
        with Live(render(watch.sample()), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(watch.sample()), refresh=True)
    except KeyboardInterrupt:  # the way to stop it
        if not console.is_terminal:
            console.line()  # Live leaves the last line open there
    finally:
        watch.close()


@main.command()
@click.option("--html", "html_file", required=True, metavar="FILE", type=click.Path(dir_okay=False, writable=True),
              help="Write the report to this HTML file (self-contained: inline SVG, no scripts, no requests).")
@click.option("--hours", type=click.FloatRange(0.01, 24 * 365), default=24.0, show_default=True,
              help="How far back the plots reach.")
@click.option("--skip-topic-scan", is_flag=True,
              help="Do not read the table topics (their sizes after compaction stay blank).")
@_with_config
def report(config: Config, html_file: str, hours: float, skip_topic_scan: bool) -> None:
    """One HTML page of the pipeline over time: the slot's lag, each sink's lag and throughput,
    dead letters, and each topic's size now and after compaction.

    From what the deployment keeps in Kafka: the daemon's samples (<prefix>.__cdc_metrics,
    every [daemon] metrics_interval_s), its heartbeats and the sinks' progress records."""
    from cdc.report import collect, render_html

    history = collect(config, hours, scan_topics=not skip_topic_scan)
    Path(html_file).write_text(render_html(history), encoding="utf-8")
    click.echo(
        f"report: {html_file} ({len(history.samples)} daemon samples, "
        f"{sum(len(r) for r in history.progress.values())} sink progress records, {len(history.topics)} topics)"
    )


@main.group()
def slot() -> None:
    """The replication slot of [source] slot."""


@slot.command("drop")
@_with_config
def drop(config: Config) -> None:
    """Drop the slot: PostgreSQL stops keeping WAL for it. The topics keep every record.

    Refused while a daemon streams from it. A later `cdc run` on the same slot name needs a
    new snapshot: [snapshot] mode = "when_needed" takes it (and cuts off the rows deleted in
    between); the other modes refuse to start and say so."""
    from cdc.source.preflight import connect_catalog
    from cdc.source.slots import drop_slot

    catalog = connect_catalog(config)
    try:
        held = drop_slot(catalog, config)
    finally:
        catalog.close()
    name = config.source.slot
    if held is None:
        click.echo(f"slot {name} does not exist: nothing to drop")
        return
    click.echo(
        f"dropped slot {name} (it held back {held:,} bytes of WAL); the topics keep every record. "
        f'To capture again, run cdc run with [snapshot] mode = "when_needed" (a new snapshot); '
        f"to stop for good, also DROP PUBLICATION {config.source.publication}"
    )


@main.command()
@click.argument("table")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events.")
@click.option("--from-end", is_flag=True, help="Start at the end instead of offset 0 (with --follow).")
@click.option("--raw", is_flag=True, help="One compact JSON line per record instead of pretty JSON.")
@_with_config
def tail(config: Config, table: str, follow: bool, from_end: bool, raw: bool) -> None:
    """Print the events of TABLE's topic (TABLE as schema.table, quoted as SQL quotes it)."""
    from kafka.errors import KafkaError

    from cdc.kafka.reader import read_topic
    from cdc.kafka.topics import ClientErrors, TopicError, connect_failure
    from cdc.naming import parse_table_pattern, topic_name

    try:
        pattern = parse_table_pattern(table)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if pattern.table is None:
        raise ConfigError(f"tail needs one table, not {table}")
    try:
        topic = topic_name(config.topic.prefix, pattern.schema, pattern.table)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    seen = ClientErrors()
    try:
        with seen:
            records = read_topic(config.topic, topic, follow=follow, from_end=from_end)
            first = next(records, None)
        _print_records(itertools.chain([first] if first is not None else [], records), topic, raw)
    except KeyboardInterrupt:  # the way to stop --follow
        return
    except LookupError as exc:
        if type(exc) is not LookupError:  # a KeyError or IndexError is a bug, not a missing topic
            raise
        raise LookupError(
            f"topic {topic} does not exist: check the table name and [topic] prefix = {config.topic.prefix} "
            "(cdc run creates the topics of the tables in [source] tables)"
        ) from None
    except KafkaError as exc:
        failure = connect_failure(config.topic, type(exc).__name__, seen.texts)
        if not failure.startswith("cannot reach"):  # the broker answered: say what failed
            raise TopicError(failure) from None
        raise TopicError(
            f"cannot read topic {topic} from the Kafka broker at {config.topic.bootstrap_servers} "
            f"({type(exc).__name__}): start it or fix [topic] bootstrap_servers / CDC_TOPIC_BOOTSTRAP_SERVERS"
        ) from None


def _print_records(records: Iterable[Any], topic: str, raw: bool) -> None:
    for record in records:
        key = record.key.decode(errors="replace") if record.key is not None else None
        value = orjson.loads(record.value) if record.value is not None else None
        if raw:
            click.echo(json.dumps({"partition": record.partition, "offset": record.offset, "key": key, "value": value}))
        else:
            kind = "tombstone" if value is None else value.get("payload", value).get("op", "?")
            click.echo(f"--- {topic} [{record.partition}] @{record.offset}  key={key}  {kind}")
            if value is not None:
                click.echo(json.dumps(value, indent=2, ensure_ascii=False))


@main.group()
def topics() -> None:
    """The prefix's topics against cdc's topic policy, and the truncate clean-up."""


@topics.command("describe")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_with_config
def topics_describe(config: Config, as_json: bool) -> None:
    """Every topic's settings, cdc's value for each and what it means for consumers; problems
    (settings that lose data or stop the pipeline) with their fixes."""
    from cdc.kafka.topics import TopicAdmin
    from cdc.topic_commands import render, reports

    admin = TopicAdmin(config.topic)
    try:
        found = reports(config, admin)
    finally:
        admin.close()
    click.echo(json.dumps([r.as_json() for r in found], indent=2) if as_json else render(found))


@topics.command("ensure")
@_with_config
def topics_ensure(config: Config) -> None:
    """Repair what a settings change can repair, and give cdc's policy value to every setting a
    topic takes from the broker's defaults; what cannot be repaired is listed, exit 1."""
    from cdc.kafka.topics import TopicAdmin
    from cdc.topic_commands import ensure

    admin = TopicAdmin(config.topic)
    try:
        done, left, advice = ensure(config, admin)
    finally:
        admin.close()
    for line in done:
        click.echo(f"set {line}")
    for line in advice:
        click.echo(f"advice: {line}")
    click.echo(f"topics ensure: {len(done)} settings changed")
    if left:
        _fail(f"{len(left)} problems a settings change cannot repair: " + " | ".join(p.line() for p in left))


@topics.command("clean-truncated")
@click.option("--tables", "-t", "tables", multiple=True, metavar="TABLE",
              help="Only these captured tables (schema.table, SQL-quoted where needed); repeatable.")
@_with_config
def topics_clean_truncated(config: Config, tables: tuple[str, ...]) -> None:
    """Tombstones for the rows truncates removed, so the log cleaner drops them. The daemon
    streaming from the slot writes them (asked with a logical message), in order with the
    changes, so no tombstone lands after a newer record of its key; with no daemon running,
    this command writes them itself while holding the slot's lock."""
    from cdc.topic_commands import clean_truncated

    for line in clean_truncated(config, list(tables)):
        click.echo(line)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--tables", "-t", "tables", multiple=True, metavar="TABLE",
              help="Only these captured tables (schema.table, SQL-quoted where needed); repeatable.")
@click.option("--stores", metavar="STORES", default=None,
              help=f"Comma-separated stores to compare: {', '.join(STORES)} (default: every store whose sink has run).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Seconds to wait for the topics and each store to be complete up to the snapshot.")
@_with_config
def verify(config: Config, as_json: bool, tables: tuple[str, ...], stores: str | None, timeout_s: float) -> None:
    """Compare PostgreSQL, read in a snapshot whose LSN is known, with the topics read as tables
    and with each store once its sink has applied everything up to that LSN: per table and
    store the row counts, missing, extra and different rows, and the first differing keys.
    Compares hashes computed where the data is, narrowing down where they differ. Exit 1 on
    any mismatch, 0 when every side agrees."""
    from cdc.verify.run import verify as run_verify

    chosen = None if stores is None else [s.strip() for s in stores.split(",") if s.strip()]
    report = run_verify(config, list(tables), chosen, timeout_s)
    click.echo(json.dumps(report.as_json(), indent=2) if as_json else redact(report.render()))
    if not report.ok:
        sys.exit(1)


@main.command("config")
@click.option("--settings", "table", is_flag=True, help="Print the table of every setting (docs/configuration.md's) instead.")
@_with_config
def show_config(config: Config, table: bool) -> None:
    """Print the effective configuration (file + environment), secrets masked."""
    click.echo(settings_markdown() if table else redact(json.dumps(as_dict(config), indent=2, ensure_ascii=False)))


def _sink_help() -> str:
    from sinks.stores import STORES

    stores = ", ".join(f"`{r.name}` ({r.what})" for r in STORES.values())
    return f"""Run a Spark sink job that keeps STORE equal to the source tables: {stores}.

    With [spark] master = local[N] the job runs in this process; with spark://host:port
    it is submitted to that cluster. It streams until SIGTERM/SIGINT, which let the
    running micro-batch finish; offsets live in [spark] checkpoint_dir/<STORE>."""


@main.command(help=_sink_help())
@click.argument("store", metavar="STORE")
@click.option("--once", is_flag=True, help="Apply what the topics hold now, then exit 0 (Spark's available-now trigger).")
@click.option("--in-driver", is_flag=True, hidden=True)  # set by the spark-submit line the command builds
@click.option("--print-submit", is_flag=True,
              help="Print the spark-submit line for [spark] master (its code archive and launcher go to ./); run nothing.")
@_with_config
def sink(config: Config, store: str, once: bool, in_driver: bool, print_submit: bool) -> None:
    import shlex

    from cdc.source.replication import format_lsn
    from sinks.batch import TypeConflict
    from sinks.query import StopSignal
    from sinks.runner import run_here, submit
    from sinks.store import SinkStopped
    from sinks.stores import check

    command = ["sink", store, *(["--once"] if once else [])]
    if print_submit:
        check(store, config)
        config_path = click.get_current_context().params.get("config_path")
        click.echo(shlex.join(submit(config, command, config_path, ".")))
        return
    _on_the_cluster(config, store, command, in_driver)
    try:
        progress = run_here(config, store, once, StopSignal())
    except (SinkStopped, TypeConflict) as exc:
        _fail(str(exc))
    summary = (
        f"sink {store}: {progress.batches} batches, {len(progress.tables)} tables, complete up to LSN "
        f"{format_lsn(progress.complete_lsn)}, {progress.dead_letters} dead letters"
    )
    if config.spark.log_format == "json":  # one JSON object per line on the job's output, this one too
        logging.getLogger("cdc.cli").info("%s", summary)
    else:
        click.echo(summary)


def _rebuild_command(store: Registration) -> click.Command:
    """`cdc <store> rebuild`, the same verb for every registered store."""

    @click.command("rebuild", help=store.rebuilds)
    @click.option("--in-driver", is_flag=True, hidden=True)  # set by the spark-submit line the command builds
    @_with_config
    def rebuild(config: Config, in_driver: bool) -> None:
        from sinks.batch import TypeConflict
        from sinks.query import StopSignal
        from sinks.store import SinkStopped
        from sinks.stores import rebuild as rebuild_store

        _on_the_cluster(config, store.name, [store.name, "rebuild"], in_driver)
        try:
            lines = rebuild_store(store.name, config, StopSignal())
        except (SinkStopped, TypeConflict) as exc:
            _fail(str(exc))
        for line in lines:
            click.echo(line)

    return rebuild


def _verb_command(verb: Verb) -> click.Command:
    """One of a store's own verbs (`cdc delta optimize`), with --config and the one-line errors."""

    def run(config: Config, **options: Any) -> None:
        for line in verb.run(config, **options):
            click.echo(line)

    command = _with_config(run)
    command.__click_params__.extend(reversed(verb.options))  # type: ignore[attr-defined]
    return click.command(verb.name, help=verb.help)(command)


for _store in STORES.values():  # each store's group of verbs: its own (`cdc delta optimize`), its rebuild
    _group = main.group(_store.name, help=f"Maintain {_store.what}.")(lambda: None)
    for _verb in _store.more_verbs():
        _group.add_command(_verb_command(_verb))
    _group.add_command(_rebuild_command(_store))


@main.command()
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the throwaway PostgreSQL and broker keep their data (default: a new temp dir).")
@click.option("--keep", is_flag=True, help="Keep the services and the daemon running until Ctrl-C.")
def demo(workdir: Path | None, keep: bool) -> None:
    """Start a local PostgreSQL (logical WAL), Apache Kafka, OpenSearch and Redis, run the daemon, write rows,
    show the events, then the Delta, search and cache sinks."""
    setup_logging("WARNING", [])
    from cdc.local.demo import run_demo
    from cdc.local.process import ServiceUnavailable

    try:
        run_demo(workdir, keep)
    except ServiceUnavailable as exc:  # a local service could not start: its message names the fix
        _fail(str(exc))


if __name__ == "__main__":
    main()
