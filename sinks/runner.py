"""`cdc sink <store>`: run a job here (`local[N]`), or submit it to a standalone cluster.

Here: the driver is this process, with a retry loop around the query (a failed batch,
e.g. a store that is down, is read again from the checkpoint after a backoff). On a
cluster: the same command runs as the spark-submit application, in client mode, with
the jars and the project's code (`--py-files`) for the executors.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from pyspark.sql import SparkSession

from cdc.config import Config, ConfigError
from sinks.job import (
    Progress,
    SinkStopped,
    StopSignal,
    Store,
    StoreLost,
    TypeConflict,
    drop_checkpoint,
    ensure_topics,
    run,
)
from sinks.spark import build_session, spark_environment, submit_command
from sinks.topics import ProgressLog

log = logging.getLogger(__name__)

STORES = ("delta", "search", "cache")
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cdc", "compaction", "sinks")  # what a sink job imports (never the capture side's C extension)
ONCE_ATTEMPTS = 3
REBUILDS = 3  # in a row, within one run: a store that keeps losing writes stops the job
REBUILD_PASSES = 6  # a search rebuild's passes before its swap, at most
CAUGHT_UP_S = 10.0  # a pass this short: the new indexes are close enough behind to swap


def checkpoint(config: Config, store: str) -> str:
    return os.path.join(config.spark.checkpoint_dir, store)


def check_store(config: Config, store: str) -> None:
    """The settings a store needs, before any Spark starts."""
    if store not in STORES:
        raise ConfigError(f"unknown sink {store!r}: use one of {', '.join(STORES)}")
    if store == "delta" and not config.delta.path:
        raise ConfigError("[delta] path is not set: set it (or CDC_DELTA_PATH) to the warehouse folder or URI")


def check(config: Config, store: str) -> None:
    """Everything a job needs that can be checked before Spark starts: settings, the store,
    the master."""
    check_store(config, store)
    if store == "cache":
        from sinks.cache import check_reachable

        check_reachable(config.cache)
    if store == "search":
        from sinks.search import check_reachable as check_search
        from sinks.search_shapes import alias_name

        try:
            alias_name(config.topic.prefix)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_search(config.search)
    master = config.spark.master
    if master.startswith("spark://"):
        host, _, port = master.removeprefix("spark://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise ConfigError(
                f"cannot reach the Spark master {master} ({exc.strerror or exc}): start it, or fix [spark] master"
            ) from None


def make_store(name: str, spark: SparkSession, config: Config) -> Store:
    if name == "cache":
        from sinks.cache import CacheStore

        return CacheStore(config.cache, config.topic.prefix)
    if name == "search":
        from sinks.search import SearchStore

        return SearchStore(spark, config.search, config.topic.prefix)
    from sinks.delta import DeltaStore

    return DeltaStore(spark, config.delta.path)


def run_here(config: Config, store_name: str, once: bool, stop: StopSignal) -> Progress:
    """Run the job in this process until drained (`once`) or stopped; permanent errors raise."""
    check(config, store_name)
    ensure_topics(config)
    spark = build_session(f"cdc-sink-{store_name}", master=config.spark.master)
    stop.install()
    try:
        return _keep_running(spark, config, make_store(store_name, spark, config), once, stop)
    finally:
        spark.stop()


def rebuild_search_here(config: Config, stop: StopSignal) -> list[tuple[str, list[str], str, int]]:
    """`cdc search rebuild`: every table's index again from the topics, beside the current
    one, then the aliases swapped; (alias, old indexes, new index, documents) per table.

    Readers and a running search job keep the current indexes until the swap. Passes to
    the topics' end follow each other until one is short, so that the new indexes are
    seconds behind the current ones when the aliases move. The job's writes to the old
    indexes that the rebuild had not read yet are in the topics before the swap, so one
    more pass after it brings them over (position-guarded like every write)."""
    from sinks.search import SearchStore

    check(config, "search")
    ensure_topics(config)
    spark = build_session("cdc-search-rebuild", master=config.spark.master)
    stop.install()
    store = SearchStore(spark, config.search, config.topic.prefix, rebuild=True)
    try:
        for _ in range(REBUILD_PASSES):  # again until a pass finds little: what came while the last one ran
            started = time.monotonic()
            _keep_running(spark, config, store, True, stop)
            if stop() or time.monotonic() - started < CAUGHT_UP_S:
                break
        if stop():
            raise SinkStopped("the rebuild stopped before its swap; the current indexes are untouched: run "
                              "`cdc search rebuild` again to go on from where it stopped")
        moved = store.swap()
        _keep_running(spark, config, store, True, lambda: False)  # after the swap it finishes
        moved += store.swap()  # tables first seen in that pass
        store.finish()
        drop_checkpoint(spark, checkpoint(config, store.name))
        ProgressLog(config.topic, store.name).forget()
        counts = store.documents([alias for alias, _, _ in moved])
        return [(alias, old, new, counts[alias]) for alias, old, new in moved]
    finally:
        spark.stop()


def _keep_running(
    spark: SparkSession, config: Config, store: Store, once: bool, stop: Callable[[], bool]
) -> Progress:
    """The job's query, again from the checkpoint after a failed batch (with a backoff),
    from the earliest offsets after a store lost writes."""
    delay, attempts, rebuilds = 1.0, 0, 0
    while True:
        attempts += 1
        try:
            return run(spark, config, store, checkpoint(config, store.name), once, stop)
        except (SinkStopped, TypeConflict):
            raise
        except StoreLost as exc:  # a replay from the earliest offsets rebuilds it
            rebuilds += 1
            if rebuilds > REBUILDS:
                raise SinkStopped(f"the {store.name} sink rebuilt its store {REBUILDS} times and it lost writes "
                                  f"again: {exc}") from None
            log.warning("sink %s: %s; rebuilding it from the topics (earliest offsets)", store.name, exc)
            drop_checkpoint(spark, checkpoint(config, store.name))
            attempts = 0
        except Exception as exc:  # the store or Kafka failed a batch: read it again
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if stop() or (once and attempts >= ONCE_ATTEMPTS):
                raise SinkStopped(f"the {store.name} sink failed {attempts} times, last: {first}") from None
            log.warning("sink %s: batch failed (%s); again from the checkpoint in %.0f s", store.name, first, delay)
            time.sleep(delay)
            delay = min(delay * 2, 60.0)


def code_archive(folder: str) -> Path:
    """The project's Python packages as one zip for `--py-files`."""
    archive = Path(folder) / "cdc-sinks.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in PACKAGES:
            for path in sorted((ROOT / package).rglob("*.py")):
                zf.write(path, path.relative_to(ROOT).as_posix())
    return archive


