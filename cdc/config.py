"""Configuration: a TOML file, every key overridable by an environment variable.

`CDC_<SECTION>_<KEY>` overrides `[section] key` (e.g. `CDC_SOURCE_DSN` for `[source] dsn`),
so a container can be configured without a file. Unknown keys are errors, not silently
ignored: a typo in a config must not quietly fall back to a default.

The section dataclasses below are the settings table: every field is declared with `opt()`,
which carries its help, its allowed values or range and whether it holds a secret. The
loader, `cdc config`, the redaction of secrets and the docs' configuration table (docs/configuration.md) all
read that table (`SETTINGS`), so a setting cannot be added without its validation: a field
declared without `opt()` fails at import.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from cdc.naming import TablePattern, parse_table_pattern, split_list, validate_prefix


class ConfigError(ValueError):
    """A configuration mistake; the message is one line naming the fix."""


INT32_MAX = 2**31 - 1
"""Kafka and PostgreSQL read these settings as 32-bit integers: a larger one must fail here."""

Check = Callable[[str, Any], None]
"""An extra check of one value: `(where, value)`, raises ConfigError naming `where`."""

SecretParts = Callable[[str], list[str]]
"""The secrets a setting's value holds (a DSN's password), for settings that are not secret whole."""


def opt(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] = (),
    low: float | None = None,
    high: float | None = None,
    secret: bool | SecretParts = False,
    optional: bool = False,
    upper: bool = False,
    check: Check | None = None,
    invalid: str | None = None,
    sample: Any = None,
) -> Any:
    """One setting of the table. `optional`: an empty string means "not set". `upper`: the
    value is case-insensitive and kept upper case. `invalid`: the message for a value not in
    `choices` (`{where}`, `{value}`, `{choices}`). `sample`: the value an error shows as an
    example where the default is none (an empty list). Ints default to at most INT32_MAX."""
    meta = {
        "help": help, "choices": tuple(choices), "low": low, "high": high, "secret": secret,
        "optional": optional, "upper": upper, "check": check, "invalid": invalid, "sample": sample,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------ per-value checks


def dsn_secret_parts(value: str) -> list[str]:
    from cdc.redact import dsn_secrets

    return dsn_secrets(value)


def _not_blank(where: str, value: str, fix: str) -> None:
    if not value.strip():
        raise ConfigError(f"{where} is empty: {fix}")


def check_dsn(where: str, value: str) -> None:
    _not_blank(where, value, "set it to a libpq DSN or URI, e.g. host=db.internal user=cdc dbname=shop")


def _check_tables(where: str, value: list[str]) -> None:
    if not value:
        raise ConfigError("[source] tables is empty: list the tables to capture, e.g. tables = [\"public.*\"]")
    for pattern in value:
        try:
            parse_table_pattern(pattern)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def table_partitions(where: str, value: list[str]) -> list[tuple[TablePattern, int]]:
    """`[topic] table_partitions`: each `schema.table=count` entry as (pattern, count)."""
    parsed = []
    for entry in value:
        text, equals, count = entry.rpartition("=")
        if not equals or not count.strip().isdigit() or not 1 <= int(count) <= INT32_MAX:
            raise ConfigError(
                f"{where} has {entry!r}, which is not schema.table=count with a count of at least 1: "
                'write each entry as "schema.table=count" or "schema.*=count", e.g. ["public.orders=6"]'
            )
        try:
            parsed.append((parse_table_pattern(text), int(count)))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return parsed


def _check_table_partitions(where: str, value: list[str]) -> None:
    table_partitions(where, value)


def _check_pg_name(where: str, value: str) -> None:
    if not value or not all(c.isalnum() and c.isascii() or c == "_" for c in value) or value != value.lower():
        raise ConfigError(
            f"{where} {value!r} must be lower-case letters, digits and underscores (PostgreSQL's rule for slot names)"
        )


def _check_servers(where: str, value: str) -> None:
    _not_blank(where, value, "set it to host:port of the broker, e.g. 127.0.0.1:9092")
    for server in value.split(","):
        host, colon, port = server.strip().rpartition(":")
        if not colon or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"{where} has {server.strip()!r}, which is not host:port with a port from 1 to 65535: "
                "write it as host:port[,host:port...], e.g. kafka1:9092,kafka2:9092"
            )


def _check_prefix(where: str, value: str) -> None:
    try:
        validate_prefix(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_file(where: str, value: str) -> None:
    if value and not Path(value).is_file():
        what = "is not a file" if Path(value).exists() else "does not exist"
        raise ConfigError(f"{where} = {value} {what}: point it at the PEM file, or leave it empty")
    if value and not os.access(value, os.R_OK):
        raise ConfigError(f"{where} = {value} is not readable by this user: fix its permissions")


def _check_spill_dir(where: str, value: str) -> None:
    _not_blank(where, value, "set it to a directory for streamed transactions, e.g. .cdc-spill")
    path = Path(value)
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"{where} = {value} is not a directory: point it at a directory cdc may write to")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} = {value}: {existing} is not writable by this user: fix its permissions or move it")


def _check_skipped(where: str, value: str) -> None:
    ops = {op.strip() for op in value.split(",")}
    if ops & {"c", "u", "d"}:
        raise ConfigError(
            f"{where} = {value!r}: cdc skips only truncates (\"t\"); skipping c, u or d would leave stale rows in the "
            "compacted topics for good: use \"t\" or \"none\""
        )


def _check_master(where: str, value: str) -> None:
    if not re.fullmatch(r"local(\[(\d+|\*)\])?|spark://[^\s/]+:\d+", value):
        raise ConfigError(
            f"{where} {value!r} is not a Spark master: use local[N] (this process) or spark://host:port (a cluster)"
        )


def url_secrets(value: str) -> list[str]:
    """The password of a `redis://user:password@host` URL, as written and decoded."""
    from urllib.parse import unquote, urlsplit

    try:
        password = urlsplit(value).password
    except ValueError:
        return []
    return [password, unquote(password)] if password else []


def url_check(what: str, schemes: tuple[str, ...], example: str, path_alone: bool) -> Callable[[str, str], None]:
    """A check that a setting is a URL of one of `schemes`, with a host (or, `path_alone`, a path)."""

    def check(where: str, value: str) -> None:
        from urllib.parse import urlsplit

        try:
            url = urlsplit(value)
            url.port  # noqa: B018 (a port that is not a number raises here)
        except ValueError as exc:
            raise ConfigError(f"{where} is not {what} ({exc}): use {example}") from None
        if url.scheme not in schemes or not (url.hostname or (path_alone and url.path)):
            raise ConfigError(f"{where} is not {what}: use {example}")

    return check


def _check_host(where: str, value: str) -> None:
    _not_blank(where, value, "set it to the address to bind, e.g. 127.0.0.1")


# ------------------------------------------------------------------ the settings table


@dataclass
class SourceConfig:
    """`[source]`: the PostgreSQL database to capture."""

    dsn: str = opt(
        "host=127.0.0.1 port=5432 user=postgres dbname=postgres",
        "libpq DSN or URI. Its password never reaches any output line.",
        secret=dsn_secret_parts, check=check_dsn,
    )
    slot: str = opt("cdc", "logical replication slot (pgoutput), created if absent", check=_check_pg_name)
    publication: str = opt(
        "cdc", "publication, created if absent (`publish_via_partition_root = true`); missing tables are added",
        check=_check_pg_name,
    )
    tables: list[str] = opt(
        ["public.*"],
        "`schema.table` or `schema.*`; identifiers as SQL writes them (unquoted folds to lower case, `\"\"` "
        "escapes a quote)",
        check=_check_tables,
    )
    protocol_version: int = opt(1, "pgoutput protocol, 1 or 2", choices=(1, 2))
    streaming: bool = opt(
        False,
        "with protocol 2: large in-progress transactions arrive in chunks and are spilled to `[daemon] spill_dir` "
        "until their commit",
    )
    set_replica_identity_full: bool = opt(
        False,
        "run `ALTER TABLE ... REPLICA IDENTITY FULL` on captured tables with TOASTable columns (see TOAST below)",
    )
    status_interval_s: float = opt(
        10.0,
        "longest gap between standby status updates (they are sent at least every second while streaming)",
        low=0.1, high=3600,
    )
    slot_wait_s: float = opt(
        10.0, "how long to wait for a slot still held by a dying previous walsender before \"slot in use\"",
        low=0, high=86400,
    )


@dataclass
class TopicConfig:
    """`[topic]`: the Kafka-protocol cluster and the compacted topics."""

    bootstrap_servers: str = opt(
        "127.0.0.1:9092", "Kafka bootstrap servers, `host:port`, comma-separated", check=_check_servers
    )
    prefix: str = opt("cdc", "topics are `<prefix>.<schema>.<table>`; also `source.name`", check=_check_prefix)
    partitions: int = opt(
        1,
        "partition count of the table topics cdc creates (existing topics keep theirs); one suits most tables, "
        "as Debezium's default does (see Choosing partitions)",
        low=1,
    )
    table_partitions: list[str] = opt(
        [],
        "`schema.table=count` (or `schema.*=count`) for busy tables: their new topics get `count` partitions "
        "(the first entry that matches wins)",
        check=_check_table_partitions, sample=["public.orders=6"],
    )
    replication_factor: int = opt(1, "replication factor of created topics", low=1, high=32767)
    min_insync_replicas: int = opt(
        1, "`min.insync.replicas` of created topics (cdc always produces with `acks=all`)", low=1, high=32767
    )
    max_message_bytes: int = opt(
        1048588, "`max.message.bytes` of created topics; the largest record cdc will send", low=1
    )
    allow_non_compacted: bool = opt(False, "accept an existing topic whose `cleanup.policy` is not `compact`")
    truncate_cleanup: bool = opt(
        True,
        "after a truncate, the daemon writes a tombstone for each key it removed, so the log cleaner "
        "drops those rows (Debezium does not; see Compaction)",
    )
    client: str = opt(
        "kafka-python",
        "`kafka-python` or `confluent` (confluent-kafka, `pip install -e '.[confluent]'`, several times faster)",
        choices=("kafka-python", "confluent"),
    )
    linger_ms: int = opt(
        5,
        "producer linger: how long a record may wait for its batch to fill (a longer one raised p99 "
        "commit-to-topic latency without raising throughput)",
        low=0,
    )
    batch_size: int = opt(1048576, "producer batch size in bytes", low=1)
    delivery_timeout_ms: int = opt(
        120000, "after this a send fails, and cdc rewinds (see Operations); more than `linger_ms` + 1", low=1
    )
    connect_timeout_s: float = opt(
        30.0, "how long a client (kafka-python) tries to reach the brokers before it gives up with a one-line "
        "error (`cdc run` checks them with at most 15 s)", low=0.1, high=3600,
    )
    security_protocol: str = opt(
        "PLAINTEXT", "how cdc talks to the brokers", choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
        upper=True,
    )
    sasl_mechanism: str = opt(
        "", "with a `SASL_*` protocol (and only then)", choices=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
        optional=True, upper=True,
    )
    sasl_username: str = opt("", "SASL user name", optional=True)
    sasl_password: str = opt("", "SASL password (masked in `cdc config`, never in any output)", optional=True,
                             secret=True)
    ssl_cafile: str = opt("", "with an `SSL` protocol: CA certificates (PEM) to verify the brokers", optional=True,
                          check=_check_file)
    ssl_certfile: str = opt("", "with an `SSL` protocol: client certificate (PEM)", optional=True, check=_check_file)
    ssl_keyfile: str = opt("", "with an `SSL` protocol: client key (PEM)", optional=True, check=_check_file)

    def partitions_of(self, schema: str, table: str) -> int:
        """The partition count a new topic of the table gets."""
        for pattern, count in self._table_partitions:
            if pattern.matches(schema, table):
                return count
        return self.partitions

    @functools.cached_property
    def _table_partitions(self) -> list[tuple[TablePattern, int]]:
        return table_partitions("[topic] table_partitions", self.table_partitions)


@dataclass
class EventsConfig:
    """`[events]`: the shape of the change events."""

    schemas: bool = opt(
        False, "values in the JsonConverter `{\"schema\":..., \"payload\":...}` form (keys stay schema-less, see Keys)"
    )
    skipped_operations: str = opt(
        "none",
        "Debezium's `skipped.operations`: `t` leaves truncate events out of the topics (for consumers that fail "
        "on op `t`), `none` sends them (see Truncates)",
        choices=("none", "t"), check=_check_skipped,
    )


@dataclass
class SnapshotConfig:
    """`[snapshot]`: the initial snapshot aligned to the slot, and incremental ones."""

    mode: str = opt(
        "initial", "`initial`, `never`, `initial_only` or `when_needed` (see Snapshots)",
        choices=("initial", "never", "initial_only", "when_needed"),
        invalid="{where} {value!r} is not a mode: use {choices}",
    )
    parallelism: int = opt(
        2, "reader processes of the initial snapshot (each COPYs a table or a key range and produces it)",
        low=1, high=256,
    )
    split_rows: int = opt(
        200000, "tables with more (estimated) rows are split into key ranges of about this many rows", low=1
    )
    chunk_size: int = opt(2048, "rows per chunk of an incremental snapshot", low=1)
    progress: str = opt(
        "auto", "`tty` (a live table), `log` (a line per table every 5 s) or `auto` (tty when stderr is a terminal)",
        choices=("auto", "tty", "log"),
    )


@dataclass
class DaemonConfig:
    """`[daemon]`: the long-running process."""

    spill_dir: str = opt(
        ".cdc-spill", "disk for streamed transactions (a sub-directory per slot); must be a writable directory",
        check=_check_spill_dir,
    )
    max_pending_records: int = opt(
        50000, "records sent but not yet acknowledged before reading pauses (bounds memory)", low=1
    )
    metrics_port: int = opt(
        0, "Prometheus `/metrics` port (`0`: off); a port in use stops the start with one line", low=0, high=65535,
        invalid="{where} must be a TCP port (0 to 65535; 0 turns metrics off)",
    )
    metrics_host: str = opt("127.0.0.1", "address the metrics endpoint binds", check=_check_host)
    log_level: str = opt(
        "INFO", "`DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL`",
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), upper=True,
        invalid="{where} {value!r} is not a level: use {choices}",
    )
    log_format: str = opt(
        "text", "`text` (a line per record) or `json` (one JSON object per line: `ts`, `level`, `component`, "
        "`logger`, `message`, and `table`, `lsn`, `batch` where they apply; secrets masked)",
        choices=("text", "json"),
    )
    metrics_interval_s: float = opt(
        5.0, "how often the daemon records its lag and counters in `<prefix>.__cdc_metrics` for `cdc report` "
        "(`0`: never)", low=0, high=3600,
    )


@dataclass
class SparkConfig:
    """`[spark]`: how the sink jobs (`cdc sink ...`) run."""

    master: str = opt(
        "local[2]", "`local[N]` runs the job in this process; `spark://host:port` submits it to that cluster",
        check=_check_master,
    )
    checkpoint_dir: str = opt(
        ".cdc-checkpoints", "Structured Streaming checkpoints, a sub-folder per sink job (the Kafka offsets live "
        "here: delete one to replay its job from the earliest offsets)",
    )
    max_offsets_per_trigger: int = opt(
        200000, "most records one micro-batch reads (over all topics); bounds a batch's memory and time", low=1,
    )
    trigger_interval_s: float = opt(
        1.0, "time between micro-batch starts while streaming (0: start the next as soon as one ends)",
        low=0, high=3600,
    )
    on_malformed: str = opt(
        "dlq", "`dlq`: a record that cannot be decoded goes to `<prefix>.__cdc_dlq` and the job goes on; "
        "`stop`: the job stops with its reason",
        choices=("dlq", "stop"),
    )
    metrics_port: int = opt(
        0, "Prometheus `/metrics` port of a sink job's driver (`0`: off); a port in use stops the start with one line",
        low=0, high=65535, invalid="{where} must be a TCP port (0 to 65535; 0 turns metrics off)",
    )
    metrics_host: str = opt("127.0.0.1", "address a sink job's metrics endpoint binds", check=_check_host)
    log_format: str = opt(
        "text", "the sink jobs' log lines: `text` or `json` (as `[daemon] log_format`, with `store` and `batch`)",
        choices=("text", "json"),
    )
    driver_java_options: str = opt(
        "", "more options for the driver's JVM, after cdc's own (Spark's `spark.driver.extraJavaOptions`), e.g. "
        "`-XX:TieredStopAtLevel=1` (less JIT work: short jobs on few cores start and finish sooner)",
        optional=True,
    )


SNAPSHOT_MODES = ("initial", "never", "initial_only", "when_needed")


@dataclass
class Config:
    source: SourceConfig = field(default_factory=SourceConfig)
    topic: TopicConfig = field(default_factory=TopicConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    spark: SparkConfig = field(default_factory=SparkConfig)
    #: each registered store's section by its name (sinks.stores adds them: `add_store_section`),
    #: read as `config.<name>` too
    stores: dict[str, Any] = field(default_factory=lambda: {name: cls() for name, cls in store_sections().items()})

    def __getattr__(self, name: str) -> Any:
        stores = self.__dict__.get("stores", {})
        if name in stores:
            return stores[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def validate(self) -> Config:
        """Rules between settings (each value was checked on its own when read)."""
        if self.source.streaming and self.source.protocol_version < 2:
            raise ConfigError("[source] streaming needs protocol_version = 2")
        if self.topic.min_insync_replicas > self.topic.replication_factor:
            raise ConfigError(
                f"[topic] min_insync_replicas = {self.topic.min_insync_replicas} is more than replication_factor = "
                f"{self.topic.replication_factor}, so every write would fail with NotEnoughReplicas: "
                "lower min_insync_replicas or raise replication_factor"
            )
        topic = self.topic
        if topic.delivery_timeout_ms <= topic.linger_ms + 1:
            raise ConfigError(
                f"[topic] delivery_timeout_ms = {topic.delivery_timeout_ms} leaves no time to send after linger_ms = "
                f"{topic.linger_ms}: raise delivery_timeout_ms (default 120000) or lower linger_ms"
            )
        sasl = topic.security_protocol.startswith("SASL_")
        if sasl and not (topic.sasl_mechanism and topic.sasl_username):
            raise ConfigError(
                f"[topic] security_protocol = {topic.security_protocol} needs sasl_mechanism and sasl_username "
                "(and sasl_password): set them, or use PLAINTEXT or SSL"
            )
        if not sasl and topic.sasl_mechanism:  # the user means to authenticate: streaming unauthenticated is not it
            raise ConfigError(
                f"[topic] sasl_mechanism is set but security_protocol = {topic.security_protocol} never uses it: "
                "set security_protocol = SASL_SSL (or SASL_PLAINTEXT), or remove it"
            )
        if not topic.security_protocol.endswith("SSL"):
            for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(topic, key):
                    raise ConfigError(
                        f"[topic] {key} is set but security_protocol = {topic.security_protocol} never uses TLS: "
                        "set security_protocol = SSL (or SASL_SSL), or remove it"
                    )
        if bool(topic.ssl_certfile) != bool(topic.ssl_keyfile):
            raise ConfigError(
                "[topic] ssl_certfile and ssl_keyfile go together (a client certificate needs its key): set both or neither"
            )
        for section in self.stores.values():  # a store's rules between its own settings
            if hasattr(section, "validate"):
                section.validate()
        return self


def _num(x: float) -> str:
    """A bound as people write it: 65535, 0.1 (not 65535.0 or 6.6e+04)."""
    return str(int(x)) if x == int(x) else repr(x)


_KIND_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Setting:
    """One row of the settings table, read from the section dataclasses' `opt()` fields."""

    section: str
    key: str
    kind: Any
    default: Any
    help: str
    choices: tuple[Any, ...]
    low: float | None
    high: float | None
    secret: bool | SecretParts
    optional: bool
    upper: bool
    check: Check | None
    invalid: str | None
    sample: Any

    @property
    def env(self) -> str:
        return f"CDC_{self.section.upper()}_{self.key.upper()}"

    def where(self, from_env: bool) -> str:
        return self.env if from_env else f"[{self.section}] {self.key}"

    def secrets(self, value: Any) -> list[str]:
        """The secret strings this setting's value holds, for redaction."""
        if not value or not self.secret:
            return []
        return [value] if self.secret is True else self.secret(value)

    def example(self, from_env: bool) -> str:
        """`key = <default>` (or `CDC_SECTION_KEY=<default>`): what a valid setting looks like."""
        default = self.default if self.sample is None else self.sample
        if isinstance(default, bool):
            text = "true" if default else "false"
        elif from_env:
            text = ",".join(default) if isinstance(default, list) else str(default)
        elif isinstance(default, (int, float)):
            text = repr(default)
        else:
            text = json.dumps(default, ensure_ascii=False)  # a JSON string or list is valid TOML
        return f"{self.env}={text}" if from_env else f"{self.key} = {text}"

    def read(self, value: Any, from_env: bool) -> Any:
        """The value as the setting's type, checked: type, emptiness, own check, choices, range."""
        value = written = self._coerce(value, from_env)
        where = self.where(from_env)
        if self.upper:
            value = value.strip().upper()
        if self.kind is str and not value.strip() and not self.optional and self.check is None:
            raise ConfigError(f"{where} is empty: set it, e.g. {self.example(from_env)}")
        if self.check is not None:
            self.check(where, value)
        if self.choices and not (self.optional and value == ""):
            if value not in self.choices:
                raise ConfigError(self._not_a_choice(where, written))
        if self.kind is float and not math.isfinite(value):
            raise ConfigError(f"{where} = {value} is not a finite number: set it, e.g. {self.example(from_env)}")
        if self.kind in (int, float):
            self._in_range(where, value)
        return value

    def _not_a_choice(self, where: str, value: Any) -> str:
        shown = [json.dumps(c) if isinstance(c, str) and self.invalid is None else str(c) for c in self.choices]
        choices = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
        if self.invalid is not None:
            return self.invalid.format(where=where, value=value, choices=choices)
        message = f"{where} must be {choices}, not {value!r}"
        close = difflib.get_close_matches(str(value).lower(), [str(c).lower() for c in self.choices], n=1, cutoff=0.6)
        if close:
            message += f": did you mean {next(c for c in self.choices if str(c).lower() == close[0])}?"
        return message

    def _in_range(self, where: str, value: float) -> None:
        low, high = self.low, self.high
        if high is None and self.kind is int:
            high = INT32_MAX
        if low is not None and value < low:
            raise ConfigError(self.invalid.format(where=where, value=value, choices="") if self.invalid
                              else f"{where} must be at least {low}")
        if high is not None and value > high:
            raise ConfigError(self.invalid.format(where=where, value=value, choices="") if self.invalid
                              else f"{where} = {value} is too large: the most is {high}")

    def _coerce(self, value: Any, from_env: bool) -> Any:
        kind = self.kind
        try:
            if kind is bool:
                if isinstance(value, bool):
                    return value
                if not isinstance(value, str):
                    raise ValueError
                text = value.strip().lower()
                if text in ("1", "true", "yes", "on"):
                    return True
                if text in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if kind is int:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise ValueError  # a float would be truncated silently: 3.5 partitions is a typo
                return int(value)
            if kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise ValueError
                return float(value)
            if kind == list[str]:
                if isinstance(value, str):
                    text = value.strip()
                    if text.startswith("["):
                        items = tomllib.loads(f"v = {text}")["v"]
                        if not all(isinstance(v, str) for v in items):
                            raise ValueError
                        return items
                    return split_list(text)
                if isinstance(value, list) and all(isinstance(v, str) for v in value):
                    return value
                raise ValueError
            if not isinstance(value, str):
                raise ValueError
            return value
        except (ValueError, TypeError, tomllib.TOMLDecodeError):
            if self.secret:
                shown = "<hidden>"
            elif isinstance(value, bool) and not from_env:
                shown = "true" if value else "false"  # as the file spells it
            else:
                shown = repr(value)
            what = _KIND_NAMES.get(kind, "a list of strings")
            raise ConfigError(
                f"{self.where(from_env)} = {shown} is not {what}: set it to one, e.g. {self.example(from_env)}"
            ) from None


