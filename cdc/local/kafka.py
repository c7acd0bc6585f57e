"""Apache Kafka, one combined KRaft broker/controller, from Maven Central's jars.

The broker of the tests, the demo and the benchmarks: a real Kafka, so that a kill -9
loses exactly what Kafka loses (nothing acknowledged with acks=all) and the log
cleaner really compacts. `CDC_TEST_BOOTSTRAP_SERVERS` points the tests elsewhere.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import subprocess
import uuid
from pathlib import Path

from cdc import jars
from cdc.local.process import (
    LOCALHOST,
    GroupProcess,
    ServerProcess,
    ServiceUnavailable,
    free_port,
    jit_options,
)


def log4j2_properties(writer: str, loggers: dict[str, str]) -> str:
    """A log4j2 config for a Kafka JVM (broker or Connect): its log on stdout at info, some
    loggers at other levels (Kafka logs nothing without one)."""
    lines = [
        f"# Written by {writer}: the JVM's log on stdout, at info.",
        "status = warn",
        "appender.out.type = Console",
        "appender.out.name = out",
        "appender.out.layout.type = PatternLayout",
        "appender.out.layout.pattern = [%d] %p %m (%c)%n",
        "rootLogger.level = info",
        "rootLogger.appenderRef.out.ref = out",
    ]
    for i, (name, level) in enumerate(loggers.items()):
        lines += [f"logger.l{i}.name = {name}", f"logger.l{i}.level = {level}"]
    return "\n".join(lines) + "\n"


_LOG4J2 = log4j2_properties("cdc.local.kafka", {"state.change.logger": "warn"})


def _cluster_id() -> str:
    """A Kafka Uuid as StorageTool's random-uuid prints it (no JVM start needed)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


_KEYSTORE_PASSWORD = "cdc-local-only"  # a throwaway certificate for a broker on 127.0.0.1


def _properties_text(value: str) -> str:
    """Java reads .properties files as ISO-8859-1: anything beyond ASCII goes as \\uXXXX."""
    return "".join(c if ord(c) < 128 else f"\\u{ord(c):04x}" for c in value)


