"""`cdc delta rebuild`: the warehouse's `current/` again from the topics, beside the one
readers use, then switched table by table.

`current/` is what a compacted topic restores (the latest row of every key); `changes/`
and `history/` are logs the topic no longer holds whole (`cdc delta rebuild-history`
rebuilds history/ from changes/). The rebuild is the Delta job under the name
`delta-rebuild`, writing only `current/` tables, under `<path>/_cdc/rebuild/current/`,
with its own checkpoint and bookkeeping (`<path>/_cdc/rebuild/delta-rebuild.json`).

The switch, with a running `cdc sink delta` paused between two of its batches
(sinks.handover): the rebuilt tables read the topics up to exactly the offsets the live
job planned last, then each `current/<schema>/<table>` gets one Delta commit that
overwrites its rows with the rebuilt table's. Readers read the version before it until it
commits (time travel keeps it). Both sides then reflect the same records, so the live job
goes on from its own offsets: a batch it planned before the pause and reads again applies
what the rebuilt table holds already, and its MERGE is position-guarded. No pass of the
rebuild writes `current/` itself: `current/` keeps no deletes, so a pass applying offsets
the live job had applied already could bring back a row a later delete removed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pyspark.sql import SparkSession

from cdc.config import Config
from sinks import checkpoint as checkpoints
from sinks import hadoop
from sinks.batch import TableBatch
from sinks.handover import STALE_S, RebuildSide
from sinks.pipeline import SinkJob
from sinks.query import StopSignal
from sinks.runner import checkpoint
from sinks.store import SinkStopped
from sinks.stores.delta.store import DeltaStore
from sinks.topics import read_range

log = logging.getLogger(__name__)

NAME = "delta-rebuild"
LIVE = "delta"  # the live job's name: its checkpoint, its lease
LIVE_PASS_S = 300.0  # how long a switch waits for a running live job to get past the rebuild's passes


class CurrentOnly(DeltaStore):
    """A Delta store that writes `current/` alone, under the rebuild's folder."""

    def __init__(self, spark: SparkSession, root: str, small_merge_rows: int) -> None:
        super().__init__(spark, root, NAME, small_merge_rows)
        self.record = hadoop.under(root, f"{NAME}.json")
        self.handover = None  # the rebuild does not pause for itself

    def open(self, resumed: bool) -> None:
        """No change log here: the rebuild writes `current/` tables alone."""

    def after_tables(self, batches: list[TableBatch], batch_id: int, lineage: str | None) -> None:
        """The change log is the live job's (the rebuild reads what it holds already)."""


