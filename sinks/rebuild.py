"""A rebuild's one shape, every store's: the store filled again beside the one readers use,
then switched (`cdc <store> rebuild`).

A store gives its `Generations` (the new one beside the live one, and the switch: the search
indexes' aliases, the cache's SWAPDB, the warehouse's one commit per table); `fill_and_switch`
runs the passes into the new generation until one is short, the switch, one more
position-guarded pass into the live store where the store wants one, and the clean-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pyspark.sql import SparkSession

from cdc.config import Config
from sinks import checkpoint as checkpoints
from sinks.query import StopSignal, ensure_topics
from sinks.runner import check, checkpoint, keep_running
from sinks.spark import job_session
from sinks.store import SinkStopped, Store
from sinks.topics import ProgressLog

S = TypeVar("S", covariant=True)

REBUILD_PASSES = 6  # a rebuild's passes before its switch, at most
CAUGHT_UP_S = 10.0  # a pass this short: the new generation is close enough behind to switch


class Generations(Protocol[S]):
    """A store's generation beside the live one (each store's `rebuild` module)."""

    name: str  # the rebuild's job: its checkpoint folder and progress record
    #: after the switch, one more position-guarded pass into the live store brings what the
    #: live job wrote after the rebuild's last pass (the cache: the live job never stops)
    last_pass: bool

    def swapped(self) -> bool: ...
    def store(self, swapped: bool) -> Store: ...
    def prepare(self, resumed: bool) -> None: ...
    def swap(self) -> S: ...
    def finish(self) -> None: ...


G = TypeVar("G", bound="Generations[Any]")


def rebuild(config: Config, name: str, generations: Callable[[SparkSession], G], stop: StopSignal,
                    untouched: str) -> tuple[G, Any]:
    """`cdc <name> rebuild`, every store's: its settings and server checked (the store's own
    checks of its generations come before, without Spark), the topics there, then in a Spark
    session of its own the generations `generations` makes, filled and switched; (them, what
    the switch returned)."""
    check(config, name)
    ensure_topics(config)
    with job_session(f"cdc-{name}-rebuild", config.spark) as spark:
        stop.install()
        made = generations(spark)
        return made, fill_and_switch(spark, config, made, stop, untouched, f"cdc {name} rebuild")


def fill_and_switch(spark: SparkSession, config: Config, generations: Generations[S], stop: StopSignal,
                    untouched: str, command: str) -> S | None:
    """The rebuilds' one shape after the store's own checks: passes into the new generation,
    the switch, the last pass into the live store where the generations want one, the
    clean-up; what the switch returned (None: an earlier run had switched and stopped
    before its clean-up)."""
    switched = None
    if not generations.swapped():  # else an earlier run stopped after its switch
        store = generations.store(swapped=False)
        generations.prepare(resumed=checkpoints.last_committed(spark, checkpoint(config, store.name)) is not None)
        passes(spark, config, store, stop)
        if stop():
            raise SinkStopped(f"the rebuild stopped before its switch; {untouched}: run `{command}` again to go on "
                              "from where it stopped")
        switched = generations.swap()
    if generations.last_pass:
        keep_running(spark, config, generations.store(swapped=True), True, lambda: False)  # it finishes
    generations.finish()
    checkpoints.drop(spark, checkpoint(config, generations.name))
    ProgressLog(config.topic, generations.name).forget()
    return switched


def passes(spark: SparkSession, config: Config, store: Store, stop: StopSignal) -> None:
    """Passes to the topics' end, again until one is short (under CAUGHT_UP_S, or, after the
    first, one micro-batch: a store whose every batch takes longer, as a warehouse's MERGE
    on a small machine, still stops): what came while the last one ran."""
    for done in range(REBUILD_PASSES):
        started = time.monotonic()
        progress = keep_running(spark, config, store, True, stop)
        if stop() or time.monotonic() - started < CAUGHT_UP_S or (done and progress.batches <= 1):
            return
