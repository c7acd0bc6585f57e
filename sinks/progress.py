"""The sink jobs' progress records, `<prefix>.__cdc_sinks`: one compacted record per job.

Each job sends one after every micro-batch (`ProgressLog`): per table the highest commit
LSN applied, and the LSN up to which its store is complete. The job reads its own back
when it starts again; `cdc status` (the tombstone horizon) and `cdc verify` (whether a
store has applied everything up to a snapshot) read them all, and the history query follows
the warehouse job's (`Completed`). No pyspark here: the command line imports this module.
"""

from __future__ import annotations

from typing import Any

import orjson

from cdc.config import TopicConfig
from cdc.kafka.clients import producer
from cdc.kafka.follow import Follower
from cdc.kafka.reader import read_topic
from cdc.kafka.topics import ClientErrors, TopicError, connect_failure

SINKS_SUFFIX = "__cdc_sinks"


def sinks_topic(prefix: str) -> str:
    return f"{prefix}.{SINKS_SUFFIX}"


def read_progress(config: TopicConfig) -> dict[str, dict[str, Any]]:
    """Every sink job's latest progress record, by job name ({} when no job ever ran)."""
    from kafka.errors import KafkaError

    out: dict[str, dict[str, Any]] = {}
    seen = ClientErrors()
    try:
        with seen:
            for record in read_topic(config, sinks_topic(config.prefix), idle_timeout_s=10):
                if record.key is None:
                    continue
                if record.value is None:  # a job that is gone (a finished rebuild)
                    out.pop(record.key.decode(), None)
                else:
                    out[record.key.decode()] = orjson.loads(record.value)
    except LookupError:
        return {}
    except KafkaError as exc:  # one line naming the fix (an unreachable broker, TLS, SASL)
        raise TopicError(connect_failure(config, type(exc).__name__, seen.texts)) from None
    return out


class ProgressLog:
    """One job's records in `<prefix>.__cdc_sinks`, sent after each batch."""

    def __init__(self, config: TopicConfig, job: str) -> None:
        self.config = config
        self.job = job
        self.topic = sinks_topic(config.prefix)
        self._producer: Any = None

    def last(self) -> dict[str, Any] | None:
        """This job's latest record (None before its first batch)."""
        return read_progress(self.config).get(self.job)

    def send(self, progress: dict[str, Any]) -> None:
        self._send(orjson.dumps(progress))

    def forget(self) -> None:
        """A tombstone for the job: `cdc status` no longer lists it (a finished rebuild)."""
        self._send(None)
        self.close()

    def _send(self, value: bytes | None) -> None:
        if self._producer is None:
            self._producer = producer(self.config, "cdc-sink")
        self._producer.send(self.topic, key=self.job.encode(), value=value)
        self._producer.flush(30)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(5)


class Completed:
    """The LSN one job's store is complete up to, as its records arrive (`poll`; `newest`:
    None before its first record). The history query's feed is the warehouse job's change
    log, which holds no heartbeats: that job's progress vouches for it instead."""

    def __init__(self, config: TopicConfig, job: str) -> None:
        self.job = job.encode()
        self.newest: int | None = None
        self._follower = Follower(config, sinks_topic(config.prefix), client_id="cdc-sink-progress")

    def poll(self) -> None:
        for record in self._follower.poll():
            if record.key == self.job and record.value is not None:
                self.newest = int(orjson.loads(record.value).get("complete_lsn", 0))

    def close(self) -> None:
        self._follower.close()
