"""SCD type 2 from change rows: one version per insert, update or snapshot read.

A version is valid from its event's position until the next change of its key, or
until the first truncate after it, whichever comes first; a delete (a `d`, a lone
tombstone) or a truncate marks the closed version `_cdc_deleted`. The same function
builds the versions of one micro-batch and rebuilds the whole history from `changes/`;
`first_changes` says where the versions of earlier batches end.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DataType

_POS = "lsn bigint, seq bigint, ts timestamp"


def _position(lsn: Column, seq: Column, ts: Column) -> Column:
    return F.struct(lsn.alias("lsn"), seq.alias("seq"), ts.alias("ts"))


def _truncates(truncates: list[tuple[int, int, int]]) -> Column:
    return F.array(*[
        _position(F.lit(lsn), F.lit(seq), F.timestamp_millis(F.lit(ts))) for lsn, seq, ts in truncates
    ]).cast(f"array<struct<{_POS}>>")


def versions(rows: DataFrame, columns: dict[str, DataType], truncates: list[tuple[int, int, int]]) -> DataFrame:
    """History rows of `rows` (typed change rows of one table): valid_from/valid_to, current, deleted."""
    by_key = Window.partitionBy("_cdc_key").orderBy("_cdc_offset")
    events = rows.where(F.col("_cdc_op").isNull() | (F.col("_cdc_op") != "t"))
    here = _position(F.col("_cdc_lsn"), F.col("_cdc_seq"), F.col("_cdc_ts"))
    events = events.select(
        "*",
        F.lead(here).over(by_key).alias("_next"),
        F.lead(F.col("_cdc_op").isNull() | (F.col("_cdc_op") == "d")).over(by_key).alias("_next_deletes"),
        F.lead(F.lit(True)).over(by_key).alias("_has_next"),
    )
    cut = F.array_min(F.filter(_truncates(truncates), lambda t: t > here)) if truncates else F.lit(None)
    next_lsn = F.col("_next.lsn")
    # the truncate first, unless the next change comes before it (a lone tombstone has no
    # position: both delete, the truncate's is the position known)
    truncated = cut.isNotNull() & (F.col("_has_next").isNull() | next_lsn.isNull() | (cut < F.col("_next")))
    valid_to = F.when(truncated, cut).otherwise(F.col("_next"))
    closed = truncated | F.col("_has_next").isNotNull()
    return events.where(F.col("_cdc_op").isin("r", "c", "u")).select(
        *columns,
        "_cdc_key",
        "_cdc_op",
        F.col("_cdc_ts").alias("_cdc_valid_from"),
        valid_to.ts.alias("_cdc_valid_to"),
        F.col("_cdc_lsn").alias("_cdc_valid_from_lsn"),
        F.col("_cdc_seq").alias("_cdc_valid_from_seq"),
        valid_to.lsn.alias("_cdc_valid_to_lsn"),
        valid_to.seq.alias("_cdc_valid_to_seq"),
        (~closed).alias("_cdc_is_current"),
        (truncated | F.coalesce(F.col("_next_deletes"), F.lit(False))).alias("_cdc_deleted"),
        "_cdc_tx_id",
        "_cdc_partition",
        "_cdc_offset",
    )


def first_changes(rows: DataFrame) -> DataFrame:
    """Per key, the batch's first change (it ends the key's version from earlier batches, unless
    a truncate of the batch comes between them): its position, offset and whether it deletes."""
    deletes = (F.col("_cdc_op").isNull() | (F.col("_cdc_op") == "d")).alias("_deletes")  # a d or a tombstone
    first = F.min_by(F.struct("_cdc_lsn", "_cdc_seq", "_cdc_ts", "_cdc_offset", deletes), F.col("_cdc_offset"))
    events = rows.where(F.col("_cdc_op").isNull() | (F.col("_cdc_op") != "t"))
    return events.groupBy("_cdc_key").agg(first.alias("f")).select("_cdc_key", "f.*")
