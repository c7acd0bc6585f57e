"""`cdc topics describe|ensure|clean-truncated`: the prefix's topics against the topic policy
(cdc.kafka.policy), and the truncate clean-up (compaction.truncates).

`describe` shows every setting of every topic with cdc's value and what it means for the
topic's consumers, and the problems (settings that lose data or stop the pipeline) with
their fixes. A `delete.retention.ms` is judged against the longest sink lag, from the sinks'
progress and the daemon's heartbeats (compaction.horizon). `ensure` repairs what a settings
change can repair, and gives the policy's value to every setting a topic takes from the
broker's defaults (settings set on the topic itself are left as they are, unless a problem).
`clean-truncated` asks the daemon streaming from the slot for tombstones of the rows truncates
removed (a logical message it reads in order with the changes), or writes them itself while
holding the slot's lock when no daemon runs (none can start meanwhile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cdc.config import Config
from cdc.kafka.policy import (
    MEANINGS,
    REPLICATION,
    SETTINGS,
    Problem,
    creation_configs,
    kind_of,
    problems,
)
from cdc.kafka.topics import TopicAdmin, TopicInfo

#: a table topic whose busiest partition took more records a second than this over the last
#: hour gets advice: a consumer that reads each partition with one task (a Kafka Connect sink)
#: applies a few thousand changes a second at best
BUSY_PARTITION_RATE = 1000.0
RATE_WINDOW_S = 3600.0
#: a burst shorter than this counts as spread over this long
RATE_MIN_SPAN_S = 60.0


@dataclass
class TopicReport:
    info: TopicInfo
    kind: str
    policy: dict[str, str]  # what cdc creates a topic of this kind with
    problems: list[Problem] = field(default_factory=list)
    rate: float | None = None  # a table topic's busiest partition, records/s over RATE_WINDOW_S

    @property
    def advice(self) -> str | None:
        """For a busy table topic, the partition count it would gain from and how to get it."""
        if self.rate is None or self.rate <= BUSY_PARTITION_RATE:
            return None
        wanted = max(self.info.partitions + 1, math.ceil(self.rate * self.info.partitions / BUSY_PARTITION_RATE))
        return (
            f"its busiest partition took {self.rate:,.0f} records/s over the last hour, more than a consumer "
            f"reading it with one task (a Kafka Connect sink) applies: give the table {wanted} partitions in a new "
            f'topic ([topic] table_partitions = ["<schema.table>={wanted}"], see Choosing partitions); adding '
            "partitions to this one would move keys between partitions and break their order"
        )

    def as_json(self) -> dict[str, Any]:
        info = self.info
        return {
            "topic": info.name, "kind": self.kind, "partitions": info.partitions,
            "replication_factor": info.replication_factor,
            "settings": {
                s.name: {
                    "value": info.configs.get(s.name), "policy": self.policy.get(s.name),
                    "from_broker_default": s.name in info.defaults, "meaning": s.meaning,
                }
                for s in SETTINGS
            },
            "records_per_s_busiest_partition": self.rate,
            "advice": self.advice,
            "problems": [
                {"setting": p.setting, "found": p.found, "why": p.why, "fix": p.fix, "loses_data": p.loses_data}
                for p in self.problems
            ],
        }


def clean_truncated(config: Config, patterns: list[str]) -> list[str]:
    """`cdc topics clean-truncated`: what was done or requested, one line each."""
    from cdc.naming import topic_name
    from cdc.source.preflight import check_server, connect_catalog, resolve_tables
    from cdc.source.slots import try_claim_slot
    from compaction.truncates import request_message
    from snapshot.incremental import MESSAGE_PREFIX
    from snapshot.plan import chosen_names

    slot = config.source.slot
    catalog = connect_catalog(config)
    try:
        check_server(catalog)
        tables = resolve_tables(catalog, config)
        names = chosen_names(tables, patterns)
        topics = {topic_name(config.topic.prefix, t.schema, t.table): t.display for t in tables if t.display in names}
        if try_claim_slot(catalog, slot):  # no daemon streams from the slot, and none starts while we hold it
            return _write_tombstones(config, topics)
        catalog.conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s::text)",
            (MESSAGE_PREFIX, request_message(slot, list(topics.values())).decode()),
        )
        return [f"requested a truncate clean-up of {', '.join(topics.values())} from the daemon streaming from slot "
                f"{slot} (its log says how many tombstones it wrote)"]
    finally:
        catalog.close()


def _write_tombstones(config: Config, topics: dict[str, str]) -> list[str]:
    """With the slot's lock held: tombstones for every key a truncate removed, table by table."""
    from cdc.kafka.producer import make_producer
    from compaction.truncates import read_truncated, truncated_keys
    from snapshot.state import deliver

    admin = TopicAdmin(config.topic)
    try:
        infos = admin.describe(list(topics))
    finally:
        admin.close()
    lines = []
    for topic, table in topics.items():
        if topic not in infos:
            lines.append(f"{table}: no topic {topic} yet, nothing to clean up")
            continue
        found, count = read_truncated(config.topic, topic)
        try:
            if count:
                producer = make_producer(config.topic, {topic: infos[topic].partitions})
                try:
                    for key in truncated_keys(found):
                        producer.send(topic, key, None)
                    deliver(producer, config.topic.delivery_timeout_ms / 1000)
                finally:
                    producer.close()
        finally:
            found.close()
        lines.append(f"{table}: {count} tombstones for rows a truncate removed")
    return lines


