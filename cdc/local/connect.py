"""Kafka Connect standalone running Debezium's PostgreSQL connector: the oracle of our events.

The tests and the benchmark compare cdc with the real connector, not with what its
documentation says. Connect's runtime and JSON converter come from Maven Central in
the broker's Kafka version (`jars.BUNDLES["connect"]`), the connector as its plugin
tarball (`jars.DISTRIBUTIONS["debezium-postgres"]`); the worker keeps its offsets in
a file under `data_dir` and serves its REST API on a free 127.0.0.1 port, through
which readiness (every connector's task RUNNING) is checked and connectors are added.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cdc import jars
from cdc.local.kafka import log4j2_properties
from cdc.local.process import (
    LOCALHOST,
    GroupProcess,
    ServerProcess,
    ServiceUnavailable,
    free_port,
    wait_until,
)

_LOG4J2 = log4j2_properties("cdc.local.connect", {"org.apache.kafka": "warn", "org.apache.kafka.connect": "info"})

#: Settings every Debezium connector started here shares: the type table's modes (docs/events.md)
#: (decimal as string, adaptive time precision, hstore as JSON), truncates sent (cdc's
#: default), and topics created by Connect (the test broker refuses auto-creation).
DEBEZIUM_DEFAULTS: dict[str, str] = {
    "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
    "tasks.max": "1",
    "plugin.name": "pgoutput",
    "publication.autocreate.mode": "filtered",
    "decimal.handling.mode": "string",
    "time.precision.mode": "adaptive",
    "binary.handling.mode": "bytes",
    "interval.handling.mode": "numeric",
    "hstore.handling.mode": "json",
    "skipped.operations": "none",
    "tombstones.on.delete": "true",
    "snapshot.mode": "initial",
    "topic.creation.default.replication.factor": "1",
    "topic.creation.default.partitions": "1",
    "key.converter": "org.apache.kafka.connect.json.JsonConverter",
    "value.converter": "org.apache.kafka.connect.json.JsonConverter",
}


def debezium_connector(
    name: str, *, dsn_host: str, dsn_port: int, dbname: str, prefix: str, tables: list[str],
    schemas: bool, user: str = "postgres", extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """A Debezium PostgreSQL connector's properties: its own slot, publication and topic
    prefix, JsonConverter with schemas on or off (keys and values alike)."""
    flag = "true" if schemas else "false"
    return {
        "name": name,
        **DEBEZIUM_DEFAULTS,
        "database.hostname": dsn_host,
        "database.port": str(dsn_port),
        "database.user": user,
        "database.dbname": dbname,
        "topic.prefix": prefix,
        "slot.name": f"dbz_{name}".lower().replace("-", "_"),
        "publication.name": f"dbz_{name}".lower().replace("-", "_"),
        "table.include.list": ",".join(tables),
        "key.converter.schemas.enable": flag,
        "value.converter.schemas.enable": flag,
        **(extra or {}),
    }


def _properties(values: dict[str, str]) -> str:
    """A .properties file (ISO-8859-1: anything beyond ASCII as \\uXXXX; separators escaped)."""
    def esc(text: str) -> str:
        text = text.replace("\\", "\\\\").replace("\n", "\\n").replace(":", "\\:").replace("=", "\\=")
        return "".join(c if ord(c) < 128 else f"\\u{ord(c):04x}" for c in text)

    return "".join(f"{esc(k)}={esc(v)}\n" for k, v in values.items())


class LocalKafkaConnect(ServerProcess):
    """Kafka Connect standalone (`ConnectStandalone`) with Debezium's PostgreSQL plugin.

    `connectors` (name -> properties) are written as properties files and started with
    the worker; ready once every one of them reports its task RUNNING. `worker` settings
    add to or override the worker's (e.g. producer overrides for the benchmark).
    """

    NAME = "Kafka Connect"
    START_TIMEOUT_S = 180.0
    STOP_GRACE_S = 30.0
    STOP_DUMP = signal.SIGQUIT
    PORT_LOST = re.compile(r"Address already in use|Failed to bind")

    def __init__(
        self,
        data_dir: str | Path,
        bootstrap_servers: str,
        connectors: dict[str, dict[str, str]] | None = None,
        *,
        worker: dict[str, str] | None = None,
        heap: str = "512m",
        stop_at_exit: bool = True,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.bootstrap_servers = bootstrap_servers
        self.connectors = dict(connectors or {})
        self.worker = dict(worker or {})
        self.heap = heap
        self.stop_at_exit = stop_at_exit
        self._auto_port = True
        self.port = free_port()
        self.log_path = self.data_dir / "connect.log"

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def _launch(self) -> GroupProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        plugin = jars.distribution_home("debezium-postgres")
        props = {
            "bootstrap.servers": self.bootstrap_servers,
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "offset.storage.file.filename": str(self.data_dir / "offsets"),
            "offset.flush.interval.ms": "1000",
            "plugin.path": str(plugin.parent),
            "listeners": f"http://{LOCALHOST}:{self.port}",
            "plugin.discovery": "only_scan",  # the plugin has no service-loader manifests for hybrid_warn to check
            **self.worker,
        }
        worker = self.data_dir / "worker.properties"
        worker.write_text("# Written by cdc.local.connect on every start.\n" + _properties(props))
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2)
        files = []
        for name, config in self.connectors.items():
            path = self.data_dir / f"connector-{name}.properties"
            path.write_text(_properties({**config, "name": name}))
            files.append(str(path))
        argv = [
            jars.java(), "-Xms128m", f"-Xmx{self.heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp", str(jars.bundle_dir("connect") / "*"),
            "org.apache.kafka.connect.cli.ConnectStandalone", str(worker), *files,
        ]
        return GroupProcess(
            argv, self.log_path, cwd=self.data_dir, env={**os.environ, "JAVA_HOME": str(jars.java_home())}
        )

    def _ready(self) -> bool:
        return all(self.task_running(name) for name in self.connectors) and self._rest("GET", "/") is not None

    # -- REST -----------------------------------------------------------------------------
    def _rest(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                text = response.read()
        except (urllib.error.URLError, OSError):
            return None
        return json.loads(text) if text else {}

    def status(self, name: str) -> dict[str, Any] | None:
        return self._rest("GET", f"/connectors/{name}/status")

    def task_running(self, name: str) -> bool:
        """Whether the connector's task runs; a FAILED task ends the wait with its trace."""
        status = self.status(name)
        tasks = (status or {}).get("tasks") or []
        for task in tasks:
            if task.get("state") == "FAILED":
                trace = str(task.get("trace", "")).splitlines()[:3]
                raise ServiceUnavailable(f"Debezium connector {name} failed: {' | '.join(trace)}")
        return bool(tasks) and all(t.get("state") == "RUNNING" for t in tasks)

    def add_connector(self, name: str, config: dict[str, str], timeout_s: float = 120.0) -> None:
        """Create (or reconfigure) a connector on the running worker; returns once its task runs."""
        if self._proc is None:
            raise ServiceUnavailable("Kafka Connect is not running")
        if self._rest("PUT", f"/connectors/{name}/config", {**config, "name": name}) is None:
            raise ServiceUnavailable(f"Kafka Connect refused connector {name}: {self._proc.tail()}")
        self.connectors[name] = config
        wait_until(lambda: self.task_running(name), self._proc, timeout_s, f"connector {name}")

    def delete_connector(self, name: str) -> None:
        self._rest("DELETE", f"/connectors/{name}")
        self.connectors.pop(name, None)

    def __repr__(self) -> str:
        return f"LocalKafkaConnect({self.url}, data_dir={str(self.data_dir)!r})"
