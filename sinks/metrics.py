"""Prometheus metrics of a sink job, served by its driver on `[spark] metrics_port` (0 = off).

The job calls `batch()` once per committed micro-batch and `retry()` from its retry loop,
and has its progress followed (`follow`): the LSN its store is complete up to is read from
it when Prometheus scrapes, also when no batch came in this run (a job started again with
nothing new to read). The lag behind the slot is measured against the daemon's newest
heartbeats (followed here, not as the job reads them: a job far behind would read old ones)
every POLL_S on a thread of its own: a scrape answers from the last measure, never waiting on
the broker.
Its own registry, like the daemon's (cdc.metrics), so several jobs in one process do not collide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cdc.config import Config, ConfigError
from cdc.kafka.follow import Heartbeats
from cdc.naming import table_of_topic
from cdc.oneline import first_line

BATCH_SECONDS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
POLL_S = 1.0  # between two measures of the lag (the daemon sends a heartbeat a second at most)

log = logging.getLogger(__name__)


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
        self._lag: tuple[int, float] | None = None  # bytes behind, and since when (epoch s), as last measured
        self._closing = threading.Event()
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
        self.measure(Heartbeats(self.config.topic))

    def measure(self, heartbeats: Heartbeats) -> None:
        """Measure the lag against `heartbeats` every POLL_S on a thread that alone uses them (a
        poll waits on the broker, without a bound while it is away; their client is not for
        two threads) and closes them once the metrics are closed."""
        threading.Thread(target=self._measuring, args=(heartbeats,), name=f"cdc-sink-lag-{self.store}",
                         daemon=True).start()

    def _measuring(self, heartbeats: Heartbeats) -> None:
        failed = False
        try:
            while not self._closing.is_set():
                try:
                    heartbeats.poll()
                    failed = False
                except Exception as exc:  # the broker away: measured again from the heartbeats held
                    if not failed:
                        log.warning("sink %s: no new heartbeats for its lag for now: %s", self.store,
                                    first_line(exc),
                                    extra={"store": self.store})
                    failed = True
                complete = None if self.complete_lsn is None else self.complete_lsn()
                if complete is not None:
                    now = time.time()
                    behind, seconds, _ = heartbeats.lag(complete, now)
                    self._lag = None if behind is None or seconds is None else (behind, now - seconds)
                self._closing.wait(POLL_S)
        finally:
            heartbeats.close()

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

    def lag(self) -> tuple[int | None, float | None]:
        """As last measured: bytes behind the slot's newest heartbeat, seconds since the topics
        first held a change the store lacks (still counting while a poll waits on the broker)."""
        lag = self._lag
        if lag is None:
            return None, None
        behind, since = lag
        return behind, max(0.0, time.time() - since) if behind else 0.0

    def close(self) -> None:
        """The measuring thread closes the heartbeats after its poll: one waiting on the broker
        does not hold up the job's exit."""
        self._closing.set()


class _Progress(Collector):
    """The complete-up-to LSN, from the job's progress at each scrape, and the lag gauges, as
    last measured (none before the job is followed; no lag without the heartbeats). A job that
    knows no LSN yet lags since the oldest heartbeat held: an alert on the lag fires for one
    stuck there."""

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
        behind, seconds = self.metrics.lag()
        lag_bytes = GaugeMetricFamily("cdc_sink_lag_bytes", "The slot's newest heartbeat LSN minus the LSN the "
                                      "store is complete up to", labels=["store"])
        lag_seconds = GaugeMetricFamily("cdc_sink_lag_seconds", "Since when the topics hold a change the store "
                                        "lacks (0: caught up)", labels=["store"])
        if behind is not None and seconds is not None:
            lag_bytes.add_metric([store], behind)
            lag_seconds.add_metric([store], seconds)
        yield lag_bytes
        yield lag_seconds
