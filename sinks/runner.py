"""`cdc sink <store>`: run a job here (`local[N]`), or submit it to a standalone cluster.

Here: the driver is this process, with a retry loop around the query: a batch that failed
for a reason a retry may cure (the store or the broker unreachable, a lost race) is read
again from the checkpoint after a backoff; a store that lost writes is cleared and filled
again from the earliest offsets; anything else stops the job. On a cluster: the same
command runs as the spark-submit application, in client mode, with the jars and the
project's code (`--py-files`) for the executors.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from pyspark.sql import SparkSession

from cdc.config import Config, ConfigError
from cdc.kafka.topics import TopicError
from cdc.oneline import first_line
from cdc.redact import json_component
from sinks import checkpoint as checkpoints
from sinks import stores
from sinks.batch import TypeConflict
from sinks.metrics import SinkMetrics
from sinks.pipeline import Progress, SinkJob, UnknownVersion
from sinks.query import StopSignal, ensure_topics, run
from sinks.spark import job_conf, job_session, spark_environment, submit_command
from sinks.spark_log import stderr_as_json
from sinks.store import SinkStopped, Store, StoreLost, StoreUnavailable

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cdc", "compaction", "sinks")  # what a sink job imports (never the capture side's C extension)
ONCE_ATTEMPTS = 3
REBUILDS = 3  # in a row, within one run: a store that keeps losing writes stops the job
FIRST_DELAY_S, LAST_DELAY_S = 1.0, 60.0
#: what a retry may cure, however it reaches the driver (a Python exception of the batch
#: function, or the text of one an executor or the JVM raised): the broker unreachable or
#: slow, a block of a batch's stored rows gone (a known Spark pitfall); each store adds its
#: own (`Store.transient`: its client's errors)
TRANSIENT = (
    "sinks.store.StoreUnavailable", "org.apache.kafka.common.errors.", "kafka.errors.",
    "CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND", "sinks.kafka_source.TopicsUnreachable",
)
TRANSIENT_TYPES = (StoreUnavailable, UnknownVersion, TopicError, TimeoutError, ConnectionError)


def checkpoint(config: Config, store: str) -> str:
    return os.path.join(config.spark.checkpoint_dir, store)


def check(config: Config, store: str) -> None:
    """Everything a job needs that can be checked before Spark starts: settings, the store,
    the master."""
    stores.check(store, config)
    master = config.spark.master
    if master.startswith("spark://"):
        host, _, port = master.removeprefix("spark://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise ConfigError(
                f"cannot reach the Spark master {master} ({exc.strerror or exc}): start it, or fix [spark] master"
            ) from None


def run_here(config: Config, store_name: str, once: bool, stop: StopSignal) -> Progress:
    """Run the job in this process until drained (`once`) or stopped; permanent errors raise."""
    check(config, store_name)
    ensure_topics(config)
    metrics = SinkMetrics(store_name, config)
    metrics.serve()  # a port in use stops the start before Spark does
    try:
        with job_session(f"cdc-sink-{store_name}", config.spark) as spark:
            stop.install()
            return keep_all_running(spark, config, stores.build_all(store_name, spark, config), once, stop, metrics)
    finally:
        metrics.close()


def keep_all_running(
    spark: SparkSession, config: Config, jobs: list[Store], once: bool, stop: Callable[[], bool],
    metrics: SinkMetrics | None = None,
) -> Progress:
    """The store's job (the first) and the jobs that follow it, fed from what it writes (the
    warehouse's history, from its change log), each its own query with its own retries; the
    first job's progress. `once`: one after the other, each to the end of its feed. Streaming:
    side by side; one that stops (a stop asked for, or a failure a retry cannot cure) stops
    the others after their running batch, and its failure is raised. `metrics` are the first
    job's (the store's records, its complete-up-to LSN): the followers report none."""
    first, *followers = jobs
    if once:
        progress = keep_running(spark, config, first, True, stop, metrics)
        for store in followers:
            keep_running(spark, config, store, True, stop)
        return progress
    ended = threading.Event()
    failed: list[BaseException] = []

    def halted() -> bool:
        return stop() or ended.is_set()

    def follow(store: Store) -> None:
        try:
            keep_running(spark, config, store, False, halted)
        except BaseException as exc:  # noqa: BLE001 (raised in the caller's thread)
            failed.append(exc)
        finally:
            ended.set()

    threads = [threading.Thread(target=follow, args=(s,), name=f"cdc-sink-{s.name}", daemon=True) for s in followers]
    for thread in threads:
        thread.start()
    try:
        progress = keep_running(spark, config, first, False, halted, metrics)
    finally:
        ended.set()
        for thread in threads:
            thread.join()
    if failed:
        raise failed[0]
    return progress


def transient(exc: BaseException, store: Store) -> bool:
    """Whether a retry may cure what failed a batch (the store's own client errors included)."""
    if isinstance(exc, TRANSIENT_TYPES):
        return True
    names = [f"{kind.__module__}.{kind.__qualname__}" for kind in type(exc).__mro__]
    text = str(exc)
    return any(marker in text or any(name.startswith(marker) for name in names)
               for marker in (*TRANSIENT, *store.transient))


def keep_running(
    spark: SparkSession, config: Config, store: Store, once: bool, stop: Callable[[], bool],
    metrics: SinkMetrics | None = None,
) -> Progress:
    """The job's query, again from the checkpoint after a batch failed for a reason a retry
    may cure (with a backoff that starts over after a good batch); cleared and from the
    earliest offsets after the store lost writes; any other failure stops the job with its
    traceback in the log."""
    job = SinkJob(spark, config, store, stop, metrics)
    delay, attempts, rebuilds = FIRST_DELAY_S, 0, 0
    try:
        while True:
            attempts += 1
            batches = job.progress.batches
            try:
                return run(spark, config, job, checkpoint(config, store.name), once, stop)
            except (SinkStopped, TypeConflict):
                raise
            except StoreLost as exc:  # a replay from the earliest offsets into a cleared store rebuilds it
                if rebuilds >= REBUILDS:
                    raise SinkStopped(f"the {store.name} sink rebuilt its store {REBUILDS} times and it lost writes "
                                      f"again: {exc}") from None
                log.warning("sink %s: %s; rebuilding it from the topics (earliest offsets) into a cleared store",
                            store.name, exc, extra={"store": store.name})
                try:
                    # the progress record says "complete up to nothing" before the store loses its rows; both
                    # wait on a server (the broker, the store), so a failure of either is retried like a batch's
                    job.forget()
                    store.clear()
                except Exception as failed:
                    if not transient(failed, store):
                        raise
                    if stop() or (once and attempts >= ONCE_ATTEMPTS):
                        raise SinkStopped(f"the {store.name} sink lost writes and starting its rebuild failed "
                                          f"{attempts} times, last: {first_line(failed)}") from None
                    log.warning("sink %s: starting its rebuild failed (%s); again in %.0f s", store.name,
                                first_line(failed), delay, extra={"store": store.name})
                    _back_off(delay, stop)
                    delay = min(delay * 2, LAST_DELAY_S)
                    continue
                rebuilds += 1
                if metrics is not None:
                    metrics.retry("store_lost")
                checkpoints.drop(spark, checkpoint(config, store.name))
                attempts = 0
            except Exception as exc:
                first = first_line(exc)
                if not transient(exc, store):
                    log.error("sink %s: a batch failed for a reason a retry cannot cure", store.name, exc_info=exc)
                    raise SinkStopped(f"the {store.name} sink stopped: {first} (its log has the traceback)") from None
                if job.progress.batches > batches:  # it got going again: the next failure starts a new count
                    delay, attempts = FIRST_DELAY_S, 1
                if stop() or (once and attempts >= ONCE_ATTEMPTS):
                    raise SinkStopped(f"the {store.name} sink failed {attempts} times, last: {first}") from None
                log.warning("sink %s: batch failed (%s); again from the checkpoint in %.0f s", store.name, first, delay,
                            extra={"store": store.name})
                if metrics is not None:
                    metrics.retry("failed")
                _back_off(delay, stop)
                delay = min(delay * 2, LAST_DELAY_S)
    finally:
        job.close()


def _back_off(seconds: float, stop: Callable[[], bool]) -> None:
    """A retry's delay, cut short by a stop request: SIGTERM during a minute's back-off (a
    store or a Spark JVM that stays down) ends the job now, not after it."""
    deadline = time.monotonic() + seconds
    while not stop() and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.2))


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
    argv = submit_command(launcher, args, app_name=f"cdc-{name}", master=config.spark.master,
                          conf=job_conf(config.spark))
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
        env = {**submit_environment(), DRIVER_PID_ENV: str(pid_file)}
        component = json_component()
        if component is None:
            child = subprocess.Popen(argv, env=env)
        else:  # spark-submit's JVM prints lines of its own before any log4j config: JSON lines too
            with stderr_as_json(component):
                child = subprocess.Popen(argv, env=env)

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
