"""The Delta warehouse: `current/` (the tables now), the one change log `changes/` and
`history/` (every version), kept by `cdc sink delta` (store.py) and its history query
(history.py); `cdc verify`'s side (read.py, or read_spark.py on Spark); `cdc delta rebuild`'s
generations (generations.py) and the warehouse's upkeep verbs (verbs.py).

This module is what the registry and the config loader read at every start: its settings
and its registration, nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc.config import opt
from sinks.stores import Registration


@dataclass
class DeltaConfig:
    """`[delta]`: the Delta warehouse (`cdc sink delta`)."""

    path: str = opt(
        "", "folder (or `s3a://`, `abfss://` URI) of the warehouse: `current/`, `changes/` and `history/` "
        "under it", optional=True,
    )
    history_interval_s: float = opt(
        30.0, "time between the starts of the history query's batches while streaming (`history/` is kept from "
        "the change log by a query of its own: fewer, bigger batches cost fewer commits)", low=0, high=86400,
    )
    history_batch_bytes: int = opt(
        268435456, "most bytes of the change log's files one history batch reads (at least one file); bounds its "
        "memory", low=1,
    )
    verify_reader: str = opt(
        "auto", "how `cdc verify` reads `current/`: `auto`: delta-rs, without a Spark session, for a local table "
        "of at most 64 MiB of data files that delta-rs reads (no deletion vectors, column mapping or type "
        "widening), Spark (hashing where the data is) for the others; `spark`: always Spark; `delta-rs`: "
        "delta-rs whatever the size (Spark still for the tables it cannot read)",
        choices=("auto", "spark", "delta-rs"),
    )
    small_merge_rows: int = opt(
        10000, "a table's batch of at most this many records is merged into current/ and history/ by delta-rs, in a child "
        "process of the driver: a tenth of a Spark MERGE's CPU, which sets a batch's cost when it touches many "
        "tables. Bigger batches, a remote warehouse, and tables delta-rs does not write right (column mapping, "
        "type widening, data files with Spark's INT96 timestamps) are merged by Spark; 0: Spark merges every "
        "batch", low=0,
    )


REGISTRATION = Registration(
    "delta", "the Delta warehouse under [delta] path",
    "a Delta warehouse: current/ (the tables now), changes (every event, one log) and history/ (every "
    "version)",
    "Fill every table's current/ again from the topics in a folder of its own, then replace each "
    "table's rows in one commit: readers read the version before it until then (time travel keeps "
    "it). changes/ and history/ are not the topics' to restore (see rebuild-history). A running "
    "`cdc sink delta` goes on, paused between two of its batches for the switch; on [spark] master = "
    "spark://... it runs on the cluster.",
    settings=DeltaConfig, package=__name__, has_verbs=True,
)
