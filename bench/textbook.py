"""The job a Spark user writes to keep Delta tables equal to Debezium topics, for bench/sinks.py
to measure beside `cdc sink delta`.

    python bench/textbook.py --config cdc.toml [--once]

Spark's Kafka source over the prefix's table topics (the sink's servers, security and
subscription: sinks.topics.spark_options and subscription) into `foreachBatch`: the
envelope parsed, the latest change per key (a window over the position), then one Delta
MERGE per source table: delete, update when newer, insert. It knows the bench's table
shapes (a user writes them down) and keeps only the current state, at the paths cdc uses
(`<[delta] path>/current/<schema>/<table>`, so the bench reads both the same way), with
the position as `_lsn`/`_seq`. No change log, no history, no type versions, truncates,
TOAST, dead letters or progress. The session is cdc's (sinks.spark.build_session): the
same Spark and Delta settings.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

# run as a script, Python puts bench/ first on sys.path, where bench/sinks.py would shadow the
# project's sinks package
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE] if __name__ == "__main__" else sys.path

ENVELOPE = "before string, after string, op string, source struct<sequence string>"
#: the bench's tables, as their JSON arrives (NUMERIC and timestamptz as strings)
BACKLOG = "id int, name string, amount string, at string, flag boolean, qty int"
MARKERS = "id int, note string, at string"
CASTS = {"amount": "decimal(12,2)", "at": "timestamp"}


def batch_function(spark: Any, root: str) -> Any:
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from sinks.stores.delta.store import table_path

    created: set[str] = set()

    def apply(records: Any, batch_id: int) -> None:
        rows = records.select(
            "topic", F.from_json(F.col("value").cast("string"), ENVELOPE).alias("e")
        ).where(F.col("e.op").isin("r", "c", "u", "d"))  # tombstones follow their d; heartbeats have no op
        sequence = F.from_json(F.col("e.source.sequence"), "array<string>")
        rows = rows.select(
            "topic", "e.op", F.coalesce(F.col("e.after"), F.col("e.before")).alias("row"),
            sequence[0].cast("long").alias("_lsn"), sequence[1].cast("long").alias("_seq"),
            F.get_json_object(F.coalesce(F.col("e.after"), F.col("e.before")), "$.id").alias("k"),
        )
        newest = Window.partitionBy("topic", "k").orderBy(F.col("_lsn").desc(), F.col("_seq").desc())
        latest = rows.withColumn("_n", F.row_number().over(newest)).where("_n = 1").drop("_n").persist()
        try:
            for (topic,) in latest.select("topic").distinct().collect():
                shape = MARKERS if topic.endswith(".zz_fresh") else BACKLOG
                names = [part.split()[0] for part in shape.split(", ")]
                parsed = latest.where(F.col("topic") == topic).select(
                    "op", "_lsn", "_seq", F.from_json("row", shape).alias("r")
                )
                source = parsed.select(
                    *[(F.col(f"r.{n}").cast(CASTS[n]) if n in CASTS else F.col(f"r.{n}")).alias(n) for n in names],
                    "op", "_lsn", "_seq",
                )
                path = table_path(root, "current", topic)
                if path not in created:
                    schema = source.drop("op").schema
                    DeltaTable.createIfNotExists(spark).location(path).addColumns(schema).execute()
                    created.add(path)
                values = {n: f"s.`{n}`" for n in [*names, "_lsn", "_seq"]}
                newer = "(s._lsn > t._lsn OR (s._lsn = t._lsn AND s._seq > t._seq))"
                (
                    DeltaTable.forPath(spark, path).alias("t")
                    .merge(source.alias("s"), "t.id = s.id")
                    .whenMatchedDelete(condition=f"s.op = 'd' AND {newer}")
                    .whenMatchedUpdate(condition=f"s.op <> 'd' AND {newer}", set=values)
                    .whenNotMatchedInsert(condition="s.op <> 'd'", values=values)
                    .execute()
                )
        finally:
            latest.unpersist()

    return apply


def run(spark: Any, config: Any, once: bool, stop: threading.Event | None = None) -> int:
    """The query until the topics are drained (`once`) or `stop` is set; its batches."""
    import logging

    from sinks.runner import checkpoint
    from sinks.topics import spark_options, subscription

    function = batch_function(spark, config.delta.path)
    log = logging.getLogger("textbook")
    batches = 0

    def timed(records: Any, batch_id: int) -> None:
        nonlocal batches
        started = time.monotonic()
        function(records, batch_id)
        batches += 1  # (its records are not counted: that would read them once more)
        log.info("batch %d: 0 records of 0 tables in %.1f s", batch_id, time.monotonic() - started)

    stream = (spark.readStream.format("kafka").options(**spark_options(config.topic))
              .option("subscribePattern", subscription(config.topic.prefix)).option("startingOffsets", "earliest")
              .option("maxOffsetsPerTrigger", str(config.spark.max_offsets_per_trigger))
              .option("failOnDataLoss", "false").load())
    writer = (stream.writeStream.foreachBatch(timed)
              .option("checkpointLocation", checkpoint(config, "textbook")))
    writer = writer.trigger(availableNow=True) if once else writer.trigger(
        processingTime=f"{config.spark.trigger_interval_s} seconds")
    query = writer.start()
    while query.isActive:
        if stop is not None and stop.is_set():
            query.stop()
            break
        time.sleep(0.2)
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    return batches


def main() -> int:
    import logging

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from cdc.config import load
    from sinks.spark import build_session

    config = load(args.config)
    spark = build_session("bench-textbook", master=config.spark.master)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(spark, config, args.once, stop)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