class LocalKafka(ServerProcess):
    """A single-node KRaft Kafka on free 127.0.0.1 ports, data kept under `data_dir`.

    Layout: ``<data_dir>/logs`` (log.dirs), ``server.properties`` and
    ``log4j2.properties`` (rewritten on every start), ``broker.log``. `settings`
    add to or override the broker's properties (e.g. ``log.cleaner.backoff.ms``). Its JVMs
    run C1 only (`jit_options`) unless `full_jit`.
    Ready once it logged ``Kafka Server started`` and answers a metadata request.
    """

    NAME = "Kafka"
    STOP_GRACE_S = 20.0  # a clean stop takes about a second; after a kill Kafka recovers its logs on start
    STOP_DUMP = signal.SIGQUIT
    START_TIMEOUT_S = 180.0  # a cold JVM on a busy 2-core machine; a restart after kill -9 waits ~10 s more
    DEFAULT_SETTINGS: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "num.partitions": "3",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "3",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "group.initial.rebalance.delay.ms": "0",
        # a broker killed -9 and started again is refused as a duplicate until its old
        # incarnation's session ends: 9 s by default, which each restart of a test waits out
        "broker.session.timeout.ms": "4000",
        "broker.heartbeat.interval.ms": "1000",
        "log.cleaner.enable": "true",
        "auto.create.topics.enable": "false",  # a produce to a topic cdc did not create is a bug
    }

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        *,
        settings: dict[str, str] | None = None,
        heap: str = "768m",
        sasl_users: dict[str, str] | None = None,
        tls: bool = False,
        stop_at_exit: bool = True,
        full_jit: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self._auto_port = port is None
        self.port: int = port if port is not None else free_port()
        self.full_jit = full_jit
        self.controller_port: int = free_port()
        self.sasl_users = sasl_users or {}
        self.sasl_port: int | None = free_port() if self.sasl_users else None
        self.ssl_port: int | None = free_port() if tls else None
        self.settings = {**self.DEFAULT_SETTINGS, **(settings or {})}
        self.heap = heap
        self.stop_at_exit = stop_at_exit
        self.log_path = self.data_dir / "broker.log"

    @property
    def bootstrap_servers(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def sasl_bootstrap_servers(self) -> str:
        """The SASL_PLAINTEXT listener (mechanism PLAIN, the `sasl_users` accounts)."""
        if self.sasl_port is None:
            raise ValueError("this broker was started without sasl_users")
        return f"{LOCALHOST}:{self.sasl_port}"

    @property
    def ssl_bootstrap_servers(self) -> str:
        """The SSL listener; clients trust it with `ca_file`."""
        if self.ssl_port is None:
            raise ValueError("this broker was started without tls")
        return f"{LOCALHOST}:{self.ssl_port}"

    @property
    def ca_file(self) -> Path:
        """The SSL listener's self-signed certificate (PEM): what a client names as its CA."""
        return self.data_dir / "tls" / "broker.pem"

    def certificate(self) -> Path:
        """`ca_file`, made (with the keystore behind it) if this broker has none yet."""
        self._keystore()
        return self.ca_file

    def _write_config(self) -> Path:
        plain = f"PLAINTEXT://{LOCALHOST}:{self.port}"
        listeners, advertised = [plain, f"CONTROLLER://{LOCALHOST}:{self.controller_port}"], [plain]
        props = {
            **self.settings,
            "controller.quorum.voters": f"1@{LOCALHOST}:{self.controller_port}",
            "log.dirs": str(self.data_dir / "logs"),
        }
        protocols = props["listener.security.protocol.map"]
        if self.sasl_port is not None:  # a client listener that authenticates (SASL/PLAIN)
            sasl = f"SASL_PLAINTEXT://{LOCALHOST}:{self.sasl_port}"
            listeners.append(sasl)
            advertised.append(sasl)
            protocols += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
            users = " ".join(f'user_{name}="{password}"' for name, password in self.sasl_users.items())
            props["sasl.enabled.mechanisms"] = "PLAIN"
            props["listener.name.sasl_plaintext.plain.sasl.jaas.config"] = (
                f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"
            )
        if self.ssl_port is not None:  # a client listener speaking TLS
            ssl = f"SSL://{LOCALHOST}:{self.ssl_port}"
            listeners.append(ssl)
            advertised.append(ssl)
            protocols += ",SSL:SSL"
            props["listener.name.ssl.ssl.keystore.location"] = str(self._keystore())
            props["listener.name.ssl.ssl.keystore.password"] = _KEYSTORE_PASSWORD
            props["listener.name.ssl.ssl.keystore.type"] = "PKCS12"
        props["listeners"] = ",".join(listeners)
        props["advertised.listeners"] = ",".join(advertised)
        props["listener.security.protocol.map"] = protocols
        path = self.data_dir / "server.properties"
        path.write_text(
            "# Written by cdc.local.kafka on every start; edits are lost.\n"
            + "".join(f"{k}={_properties_text(v)}\n" for k, v in props.items())
        )
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2)
        return path

    def _keystore(self) -> Path:
        """A self-signed certificate for 127.0.0.1, made once with the JDK's keytool; its
        PEM (`ca_file`) is what clients trust."""
        store = self.data_dir / "tls" / "broker.p12"
        if store.exists():
            return store
        store.parent.mkdir(parents=True, exist_ok=True)
        keytool = str(jars.java_home() / "bin" / "keytool")
        common = ["-alias", "broker", "-keystore", str(store), "-storepass", _KEYSTORE_PASSWORD]
        for args in (
            ["-genkeypair", *common, "-storetype", "PKCS12", "-keyalg", "RSA", "-keysize", "2048",
             "-validity", "30", "-dname", f"CN={LOCALHOST}", "-ext", f"SAN=IP:{LOCALHOST}"],
            ["-exportcert", *common, "-rfc", "-file", str(self.ca_file)],
        ):
            done = subprocess.run([keytool, *args], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise ServiceUnavailable(f"keytool could not make the broker's certificate: {done.stderr.strip()}")
        return store

    def _java(self, main: str, *args: str, heap: str = "256m") -> list[str]:
        return [
            jars.java(),
            "-Xms128m",
            "-Xmx" + heap,
            "-XX:+UseG1GC",
            *jit_options(self.full_jit),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            str(jars.bundle_dir("kafka") / "*"),
            main,
            *args,
        ]

    def _format(self, config: Path) -> None:
        """Format the log dir once (KRaft needs a cluster id and meta.properties before start)."""
        if (self.data_dir / "logs" / "meta.properties").exists():
            return
        proc = GroupProcess(
            self._java("kafka.tools.StorageTool", "format", "-t", _cluster_id(), "-c", str(config)),
            self.log_path,
            cwd=self.data_dir,
        )
        if proc.popen.wait(timeout=180) != 0:
            raise ServiceUnavailable(f"Kafka's StorageTool format failed: {proc.tail()}")

    def _launch(self) -> GroupProcess:
        """Format on first use, then the broker."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        self._format(config)
        return GroupProcess(
            self._java("kafka.Kafka", str(config), heap=self.heap),
            self.log_path,
            cwd=self.data_dir,
            env={**os.environ, "JAVA_HOME": str(jars.java_home())},
        )

    def _ports(self) -> list[int]:
        return [p for p in (self.port, self.controller_port, self.sasl_port, self.ssl_port) if p is not None]

    def _new_ports(self) -> None:
        self.port, self.controller_port = free_port(), free_port()
        if self.sasl_port is not None:
            self.sasl_port = free_port()
        if self.ssl_port is not None:
            self.ssl_port = free_port()

    def _ready(self) -> bool:
        assert self._proc is not None
        return self._proc.logged(r"Kafka Server started") and self._answers_metadata()

    def _answers_metadata(self) -> bool:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        kafka_log = logging.getLogger("kafka")
        level = kafka_log.level
        kafka_log.setLevel(logging.CRITICAL)  # a refused probe is expected while starting
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers,
                client_id="cdc-local-kafka-probe",
                request_timeout_ms=5000,
            )
            try:
                admin.describe_cluster()
            finally:
                admin.close()
            return True
        except KafkaError:
            return False
        finally:
            kafka_log.setLevel(level)

    def __repr__(self) -> str:
        return f"LocalKafka({self.bootstrap_servers}, data_dir={str(self.data_dir)!r})"
