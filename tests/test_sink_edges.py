"""A sink job at the edge of its topics: a table's topic deleted and created again under it.
(The edges every store passes, by the same code, are in tests/test_every_store.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cdc.local.redis import LocalRedis
from cdc.naming import topic_name
from tests.support import Sink, wait_caught_up, write_config

PARTITIONS = 3


def test_a_topic_created_again_under_the_job_stops_it_in_one_line(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, redis_server: LocalRedis
) -> None:
    """A table's topic deleted and created again starts its offsets over: what the job's
    checkpoint and store know of the old one no longer holds (Delta's offset watermarks would
    skip the new records), so the job stops and says how to rebuild."""
    import time

    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    from cdc.config import TopicConfig
    from cdc.kafka.reader import read_topic
    from tests.support import wait_for

    db.execute("CREATE TABLE public.acct (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.acct SELECT g, 'v' || g FROM generate_series(1, 20) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    config = write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                          cache={"url": redis_server.url}, spark={"checkpoint_dir": str(tmp_path / "checkpoints")})
    sink = Sink(config, tmp_path / "cache.log", store="cache")
    sink.once()
    topic = topic_name(topic_prefix, "public", "acct")
    records = list(read_topic(TopicConfig(bootstrap_servers=broker_servers), topic))
    admin = KafkaAdminClient(bootstrap_servers=broker_servers)
    admin.delete_topics([topic])
    wait_for(lambda: topic not in admin.list_topics(), 60, "the topic to go")
    for _ in range(60):  # the broker may still be removing it
        try:
            admin.create_topics([NewTopic(topic, PARTITIONS, 1, topic_configs={"cleanup.policy": "compact"})])
            break
        except Exception:  # noqa: BLE001 (TopicAlreadyExistsError while the deletion finishes)
            time.sleep(1)
    admin.close()
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    for r in records[:5]:
        producer.send(topic, key=r.key, value=r.value, partition=r.partition)
    producer.flush()
    producer.close()
    err = sink.once(exit_code=1)
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: topic {topic} was deleted and created again (id "), line
    assert line.endswith(
        "its offsets started over, and the cache job's checkpoint and store follow the old topic; rebuild the store "
        "from the topics: stop the job, clear the store and delete its checkpoint folder (cache under [spark] "
        "checkpoint_dir)"
    ), line
