"""Where the Delta job's CPU per change goes, stage by stage, and what a design change does to it.

    python bench/delta_stages.py [--changes 200000] [--tables 5] [--batches 6] [--inserts 0.6]
                                 [--variants default,deletion-vectors,broadcast-source,no-materialize,flat-history]

bench/sinks.py measures the whole job against the textbook job on a real backlog; this one
takes its CPU apart, without Kafka or PostgreSQL. Each variant runs in a child process of
its own (a fresh driver JVM, the sink's session settings and the variant's). The child makes
--batches micro-batches of --changes change rows over --tables tables shaped like
bench/sinks.py's backlog tables (--inserts of new keys, 60 % by default, the rest updates of
random stored keys), stores each batch (`localCheckpoint`, as the job does after its read), then runs the
job's own code on it, timing the CPU of its process group (Python and JVM) per stage:

- decode: each table's rows decoded with its table version and stored
  (sinks.batch.decode_table, as sinks.pipeline.SinkJob._decode);
- current: each table's `current` MERGE (sinks.stores.delta.DeltaStore._current), the last change
  per key included;
- change log: the batch's one append (sinks.stores.delta.DeltaStore.after_tables);
- history: each table's `history` MERGE (sinks.stores.delta.history.HistoryStore._history), which
  the history query makes over its own batches (here one per job batch).

The first batch is reported apart (the JIT compiles most of Spark's and Delta's code then);
the others give the median CPU per stage, and per change; the last batch is shown too (the
tables are biggest then).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import figures
from capture import group_cpu_seconds

MARK = "@@stage "
STAGES = ("store the batch", "decode", "current", "change log", "history")
#: per variant: session settings over the sink's own, and whether the MERGE source is broadcast
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    # MERGE marks replaced rows in a deletion vector instead of rewriting their files
    "deletion-vectors": {"spark.databricks.delta.properties.defaults.enableDeletionVectors": "true"},
    # the last changes per key are broadcast to the MERGE's join: the table is not shuffled
    "broadcast-source": {},
    # Delta does not store the MERGE's source: it computes the last changes twice
    "no-materialize": {"spark.databricks.delta.merge.materializeSource": "none"},
    # `history` not partitioned by `_cdc_is_current` (as cdc wrote it before): the MERGE that
    # ends versions reads and rewrites the files of every version, not the current ones'
    "flat-history": {},
}


class Laps:
    """CPU seconds of a process group between calls, per stage."""

    def __init__(self, group: int) -> None:
        self.group = group
        self.spent: dict[str, float] = {}
        self.clock = group_cpu_seconds(group) or 0.0

    def __call__(self, stage: str) -> None:
        now = group_cpu_seconds(self.group) or 0.0
        self.spent[stage], self.clock = now - self.clock, now


def child(variant: str, changes: int, tables: int, batches: int, inserts: float, root: str) -> None:
    """One variant's run, reporting `MARK {json}` lines on stdout."""
    from pyspark.sql import functions as F

    from sinks.batch import decode_table, table_batch
    from sinks.spark import build_session
    from sinks.stores.delta import history as delta_history
    from sinks.stores.delta.history import HistoryStore
    from sinks.stores.delta.store import DeltaStore
    from sinks.versions import ColumnShape, Registry, Version

    spark = build_session("bench-delta-stages", conf=VARIANTS[variant])
    group = os.getpgid(0)
    columns = (
        ColumnShape("id", "int4", -1, True, {"type": "int32"}),
        ColumnShape("name", "text", -1, False, {"type": "string"}),
        ColumnShape("amount", "numeric", ((12 << 16) | 2) + 4, False, {"type": "string"}),
        ColumnShape("at", "timestamptz", -1, False, {"type": "string", "name": "io.debezium.time.ZonedTimestamp"}),
        ColumnShape("flag", "bool", -1, False, {"type": "boolean"}),
        ColumnShape("qty", "int4", -1, False, {"type": "int32"}),
    )
    topics = [f"bench.public.t{i}" for i in range(tables)]
    registry = Registry([Version("public", f"t{i}", topic, 1, columns) for i, topic in enumerate(topics)])
    store = DeltaStore(spark, root)
    store.open(resumed=False)
    if variant == "flat-history":
        delta_history.PARTITIONED_BY = None  # type: ignore[assignment]
    history = HistoryStore(spark, root)

    def change_rows(first: int) -> Any:
        """Change rows (sinks.envelope.CHANGE_COLUMNS, `_cdc_error`, `_value`) of one batch."""
        new = changes if first == 0 else int(changes * inserts)  # the first batch inserts only
        stored = 0 if first == 0 else changes + int((first - changes) * inserts)
        i = F.col("id") - first
        key = F.when(i < new, F.lit(stored) + i).otherwise(F.abs(F.xxhash64(F.col("id"))) % (stored + new))
        n = F.col("id")
        after = F.format_string(
            '{"id":%d,"name":"%s","amount":"%d.%02d","at":"2026-11-27T09:00:00.%06dZ","flag":%s,"qty":%d}',
            key.cast("int"), F.md5(n.cast("string")), n % 100000, n % 100, n % 1000000,
            F.when(n % 2 == 0, "true").otherwise("false"), (n % 1000).cast("int"),
        )
        text = F.lit(None).cast("string")
        return spark.range(first, first + changes).select(
            F.concat(F.lit("bench.public.t"), (n % tables).cast("string")).alias("_cdc_topic"),
            (n % 3).cast("int").alias("_cdc_partition"), n.alias("_cdc_offset"),
            F.format_string('{"id":%d}', key.cast("int")).alias("_cdc_key"),
            F.when(i < new, "c").otherwise("u").alias("_cdc_op"), (n * 100).alias("_cdc_lsn"),
            F.lit(0).cast("long").alias("_cdc_seq"), F.current_timestamp().alias("_cdc_ts"), n.alias("_cdc_tx_id"),
            F.lit("false").alias("_cdc_snapshot"), F.lit(False).alias("_cdc_tombstone"), text.alias("before"),
            after.alias("after"), text.alias("_cdc_error"), text.alias("_value"),
        )

    for batch in range(batches):
        lap = Laps(group)
        stored = change_rows(batch * changes).coalesce(2).localCheckpoint(eager=True)
        lap("store the batch")
        last = (batch + 1) * changes - 1
        offsets = {p: last - (last - p) % 3 for p in range(3)}  # the batch's highest offset per partition
        work = []
        for topic in topics:
            decoded, types = decode_table(stored.where(F.col("_cdc_topic") == topic), registry, topic, 0, 2**62)
            decoded = decoded.localCheckpoint(eager=True)
            work.append(table_batch(decoded.where(F.col("_cdc_error").isNull()), registry.versions(topic)[0], types,
                                    [], offsets, None, changes // tables))
        lap("decode")
        for table in work:
            if variant == "broadcast-source":
                table.latest = F.broadcast(table.latest)
            store._current(table)
        lap("current")
        store.after_tables(work, batch, None)
        lap("change log")
        for table in work:
            history._history(table)
        lap("history")
        print(MARK + json.dumps({"batch": batch, **lap.spent}), flush=True)
    held = spark.read.format("delta").load(f"{root}/current/public/t0").count()
    print(MARK + json.dumps({"rows": held}), flush=True)


def run_variant(variant: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="bench-delta-stages-")
    try:
        cmd = [sys.executable, __file__, "--child", variant, "--changes", str(args.changes), "--tables",
               str(args.tables), "--batches", str(args.batches), "--inserts", str(args.inserts), "--root", root]
        done = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True, check=False)
        lines = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"variant {variant} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        return lines
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    head = "| variant | batch | " + " | ".join(f"{s}, CPU s" for s in STAGES) + " | total CPU s | µs per change | rows in t0's `current` |"
    out = [f"{args.batches} batches of {args.changes:,} changes over {args.tables} tables, CPU of the process group "
           "(Python and JVM); later batches: medians", "", head, "|---|---|" + "---:|" * (len(STAGES) + 3)]
    for variant, lines in results.items():
        batches = [line for line in lines if "batch" in line]
        rows = next((f"{line['rows']:,}" for line in lines if "rows" in line), "?")
        for label, picked in (("first", batches[:1]), ("later", batches[1:]), ("last", batches[-1:])):
            if not picked:
                continue
            cpu = {s: statistics.median(b[s] for b in picked) for s in STAGES}
            total = sum(cpu.values())
            out.append(f"| {variant} | {label} | " + " | ".join(f"{cpu[s]:.1f}" for s in STAGES)
                       + f" | {total:.1f} | {total / args.changes * 1e6:.0f} | {rows} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--changes", type=int, default=200_000, help="change rows per batch")
    parser.add_argument("--tables", type=int, default=5)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--inserts", type=float, default=0.6, help="share of a batch's changes that insert new keys")
    parser.add_argument("--variants", default="default,deletion-vectors,broadcast-source,no-materialize,flat-history")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.changes, args.tables, args.batches, args.inserts, args.root)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {', '.join(unknown)}: pick from {', '.join(VARIANTS)}")
    started = time.monotonic()
    results = {variant: run_variant(variant, args) for variant in variants}
    printed = "\n".join(report(results, args))
    print(printed)
    print(f"\n({time.monotonic() - started:.0f} s)")
    inserts = "" if args.inserts == 0.6 else f"-{args.inserts * 100:.0f}pct-inserts"
    figures.write("delta_stages", printed, title="The Delta job's CPU per stage", variant=f"{args.tables}-tables{inserts}",
                  versions={**figures.package_versions("pyspark", "pyarrow"), **figures.jvm_versions("spark")})


if __name__ == "__main__":
    # run as a script, Python puts bench/ first on sys.path, where bench/sinks.py would shadow
    # the project's sinks package
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here] + [here]
    main()
