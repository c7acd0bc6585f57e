"""`cdc delta`'s verbs beside its rebuild: the warehouse's upkeep, each in a local Spark session
over the warehouse, stopped after the verb. Light to import (the CLI lists them at start):
Spark and Delta load when a verb runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from cdc.config import Config
from sinks.stores import Verb

if TYPE_CHECKING:
    from sinks.stores.delta.store import DeltaStore


@contextmanager
def _warehouse(config: Config, conf: dict[str, str] | None = None) -> Iterator[DeltaStore]:
    from sinks.spark import job_session
    from sinks.stores import check
    from sinks.stores.delta.store import DeltaStore

    check("delta", config)
    with job_session("cdc-delta-maintenance", config.spark, master="local[2]", conf=conf) as spark:
        yield DeltaStore(spark, config.delta.path)


def optimize(config: Config) -> Iterator[str]:
    with _warehouse(config) as store:
        for path, removed, added in store.optimize():
            yield f"{path}: {removed} files compacted into {added}"


def vacuum(config: Config, retain_hours: float) -> Iterator[str]:
    with _warehouse(config, {"spark.databricks.delta.retentionDurationCheck.enabled": "false"}) as store:
        for path in store.vacuum(retain_hours):
            yield f"{path}: vacuumed (retaining {retain_hours:g} h)"


def rebuild_history(config: Config) -> Iterator[str]:
    from sinks.stores.delta.history import HistoryStore
    from sinks.stores.delta.history import rebuild_history as rebuild

    with _warehouse(config) as store:
        for table, versions in rebuild(HistoryStore(store.spark, config.delta.path), config):
            yield f"{table}: {versions} versions"


def migrate(config: Config) -> Iterator[str]:
    with _warehouse(config) as store:
        moved = store.migrate()
        for table, rows in moved:
            yield f"{table}: {rows} rows moved into {store.log}"
        yield (f"delta migrate: {len(moved)} change tables moved" if moved else
               f"delta migrate: nothing to move, {store.log} is the change log already")


VERBS = [
    Verb("optimize", "Compact the small files the micro-batches wrote, in every table.", optimize),
    Verb("vacuum", "Delete files no recent version of any table needs.", vacuum, (
        click.Option(["--retain-hours"], type=float, default=168.0, show_default=True,
                     help="Keep files a version younger than this still needs (time travel and running readers)."),
    )),
    Verb("rebuild-history", "Rebuild every history/ table from the change log changes/ (every version it holds).",
         rebuild_history),
    Verb("migrate", "Move a warehouse written by cdc before the one change log (changes/<schema>/<table>) to the "
         "one log changes/, partitioned by _cdc_topic. Stop `cdc sink delta` first; a run stopped half-way can be "
         "run again.", migrate),
]
