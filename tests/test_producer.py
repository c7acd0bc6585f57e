"""Both producers put every key on the partition Kafka's Java client would pick (murmur2);
both readers read a topic whole or its last records per partition."""

from __future__ import annotations

import pytest

from cdc.config import TopicConfig
from cdc.kafka.partitioner import partition_for
from cdc.kafka.producer import make_producer
from cdc.kafka.reader import read_topic
from cdc.kafka.topics import TopicAdmin


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_records_land_on_the_murmur2_partition(broker_servers, topic_prefix, client):
    config = TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix, partitions=5, client=client)
    topic = f"{topic_prefix}.public.placement"
    admin = TopicAdmin(config)
    try:
        infos = admin.ensure([topic])
    finally:
        admin.close()
    assert infos[topic].partitions == 5 and infos[topic].cleanup_policy == "compact"
    producer = make_producer(config, {topic: 5})
    keys = [f'{{"id":{i}}}'.encode() for i in range(300)] + [f'{{"name":"k\\u00e9{i}"}}'.encode() for i in range(50)]
    for key in keys:
        producer.send(topic, key, b"{}")
    mark = producer.mark()
    assert sum(mark.values()) == len(keys)
    assert producer.flush(30)
    producer.poll()
    assert producer.reached(mark) and producer.in_flight() == 0
    producer.close()
    placed = {r.key: r.partition for r in read_topic(config, topic)}
    assert placed == {key: partition_for(key, 5) for key in keys}
    newest = {p: [k for k in keys if partition_for(k, 5) == p][-1] for p in range(5)}
    assert {r.partition: r.key for r in read_topic(config, topic, tail=1)} == newest
    assert len(list(read_topic(config, topic, tail=2))) == 10
