"""Prometheus metrics of a sink job, served by its driver on `[spark] metrics_port` (0 = off).

The job calls `batch()` once per committed micro-batch and `retry()` from its retry loop,
and has its progress followed (`follow`): the LSN its store is complete up to is read from
it when Prometheus scrapes, also when no batch came in this run (a job started again with
nothing new to read), and so is the lag behind the slot, against the daemon's newest
heartbeats (followed here, not as the job reads them: a job far behind would read old ones).
Its own registry, like the daemon's (cdc.metrics), so several jobs in one process do not collide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cdc.config import Config, ConfigError
from cdc.kafka.follow import Heartbeats
from cdc.naming import table_of_topic

BATCH_SECONDS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class SinkMetrics:
    """Records applied per store and table, batches and their duration, dead letters, retries,
    the LSN the store is complete up to and its lag behind the slot in bytes and seconds."""

    def __init__(self, store: str, config: Config) -> None:
        self.store = store
        self.config = config
        self.registry = CollectorRegistry()
        r = self.registry
        self.records = Counter("cdc_sink_records", "Records applied to the store (events and tombstones)",
                               ["store", "table"], registry=r)
        self.batches = Histogram("cdc_sink_batch_duration_seconds", "Micro-batches committed, by duration",
                                 ["store"], buckets=BATCH_SECONDS, registry=r)
        self.dead_letters = Counter("cdc_sink_dead_letters", "Records sent to the dead-letter topic", ["store"],
                                    registry=r)
        self.retries = Counter("cdc_sink_retries", "Batches read again: a failed batch (failed), or every record "
                               "again after the store lost writes (store_lost)", ["store", "reason"], registry=r)
        for reason in ("failed", "store_lost"):
            self.retries.labels(store, reason)
        self.dead_letters.labels(store)
        self.complete_lsn: Callable[[], int] | None = None  # the job's progress, once it follows one
        self.heartbeats: Heartbeats | None = None
        self._lock = threading.Lock()
        r.register(_Progress(self))

    def serve(self) -> None:
        """The endpoint, and the heartbeats the lag is measured against; a port in use is one line."""
        spark = self.config.spark
        if not spark.metrics_port:
            return
        try:
            start_http_server(spark.metrics_port, addr=spark.metrics_host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {spark.metrics_host}:{spark.metrics_port} ({exc.strerror or exc}): "
                "set [spark] metrics_port to a free port (0 turns metrics off) or fix metrics_host"
            ) from None
        self.heartbeats = Heartbeats(self.config.topic)

    def follow(self, complete_lsn: Callable[[], int]) -> None:
        """Read the LSN the store is complete up to from the job (sinks.pipeline.SinkJob)."""
        self.complete_lsn = complete_lsn

    def batch(self, seconds: float, applied: dict[str, int], dead_letters: int) -> None:
        """One committed micro-batch: records applied per table topic, dead letters it sent."""
        store = self.store
        self.batches.labels(store).observe(seconds)
        for topic, count in applied.items():
            if count:
                self.records.labels(store, table_of_topic(topic)).inc(count)
        if dead_letters:
            self.dead_letters.labels(store).inc(dead_letters)

    def retry(self, reason: str) -> None:
        self.retries.labels(self.store, reason).inc()

    def lag(self, complete: int) -> tuple[int | None, float | None]:
        """For a store complete up to `complete`: bytes behind the slot's newest heartbeat,
        seconds since the topics first held a change the store lacks."""
        if self.heartbeats is None:
            return None, None
        with self._lock:  # scrapes may come in parallel
            self.heartbeats.poll()
            behind, seconds, _ = self.heartbeats.lag(complete)
        return behind, seconds

    def close(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.close()


class _Progress(Collector):
    """The complete-up-to LSN and the lag gauges, from the job's progress at each scrape (none
    before the job is followed; no lag without the heartbeats). A job that knows no LSN yet
    lags since the oldest heartbeat held: an alert on the lag fires for one stuck there."""

    def __init__(self, metrics: SinkMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        store = self.metrics.store
        complete = None if self.metrics.complete_lsn is None else self.metrics.complete_lsn()
        gauge = GaugeMetricFamily("cdc_sink_complete_lsn", "The LSN up to which the store reflects the source "
                                  "(0: none known yet)", labels=["store"])
        if complete is not None:
            gauge.add_metric([store], complete)
        yield gauge
        behind, seconds = self.metrics.lag(complete) if complete is not None else (None, None)
        lag_bytes = GaugeMetricFamily("cdc_sink_lag_bytes", "The slot's newest heartbeat LSN minus the LSN the "
                                      "store is complete up to", labels=["store"])
        lag_seconds = GaugeMetricFamily("cdc_sink_lag_seconds", "Since when the topics hold a change the store "
                                        "lacks (0: caught up)", labels=["store"])
        if behind is not None and seconds is not None:
            lag_bytes.add_metric([store], behind)
            lag_seconds.add_metric([store], seconds)
        yield lag_bytes
        yield lag_seconds
