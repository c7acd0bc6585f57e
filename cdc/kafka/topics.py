"""The compacted topics: create them with the topic policy, check an existing one's, read limits
and offsets, change settings.

A topic that is not compacted would silently grow forever and never forget deleted rows,
so an existing one with another `cleanup.policy` is refused unless the user says otherwise.
What every setting is and why: cdc.kafka.policy.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from cdc.config import TopicConfig
from cdc.kafka.policy import creation_configs, kind_of
from cdc.kafka.security import security_settings

log = logging.getLogger(__name__)


#: topics one CreateTopics request creates (a request per topic took 32 s for 1,000 tables)
CREATE_AT_ONCE = 500


class TopicError(Exception):
    """A broker or topic problem; the message is one line naming the fix."""


def _broker_reason(exc: Exception) -> str:
    """The broker's own error message out of kafka-python's long exception text."""
    found = re.search(r"error_message=(['\"])(.+?)\1[,)]", str(exc))
    name = type(exc).__name__
    return f"{name}: {found.group(2)}" if found else name


class ClientErrors(logging.Handler):
    """While in use, collects what kafka-python logs about its connections (silenced otherwise):
    the only place it says why a bootstrap failed (TLS, SASL), its exception saying only "timeout"."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []
        self._authenticating = False
        self._logger = logging.getLogger("kafka")

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.levelno >= logging.WARNING or "error_message='" in text:
            self.texts.append(text)
        # A broker that refuses SASL credentials answers "Authentication failed" and closes the
        # connection; kafka-python often sees the close first and warns of a disconnect only.
        if "SaslAuthenticateRequest" in text:
            self._authenticating = True
        elif "SaslAuthenticateResponse" in text and "error_code=0," in text:
            self._authenticating = False
        elif self._authenticating and "socket disconnected" in text:
            self._authenticating = False
            self.texts.append("Authentication failed: the broker closed the connection on the credentials")

    def __enter__(self) -> ClientErrors:
        self._saved = self._logger.level, self._logger.propagate
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved[0])
        self._logger.propagate = self._saved[1]


# What failed, from the client's connection errors: (marks, what failed, what to fix), first match wins
_CONNECT_FAILURES = (
    (("SaslAuthenticationFailed", "Authentication failed", "authentication failed"),
     "authentication failed", "check [topic] sasl_username, sasl_password and sasl_mechanism"),
    (("UnsupportedSaslMechanism",),
     "the broker does not offer sasl_mechanism = {sasl_mechanism}", "use a mechanism its listener enables"),
    (("IllegalSaslState", "SaslHandshake failed"),
     "the SASL handshake failed: this listener does not speak security_protocol = {security_protocol}",
     "set [topic] security_protocol to what the listener speaks (PLAINTEXT or SSL?)"),
    (("CERTIFICATE_VERIFY_FAILED", "certificate verify failed"),
     "the TLS handshake failed: the broker's certificate is not trusted",
     "point [topic] ssl_cafile at the CA that signed it"),
    (("WRONG_VERSION_NUMBER", "UNEXPECTED_EOF", "Handshake failed", "SSL"),
     "the TLS handshake failed: this listener does not speak TLS (security_protocol = {security_protocol})",
     "set [topic] security_protocol to what the listener speaks (PLAINTEXT or SASL_PLAINTEXT?), or fix the TLS files"),
)


def connect_failure(config: TopicConfig, exception: str, texts: list[str]) -> str:
    """One line saying what failed when a client cannot bootstrap: authentication, the TLS or SASL
    handshake (a wrong protocol for the listener), or a broker that is truly unreachable."""
    joined = " ".join(texts)
    for marks, what, fix in _CONNECT_FAILURES:
        if any(mark in joined for mark in marks):
            what = what.format(sasl_mechanism=config.sasl_mechanism, security_protocol=config.security_protocol)
            return f"cannot use the Kafka broker at {config.bootstrap_servers}: {what} ({exception}): {fix}"
    return (
        f"cannot reach the Kafka broker at {config.bootstrap_servers} ({exception}): "
        "start it or fix [topic] bootstrap_servers / CDC_TOPIC_BOOTSTRAP_SERVERS"
    )


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    max_message_bytes: int
    cleanup_policy: str
    replication_factor: int = 0
    configs: dict[str, str] = field(default_factory=dict, hash=False, compare=False)  # every setting's value
    defaults: frozenset[str] = frozenset()  # settings the topic takes from the broker's defaults


