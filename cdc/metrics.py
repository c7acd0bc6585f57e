"""Prometheus metrics of the daemon, served on `[daemon] metrics_port` (0 = off).

Counters are updated per transaction, not per record, to keep the hot path lean.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class Metrics:
    """What an operator watches to know the pipeline keeps up: events and bytes produced,
    transactions acknowledged, errors by kind, the confirmed LSN against the server's WAL
    end (lag in bytes and seconds) and records still unacknowledged. Its own registry, so
    several daemons in one process (the tests) do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter("cdc_events", "Records produced (events and tombstones)", ["table"], registry=r)
        self.bytes = Counter("cdc_bytes", "Key and value bytes produced", registry=r)
        self.transactions = Counter("cdc_transactions", "Source transactions fully acknowledged", registry=r)
        self.errors = Counter("cdc_errors", "Errors by kind (each one a reconnect or rewind)", ["kind"], registry=r)
        self.acked_lsn = Gauge("cdc_last_acknowledged_lsn", "Highest LSN confirmed to PostgreSQL", registry=r)
        self.server_lsn = Gauge("cdc_server_wal_lsn", "Latest WAL end reported by the walsender", registry=r)
        self.lag_bytes = Gauge("cdc_lag_bytes", "Server WAL end minus the confirmed LSN", registry=r)
        self.lag_seconds = Gauge(
            "cdc_lag_seconds", "Age of the oldest unacknowledged commit (0 when caught up)", registry=r
        )
        self.pending = Gauge("cdc_pending_records", "Records sent but not yet acknowledged", registry=r)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