class Rebuild:
    """The rebuild's folder under the warehouse, and the switch."""

    name = NAME
    last_pass = False  # the live job is paused through the switch: nothing to bring after it

    def __init__(self, spark: SparkSession, config: Config, stop: Callable[[], bool]) -> None:
        self.spark = spark
        self.config = config
        self.stop = stop
        self.path = config.delta.path.rstrip("/")
        self.root = f"{self.path}/_cdc/rebuild"
        self.marker = f"{self.root}/swapped"  # every table switched: what is left is the clean-up

    def store(self, swapped: bool) -> CurrentOnly:
        assert not swapped, "the Delta rebuild has no pass after its switch"
        return CurrentOnly(self.spark, self.root, self.config.delta.small_merge_rows)

    def swapped(self) -> bool:
        return hadoop.read_bytes(self.spark, self.marker) is not None

    def prepare(self, resumed: bool) -> None:
        """A new rebuild (no checkpoint): what an unfinished one left goes."""
        if not resumed:
            hadoop.delete(self.spark, self.root)

    def swap(self) -> list[tuple[str, int]]:
        """With the live job paused (or not running): the rebuilt tables up to its offsets,
        then each one's rows into its `current/` table, one commit per table; (table path,
        rows) of each."""
        handover = RebuildSide(self.spark, self.path, LIVE)
        self._let_live_pass(handover)
        handover.request()
        try:
            live = handover.wait_for_live(self.stop)
            log.info("cdc sink delta %s; the rebuilt tables catch up to its offsets", live)
            self._catch_up()
            done = []
            for rebuilt in DeltaStore(self.spark, self.root).tables(("current",)):
                if not handover.held():
                    raise SinkStopped("the rebuild's request to pause `cdc sink delta` went stale (the rebuild was "
                                      f"stalled for over {STALE_S:.0f} s) and the job went on; the tables switched so "
                                      "far are whole: run `cdc delta rebuild` again")
                target = f"{self.path}/current/{rebuilt.rsplit('/_cdc/rebuild/current/', 1)[1]}"
                done.append((target, self._replace(rebuilt, target)))
            hadoop.write_bytes(self.spark, self.marker, b"1")
            return done
        finally:
            handover.release()

    def _let_live_pass(self, handover: RebuildSide) -> None:
        """Before the pause, give a running live job up to LIVE_PASS_S to commit past where
        the rebuild's passes ended. Else it would read that stretch again after the switch,
        over rows that are ahead of it: a row deleted in it would show until the job got to
        the delete again (for a batch or so)."""
        ours = checkpoints.committed_offsets(self.spark, checkpoint(self.config, NAME))
        live = checkpoint(self.config, LIVE)
        deadline = time.monotonic() + LIVE_PASS_S
        while ours and handover.live_running() and time.monotonic() < deadline and not self.stop():
            theirs = checkpoints.committed_offsets(self.spark, live) or {}
            if all(theirs.get(topic, {}).get(part, 0) >= offset for topic, parts in ours.items()
                   for part, offset in parts.items()):
                return
            time.sleep(1.0)

    def _catch_up(self) -> None:
        """One batch into the rebuilt tables from where their passes ended up to where the
        live job's last planned batch ends (a partition the rebuild read further, the live
        job not running or slow, stays as it is: the job reads it again, position-guarded)."""
        live = checkpoints.offsets(self.spark, checkpoint(self.config, LIVE))
        if live is None:
            return  # the live job never started: it reads everything, from the earliest offsets
        mine = checkpoint(self.config, NAME)
        committed = checkpoints.last_committed(self.spark, mine)
        read = checkpoints.committed_offsets(self.spark, mine) or {}
        start: dict[str, dict[int, int]] = {}
        end: dict[str, dict[int, int]] = {}
        for topic, parts in live.items():
            for part, offset in parts.items():
                have = read.get(topic, {}).get(part, -2)
                if (have == -2 and offset > 0) or 0 <= have < offset:
                    start.setdefault(topic, {})[part] = have
                    end.setdefault(topic, {})[part] = offset
        if not end:
            return
        job = SinkJob(self.spark, self.config, self.store(swapped=False))  # one batch: a stop waits for it
        try:
            job.begin(mine)
            job(read_range(self.spark, self.config.topic, start, end), 0 if committed is None else committed + 1)
        finally:
            job.close()

    def _replace(self, rebuilt: str, target: str) -> int:
        """One commit replacing `target`'s rows by `rebuilt`'s (new columns added)."""
        rows = self.spark.read.format("delta").load(rebuilt).localCheckpoint(eager=True)
        rows.write.format("delta").mode("overwrite").option("mergeSchema", "true").save(target)
        log.info("%s: replaced by the rebuilt table %s", target, rebuilt)
        return rows.count()

    def finish(self) -> None:
        hadoop.delete(self.spark, self.root)


def rebuild_here(config: Config, stop: StopSignal) -> list[tuple[str, int]]:
    """`cdc delta rebuild`: every table's `current/` again from the topics, beside the one
    readers use, then one commit per table replacing its rows; (table path, rows) per table
    switched.

    Passes until one is short (sinks.rebuild), then the switch, with a running `cdc sink
    delta` paused between two batches (sinks.handover) while the rebuilt tables catch up to
    exactly its offsets and replace its tables; then the rebuilt tables and the rebuild's
    checkpoint go."""
    from sinks.rebuild import rebuild

    _, switched = rebuild(config, "delta", lambda spark: Rebuild(spark, config, stop), stop, "current/ is untouched")
    return switched or []
