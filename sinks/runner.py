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

log = logging.getLogger(__name__)

STORES = ("delta", "search", "cache")
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cdc", "compaction", "sinks")  # what a sink job imports (never the capture side's C extension)
ONCE_ATTEMPTS = 3
REBUILDS = 3  # in a row, within one run: a store that keeps losing writes stops the job


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
    store = make_store(store_name, spark, config)
    delay, attempts, rebuilds = 1.0, 0, 0
    try:
        while True:
            attempts += 1
            try:
                return run(spark, config, store, checkpoint(config, store_name), once, stop)
            except (SinkStopped, TypeConflict):
                raise
            except StoreLost as exc:  # a replay from the earliest offsets rebuilds it
                rebuilds += 1
                if rebuilds > REBUILDS:
                    raise SinkStopped(f"the {store_name} sink rebuilt its store {REBUILDS} times and it lost writes "
                                      f"again: {exc}") from None
                log.warning("sink %s: %s; rebuilding it from the topics (earliest offsets)", store_name, exc)
                drop_checkpoint(spark, checkpoint(config, store_name))
                attempts = 0
            except Exception as exc:  # the store or Kafka failed a batch: read it again
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if stop() or (once and attempts >= ONCE_ATTEMPTS):
                    raise SinkStopped(f"the {store_name} sink failed {attempts} times, last: {first}") from None
                log.warning("sink %s: batch failed (%s); again from the checkpoint in %.0f s", store_name, first, delay)
                time.sleep(delay)
                delay = min(delay * 2, 60.0)
    finally:
        spark.stop()


def code_archive(folder: str) -> Path:
    """The project's Python packages as one zip for `--py-files`."""
    archive = Path(folder) / "cdc-sinks.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in PACKAGES:
            for path in sorted((ROOT / package).rglob("*.py")):
                zf.write(path, path.relative_to(ROOT).as_posix())
    return archive


_LAUNCHER = '''"""spark-submit's entry point: the `cdc` command, as the cluster job's driver."""
from cdc.cli import main

main()
'''


def submit(config: Config, store_name: str, config_path: str | None, once: bool, workdir: str) -> list[str]:
    """The spark-submit argv that runs this very command as the cluster's driver (client mode).

    The application file is a launcher written to `workdir`: spark-submit puts the file's
    folder first on sys.path, and cdc/ or sinks/ there would shadow kafka-python and delta."""
    launcher = Path(workdir) / "cdc_sink_driver.py"
    launcher.write_text(_LAUNCHER)
    args = ["sink", store_name, "--in-driver"]
    if config_path:
        args += ["--config", os.path.abspath(config_path)]
    if once:
        args.append("--once")
    argv = submit_command(launcher, args, app_name=f"cdc-sink-{store_name}", master=config.spark.master)
    at = argv.index("--master")
    return [*argv[:at], "--py-files", str(code_archive(workdir)), *argv[at:]]


def submit_environment() -> dict[str, str]:
    """The driver's environment: our JDK and pyspark, and the project importable."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ, **spark_environment(), "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
    }


def run_submitted(config: Config, store_name: str, config_path: str | None, once: bool) -> int:
    """spark-submit the job and wait for it; its exit status. SIGTERM/SIGINT go on to it."""
    import signal
    import subprocess

    check(config, store_name)
    with tempfile.TemporaryDirectory(prefix="cdc-submit-") as workdir:
        argv = submit(config, store_name, config_path, once, workdir)
        log.info("submitting to %s: %s", config.spark.master, " ".join(argv[:1] + argv[-6:]))
        child = subprocess.Popen(argv, env=submit_environment())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
        return child.wait()
