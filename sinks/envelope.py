"""Kafka records into change rows: the Debezium envelope (schemas on or off) as columns.

The columns are the `changes/` table's: every sink reads the same rows, and the history
rebuild reads them back from `changes/`. A record that is not a change event gets its
reason in `_cdc_error` (the job sends it to the dead-letter topic); a tombstone is a row
with a null op and `_cdc_tombstone` set.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

TRUNCATE_KEY = '"__truncate__"'  # cdc.events.records.TRUNCATE_KEY as text
OPS = ("r", "c", "u", "d", "t")

_SOURCE = "ts_ms bigint, snapshot string, db string, schema string, table string, txId bigint, lsn bigint, sequence string"
_ENVELOPE = f"before string, after string, source struct<{_SOURCE}>, op string, ts_ms bigint"
_VALUE = f"payload struct<{_ENVELOPE}>, {_ENVELOPE}"

CHANGE_COLUMNS = (
    "_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_key", "_cdc_op", "_cdc_lsn", "_cdc_seq", "_cdc_ts",
    "_cdc_tx_id", "_cdc_snapshot", "_cdc_tombstone", "before", "after",
)


def _reason(env: Column, key: Column, lsn: Column, seq: Column) -> Column:
    op = env.op
    return (
        F.when(key.isNull(), F.lit("record has no key"))
        .when(op.isNull() & env.source.isNull(), F.lit("value is not a Debezium change event (JSON object with op)"))
        .when(~op.isin(*OPS) | op.isNull(), F.concat(F.lit("unknown op "), F.coalesce(op, F.lit("null"))))
        .when(lsn.isNull() | seq.isNull(), F.lit("source.sequence is not [commit LSN, change LSN]"))
        .when(op.isin("r", "c", "u") & env.after.isNull(), F.concat(F.lit("op "), op, F.lit(" without after")))
        .when((op == "d") & env.before.isNull(), F.lit("op d without before"))
        .when((op == "t") != (key == TRUNCATE_KEY), F.lit("truncate events and only they have the truncate key"))
    )


def change_rows(records: DataFrame) -> DataFrame:
    """Kafka records (Spark's Kafka source's columns) -> CHANGE_COLUMNS + `_cdc_error` (null for a good record).

    Each value is parsed once, in a projection of its own: written as one expression, the
    optimizer split the parse per branch (the envelope with or without `payload`) and the
    projection lost code generation, which nearly doubled the time to parse and store a
    batch."""
    value = F.col("value").cast("string")
    parsed = records.select(
        F.col("topic").alias("_cdc_topic"),
        F.col("partition").alias("_cdc_partition"),
        F.col("offset").alias("_cdc_offset"),
        F.col("key").cast("string").alias("_cdc_key"),
        value.alias("_value"),
        F.from_json(value, _VALUE).alias("_parsed"),
    )
    doc = F.col("_parsed")
    rows = parsed.select(
        "_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_key", "_value",
        F.when(doc.payload.isNotNull(), doc.payload).otherwise(
            F.struct(doc.before.alias("before"), doc.after.alias("after"), doc.source.alias("source"),
                     doc.op.alias("op"), doc.ts_ms.alias("ts_ms"))
        ).alias("_env"),
    )
    rows = rows.select("*", F.from_json(F.col("_env.source.sequence"), "array<string>").alias("_sequence"))
    sequence = F.col("_sequence")  # `get`, not [i]: a short array is a dead letter, not a failed batch
    lsn, seq = F.get(sequence, 0).try_cast("long"), F.get(sequence, 1).try_cast("long")
    tombstone = F.col("_value").isNull()
    env_col, key = F.col("_env"), F.col("_cdc_key")
    return rows.select(
        "_cdc_topic", "_cdc_partition", "_cdc_offset", "_cdc_key",
        F.when(~tombstone, env_col.op).alias("_cdc_op"),
        F.when(~tombstone, lsn).alias("_cdc_lsn"),
        F.when(~tombstone, seq).alias("_cdc_seq"),
        F.timestamp_millis(env_col.source.ts_ms).alias("_cdc_ts"),
        env_col.source.txId.alias("_cdc_tx_id"),
        env_col.source.snapshot.alias("_cdc_snapshot"),
        tombstone.alias("_cdc_tombstone"),
        env_col.before.alias("before"),
        env_col.after.alias("after"),
        F.when(tombstone, F.when(key.isNull(), F.lit("tombstone without a key")))
        .otherwise(_reason(env_col, key, lsn, seq)).alias("_cdc_error"),
        F.col("_value"),
    )