def longest_sink_lag(config: Config, tables: dict[str, int]) -> int | None:
    """How far behind the furthest sink is, in ms (None when no sink ever ran); `tables`: the
    table topics and their partition counts."""
    from compaction.horizon import sink_lags
    from sinks.progress import read_progress

    progress = read_progress(config.topic)
    if not progress:
        return None
    return max(lag.lag_ms for lag in sink_lags(config.topic, progress, tables).values())


def reports(config: Config, admin: TopicAdmin) -> list[TopicReport]:
    """Every topic of the prefix with its problems."""
    prefix = config.topic.prefix
    infos = admin.describe(admin.topics_with_prefix(prefix))
    kinds = {name: kind_of(prefix, name) for name in infos}
    tables = [infos[n] for n, k in kinds.items() if k == "table"]
    lag = longest_sink_lag(config, {t.name: t.partitions for t in tables})
    rates = admin.write_rates(tables, RATE_WINDOW_S, RATE_MIN_SPAN_S)
    out = []
    for name, info in sorted(infos.items()):
        kind = kinds[name]
        found = problems(name, kind, info.configs, info.replication_factor, config.topic, lag)
        out.append(TopicReport(info, kind, creation_configs(config.topic, kind), found, rates.get(name)))
    return out


def render(found: list[TopicReport]) -> str:
    """The human form of `describe`."""
    if not found:
        return "no topics yet (cdc run creates them)"
    lines = []
    for report in found:
        info = report.info
        lines.append(
            f"topic {info.name} ({report.kind}, {info.partitions} partitions, "
            f"{REPLICATION.name} {info.replication_factor})"
        )
        for setting in SETTINGS:
            value = info.configs.get(setting.name, "-")
            wanted = report.policy.get(setting.name)
            note = "" if wanted is None or wanted == value else f" (cdc's policy: {wanted})"
            origin = " [broker default]" if setting.name in info.defaults else ""
            lines.append(f"  {setting.name:<31}{value}{origin}{note}")
            lines.append(f"  {'':<31}{MEANINGS[setting.name]}")
        if report.rate is not None:
            lines.append(f"  {'busiest partition':<31}{report.rate:,.1f} records/s over the last hour")
        for problem in report.problems:
            lines.append(f"  problem{' (loses data)' if problem.loses_data else ''}: {problem.setting}={problem.found}: "
                         f"{problem.why}; {problem.fix}")
        if report.advice is not None:
            lines.append(f"  advice: partitions={info.partitions}: {report.advice}")
    count = sum(len(r.problems) for r in found)
    busy = sum(1 for r in found if r.advice is not None)
    lines.append(
        f"{len(found)} topics, {count} problems" + ("" if count else " (cdc topics ensure has nothing to repair)")
        + (f", {busy} {'table' if busy == 1 else 'tables'} busy enough to gain from more partitions" if busy else "")
    )
    return "\n".join(lines)


def ensure(config: Config, admin: TopicAdmin) -> tuple[list[str], list[Problem], list[str]]:
    """Repair what a settings change can: (what was changed, one line each; what is left;
    advice for busy tables, which only a new topic can follow)."""
    done, left, advice = [], [], []
    for report in reports(config, admin):
        if report.advice is not None:
            advice.append(f"{report.info.name}: {report.advice}")
        info, changes = report.info, {}
        for name, value in report.policy.items():
            if name in info.defaults and info.configs.get(name) != value:
                changes[name] = value
        for problem in report.problems:
            if problem.repair is None:
                left.append(problem)
            else:
                changes[problem.repair[0]] = problem.repair[1]
        if changes:
            admin.alter(info.name, changes)
            done += [f"{info.name}: {k}={v} (was {info.configs.get(k, '-')})" for k, v in sorted(changes.items())]
    return done, left, advice
