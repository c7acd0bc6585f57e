"""`cdc delta rebuild`: the warehouse's `current/` again from the topics, beside the one
readers use, then switched table by table.

`current/` is what a compacted topic restores (the latest row of every key); `changes/`
and `history/` are logs the topic no longer holds whole (`cdc delta rebuild-history`
rebuilds history/ from changes/). The rebuild is the Delta job under the name
`delta-rebuild`, writing only `current/` tables, under `<path>/_cdc/rebuild/current/`,
with its own checkpoint and bookkeeping (`<path>/_cdc/rebuild/delta-rebuild.json`). The
switch of a table is one Delta commit to `current/<schema>/<table>`: an overwrite with the
rebuilt table's rows. Readers keep reading the version before it until it commits (and
time travel keeps it); the live job's MERGEs go on (a MERGE that lost the race to the
commit is retried by the job, as any concurrent commit). One more position-guarded pass,
then into `current/` itself, brings what the live job wrote after the rebuild's last
pass; then the rebuilt tables, the bookkeeping, checkpoint and progress go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pyspark.sql import SparkSession

from sinks import hadoop
from sinks.batch import TableBatch
from sinks.delta import DeltaStore
from sinks.store import SinkStopped

log = logging.getLogger(__name__)

NAME = "delta-rebuild"
SWAP_ATTEMPTS = 8  # a table's switch that lost a race to the live job's commit, tried again


class CurrentOnly(DeltaStore):
    """A Delta store that writes `current/` alone, under `root`, with its bookkeeping at
    `record` (one place before the switch and after it)."""

    def __init__(self, spark: SparkSession, root: str, record: str, swapped: bool) -> None:
        super().__init__(spark, root, NAME)
        self.record = record
        self.swapped = swapped

    def steps(self) -> tuple[Callable[[TableBatch], None], ...]:
        return (self._current_alone,)

    def _current_alone(self, batch: TableBatch) -> None:
        self._write("current", self._current, batch)

    def clear(self) -> None:
        if self.swapped:  # never the readers' current/: a new rebuild starts over
            raise SinkStopped(f"{self.where}: the rebuild lost its bookkeeping after its switch; current/ is "
                              "switched already: run `cdc delta rebuild` again for a new one")
        super().clear()


class Rebuild:
    """The rebuild's folder under the warehouse, and the switch."""

    def __init__(self, spark: SparkSession, path: str) -> None:
        self.spark = spark
        self.path = path.rstrip("/")
        self.root = f"{self.path}/_cdc/rebuild"
        self.record = f"{self.root}/{NAME}.json"
        self.marker = f"{self.root}/swapped"  # every table switched: what is left is the last pass

    def store(self, swapped: bool) -> CurrentOnly:
        return CurrentOnly(self.spark, self.path if swapped else self.root, self.record, swapped)

    def swapped(self) -> bool:
        return hadoop.read_bytes(self.spark, self.marker) is not None

    def prepare(self, resumed: bool) -> None:
        """A new rebuild (no checkpoint): what an unfinished one left goes."""
        if not resumed:
            hadoop.delete(self.spark, self.root)

    def swap(self) -> list[tuple[str, int]]:
        """Every rebuilt table's rows into its `current/` table, one commit per table;
        (table path, rows) of each."""
        done = []
        for rebuilt in DeltaStore(self.spark, self.root).tables(("current",)):
            target = f"{self.path}/current/{rebuilt.rsplit('/_cdc/rebuild/current/', 1)[1]}"
            done.append((target, self._replace(rebuilt, target)))
        hadoop.write_bytes(self.spark, self.marker, b"1")
        return done

    def _replace(self, rebuilt: str, target: str) -> int:
        """One commit replacing `target`'s rows by `rebuilt`'s (new columns added)."""
        rows = self.spark.read.format("delta").load(rebuilt).localCheckpoint(eager=True)
        for attempt in range(SWAP_ATTEMPTS):
            try:
                rows.write.format("delta").mode("overwrite").option("mergeSchema", "true").save(target)
                log.info("%s: replaced by the rebuilt table %s", target, rebuilt)
                return rows.count()
            except Exception as exc:
                if not any(m in f"{type(exc).__name__} {exc}" for m in DeltaStore.transient[:2]) \
                        or attempt == SWAP_ATTEMPTS - 1:
                    raise
                log.info("%s: the switch lost a race to another commit (%s); again", target,
                         str(exc).splitlines()[0])
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def finish(self) -> None:
        hadoop.delete(self.spark, self.root)
