"""How Spark's driver JVM logs: in the format of the process that starts it.

A log4j2 config per format, written once (named by its content) where a printed
spark-submit line can still find it: Spark's own lines as text, or as JSON objects with
the keys cdc's JSON lines have (`cdc.redact.JsonFormatter`); at WARN, without the warning
every `localCheckpoint` release repeats. With JSON, what the JVM prints outside log4j (the
JDK's incubator-module warning, a Python worker's traceback) is wrapped into a JSON line
by `stderr_as_json`, so every line of a sink job's stderr is one JSON object.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shlex
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cdc.redact import JsonFormatter, json_component, redact_json_line

#: Spark's warning on every unpersist of a `localCheckpoint`ed RDD: the sinks checkpoint
#: locally on purpose and release the blocks themselves (sinks.pipeline.release)
CHECKPOINT_WARNING = "was locally checkpointed, its lineage has been truncated"

#: JVM lines outside log4j come out under this logger
STDERR_LOGGER = "spark.stderr"

# cdc's JSON line: ts (UTC, ms), level (Python's names), component, logger, message, error
_EVENT = {
    "ts": {"$resolver": "timestamp", "pattern": {"format": "yyyy-MM-dd'T'HH:mm:ss.SSS'Z'", "timeZone": "UTC"}},
    "level": {"$resolver": "pattern", "pattern": "%level{WARN=WARNING,FATAL=CRITICAL}", "stackTraceEnabled": False},
    "component": "${sys:cdc.log.component:-spark}",
    "logger": {"$resolver": "logger", "field": "name"},
    "message": {"$resolver": "message", "stringified": True},
    "error": {"$resolver": "exception", "field": "stackTrace", "stackTrace": {"stringified": True}},
}

_LAYOUTS = {
    "text": ["appender.console.layout.type = PatternLayout",
             "appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex"],  # Spark's own
    "json": ["appender.console.layout.type = JsonTemplateLayout",
             f"appender.console.layout.eventTemplate = {json.dumps(_EVENT, separators=(',', ':'))}"],
}


def properties(log_format: str) -> str:
    """The log4j2 config of a driver logging in `log_format` (`text` or `json`)."""
    lines = [
        "# Written by sinks.spark_log: Spark's driver log on stderr at warn (as spark.log.level).",
        "rootLogger.level = warn",
        "rootLogger.appenderRef.console.ref = console",
        "appender.console.type = Console",
        "appender.console.name = console",
        "appender.console.target = SYSTEM_ERR",
        *_LAYOUTS[log_format],
        "appender.console.filter.checkpointed.type = StringMatchFilter",
        f"appender.console.filter.checkpointed.text = {CHECKPOINT_WARNING}",
        "appender.console.filter.checkpointed.onMatch = DENY",
        "appender.console.filter.checkpointed.onMismatch = NEUTRAL",
    ]
    # what Spark's default config quiets below warn
    quiet = {"org.sparkproject.jetty.util.component.AbstractLifeCycle": "error",
             "org.apache.parquet.CorruptStatistics": "error", "parquet.CorruptStatistics": "error"}
    for i, (name, level) in enumerate(quiet.items()):
        lines += [f"logger.q{i}.name = {name}", f"logger.q{i}.level = {level}"]
    return "\n".join(lines) + "\n"


@functools.cache
def config_file(log_format: str) -> Path:
    """`properties(log_format)` in a file named by its content, under ~/.cache/cdc/log4j2 (it
    outlives this process: `cdc sink --print-submit` prints a line naming it), else in a
    temporary folder of this process's own."""
    text = properties(log_format)
    name = f"spark-{log_format}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.properties"
    try:
        return _written(Path.home() / ".cache" / "cdc" / "log4j2", name, text)
    except (OSError, RuntimeError):  # no home, or one this user cannot write
        return _written(Path(tempfile.mkdtemp(prefix="cdc-log4j2-")), name, text)


def _written(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{name}.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, path)  # a JVM starting beside this one reads all of it or none
    return path


def java_options(json_lines: bool) -> str:
    """The driver's Java options for its log: text, or JSON lines tagged with this process's
    component (`spark` when it logs text)."""
    options = [f"-Dlog4j2.configurationFile={config_file('json' if json_lines else 'text')}"]
    if json_lines:
        options.append(f"-Dcdc.log.component={json_component() or 'spark'}")
    return " ".join(shlex.quote(option) for option in options)


@contextmanager
def stderr_as_json(component: str) -> Iterator[None]:
    """While the body runs (it starts the driver JVM), this process's stderr is a pipe a thread
    copies to the real stderr, a line that is not a JSON object wrapped into one (logger
    `spark.stderr`, WARNING) and every JSON line redacted. The JVM keeps the pipe for its life."""
    sys.stderr.flush()
    read, write = os.pipe()
    real = os.dup(2)
    os.dup2(write, 2)
    os.close(write)
    threading.Thread(target=_relay, args=(read, real, JsonFormatter(component)), name="spark-stderr",
                     daemon=True).start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # the relay still writes to `real`, until the JVM closes the pipe


def _relay(read: int, real: int, formatter: JsonFormatter) -> None:
    with open(read, "rb") as lines, open(real, "wb") as out:
        for raw in lines:
            try:
                line = as_json_line(raw.decode(errors="replace").rstrip("\r\n"), formatter)
                if line:
                    out.write(line.encode() + b"\n")
                    out.flush()
            except Exception:  # keep draining: a full pipe would stop the JVM's logging
                continue


def as_json_line(text: str, formatter: JsonFormatter) -> str:
    """`text`, a line of the JVM's stderr, as one redacted JSON object ("" for a blank line)."""
    if not text.strip():
        return ""
    if text.lstrip().startswith("{"):
        line = redact_json_line(text)
        if line is not None:
            return line
    return formatter.format(logging.LogRecord(STDERR_LOGGER, logging.WARNING, "", 0, text, None, None))