class TopicAdmin:
    """Admin operations on the Kafka-protocol cluster, through kafka-python's admin client."""

    def __init__(self, config: TopicConfig, timeout_s: float = 15.0) -> None:
        from kafka.admin import KafkaAdminClient
        from kafka.errors import KafkaError

        self.config = config
        seen = ClientErrors()
        try:
            with seen:
                self._admin = KafkaAdminClient(
                    bootstrap_servers=config.bootstrap_servers.split(","),
                    client_id="cdc-admin",
                    request_timeout_ms=int(timeout_s * 1000),
                    bootstrap_timeout_ms=int(min(timeout_s, config.connect_timeout_s) * 1000),
                    **security_settings(config),
                )
        except KafkaError as exc:
            raise TopicError(connect_failure(config, type(exc).__name__, seen.texts)) from None

    def close(self) -> None:
        self._admin.close()

    def _existing(self, names: list[str]) -> list[str]:
        """`names` the brokers have, in their order."""
        existing = set(self._admin.list_topics())
        return [n for n in names if n in existing]

    def describe(self, names: list[str]) -> dict[str, TopicInfo]:
        """Existing topics among `names`, with partition count and the configs we depend on."""
        from kafka.admin import ConfigResource, ConfigResourceType

        wanted = self._existing(names)
        if not wanted:
            return {}
        described = {t["name"]: t["partitions"] for t in self._admin.describe_topics(wanted)}
        configs = self._admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n) for n in wanted], config_filter="all"
        )["topic"]
        out = {}
        for name in wanted:
            conf = configs.get(name, {})
            parts = described[name]
            out[name] = TopicInfo(
                name=name,
                partitions=len(parts),
                max_message_bytes=int(conf.get("max.message.bytes", {}).get("value", 1048588)),
                cleanup_policy=conf.get("cleanup.policy", {}).get("value", "delete"),
                replication_factor=min((len(p.get("replica_nodes", ())) for p in parts), default=0),
                configs={k: v.get("value") for k, v in conf.items() if v.get("value") is not None},
                defaults=frozenset(k for k, v in conf.items() if not str(v.get("config_source", "")).endswith("TOPIC_CONFIG")),
            )
        return out

    @contextlib.contextmanager
    def _broker_errors(self, what: str) -> Iterator[None]:
        """Any other broker failure becomes one TopicError line, not a traceback."""
        from kafka.errors import KafkaError

        try:
            yield
        except KafkaError as exc:
            raise TopicError(
                f"the Kafka broker at {self.config.bootstrap_servers} failed to {what} ({_broker_reason(exc)}): "
                "check that it is up and that this client may describe and create topics "
                "([topic] security settings, ACLs)"
            ) from None

    def ensure(
        self, names: list[str], partitions: int | None = None, log_only: bool = False, retention_ms: int = -1
    ) -> dict[str, TopicInfo]:
        """Create the missing topics compacted; refuse existing non-compacted ones unless allowed.
        `log_only`: a plain log kept `retention_ms` (-1: until deleted; dead letters: every record
        counts, none supersedes another)."""
        with self._broker_errors("describe or create the topics"):
            return self._ensure(names, partitions or self.config.partitions, log_only, retention_ms)

    def _ensure(
        self, names: list[str], partitions: int, log_only: bool = False, retention_ms: int = -1
    ) -> dict[str, TopicInfo]:
        infos = self.describe(names)
        for info in infos.values():
            if not log_only and "compact" not in info.cleanup_policy.split(","):
                if not self.config.allow_non_compacted:
                    raise TopicError(
                        f"topic {info.name} has cleanup.policy={info.cleanup_policy}, not compact: compaction is what "
                        "keeps the latest row per key, so set cleanup.policy=compact on it, or set "
                        "[topic] allow_non_compacted = true to use it anyway"
                    )
                log.warning("topic %s is not compacted (cleanup.policy=%s), as allowed", info.name, info.cleanup_policy)
        other = sorted(f"{i.name} ({i.partitions})" for i in infos.values() if i.partitions != partitions)
        if other:  # one line: a wide schema's topics made under another default would be a line each
            log.info(
                "%d topics exist with other partition counts than the %d a new one would get: %s%s ([topic] "
                "partitions and table_partitions apply to new topics only, see Choosing partitions)",
                len(other), partitions, ", ".join(other[:5]), f" and {len(other) - 5} more" if len(other) > 5 else "",
            )
        missing = [n for n in names if n not in infos]
        for start in range(0, len(missing), CREATE_AT_ONCE):
            self._create(missing[start:start + CREATE_AT_ONCE], partitions, log_only, retention_ms)
        if missing:
            infos.update(self._await_created(missing))
        return infos

    def _create(self, names: list[str], partitions: int, log_only: bool, retention_ms: int) -> None:
        """One CreateTopics request for `names` (a wide schema's topics at once, not a round
        trip to the controller each); a topic another process made meanwhile is fine, any other
        refusal names its topic and the settings to fix."""
        from kafka.errors import TopicAlreadyExistsError, for_code

        prefix = self.config.prefix
        wanted = {
            n: {"num_partitions": partitions, "replication_factor": self.config.replication_factor,
                "configs": creation_configs(self.config, kind_of(prefix, n, log_only), retention_ms)}
            for n in names
        }
        kept = "compacted" if not log_only else "kept until deleted" if retention_ms < 0 else f"kept {retention_ms // 3600000} h"
        for topic in self._admin.create_topics(wanted, raise_errors=False)["topics"]:
            error = for_code(topic["error_code"])
            if topic["error_code"] == 0:
                log.info("created topic %s (%d partitions, %s)", topic["name"], partitions, kept)
            elif error is not TopicAlreadyExistsError:  # (that one: another process won the race; described next)
                reason = f"{error.__name__}: {topic['error_message']}" if topic.get("error_message") else error.__name__
                raise TopicError(
                    f"the broker refused to create topic {topic['name']} ({reason}): fix [topic] "
                    f"partitions = {partitions}, replication_factor = {self.config.replication_factor}, "
                    f"min_insync_replicas = {self.config.min_insync_replicas} or max_message_bytes = "
                    f"{self.config.max_message_bytes} for this cluster, or create the topic yourself "
                    "with cleanup.policy=compact"
                )

    def _await_created(self, names: list[str], timeout_s: float = 30.0) -> dict[str, TopicInfo]:
        """Describe topics just created: a broker lists a new topic only once its metadata
        has reached it, a moment after CreateTopics returned, so a single look can miss it."""
        from kafka.errors import UnknownTopicOrPartitionError

        deadline = time.monotonic() + timeout_s
        infos: dict[str, TopicInfo] = {}
        while True:
            with contextlib.suppress(UnknownTopicOrPartitionError):
                infos = self.describe(names)
                if len(infos) == len(names):
                    return infos
            if time.monotonic() > deadline:
                absent = sorted(set(names) - set(infos))
                raise TopicError(
                    f"topics {', '.join(absent)} were created but not visible after {timeout_s:.0f} s: "
                    "check the broker's log and ACLs"
                )
            time.sleep(0.2)

    def alter(self, topic: str, settings: dict[str, str]) -> None:
        """Set these settings on the topic (an incremental change: the others stay)."""
        from kafka.admin import ConfigResource, ConfigResourceType

        with self._broker_errors(f"change the settings of topic {topic}"):
            result = self._admin.alter_configs(
                [ConfigResource(ConfigResourceType.TOPIC, topic, configs=settings)], incremental=True
            )
        answer = result.get("topic", {}).get(topic, "OK")
        if answer != "OK":
            raise TopicError(
                f"the broker refused to change {', '.join(f'{k}={v}' for k, v in settings.items())} on topic "
                f"{topic} ({answer}): check this client's ACLs (AlterConfigs) or change it with kafka-configs.sh"
            )

    def end_offsets(self, names: list[str]) -> dict[str, dict[int, int]]:
        """Per topic, per partition, the offset the next record will get."""
        with self._broker_errors("list the topics' end offsets"):
            return self._end_offsets(names)

    def _end_offsets(self, names: list[str]) -> dict[str, dict[int, int]]:
        from kafka.admin import OffsetSpec
        from kafka.structs import TopicPartition

        wanted = self._existing(names)
        # partition counts only: describing the configs too cost about a second at 1,000 topics
        counts = {t["name"]: len(t["partitions"]) for t in self._admin.describe_topics(wanted)
                  if not t.get("error_code")} if wanted else {}
        specs = {TopicPartition(name, p): OffsetSpec.LATEST for name, count in counts.items() for p in range(count)}
        if not specs:
            return {}
        result = self._admin.list_partition_offsets(specs)
        out: dict[str, dict[int, int]] = {name: {} for name in counts}
        for tp, value in result.items():
            out[tp.topic][tp.partition] = value.offset
        return out

    def write_rates(self, infos: list[TopicInfo], window_s: float, min_span_s: float) -> dict[str, float]:
        """Per topic (described), the records a second its busiest partition took over the last
        `window_s`: the offsets since the first record written in the window, over the time
        since it (at least `min_span_s`, so a short burst is not a rate). Offsets count every
        record, also the ones compaction has removed since."""
        with self._broker_errors("list the topics' offsets"):
            return self._write_rates(infos, window_s, min_span_s)

    def _write_rates(self, infos: list[TopicInfo], window_s: float, min_span_s: float) -> dict[str, float]:
        from kafka.admin import OffsetSpec
        from kafka.structs import TopicPartition

        parts = [TopicPartition(info.name, p) for info in infos for p in range(info.partitions)]
        rates = {info.name: 0.0 for info in infos}
        if not parts:
            return rates
        now_ms = int(time.time() * 1000)
        since = self._admin.list_partition_offsets({tp: now_ms - int(window_s * 1000) for tp in parts})
        ends = self._admin.list_partition_offsets(dict.fromkeys(parts, OffsetSpec.LATEST))
        for tp in parts:
            first = since[tp]
            if first.offset < 0:  # nothing written in the window
                continue
            span_s = max(min_span_s, (now_ms - first.timestamp) / 1000)
            rates[tp.topic] = max(rates[tp.topic], (ends[tp].offset - first.offset) / span_s)
        return rates

    def log_sizes(self) -> dict[str, int]:
        """Bytes each topic's log holds on disk: per partition its largest replica (the leader's,
        or one that is ahead), summed over the partitions."""
        with self._broker_errors("describe the log directories"):
            answers = self._admin.describe_log_dirs()
        largest: dict[tuple[str, int], int] = {}
        for broker in answers:
            for log_dir in broker.get("log_dirs", []):
                for topic in log_dir.get("topics", []):
                    for part in topic.get("partitions", []):
                        key = (topic["name"], part["partition_index"])
                        largest[key] = max(largest.get(key, 0), part["partition_size"])
        out: dict[str, int] = {}
        for (name, _), size in largest.items():
            out[name] = out.get(name, 0) + size
        return out

    def topics_with_prefix(self, prefix: str) -> list[str]:
        with self._broker_errors("list the topics"):
            return sorted(t for t in self._admin.list_topics() if t.startswith(prefix + "."))

    def topic_ids(self, names: list[str]) -> dict[str, str]:
        """Each existing topic's id (KIP-516): a topic deleted and created again gets a new one."""
        with self._broker_errors("look up the topics' ids"):
            found = self._admin.describe_topics(names)
        return {t["name"]: str(t["topic_id"]) for t in found if not t.get("error_code") and t.get("topic_id")}