DRIVER_PID_ENV = "CDC_SUBMITTED_DRIVER_PID_FILE"

_LAUNCHER = f'''"""spark-submit's entry point: the `cdc` command, as the cluster job's driver."""
import os

if os.environ.get("{DRIVER_PID_ENV}"):  # where run_submitted sends SIGTERM/SIGINT
    with open(os.environ["{DRIVER_PID_ENV}"], "w") as pid_file:
        pid_file.write(str(os.getpid()))

from cdc.cli import main

main()
'''


def submit(config: Config, command: list[str], config_path: str | None, workdir: str) -> list[str]:
    """The spark-submit argv that runs the `cdc` `command` (`sink search --once`, `search
    rebuild`) as the cluster's driver (client mode).

    The application file is a launcher written to `workdir`: spark-submit puts the file's
    folder first on sys.path, and cdc/ or sinks/ there would shadow kafka-python and delta."""
    launcher = Path(workdir) / "cdc_sink_driver.py"
    launcher.write_text(_LAUNCHER)
    args = [*command, "--in-driver"]
    if config_path:
        args += ["--config", os.path.abspath(config_path)]
    name = "-".join(word for word in command[:2] if not word.startswith("-"))
    argv = submit_command(launcher, args, app_name=f"cdc-{name}", master=config.spark.master)
    at = argv.index("--master")
    return [*argv[:at], "--py-files", str(code_archive(workdir)), *argv[at:]]


def submit_environment() -> dict[str, str]:
    """The driver's environment: our JDK and pyspark, and the project importable."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ, **spark_environment(), "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
    }


def run_submitted(config: Config, store_name: str, command: list[str], config_path: str | None) -> int:
    """spark-submit the `cdc` `command` of a job writing to `store_name` and wait for it; its
    exit status. SIGTERM/SIGINT go on to it."""
    import signal
    import subprocess

    check(config, store_name)
    with tempfile.TemporaryDirectory(prefix="cdc-submit-") as workdir:
        argv = submit(config, command, config_path, workdir)
        log.info("submitting to %s: %s", config.spark.master, " ".join(argv[:1] + argv[-6:]))
        pid_file = Path(workdir) / "driver.pid"
        child = subprocess.Popen(argv, env={**submit_environment(), DRIVER_PID_ENV: str(pid_file)})

        def forward(signum: int, _frame: object) -> None:
            """To the Python driver, which lets its running batch finish and exits; spark-submit's
            JVM would die at once (status 143), the batch with it. Before the driver runs: the JVM."""
            try:
                os.kill(int(pid_file.read_text()), signum)
            except (OSError, ValueError):
                child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        return child.wait()
