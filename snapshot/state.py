"""The daemon's durable snapshot state, kept in a compacted topic beside the data it describes.

An existing slot must not mean "the snapshot is done": a daemon killed halfway through its
initial snapshot leaves a slot behind. So the state says which tables have a complete
snapshot in the topics and how far an incremental snapshot got. It lives in Kafka (one
record per slot in `<prefix>.__cdc_state`, as Kafka Connect keeps its offsets), so it
moves with the topics: wipe the topics and the state goes with them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import orjson

from cdc.config import Config
from cdc.kafka.producer import Producer, ProducerError

STATE_SUFFIX = "__cdc_state"


def state_topic(prefix: str) -> str:
    """Never a table's topic: those have a schema and a table part after the prefix."""
    return f"{prefix}.{STATE_SUFFIX}"


@dataclass
class Incremental:
    """An incremental snapshot in progress: the queue of tables and where the current one is."""

    tables: list[str]  # display names (schema.table as SQL quotes them), first is current
    after: list[str] | None = None  # text of the last key emitted from the current table
    chunks: int = 0
    rows: int = 0


@dataclass
class SnapshotState:
    slot: str
    initial: str = "pending"  # pending, running, done or skipped (mode never)
    consistent_point: int | None = None
    done: list[str] = field(default_factory=list)  # tables whose snapshot is complete in the topics
    incremental: Incremental | None = None
    updated_ms: int = 0

    def to_bytes(self) -> bytes:
        self.updated_ms = int(time.time() * 1000)
        return orjson.dumps(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> SnapshotState:
        raw = orjson.loads(data)
        inc = raw.pop("incremental", None)
        return cls(**raw, incremental=Incremental(**inc) if inc else None)

    def mark_done(self, table: str) -> None:
        if table not in self.done:
            self.done.append(table)


def load_state(config: Config) -> SnapshotState | None:
    """The slot's latest state record, or None when there is none (or no state topic yet)."""
    from cdc.kafka.reader import read_topic

    key = config.source.slot.encode()
    found: SnapshotState | None = None
    try:
        for record in read_topic(config.topic, state_topic(config.topic.prefix)):
            if record.key == key:
                found = None if record.value is None else SnapshotState.from_bytes(record.value)
    except LookupError:
        return None
    return found


def send_state(producer: Producer, prefix: str, state: SnapshotState) -> None:
    producer.send(state_topic(prefix), state.slot.encode(), state.to_bytes())


def deliver(producer: Producer, timeout_s: float) -> None:
    """Wait until every record sent so far is acknowledged; raise if one failed or time ran out.
    Counts acknowledgements rather than trusting flush(): kafka-python's flush returns early
    when the broker made it split a batch and the pieces are still on their way."""
    deadline = time.monotonic() + timeout_s
    while True:
        producer.flush(max(0.1, deadline - time.monotonic()))
        producer.reached({})  # raises the first failure
        if not producer.in_flight():
            return
        if time.monotonic() >= deadline:
            raise ProducerError(f"{producer.in_flight()} records not acknowledged within {timeout_s:.0f} s")
        time.sleep(0.01)
