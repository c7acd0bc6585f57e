"""The SparkSession every sink job and test runs on, and the spark-submit command that matches it.

One place decides what Spark gets: the Kafka source and Delta as local jars (never
Ivy, see `cdc.jars`), Delta's SQL extension and catalog, a bigger driver
thread stack, quiet local defaults, and a driver that logs as the process starting it
(sinks.spark_log). This module imports nothing from the capture side (psycopg, the C
accelerator): executors run the driver's interpreter and must not need them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pyspark.sql import SparkSession

from cdc import jars
from cdc.machine import LOCALHOST
from cdc.redact import json_component
from sinks import spark_log

if TYPE_CHECKING:
    from cdc.config import SparkConfig

DEFAULT_MASTER = "local[2]"
DRIVER_JAVA_OPTIONS = "-Xss16m"


def session_conf(app_name: str, master: str = DEFAULT_MASTER) -> dict[str, str]:
    """Spark settings of a sink session; static ones, so they must be set before it starts."""
    return {
        "spark.master": master,
        "spark.app.name": app_name,
        "spark.jars": ",".join(str(jar) for jar in jars.spark_jars()),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        # query.stop() during a batch otherwise kills the query thread with a
        # StackOverflowError (Spark matches a regex over a huge interruption message);
        # the driver logs as this process does (text or JSON lines)
        "spark.driver.extraJavaOptions": driver_java_options(json_component() is not None),
        "spark.log.level": "WARN",  # also under spark-submit, whose default is INFO
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",  # timestamp (without time zone) columns keep their wall time
        # zoned timestamps as Parquet's INT64 µs, not Spark's INT96 (which other readers, delta-rs
        # among them, take as nanoseconds, wrong beyond years 1677-2262): the Delta sink's files
        # are read and rewritten by delta-rs too (sinks.stores.delta.rs)
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.sql.shuffle.partitions": "2",  # the default 200 costs seconds per micro-batch on 2 cores
        # Delta rebuilds a table's file list for every MERGE/UPDATE/DELETE in this many tasks (50
        # by default): on a few cores that is most of a small batch's time
        "spark.databricks.delta.snapshotPartitions": "2",
        # every write gains small files: the Delta sink compacts a table every so many commits
        # (sinks.stores.delta.COMPACT_EVERY) rather than with Delta's auto compaction, whose check after
        # each commit costs about a second on 2 cores; scans pack small files into few tasks
        "spark.sql.files.openCostInBytes": "131072",
        # a batch's Delta writes compile ~25 classes per table; with Spark's 100 cached ones,
        # a few tables evict each other every batch and compile again, and the JIT compiles the
        # new classes again
        "spark.sql.codegen.cache.maxEntries": "2000",
    }


JSON_LOG4J = "-Dlog4j2.configurationFile=org/apache/spark/log4j2-json-layout.properties"


def driver_java_options(json_lines: bool, extra: str = "") -> str:
    """cdc's driver JVM options (the thread stack, the log layout), then `extra`."""
    return f"{DRIVER_JAVA_OPTIONS} {spark_log.java_options(json_lines)} {extra}".strip()


def job_conf(spark: SparkConfig) -> dict[str, str]:
    """What a job's `[spark]` adds to `session_conf`: the driver JVM's options with
    `driver_java_options` after cdc's own, and with `log_format = "json"` a driver logging
    JSON lines with the Python side's keys (sinks.spark_log) and executors, whose log stays on
    their worker, in Spark's own JSON layout (`ts`, `level`, `msg`, `logger`), which every
    Spark has on its classpath."""
    json_lines = spark.log_format == "json"
    driver = driver_java_options(json_lines or json_component() is not None, spark.driver_java_options)
    conf = {"spark.driver.extraJavaOptions": driver}
    if json_lines:
        conf["spark.executor.extraJavaOptions"] = JSON_LOG4J
    return conf


def spark_environment() -> dict[str, str]:
    """Environment of a driver: our JDK and pyspark, executors on this very interpreter.

    SPARK_HOME is pyspark's folder because `jars.spark_jars` leaves out what its
    jars/ has; another Spark would miss those. SPARK_LOCAL_IP keeps a local driver
    on 127.0.0.1 unless the caller's environment names another address.
    """
    return {
        "JAVA_HOME": str(jars.java_home()),
        "SPARK_HOME": str(jars.spark_home()),
        "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", LOCALHOST),
        "PYSPARK_PYTHON": sys.executable,
    }


def build_session(
    app_name: str, master: str = DEFAULT_MASTER, conf: Mapping[str, str] | None = None
) -> SparkSession:
    """Start this process's SparkSession (`conf` adds or overrides settings).

    The driver JVM reads its settings once, at start: a process that already has a
    session gets that one back unchanged, so build it once per process. A process that
    logs JSON lines gets the JVM's other lines on stderr as JSON lines too.
    """
    os.environ.update(spark_environment())
    builder = SparkSession.builder
    for key, value in {**session_conf(app_name, master), **(conf or {})}.items():
        builder = builder.config(key, value)
    component = json_component()
    if component is None:
        return builder.getOrCreate()
    with spark_log.stderr_as_json(component):
        return builder.getOrCreate()


@contextmanager
def job_session(app_name: str, spark: SparkConfig, master: str | None = None,
                conf: Mapping[str, str] | None = None) -> Iterator[SparkSession]:
    """A command's session (`build_session` with the job's `[spark]` settings and `conf`),
    stopped after it, unless the process had one already: a session the caller made (a
    notebook, an embedding program, the tests' one JVM) stays the caller's."""
    callers = SparkSession.getActiveSession()
    session = build_session(app_name, master=master or spark.master, conf={**job_conf(spark), **(conf or {})})
    try:
        yield session
    finally:
        if callers is None:
            session.stop()


def submit_command(
    app: str | Path,
    app_args: Sequence[str] = (),
    *,
    app_name: str,
    master: str,
    conf: Mapping[str, str] | None = None,
) -> list[str]:
    """The spark-submit argv running `app` with the session settings of `build_session`.

    Run it with ``{**os.environ, **spark_environment()}``. Submitted jobs (client
    mode, e.g. to a ``spark://`` master) should take the session spark-submit made
    (``SparkSession.builder.getOrCreate()``) rather than set these again.
    """
    settings = {**session_conf(app_name, master), **(conf or {})}
    argv = [
        str(jars.spark_home() / "bin" / "spark-submit"),
        "--master",
        settings.pop("spark.master"),
        "--name",
        settings.pop("spark.app.name"),
    ]
    for key, value in settings.items():
        argv += ["--conf", f"{key}={value}"]
    return [*argv, str(app), *app_args]
