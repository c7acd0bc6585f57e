"""Record producers behind one small interface: kafka-python (default) or confluent-kafka.

Both are configured for the ordering invariant in docs/design.md: acks=all, the idempotent
producer (so the client's own retries keep per-partition order), and the same partitioner.
Both clients get the partition computed here with Kafka's murmur2 (the per-partition
acknowledgement counts need it at send time); librdkafka is also set to `murmur2_random`,
the same function, for any record sent without one. tests/test_producer.py checks placement.
A delivery failure is never handled here: the daemon rewinds to the last confirmed LSN.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from cdc.config import TopicConfig
from cdc.kafka import partitioner
from cdc.kafka.security import librdkafka_security, security_settings

log = logging.getLogger(__name__)

# Kafka's per-record and per-batch framing, on top of key + value bytes: a record that fits
# `max.message.bytes` with this headroom is accepted by any broker version.
RECORD_OVERHEAD = 128


class ProducerError(Exception):
    """A record was not acknowledged; everything after the last confirmed LSN must be resent."""


class RecordTooLarge(Exception):
    """A single record can never be accepted under the current topic limit."""

    @classmethod
    def of(cls, table: str, key: bytes, size: int, topic: str, limit: int) -> RecordTooLarge:
        return cls(
            f"record for table {table} key {key.decode(errors='replace')[:200]} is {size} bytes, above topic "
            f"{topic}'s max.message.bytes={limit}: raise [topic] max_message_bytes and the topic's "
            "max.message.bytes, then restart (nothing after this transaction was confirmed)"
        )


Mark = dict[tuple[str, int], int]  # (topic, partition) -> records sent there so far


class Producer(Protocol):
    """Sends records and counts acknowledgements per partition.

    Kafka completes the records of one partition in send order, so "everything sent
    before this point is acknowledged" is a per-partition count comparison: no object
    per record for the daemon to track."""

    def send(self, topic: str, key: bytes, value: bytes | None) -> None: ...

    def mark(self) -> Mark:
        """A point in the send order; `reached` tells when everything before it is acknowledged."""
        ...

    def reached(self, mark: Mark) -> bool:
        """Raises ProducerError if any record failed."""
        ...

    def in_flight(self) -> int: ...

    def poll(self) -> None: ...

    def flush(self, timeout_s: float) -> bool: ...

    def close(self) -> None: ...


class _Counts:
    """Per-partition sent/acknowledged counts and the first failure, shared by both clients."""

    def __init__(self, partition_counts: dict[str, int]) -> None:
        # (topic, partition) keys made once, not per record; the count to pick a partition
        self._partitions = {topic: (n, [(topic, p) for p in range(n)]) for topic, n in partition_counts.items()}
        self._partition_for = partitioner.fast_partition_for  # the accelerator switch, read per producer
        self.sent: dict[tuple[str, int], int] = {}
        self.acked: dict[tuple[str, int], int] = {}
        self.touched: set[tuple[str, int]] = set()
        self.total_sent = 0
        self.total_acked = 0
        self.failure: BaseException | None = None

    def _place(self, topic: str, key: bytes) -> tuple[str, int]:
        """The record's (topic, partition), counted as sent. Counted before the client takes
        it: a send that raises ends this producer's life (the daemon rewinds with a new one)."""
        count, tps = self._partitions[topic]
        tp = tps[self._partition_for(key, count)]
        sent = self.sent
        sent[tp] = sent.get(tp, 0) + 1
        self.touched.add(tp)
        self.total_sent += 1
        return tp

    def mark(self) -> Mark:
        # Marks are checked in order, so one only needs the partitions written since the last.
        sent = self.sent
        mark = {tp: sent[tp] for tp in self.touched}
        self.touched.clear()
        return mark

    def _check(self, mark: Mark) -> bool:
        if self.failure is not None:
            raise ProducerError(str(self.failure) or type(self.failure).__name__)
        acked = self.acked
        return all(acked.get(tp, 0) >= n for tp, n in mark.items())

    def in_flight(self) -> int:
        return self.total_sent - self.total_acked


