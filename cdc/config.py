"""Configuration: a TOML file, every key overridable by an environment variable.

`CDC_<SECTION>_<KEY>` overrides `[section] key` (e.g. `CDC_SOURCE_DSN` for `[source] dsn`),
so a container can be configured without a file. Unknown keys are errors, not silently
ignored: a typo in a config must not quietly fall back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import tomllib
from collections.abc import Callable
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


SNAPSHOT_MODES = ("initial", "never", "initial_only", "when_needed")


@dataclass
class SnapshotConfig:
    """`[snapshot]`: the initial snapshot aligned to the slot, and incremental ones."""

    mode: str = "initial"
    parallelism: int = 2
    split_rows: int = 200000
    chunk_size: int = 2048
    progress: str = "auto"


@dataclass
class Config:
    source: SourceConfig = field(default_factory=SourceConfig)
    topic: TopicConfig = field(default_factory=TopicConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
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
        for section, key, low in (
            ("topic", "replication_factor", 1), ("topic", "min_insync_replicas", 1),
            ("topic", "max_message_bytes", 1), ("daemon", "max_pending_records", 1),
            ("source", "slot_wait_s", 0), ("source", "status_interval_s", 0.1),
            ("daemon", "metrics_port", 0), ("snapshot", "parallelism", 1),
            ("snapshot", "split_rows", 1), ("snapshot", "chunk_size", 1),
        ):
            if getattr(getattr(self, section), key) < low:
                raise ConfigError(f"[{section}] {key} must be at least {low}")
        if self.snapshot.mode not in SNAPSHOT_MODES:
            raise ConfigError(
                f"[snapshot] mode {self.snapshot.mode!r} is not a mode: use {', '.join(SNAPSHOT_MODES)}"
            )
        if self.snapshot.progress not in ("auto", "tty", "log"):
            raise ConfigError(f"[snapshot] progress {self.snapshot.progress!r} must be \"auto\", \"tty\" or \"log\"")
        if self.topic.min_insync_replicas > self.topic.replication_factor:
            raise ConfigError(
                f"[topic] min_insync_replicas = {self.topic.min_insync_replicas} is more than replication_factor = "
                f"{self.topic.replication_factor}, so every write would fail with NotEnoughReplicas: "
                "lower min_insync_replicas or raise replication_factor"
            )
        if self.daemon.metrics_port > 65535:
            raise ConfigError("[daemon] metrics_port must be a TCP port (0 to 65535; 0 turns metrics off)")
        if self.daemon.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(
                f"[daemon] log_level {self.daemon.log_level!r} is not a level: use DEBUG, INFO, WARNING, ERROR or CRITICAL"
            )
        if not self.topic.bootstrap_servers.strip():
            raise ConfigError("[topic] bootstrap_servers is empty: set it to host:port of the broker, e.g. 127.0.0.1:9092")
        for name in ("slot", "publication"):
            value = getattr(self.source, name)
            if not value or not all(c.isalnum() and c.isascii() or c == "_" for c in value) or value != value.lower():
                raise ConfigError(
                    f"[source] {name} {value!r} must be lower-case letters, digits and underscores "
                    "(PostgreSQL's rule for slot names)"
                )
        return self


SECTIONS = {f.name: f.type for f in fields(Config)}
_SECTION_TYPES: dict[str, Any] = {f.name: f.default_factory for f in fields(Config)}


_KIND_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _example(section: str, key: str, kind: Any, from_env: bool) -> str:
    """`key = <default>` (or `CDC_SECTION_KEY=<default>`): what a valid setting looks like."""
    default = getattr(_SECTION_TYPES[section](), key)
    if from_env:
        if isinstance(default, bool):
            text = "true" if default else "false"
        elif isinstance(default, list):
            text = ",".join(default)
        else:
            text = str(default)
        return f"CDC_{section.upper()}_{key.upper()}={text}"
    if isinstance(default, bool):
        text = "true" if default else "false"
    elif isinstance(default, (int, float)):
        text = repr(default)
    else:
        text = json.dumps(default, ensure_ascii=False)  # a JSON string or list is valid TOML
    return f"{key} = {text}"


def _coerce(section: str, key: str, kind: Any, value: Any, from_env: bool) -> Any:
    where = f"CDC_{section.upper()}_{key.upper()}" if from_env else f"[{section}] {key}"
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
        if "password" in key:
            shown = "<hidden>"
        elif isinstance(value, bool) and not from_env:
            shown = "true" if value else "false"  # as the file spells it
        else:
            shown = repr(value)
        what = _KIND_NAMES.get(kind, "a list of strings")
        raise ConfigError(
            f"{where} = {shown} is not {what}: set it to one, e.g. {_example(section, key, kind, from_env)}"
        ) from None


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
    sections = list(SECTIONS)
    for name in raw:
        if name not in SECTIONS:
            raise _unknown(
                f"section [{name}] in {path}", name, sections, lambda s: f"[{s}]", f"sections: {', '.join(sections)}"
            )
    config = Config()
    for section_name in SECTIONS:
        section = getattr(config, section_name)
        hints = get_type_hints(type(section))
        values = raw.get(section_name, {})
        if not isinstance(values, dict):
            raise ConfigError(
                f"[{section_name}] in {path} must be a table: write it as a [{section_name}] section"
            )
        known = sorted(f.name for f in dataclasses.fields(section))
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
        for key in known:
            if key in values:
                setattr(section, key, _coerce(section_name, key, hints[key], values[key], False))
            env_name = env_prefix + key.upper()
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
