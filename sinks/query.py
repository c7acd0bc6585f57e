"""A sink job's Structured Streaming query: the table topics through the batch function
(sinks.pipeline) until they are drained (`--once`) or a stop is requested; its checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from pyspark.sql import SparkSession

from cdc.config import Config
from cdc.kafka.topics import TopicAdmin
from sinks import topics
from sinks.pipeline import Progress, SinkJob, StopRequested


class QueryFailed(Exception):
    """The query stopped outside the batch function (its Kafka source, Spark itself)."""


def run(
    spark: SparkSession, config: Config, job: SinkJob, checkpoint: str, once: bool,
    stop_requested: Callable[[], bool] = lambda: False,
) -> Progress:
    """Run the job until its topics are drained (`once`) or a stop is requested.

    A failed batch fails the query: the error is raised here, and the caller may start
    the job again from the same checkpoint (nothing after the last good batch is lost).
    A rebuild that asks the store's live job to pause (sinks.handover) finds the query
    stopped between two batches until its switch is done; then the query starts again."""
    handover = job.store.handover
    try:
        while True:
            if handover is not None:
                handover.beat()
                if handover.requested():
                    handover.hold(stop_requested)
                    if stop_requested():
                        return job.progress
            if not _query(spark, config, job, checkpoint, once, stop_requested):
                return job.progress
    finally:
        if handover is not None:
            handover.end()


def _query(
    spark: SparkSession, config: Config, job: SinkJob, checkpoint: str, once: bool, stop_requested: Callable[[], bool],
) -> bool:
    """One query until drained or stopped (False), or until a rebuild asks for a pause (True)."""
    handover = job.store.handover
    job.begin(checkpoint)
    writer = job.feed.stream(spark, config).writeStream.foreachBatch(job).option("checkpointLocation", checkpoint)
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{job.feed.interval_s(config)} seconds")
    query = writer.queryName(f"cdc-sink-{job.store.name}").start()
    stopped = paused = False
    try:
        while query.isActive:
            if handover is not None:
                handover.beat()
                paused = handover.requested(fresh=False)
            if (stop_requested() or paused) and not job.running:
                # a batch that starts in between stops itself (StopRequested), uncommitted
                stopped = True
                query.stop()
                break
            if not once and job.quiet():
                job.look()
            time.sleep(0.2)
        stopped = stopped or isinstance(job.failure, StopRequested)
        if job.failure is not None and not stopped:
            raise job.failure
        if query.exception() is not None and not stopped:
            raise QueryFailed(str(query.exception()))
        job.look()  # drained or stopped: how complete the store is as the run leaves it
    finally:
        if query.isActive:
            query.stop()
    # stopped without a stop requested: a rebuild's pause, even if its request is gone by now
    # (the caller looks again; ending here would end the job)
    return stopped and handover is not None and not stop_requested()


def ensure_topics(config: Config) -> None:
    """The topics a job reads or writes beyond the tables' (a job may start before the daemon)."""
    prefix = config.topic.prefix
    admin = TopicAdmin(config.topic)
    try:
        admin.ensure([topics.internal(prefix, s) for s in (topics.SCHEMAS, topics.HEARTBEAT, topics.PROGRESS)], 1)
        admin.ensure([topics.internal(prefix, topics.DLQ)], 1, log_only=True)
    finally:
        admin.close()


class StopSignal:
    """SIGTERM/SIGINT ask the job to stop after its running batch. `install` after the
    SparkContext started: pyspark puts its own SIGINT handler in (cancel every job)."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.requested.set())

    def __call__(self) -> bool:
        return self.requested.is_set()
