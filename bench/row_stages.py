"""Where the search and cache jobs' Spark CPU per record goes, stage by stage.

    python bench/row_stages.py [--records 200000] [--tables 5] [--batches 5]

bench/sinks.py measures each job whole against its store's room, and finds Spark's JVM and
driver taking several times its read ceiling's CPU per record (docs/benchmarks.md). This one
takes that apart without Kafka, PostgreSQL or a store. It makes --batches micro-batches of
--records Kafka records (Debezium envelopes without schema blocks, as cdc sends them by
default, over --tables tables shaped like bench/sinks.py's backlog tables), stores each
(`localCheckpoint`, standing in for Spark's Kafka source, which bench/sinks.py's read ceiling
measures), then runs the jobs' own code on it, timing the CPU of this process group (the
driver's Python and its JVM; the executors' Python workers are in a group of their own and
not counted) per stage:

- scan: the stored records counted (the floor of every later stage);
- parse: the envelopes into change rows (sinks.envelope.change_rows), not stored;
- parse and store: the same, stored, as sinks.pipeline.SinkJob._batch does;
- statistics: the batch's counts and positions per topic (SinkJob._stats);
- Arrow hand-over: the change rows the writers take (sinks.latest.COLUMNS) into the Python
  workers as Arrow batches (sinks.rows.map_in_arrow), which only read them.

The first batch is reported apart (the JIT compiles most of Spark's code then); the others
give the median per stage, in µs per record.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import figures
import pyarrow as pa
from delta_stages import Laps

STAGES = ("scan", "parse", "parse and store", "statistics", "Arrow hand-over")


def read_only(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A writer that takes every batch and writes nothing."""
    for _ in batches:
        pass
    return iter(())


def run(records: int, tables: int, batches: int) -> list[dict[str, float]]:
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from sinks.envelope import change_rows
    from sinks.latest import COLUMNS
    from sinks.pipeline import SinkJob
    from sinks.rows import REJECTED, map_in_arrow
    from sinks.spark import build_session

    spark = build_session("bench-row-stages")
    group = os.getpgid(0)
    cores = spark.sparkContext.defaultParallelism
    job = types.SimpleNamespace(heartbeat_topic="bench.__cdc_heartbeat")  # what SinkJob._stats reads of its job

    def kafka_records(first: int) -> DataFrame:
        """One batch as Spark's Kafka source gives it: updates of random keys of 600,000."""
        n = F.col("id")
        key = (F.abs(F.xxhash64(n)) % 600_000).cast("int")
        after = F.format_string(
            '{"id":%d,"name":"%s","amount":"%d.%02d","at":"2026-11-27T09:00:00.%06dZ","flag":%s,"qty":%d}',
            key, F.md5(n.cast("string")), n % 100000, n % 100, n % 1000000,
            F.when(n % 2 == 0, "true").otherwise("false"), (n % 1000).cast("int"),
        )
        value = F.format_string(
            '{"before":null,"after":%s,"source":{"version":"3.0.0.Final","connector":"postgresql","name":"bench",'
            '"ts_ms":1764234000000,"snapshot":"false","db":"bench","sequence":"[\\"%d\\",\\"%d\\"]",'
            '"schema":"public","table":"t%d","txId":%d,"lsn":%d,"xmin":null},"op":"u","ts_ms":1764234000001,'
            '"transaction":null}',
            after, n * 100, n * 100 + 1, (n % tables).cast("int"), n, n * 100 + 1,
        )
        return spark.range(first, first + records).select(
            F.concat(F.lit("bench.public.t"), (n % tables).cast("string")).alias("topic"),
            (n % 3).cast("int").alias("partition"), n.alias("offset"),
            F.format_string('{"id":%d}', key).cast("binary").alias("key"), value.cast("binary").alias("value"),
        )

    spent = []
    for batch in range(batches):
        stored = kafka_records(batch * records).coalesce(cores).localCheckpoint(eager=True)
        lap = Laps(group)
        stored.count()
        lap("scan")
        change_rows(stored).write.format("noop").mode("overwrite").save()
        lap("parse")
        rows = change_rows(stored).localCheckpoint(eager=True)
        lap("parse and store")
        SinkJob._stats(job, rows)  # type: ignore[arg-type]
        lap("statistics")
        changes = rows.where(F.col("_cdc_error").isNull()).select(*COLUMNS)
        assert not map_in_arrow(changes, read_only, REJECTED).collect()
        lap("Arrow hand-over")
        spent.append(lap.spent)
        print(f"batch {batch}: " + ", ".join(f"{s} {lap.spent[s]:.2f}" for s in STAGES) + " CPU s", flush=True)
    return spent


def report(spent: list[dict[str, float]], args: argparse.Namespace) -> list[str]:
    out = [f"{args.batches} batches of {args.records:,} records over {args.tables} tables: µs of CPU per record "
           "(the driver's Python and its JVM); later batches: medians", "",
           "| batch | " + " | ".join(STAGES) + " |", "|---|" + "---:|" * len(STAGES)]
    for label, picked in (("first", spent[:1]), ("later", spent[1:])):
        if picked:
            out.append(f"| {label} | " + " | ".join(
                f"{statistics.median(b[s] for b in picked) / args.records * 1e6:.1f}" for s in STAGES) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000, help="Kafka records per batch")
    parser.add_argument("--tables", type=int, default=5)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    started = time.monotonic()
    spent = run(args.records, args.tables, args.batches)
    printed = "\n".join(report(spent, args))
    print(printed)
    print(f"\n({time.monotonic() - started:.0f} s)")
    figures.write("row_stages", printed, title="Spark's CPU per record, stage by stage",
                  versions={**figures.package_versions("pyspark", "pyarrow"), **figures.jvm_versions("spark")})


if __name__ == "__main__":
    # run as a script, Python puts bench/ first on sys.path, where bench/sinks.py would shadow
    # the project's sinks package
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here] + [here]
    main()
