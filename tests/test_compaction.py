"""Apache Kafka's log cleaner on cdc's topics: superseded records and, after
`delete.retention.ms`, tombstones are gone, and the topic still reads as the source table."""

from __future__ import annotations

from collections import Counter

import orjson
from kafka.admin import KafkaAdminClient, NewTopic

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic
from cdc.naming import topic_name
from compaction.table import build
from tests.support import (
    ACCT,
    EAGER_COMPACTION,
    slot_of,
    source_table,
    start_streaming,
    wait_caught_up,
    wait_for,
    write_config,
)


def test_log_cleaner_compacts_cdc_topics_to_the_source_table(tmp_path, db, eager_broker, topic_prefix):
    servers = eager_broker.bootstrap_servers
    topic = topic_name(topic_prefix, "public", "acct")
    admin = KafkaAdminClient(bootstrap_servers=servers)
    try:  # made ahead with eager settings; cdc accepts an existing compacted topic as it is
        admin.create_topics([NewTopic(topic, 3, 1, topic_configs=EAGER_COMPACTION)])
    finally:
        admin.close()
    db.execute(ACCT)
    config = write_config(tmp_path / "cdc.toml", db.dsn, servers, topic_prefix, ["public.acct"])
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)

    db.execute("INSERT INTO public.acct SELECT g, 1, 'new' FROM generate_series(0, 59) g")
    for _ in range(10):
        db.execute("UPDATE public.acct SET version = version + 1, note = md5(random()::text)")
    db.execute("DELETE FROM public.acct WHERE id < 20")
    wait_caught_up(db.dsn, slot, daemon)
    written = 60 * 11 + 20 * 2  # inserts, updates, and a delete event plus a tombstone per deleted row
    deleted_keys = {orjson.dumps({"id": i}) for i in range(20)}

    def compacted() -> bool:
        # Keep writing to the live keys: segments roll only when a record arrives after segment.ms.
        db.execute("UPDATE public.acct SET version = version + 1 WHERE id >= 20")
        wait_caught_up(db.dsn, slot, daemon)
        records = list(read_topic(TopicConfig(bootstrap_servers=servers), topic))
        per_key = Counter(r.key for r in records)
        return not deleted_keys & per_key.keys() and len(records) < written / 4

    wait_for(compacted, 180, "the log cleaner to drop superseded records and tombstones", poll=1.5)
    records = list(read_topic(TopicConfig(bootstrap_servers=servers), topic))
    ends: dict[int, int] = {}
    for r in records:
        ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
    assert sum(ends.values()) >= written  # offsets keep counting: compaction leaves gaps behind
    assert all(r.value is not None for r in records)  # no tombstone left: their retention passed
    table = build(records)
    assert table.order_violations() == []
    assert table.state() == source_table(db.dsn, "SELECT id, version, note FROM public.acct")
    assert daemon.stop() == 0