def _section_settings(name: str, cls: type) -> list[Setting]:
    """A section's rows, read from its dataclass; a field declared without `opt()` is refused here."""
    hints = get_type_hints(cls)
    defaults = cls()
    out = []
    for f in fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"[{name}] {f.name} is declared without opt(): give it its help and checks")
        out.append(Setting(name, f.name, hints[f.name], getattr(defaults, f.name), **f.metadata))
    return out


_CORE = {name: cls for name, cls in get_type_hints(Config).items() if name != "stores"}
#: every setting: the core sections', then each registered store's (`add_store_section`)
SETTINGS: list[Setting] = [row for name, cls in _CORE.items() for row in _section_settings(name, cls)]
#: every section by its name, the stores' included
SECTIONS: dict[str, type] = dict(_CORE)
#: the stores' sections, in the order they were registered
STORE_SECTIONS: dict[str, type] = {}


#: where the stores register their sections: the sink side's registry, imported by name the
#: first time the sections are needed, so that a store's settings live in its own folder and
#: every caller of `load` (the CLI, a bench, a test) knows them
STORE_REGISTRY = "sinks.stores"


def store_sections() -> dict[str, type]:
    """The stores' sections (the registry registers every store the first time it is asked)."""
    import importlib

    importlib.import_module(STORE_REGISTRY).load_all()
    return STORE_SECTIONS


