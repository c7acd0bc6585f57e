"""The daemon's metrics over time, for `cdc report`: `<prefix>.__cdc_metrics`.

Every `[daemon] metrics_interval_s` the daemon sends one record keyed by its slot: the
confirmed LSN against the server's WAL end (the slot's lag in bytes and seconds), the
records and bytes it produced since it started, and what is still unacknowledged. A plain
log (`cleanup.policy=delete`) kept `RETENTION_MS`: every record counts as a point of the
plot, none supersedes another. The Prometheus endpoint answers "now"; this answers "when".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson

from cdc.events.records import Record
from cdc.kafka.policy import METRICS_SUFFIX

RETENTION_MS = 7 * 24 * 3600 * 1000


def metrics_topic(prefix: str) -> str:
    """One segment after the prefix, like the heartbeat: never a table's topic."""
    return f"{prefix}.{METRICS_SUFFIX}"


@dataclass(frozen=True)
class Sample:
    """One point of the daemon's history (`events` and `bytes` count from the daemon's start)."""

    slot: str
    ts_ms: int
    confirmed_lsn: int
    server_lsn: int
    lag_seconds: float
    events: int
    produced_bytes: int
    pending: int

    @property
    def lag_bytes(self) -> int:
        return max(0, self.server_lsn - self.confirmed_lsn)

    def record(self, prefix: str) -> Record:
        value = orjson.dumps({
            "slot": self.slot, "ts_ms": self.ts_ms, "confirmed_lsn": str(self.confirmed_lsn),
            "server_lsn": str(self.server_lsn), "lag_bytes": self.lag_bytes, "lag_seconds": self.lag_seconds,
            "events": self.events, "bytes": self.produced_bytes, "pending": self.pending,
        })
        return Record(metrics_topic(prefix), self.slot.encode(), value, METRICS_SUFFIX)

    @classmethod
    def parse(cls, value: bytes) -> Sample:
        raw = orjson.loads(value)
        return cls(
            raw["slot"], int(raw["ts_ms"]), int(raw["confirmed_lsn"]), int(raw["server_lsn"]),
            float(raw["lag_seconds"]), int(raw["events"]), int(raw["bytes"]), int(raw["pending"]),
        )


def now_ms() -> int:
    return int(time.time() * 1000)