class KafkaPythonProducer(_Counts):
    """kafka-python, partitions chosen here so every client agrees (murmur2 on the key bytes)."""

    def __init__(self, config: TopicConfig, partition_counts: dict[str, int]) -> None:
        from kafka import KafkaProducer

        super().__init__(partition_counts)
        self._futures: dict[tuple[str, int], deque] = {}
        self._producer = KafkaProducer(
            bootstrap_servers=config.bootstrap_servers.split(","),
            client_id="cdc",
            acks="all",
            enable_idempotence=True,
            max_in_flight_requests_per_connection=5,
            linger_ms=config.linger_ms,
            batch_size=min(config.batch_size, config.max_message_bytes),  # a batch the topic accepts whole
            max_request_size=max(config.max_message_bytes + RECORD_OVERHEAD, config.batch_size),
            delivery_timeout_ms=config.delivery_timeout_ms,
            request_timeout_ms=min(30000, config.delivery_timeout_ms - config.linger_ms - 1),
            max_block_ms=10000,
            bootstrap_timeout_ms=int(config.connect_timeout_s * 1000),
            allow_auto_create_topics=False,
            **security_settings(config),
        )
        self._send = self._producer.send

    def send(self, topic: str, key: bytes, value: bytes | None) -> None:
        tp = self._place(topic, key)
        future = self._send(topic, value=value, key=key, partition=tp[1])
        queue = self._futures.get(tp)
        if queue is None:
            queue = self._futures[tp] = deque()
        queue.append(future)

    def reached(self, mark: Mark) -> bool:
        acked = self.acked
        for tp, queue in self._futures.items():
            done = 0
            while queue and queue[0].is_done:
                future = queue.popleft()
                if future.exception is not None and self.failure is None:
                    self.failure = future.exception
                done += 1
            if done:
                acked[tp] = acked.get(tp, 0) + done
                self.total_acked += done
        return self._check(mark)

    def poll(self) -> None:
        """kafka-python delivers from its own I/O thread: nothing to serve here."""

    def flush(self, timeout_s: float) -> bool:
        try:
            self._producer.flush(timeout=timeout_s)
        except Exception:  # a timeout or failure shows up in the deliveries, read by the caller
            return False
        return True

    def close(self) -> None:
        """Abandon unacknowledged records (the daemon rewinds and resends them) and make sure
        this producer's I/O thread is gone, so none of its retries can land after the resends."""
        from kafka.errors import KafkaError

        try:
            self._producer.close(timeout=0.5)
        except KafkaError:  # kafka-python's close flushes first and raises while records are pending
            sender = self._producer._sender
            if sender is not None:
                sender.force_close()
                sender.join(10)
            self._producer._closed = True


class ConfluentProducer(_Counts):
    """confluent-kafka (librdkafka): several times faster per record than kafka-python."""

    def __init__(self, config: TopicConfig, partition_counts: dict[str, int]) -> None:
        from confluent_kafka import Producer as _Producer

        super().__init__(partition_counts)
        settings = {
            "bootstrap.servers": config.bootstrap_servers,
            "client.id": "cdc",
            "acks": "all",
            "enable.idempotence": True,
            "partitioner": "murmur2_random",
            "linger.ms": config.linger_ms,
            "batch.size": min(config.batch_size, config.max_message_bytes),
            "message.max.bytes": max(config.max_message_bytes + RECORD_OVERHEAD, config.batch_size),
            "delivery.timeout.ms": config.delivery_timeout_ms,
            "queue.buffering.max.messages": 1000000,
            "on_delivery": self._delivered,  # one callback for every record: none passed per send
            **librdkafka_security(config),
        }
        self._producer = _Producer(settings, logger=log)
        self._produce = self._producer.produce
        self._poll = self._producer.poll

    def _delivered(self, err, msg) -> None:
        """librdkafka's delivery report, one per record, served inside poll()."""
        if err is not None:
            if self.failure is None:
                self.failure = ProducerError(str(err))
            return
        tp = (msg.topic(), msg.partition())
        self.acked[tp] = self.acked.get(tp, 0) + 1
        self.total_acked += 1

    def send(self, topic: str, key: bytes, value: bytes | None) -> None:
        partition = self._place(topic, key)[1]
        try:
            self._produce(topic, value, key, partition)
        except BufferError:  # local queue full: serve deliveries until it takes the record
            while True:
                self._poll(0.05)
                try:
                    self._produce(topic, value, key, partition)
                    break
                except BufferError:
                    continue

    def reached(self, mark: Mark) -> bool:
        return self._check(mark)

    def poll(self) -> None:
        self._poll(0)

    def flush(self, timeout_s: float) -> bool:
        return self._producer.flush(timeout_s) == 0

    def close(self) -> None:
        """Abandon queued and in-flight records (no retries of them after this)."""
        self._producer.purge(in_queue=True, in_flight=True)
        self._producer.flush(5)


def make_producer(config: TopicConfig, partition_counts: dict[str, int]) -> Producer:
    """The producer named by `[topic] client`, for topics whose partition counts are known."""
    if config.client == "confluent":
        return ConfluentProducer(config, partition_counts)
    return KafkaPythonProducer(config, partition_counts)
