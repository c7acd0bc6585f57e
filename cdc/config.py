"""Configuration: a TOML file, every key overridable by an environment variable.

`CDC_<SECTION>_<KEY>` overrides `[section] key` (e.g. `CDC_SOURCE_DSN` for `[source] dsn`),
so a container can be configured without a file. Unknown keys are errors, not silently
ignored: a typo in a config must not quietly fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from cdc.naming import parse_table_pattern, split_list, validate_prefix


class ConfigError(ValueError):
    """A configuration mistake; the message is one line naming the fix."""


@dataclass
class SourceConfig:
    """`[source]`: the PostgreSQL database to capture."""

    dsn: str = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
    slot: str = "cdc"
    publication: str = "cdc"
    tables: list[str] = field(default_factory=lambda: ["public.*"])
    protocol_version: int = 1
    streaming: bool = False
    set_replica_identity_full: bool = False
    status_interval_s: float = 10.0
    slot_wait_s: float = 10.0


@dataclass
class TopicConfig:
    """`[topic]`: the Kafka-protocol cluster and the compacted topics."""

    bootstrap_servers: str = "127.0.0.1:9092"
    prefix: str = "cdc"
    partitions: int = 3
    replication_factor: int = 1
    min_insync_replicas: int = 1
    max_message_bytes: int = 1048588
    allow_non_compacted: bool = False
    client: str = "kafka-python"
    linger_ms: int = 5
    batch_size: int = 1048576
    delivery_timeout_ms: int = 120000
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = ""
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""


@dataclass
class EventsConfig:
    """`[events]`: the shape of the change events."""

    schemas: bool = False


@dataclass
class DaemonConfig:
    """`[daemon]`: the long-running process."""

    spill_dir: str = ".cdc-spill"
    max_pending_records: int = 50000
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"


@dataclass
class Config:
    source: SourceConfig = field(default_factory=SourceConfig)
    topic: TopicConfig = field(default_factory=TopicConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)

    def validate(self) -> Config:
        """Check values whose mistakes would otherwise surface deep inside a run."""
        try:
            validate_prefix(self.topic.prefix)
            for pattern in self.source.tables:
                parse_table_pattern(pattern)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.source.tables:
            raise ConfigError("[source] tables is empty: list the tables to capture, e.g. tables = [\"public.*\"]")
        if self.source.protocol_version not in (1, 2):
            raise ConfigError("[source] protocol_version must be 1 or 2")
        if self.source.streaming and self.source.protocol_version < 2:
            raise ConfigError("[source] streaming needs protocol_version = 2")
        if self.topic.client not in ("kafka-python", "confluent"):
            raise ConfigError("[topic] client must be \"kafka-python\" or \"confluent\"")
        if self.topic.partitions < 1:
            raise ConfigError("[topic] partitions must be at least 1")
        for name in ("slot", "publication"):
            value = getattr(self.source, name)
            if not value or not all(c.isalnum() and c.isascii() or c == "_" for c in value) or value != value.lower():
                raise ConfigError(
                    f"[source] {name} {value!r} must be lower-case letters, digits and underscores "
                    "(PostgreSQL's rule for slot names)"
                )
        return self


SECTIONS = {f.name: f.type for f in fields(Config)}


def _coerce(section: str, key: str, kind: Any, value: Any, from_env: bool) -> Any:
    where = f"CDC_{section.upper()}_{key.upper()}" if from_env else f"[{section}] {key}"
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if kind == list[str]:
            if isinstance(value, str):
                text = value.strip()
                if text.startswith("["):
                    return [str(v) for v in tomllib.loads(f"v = {text}")["v"]]
                return split_list(text)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
            raise ValueError
        if not isinstance(value, str):
            raise ValueError
        return value
    except (ValueError, tomllib.TOMLDecodeError):
        shown = "<hidden>" if "password" in key else repr(value)
        raise ConfigError(f"{where} = {shown} is not a valid {getattr(kind, '__name__', str(kind))}") from None


def load(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Read the TOML file (optional), apply `CDC_*` environment overrides and validate."""
    environ = dict(os.environ if environ is None else environ)
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found: pass an existing file to --config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section [{sorted(unknown)[0]}] in {path}: known are {', '.join(SECTIONS)}")
    config = Config()
    for section_name in SECTIONS:
        section = getattr(config, section_name)
        hints = get_type_hints(type(section))
        values = raw.get(section_name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"[{section_name}] in {path} must be a table")
        known = {f.name for f in dataclasses.fields(section)}
        for key in values:
            if key not in known:
                raise ConfigError(f"unknown key {key!r} in [{section_name}]: known keys are {', '.join(sorted(known))}")
        for key in known:
            if key in values:
                setattr(section, key, _coerce(section_name, key, hints[key], values[key], False))
            env_name = f"CDC_{section_name.upper()}_{key.upper()}"
            if env_name in environ:
                setattr(section, key, _coerce(section_name, key, hints[key], environ[env_name], True))
    return config.validate()


def as_dict(config: Config, hide_secrets: bool = True) -> dict[str, Any]:
    """The effective configuration, for `cdc config`; secrets are masked."""
    out = dataclasses.asdict(config)
    if hide_secrets:
        from cdc.redact import redact_dsn

        out["source"]["dsn"] = redact_dsn(out["source"]["dsn"])
        if out["topic"]["sasl_password"]:
            out["topic"]["sasl_password"] = "<hidden>"
    return out