def add_store_section(name: str, cls: type) -> None:
    """A store's `[name]` section (a dataclass of `opt()` fields; its optional `validate()` holds
    the rules between its settings): the loader reads it, the settings table lists it."""
    if name in SECTIONS:
        if STORE_SECTIONS.get(name) is cls:
            return
        raise ValueError(f"section [{name}] is registered already")
    SETTINGS.extend(_section_settings(name, cls))
    SECTIONS[name] = STORE_SECTIONS[name] = cls


def _env_name(prefix: str, key: str) -> str:
    return prefix + key.upper()


def _unknown(what: str, name: str, known: list[str], shown: Callable[[str], str], listing: str) -> ConfigError:
    """`unknown <what>: did you mean <x>? ...` when a known name is close, else the known names."""
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.6)
    if close:
        return ConfigError(f"unknown {what}: did you mean {shown(close[0])}? (remove it or fix the spelling)")
    return ConfigError(f"unknown {what}: remove it ({listing})")


def load(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Read the TOML file (optional), apply `CDC_*` environment overrides and validate."""
    environ = dict(os.environ if environ is None else environ)
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found: pass an existing file to --config") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text: save it as UTF-8") from None
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file {path} ({exc.strerror or type(exc).__name__}): "
                "pass a readable TOML file to --config"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    store_sections()
    sections = list(SECTIONS)
    for name in raw:
        if name not in SECTIONS:
            raise _unknown(
                f"section [{name}] in {path}", name, sections, lambda s: f"[{s}]", f"sections: {', '.join(sections)}"
            )
    config = Config()
    for section_name in SECTIONS:
        section = getattr(config, section_name)
        values = raw.get(section_name, {})
        if not isinstance(values, dict):
            raise ConfigError(
                f"[{section_name}] in {path} must be a table: write it as a [{section_name}] section"
            )
        rows = {s.key: s for s in SETTINGS if s.section == section_name}
        known = sorted(rows)
        for key in values:
            if key not in known:
                raise _unknown(
                    f"key {key!r} in [{section_name}]", key, known, repr, f"known keys: {', '.join(known)}"
                )
        env_prefix = f"CDC_{section_name.upper()}_"
        for name in sorted(environ):
            if name.startswith(env_prefix) and name[len(env_prefix):] not in {k.upper() for k in known}:
                raise _unknown(
                    f"environment variable {name}", name[len(env_prefix):], known,
                    functools.partial(_env_name, env_prefix),
                    f"known: {', '.join(env_prefix + k.upper() for k in known)}",
                )
        for key, row in rows.items():
            if key in values:
                setattr(section, key, row.read(values[key], False))
            if row.env in environ:
                setattr(section, key, row.read(environ[row.env], True))
    return config.validate()


def secrets_of(config: Config) -> list[str]:
    """Every secret string the configuration holds (settings marked secret in the table)."""
    return [part for s in SETTINGS for part in s.secrets(getattr(getattr(config, s.section), s.key))]


def as_dict(config: Config, hide_secrets: bool = True) -> dict[str, Any]:
    """The effective configuration, for `cdc config`; secrets are masked."""
    out = {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}
    if hide_secrets:
        from cdc.redact import Redactor

        mask = Redactor(secrets_of(config))
        for s in SETTINGS:
            value = out[s.section][s.key]
            if s.secret is True and value:
                out[s.section][s.key] = "<hidden>"
            elif s.secret and value:
                out[s.section][s.key] = mask(value)
    return out


def settings_markdown() -> str:
    """The table of docs/configuration.md, generated from SETTINGS (tests/test_config.py keeps them equal)."""
    store_sections()
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        if s.default in ("", []):
            default = "(none)"
        elif isinstance(s.default, bool):
            default = "`true`" if s.default else "`false`"
        elif isinstance(s.default, list):
            default = f"`{json.dumps(s.default)}`"
        else:
            default = f"`{_num(s.default)}`" if isinstance(s.default, float) else f"`{s.default}`"
        if s.choices:
            allowed = ", ".join(f"`{c}`" for c in s.choices)
        elif s.kind in (int, float):
            high = s.high if s.high is not None else (INT32_MAX if s.kind is int else None)
            low = s.low if s.low is not None else -INT32_MAX - 1
            allowed = f"{_num(low)} to {_num(high)}" if high is not None else f"at least {_num(low)}"
        else:
            allowed = {bool: "`true`, `false`", list[str]: "list of strings"}.get(s.kind, "string")
        if s.secret:
            allowed += ", secret" if s.secret is True else ", its password is secret"
        lines.append(f"| `[{s.section}] {s.key}` | {default} | {allowed} | {s.help} |")
    return "\n".join(lines)
