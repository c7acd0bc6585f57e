"""The topic policy: the settings cdc creates its topics with, why, what each means for a
consumer, and which values found on a topic would lose data (each a problem with its fix).

A table topic is the log every derived store is rebuilt from (docs/design.md): compaction must
keep the latest record of every key for good, and deletes (tombstones) long enough for every
sink to see them. `cdc run` creates topics with `creation_configs` and warns at start about
`problems`; `cdc topics describe` shows every setting with its meaning, `cdc topics ensure`
repairs what a configuration change can repair. The topic policy table of docs/compaction.md is this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc.config import TopicConfig

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
#: how long a tombstone stays readable after compaction: the same 7 days the cache's and the
#: index's delete markers live (`marker_ttl_s`), the longest a sink may be down
DELETE_RETENTION_MS = 7 * DAY_MS


@dataclass(frozen=True)
class Setting:
    name: str
    reason: str  # why cdc's value
    meaning: str  # what the value found on a topic means for its consumers


#: Every setting cdc sets or checks on a table topic, in the order `cdc topics describe` shows them.
SETTINGS = (
    Setting(
        "cleanup.policy",
        "compact: the topic keeps the latest record of every key for good, so reading it from offset 0 "
        "rebuilds any store; `delete` would drop rows after retention.ms",
        "compact: a reader from offset 0 gets every row's latest version; delete: rows older than "
        "retention.ms are gone for every new reader",
    ),
    Setting(
        "min.compaction.lag.ms",
        "1 hour: a sink that keeps up within an hour reads every version of a row (its history/ is "
        "complete) and can fill unchanged TOASTed values from the row's previous record",
        "records younger than this are never compacted: a reader this close behind sees every change",
    ),
    Setting(
        "delete.retention.ms",
        "7 days, as long as the sinks keep their delete markers: a sink stopped for less than this "
        "still reads every delete (`cdc status` warns at half of it)",
        "a tombstone may be gone this long after compaction reached it: a reader further behind may "
        "miss a delete and keep the row",
    ),
    Setting(
        "segment.ms",
        "1 day: the cleaner compacts closed segments only, so superseded records and tombstones wait "
        "at most a day (Kafka's default, 7 days, lets a new reader replay a week of history)",
        "the open segment is never compacted: a reader from offset 0 replays up to this much history",
    ),
    Setting(
        "segment.bytes",
        "the broker's default (1 GiB): segments close by time on these topics",
        "a segment also closes at this size",
    ),
    Setting(
        "min.cleanable.dirty.ratio",
        "0.5: the cleaner runs once half the log is superseded records, so a reader from offset 0 reads "
        "at most about twice the table",
        "how much of the log may be superseded records before the cleaner rewrites it",
    ),
    Setting(
        "min.insync.replicas",
        "[topic] min_insync_replicas: cdc produces with acks=all, so a record counts as written once "
        "this many replicas have it",
        "an acknowledged record survives the loss of all but this many replicas",
    ),
    Setting(
        "max.message.bytes",
        "[topic] max_message_bytes: the largest event cdc sends (the daemon stops on a larger one, "
        "naming the setting)",
        "the largest record a consumer must be able to fetch",
    ),
    Setting(
        "retention.ms",
        "not used: it applies only with a delete policy",
        "with a delete policy, records older than this are dropped, live rows included",
    ),
    Setting(
        "unclean.leader.election.enable",
        "false (Kafka's default): an out-of-sync replica never becomes leader",
        "true lets a lagging replica lead, and acknowledged records are lost",
    ),
)
MEANINGS = {s.name: s.meaning for s in SETTINGS}
REPLICATION = Setting(
    "replication factor",
    "[topic] replication_factor",
    "copies of each partition: the topic survives the loss of all but one broker holding it",
)


DLQ_SUFFIX = "__cdc_dlq"  # the sinks' dead letters (sinks.topics.DLQ)
METRICS_SUFFIX = "__cdc_metrics"  # the daemon's metrics over time (cdc.kafka.history)


def kind_of(prefix: str, name: str, log_only: bool = False) -> str:
    """`table`, `internal` (compacted bookkeeping: the snapshot state, table versions, heartbeats,
    sink progress) or `log` (dead letters, the daemon's metrics)."""
    rest = name[len(prefix) + 1:] if name.startswith(prefix + ".") else name
    if log_only or rest in (DLQ_SUFFIX, METRICS_SUFFIX):
        return "log"
    return "internal" if "." not in rest else "table"


def creation_configs(config: TopicConfig, kind: str, retention_ms: int = -1) -> dict[str, str]:
    """What cdc creates a topic of this kind with (`retention_ms`: how long a log keeps records)."""
    common = {"min.insync.replicas": str(config.min_insync_replicas), "max.message.bytes": str(config.max_message_bytes)}
    if kind == "log":  # dead letters, metrics: every record counts and none supersedes another
        return {"cleanup.policy": "delete", "retention.ms": str(retention_ms), **common}
    compacted = {"cleanup.policy": "compact", "unclean.leader.election.enable": "false", **common}
    if kind == "internal":
        return compacted
    return {
        **compacted,
        "min.compaction.lag.ms": str(HOUR_MS),
        "delete.retention.ms": str(DELETE_RETENTION_MS),
        "segment.ms": str(DAY_MS),
        "min.cleanable.dirty.ratio": "0.5",
    }


@dataclass(frozen=True)
class Problem:
    """A setting found on a topic that loses data or stops the pipeline, and its fix.
    `repair`: the setting and value `cdc topics ensure` sets (None: it cannot)."""

    topic: str
    setting: str
    found: str
    why: str
    fix: str
    loses_data: bool
    repair: tuple[str, str] | None = None

    def line(self) -> str:
        return f"{self.topic}: {self.setting}={self.found}: {self.why}; {self.fix}"


def problems(
    topic: str, kind: str, configs: dict[str, str], replication_factor: int, config: TopicConfig,
    longest_lag_ms: int | None = None,
) -> list[Problem]:
    """What is wrong with a topic's settings (`configs`: name -> value as the broker reports
    them). `longest_lag_ms`: the furthest behind any sink is, in time (table topics)."""
    out: list[Problem] = []
    policy = configs.get("cleanup.policy", "delete").split(",")
    if kind != "log":
        if "compact" not in policy:
            out.append(Problem(
                topic, "cleanup.policy", ",".join(policy),
                "not compacted: rows older than retention.ms are dropped and deleted rows are never forgotten",
                "set cleanup.policy=compact (cdc topics ensure does), then re-snapshot the tables whose oldest "
                "rows may be gone (cdc snapshot --tables ...)", True, ("cleanup.policy", "compact"),
            ))
        elif "delete" in policy:
            out.append(Problem(
                topic, "cleanup.policy", ",".join(policy),
                f"compacted and deleted: rows older than retention.ms={configs.get('retention.ms')} are dropped",
                "set cleanup.policy=compact (cdc topics ensure does)", True, ("cleanup.policy", "compact"),
            ))
        if configs.get("unclean.leader.election.enable") == "true":
            out.append(Problem(
                topic, "unclean.leader.election.enable", "true",
                "an out-of-sync replica may become leader and acknowledged records are lost",
                "set it to false (cdc topics ensure does)", True, ("unclean.leader.election.enable", "false"),
            ))
    retention = _int(configs.get("delete.retention.ms"))
    if kind == "table" and longest_lag_ms is not None and retention is not None and retention <= longest_lag_ms:
        wanted = max(DELETE_RETENTION_MS, 2 * longest_lag_ms)
        out.append(Problem(
            topic, "delete.retention.ms", str(retention),
            f"shorter than the longest sink lag ({duration(longest_lag_ms)}): that sink may miss deletes for good",
            f"raise it to {wanted} (cdc topics ensure does) and catch the sink up, or rebuild its store",
            True, ("delete.retention.ms", str(wanted)),
        ))
    insync = _int(configs.get("min.insync.replicas")) or 1
    if insync > replication_factor > 0:
        fixed = min(config.min_insync_replicas, replication_factor)
        out.append(Problem(
            topic, "min.insync.replicas", str(insync),
            f"above the topic's replication factor {replication_factor}: every write with acks=all fails",
            f"set it to {fixed} (cdc topics ensure does)", False, ("min.insync.replicas", str(fixed)),
        ))
    elif insync < config.min_insync_replicas <= replication_factor:
        out.append(Problem(
            topic, "min.insync.replicas", str(insync),
            f"below [topic] min_insync_replicas = {config.min_insync_replicas}: an acknowledged record can be "
            "lost with fewer brokers", f"set it to {config.min_insync_replicas} (cdc topics ensure does)",
            True, ("min.insync.replicas", str(config.min_insync_replicas)),
        ))
    if 0 < replication_factor < config.replication_factor:
        out.append(Problem(
            topic, "replication factor", str(replication_factor),
            f"below [topic] replication_factor = {config.replication_factor}: the topic survives fewer broker losses",
            "add replicas with kafka-reassign-partitions.sh (a configuration change cannot)", True,
        ))
    largest = _int(configs.get("max.message.bytes"))
    if largest is not None and largest < config.max_message_bytes:
        out.append(Problem(
            topic, "max.message.bytes", str(largest),
            f"below [topic] max_message_bytes = {config.max_message_bytes}: the daemon stops on a record this topic "
            "refuses", f"raise it to {config.max_message_bytes} (cdc topics ensure does)",
            False, ("max.message.bytes", str(config.max_message_bytes)),
        ))
    return out


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


def duration(ms: int) -> str:
    """A span of time for people: `45 s`, `12.5 min`, `3.2 h`, `7.0 d`."""
    seconds = ms / 1000
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"
