"""The topic policy on a real broker: what cdc creates its topics with, what `cdc topics describe`
says of settings that lose data, and what `cdc topics ensure` repairs."""

from __future__ import annotations

import json
import math

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic

from cdc.config import TopicConfig
from cdc.kafka.policy import DAY_MS, DELETE_RETENTION_MS, HOUR_MS, problems
from cdc.naming import topic_name
from tests.support import ACCT, cdc, slot_of, start_streaming, wait_caught_up, write_config


def _describe(config) -> dict[str, dict]:
    done = cdc("topics", "describe", "--json", "--config", str(config))
    assert done.returncode == 0, done.stderr
    return {t["topic"]: t for t in json.loads(done.stdout)}


def _alter(servers: str, topic: str, settings: dict[str, str]) -> None:
    admin = KafkaAdminClient(bootstrap_servers=servers)
    try:
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=settings)], incremental=True)
    finally:
        admin.close()


def test_topics_get_the_policy_and_ensure_repairs_what_loses_data(tmp_path, db, broker_servers, topic_prefix):
    db.execute(ACCT)
    db.execute("CREATE TABLE public.other (id int PRIMARY KEY)")
    other = topic_name(topic_prefix, "public", "other")
    admin = KafkaAdminClient(bootstrap_servers=broker_servers)
    try:  # made by hand before cdc: compacted and deleted, and an out-of-sync replica may lead
        admin.create_topics([NewTopic(other, 3, 1, topic_configs={
            "cleanup.policy": "compact,delete", "retention.ms": "3600000", "unclean.leader.election.enable": "true",
        })])
    finally:
        admin.close()
    config = write_config(tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.*"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    db.execute("INSERT INTO public.acct VALUES (1, 1, 'x')")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    # the daemon warned at start, naming the fix
    assert (
        f"{other}: cleanup.policy=compact,delete: compacted and deleted: rows older than retention.ms=3600000 are "
        "dropped; set cleanup.policy=compact (cdc topics ensure does)"
    ) in daemon.output()

    topics = _describe(config)
    acct = topics[topic_name(topic_prefix, "public", "acct")]
    assert {k: v["value"] for k, v in acct["settings"].items() if v["policy"] is not None} == {
        "cleanup.policy": "compact", "min.compaction.lag.ms": str(HOUR_MS),
        "delete.retention.ms": str(DELETE_RETENTION_MS), "segment.ms": str(DAY_MS),
        "min.cleanable.dirty.ratio": "0.5", "min.insync.replicas": "1", "max.message.bytes": "1048588",
        "unclean.leader.election.enable": "false",
    }
    assert acct["problems"] == [] and acct["kind"] == "table"
    heartbeat = topics[f"{topic_prefix}.__cdc_heartbeat"]
    assert heartbeat["kind"] == "internal" and heartbeat["partitions"] == 1
    assert heartbeat["settings"]["cleanup.policy"]["value"] == "compact"
    assert [(p["setting"], p["loses_data"]) for p in topics[other]["problems"]] == [
        ("cleanup.policy", True), ("unclean.leader.election.enable", True),
    ]
    assert topics[other]["settings"]["segment.ms"]["from_broker_default"] is True

    # a topic cdc created, later set to delete by hand
    _alter(broker_servers, acct["topic"], {"cleanup.policy": "delete"})
    text = cdc("topics", "describe", "--config", str(config)).stdout
    assert (
        "problem (loses data): cleanup.policy=delete: not compacted: rows older than retention.ms are dropped and "
        "deleted rows are never forgotten; set cleanup.policy=compact (cdc topics ensure does), then re-snapshot"
    ) in text
    assert text.rstrip().endswith("3 problems")

    done = cdc("topics", "ensure", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert f"set {acct['topic']}: cleanup.policy=compact (was delete)" in done.stdout
    assert f"set {other}: cleanup.policy=compact (was compact,delete)" in done.stdout
    assert f"set {other}: unclean.leader.election.enable=false (was true)" in done.stdout
    assert f"set {other}: segment.ms={DAY_MS} (was 604800000)" in done.stdout  # a broker default: the policy's
    assert not any(t["problems"] for t in _describe(config).values())
    again = cdc("topics", "ensure", "--config", str(config))
    assert again.stdout.strip() == "topics ensure: 0 settings changed"

    # what a settings change cannot repair: one line, exit 1
    failed = cdc("topics", "ensure", "--config", str(config), env={"CDC_TOPIC_REPLICATION_FACTOR": "2"})
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: ")
    assert (
        f"{acct['topic']}: replication factor=1: below [topic] replication_factor = 2: the topic survives fewer "
        "broker losses; add replicas with kafka-reassign-partitions.sh (a configuration change cannot)"
    ) in failed.stderr


def test_a_delete_retention_shorter_than_a_sinks_lag_is_a_problem() -> None:
    config = TopicConfig()
    settings = {"cleanup.policy": "compact", "delete.retention.ms": "86400000", "min.insync.replicas": "1"}
    found = problems("p.public.t", "table", settings, 1, config, longest_lag_ms=2 * DAY_MS)
    assert [p.line() for p in found] == [
        "p.public.t: delete.retention.ms=86400000: shorter than the longest sink lag (2.0 d): that sink may miss "
        f"deletes for good; raise it to {DELETE_RETENTION_MS} (cdc topics ensure does) and catch the sink up, or "
        "rebuild its store"
    ]
    assert found[0].repair == ("delete.retention.ms", str(DELETE_RETENTION_MS))
    assert problems("p.public.t", "table", settings, 1, config, longest_lag_ms=3600000) == []
    assert problems("p.public.t", "table", settings, 1, config, longest_lag_ms=10 * DAY_MS)[0].repair == (
        "delete.retention.ms", str(20 * DAY_MS),
    )


def test_a_wide_schemas_topics_are_created_together_each_with_the_policy(broker_servers, topic_prefix) -> None:
    """More topics than one CreateTopics request carries: each one made compacted, with the
    configured partitions; one made by someone else first keeps its own; a create that loses
    the race to another process (the broker says the topic exists) is no error."""
    from cdc.kafka.topics import CREATE_AT_ONCE, TopicAdmin

    names = [topic_name(topic_prefix, "public", f"t{i}") for i in range(CREATE_AT_ONCE + 20)]
    other = KafkaAdminClient(bootstrap_servers=broker_servers)
    other.create_topics([NewTopic(names[7], 2, 1, topic_configs={"cleanup.policy": "compact"})])
    other.close()
    admin = TopicAdmin(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix, partitions=1))
    try:
        infos = admin.ensure(names)
        assert sorted(infos) == sorted(names)
        assert {(i.partitions, i.cleanup_policy) for n, i in infos.items() if n != names[7]} == {(1, "compact")}
        assert infos[names[7]].partitions == 2
        admin._create(names[:3], 1, log_only=False, retention_ms=-1)
    finally:
        admin.close()


def test_busy_tables_get_their_partitions_and_describe_names_a_table_that_would_gain_from_more(
    tmp_path, db, broker_servers, topic_prefix
) -> None:
    """[topic] table_partitions gives the matching tables' new topics their count (the first
    entry that matches), the others get [topic] partitions; `describe` shows each table
    topic's busiest partition's rate over the last hour, and `describe` and `ensure` name a
    table above BUSY_PARTITION_RATE with the count it would gain from, as advice (exit 0)."""
    from cdc.topic_commands import BUSY_PARTITION_RATE, RATE_MIN_SPAN_S

    db.execute("CREATE SCHEMA other")
    for table in ("public.hot", "public.warm", "other.busy"):
        db.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.*", "other.*"],
        topic={"partitions": 1, "table_partitions": ["public.hot=4", "public.*=2"]},
    )
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    busy = int(BUSY_PARTITION_RATE * RATE_MIN_SPAN_S * 1.5)  # within a minute: 1.5 x the rate
    db.execute(f"INSERT INTO other.busy SELECT g FROM generate_series(1, {busy}) g")
    db.execute("INSERT INTO public.hot SELECT g FROM generate_series(1, 100) g")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0

    topics = _describe(config)
    hot, warm, other = (topics[topic_name(topic_prefix, *t)] for t in (("public", "hot"), ("public", "warm"),
                                                                        ("other", "busy")))
    assert (hot["partitions"], warm["partitions"], other["partitions"]) == (4, 2, 1)
    assert topics[f"{topic_prefix}.__cdc_heartbeat"]["partitions"] == 1
    assert warm["records_per_s_busiest_partition"] == 0 and warm["advice"] is None
    assert 0 < hot["records_per_s_busiest_partition"] < BUSY_PARTITION_RATE and hot["advice"] is None
    rate = other["records_per_s_busiest_partition"]
    assert BUSY_PARTITION_RATE < rate <= busy / RATE_MIN_SPAN_S
    advice = (
        f"its busiest partition took {rate:,.0f} records/s over the last hour, more than a consumer reading it with "
        f"one task (a Kafka Connect sink) applies: give the table {math.ceil(rate / BUSY_PARTITION_RATE)} partitions "
        f"in a new topic ([topic] table_partitions = [\"<schema.table>={math.ceil(rate / BUSY_PARTITION_RATE)}\"], "
        "see Choosing partitions); adding partitions to this one would move keys between partitions and break their "
        "order"
    )
    assert other["advice"] == advice
    text = cdc("topics", "describe", "--config", str(config)).stdout
    assert f"  advice: partitions=1: {advice}\n" in text
    assert f"  busiest partition              {rate:,.1f} records/s over the last hour\n" in text
    assert text.rstrip().endswith(", 1 table busy enough to gain from more partitions")
    done = cdc("topics", "ensure", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert f"advice: {other['topic']}: {advice}" in done.stdout.splitlines()

    # the entries gone: the topics keep their counts, and the start says so in one line
    daemon = start_streaming(config, tmp_path / "again.log", db.dsn, slot, env={"CDC_TOPIC_TABLE_PARTITIONS": ""})
    assert daemon.stop() == 0
    assert (
        f"2 topics exist with other partition counts than the 1 a new one would get: {hot['topic']} (4), "
        f"{warm['topic']} (2) ([topic] partitions and table_partitions apply to new topics only, see Choosing "
        "partitions)"
    ) in daemon.output()
