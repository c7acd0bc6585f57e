"""One micro-batch of one table, decoded for a store of typed columns (sinks.store.TableStore).

The rules every store shares (docs/design.md, derived stores): events are decoded with the
table version in force at their commit LSN; per key, offset order is position order, so
the last change of a key is its highest offset; a tombstone deletes its key; a truncate
deletes every older row of its table, also one read in a later batch than the truncate.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, BinaryType, DataType, StringType

from sinks.envelope import CHANGE_COLUMNS
from sinks.spark_types import decode, spark_type, unavailable
from sinks.store import Truncate
from sinks.versions import Registry, Version

UNAVAILABLE = "_cdc_unavailable"  # columns whose value the event did not carry (unchanged TOAST)
_TOASTABLE = (StringType, BinaryType, ArrayType)


class TypeConflict(Exception):
    """A column changed to a type the store cannot take; one line naming table and column."""


@dataclass
class TableBatch:
    """What a store needs of one table in one micro-batch."""

    topic: str
    schema: str
    table: str
    #: source column -> Spark type, in column order: every column any version had (a dropped
    #: column stays, null in newer rows), each with the type of its newest version
    columns: dict[str, DataType]
    keys: list[str]
    #: every good change row of the table (CHANGE_COLUMNS, typed source columns and UNAVAILABLE),
    #: tombstones and truncates included; source columns are null for d, t and tombstones
    rows: DataFrame
    #: the last change of each key above the table's newest truncate (no truncate events),
    #: with `_cdc_delete` for d and tombstones; a tombstone's position is that of the key's d
    #: in the batch, or null when the d is not in it
    latest: DataFrame
    #: the batch's truncates of this table, (commit LSN, change LSN, commit time in ms), in order
    truncates: list[Truncate]
    #: the table's truncates the job knows: its newest from earlier batches, then the batch's
    known: list[Truncate]
    #: partition -> highest offset of this table's records in the batch (bad ones included)
    offsets: dict[int, int]
    #: this table's records in the batch (bad ones included)
    records: int = 0

    @property
    def display(self) -> str:
        return f"{self.schema}.{self.table}"


def merged_columns(versions: list[Version]) -> dict[str, DataType]:
    columns: dict[str, DataType] = {}
    for version in versions:
        for col in version.columns:
            columns[col.name] = spark_type(col.connect, col.type, col.modifier)
    return columns


def _decoded(rows: DataFrame, version: Version, columns: dict[str, DataType]) -> DataFrame:
    """`rows` of one version with typed source columns; a bad value sets `_cdc_error`.

    Every record of the warehouse is decoded here twice (the job, then history's query), so
    it keeps to expressions Spark compiles: a lambda (`forall`, `filter`) runs interpreted
    per row, and without the three it had, decoding took 30 % less CPU (docs/benchmarks.md,
    "Delta: the job's CPU per stage")."""
    after = F.from_json(F.col("after"), "map<string,string>")
    decoded = rows.withColumn("_after", after)
    m = F.col("_after")
    has_row = F.col("_cdc_op").isin("r", "c", "u")
    has_all = F.lit(True)  # with as many keys as names, the same names
    for name in version.names:
        has_all = has_all & F.map_contains_key(m, name)
    mismatch = has_row & (m.isNull() | (F.size(m) != len(version.names)) | ~has_all)
    typed: list[Column] = []
    errors: list[Column] = []
    missing: list[Column] = []
    own = {}
    for col in version.columns:
        target = columns[col.name]
        raw = m[col.name]
        value, bad = decode(raw, col.connect, spark_type(col.connect, col.type, col.modifier))
        gone = unavailable(raw)
        own[col.name] = F.when(~gone, value).cast(target)
        errors.append(F.when(bad & ~gone, F.lit(f"{col.name}: value does not fit {target.simpleString()}")))
        missing.append(F.when(gone, F.lit(col.name)))
    for name, target in columns.items():
        typed.append(F.when(has_row, own.get(name, F.lit(None))).cast(target).alias(name))
    error = F.when(
        mismatch,
        F.lit(f"the event's columns are not those of table version {version.display} from LSN {version.from_lsn}"),
    ).otherwise(F.when(has_row, F.concat_ws("; ", *errors)))  # concat_ws skips the nulls
    return decoded.select(
        *CHANGE_COLUMNS,
        *typed,
        F.when(has_row, F.array_compact(F.array(*missing))).alias(UNAVAILABLE),
        F.coalesce(F.nullif(error, F.lit("")), F.col("_cdc_error")).alias("_cdc_error"),
        "_value",
    )


def decode_table(rows: DataFrame, registry: Registry, topic: str, low: int, high: int) -> tuple[DataFrame, dict]:
    """The rows of `topic` (commit LSNs low..high) with typed columns, and the merged columns."""
    spanning = registry.spanning(topic, low, high)
    versions = [v for v in registry.versions(topic) if v.from_lsn <= max(high, spanning[0][0].from_lsn)]
    columns = merged_columns(versions)
    parts = []
    for version, start, end in spanning:
        lsn = F.col("_cdc_lsn")
        # rows without a position (tombstones) go with the first version: they carry no columns
        in_range = (lsn >= start) & (lsn < end)
        if version is spanning[0][0]:
            in_range = in_range | lsn.isNull()
        parts.append(_decoded(rows.where(in_range), version, columns))
    out = parts[0]
    for part in parts[1:]:
        out = out.unionByName(part)
    return out, columns


def last_per_key(rows: DataFrame, columns: dict[str, DataType]) -> DataFrame:
    """The last change of every key: its highest offset (offset order is position order per
    key). An unchanged TOASTed value takes the newest value the batch has for it; only when
    the batch has none does it stay in UNAVAILABLE, for the store to keep what it holds."""
    changes = rows.where(F.col("_cdc_op").isNull() | (F.col("_cdc_op") != "t"))
    offset = F.col("_cdc_offset")
    meta = [c for c in CHANGE_COLUMNS if c not in ("_cdc_key",)]
    aggs = [F.max_by(F.struct(*meta, UNAVAILABLE), offset).alias("_last")]
    aggs.append(F.max(F.struct(F.col("_cdc_lsn"), F.col("_cdc_seq"))).alias("_pos"))
    toasted = [n for n, t in columns.items() if isinstance(t, _TOASTABLE)]
    for name in columns:
        if name in toasted:
            carried = F.when(~F.coalesce(F.array_contains(F.col(UNAVAILABLE), name), F.lit(False)), offset)
            aggs.append(F.max_by(F.col(name), carried).alias(name))
            aggs.append(F.max(carried).alias(f"_has_{name}"))
        else:
            aggs.append(F.max_by(F.col(name), offset).alias(name))
    grouped = changes.groupBy("_cdc_key").agg(*aggs)
    last = F.col("_last")
    still_missing = F.filter(
        F.array(*[
            F.when(F.col(f"_has_{n}").isNull() & F.array_contains(last[UNAVAILABLE], n), F.lit(n)) for n in toasted
        ]),
        lambda n: n.isNotNull(),
    )
    tombstone = last["_cdc_tombstone"]
    return grouped.select(
        "_cdc_key",
        *[last[c].alias(c) for c in meta if c not in ("_cdc_lsn", "_cdc_seq")],
        F.when(tombstone, F.col("_pos._cdc_lsn")).otherwise(last["_cdc_lsn"]).alias("_cdc_lsn"),
        F.when(tombstone, F.col("_pos._cdc_seq")).otherwise(last["_cdc_seq"]).alias("_cdc_seq"),
        *[F.col(n) for n in columns],
        still_missing.alias(UNAVAILABLE),
        (tombstone | (last["_cdc_op"] == "d")).alias("_cdc_delete"),
    )


def _after(truncate: tuple[int, int]) -> Column:
    lsn, seq = F.col("_cdc_lsn"), F.col("_cdc_seq")
    return lsn.isNull() | (lsn > truncate[0]) | ((lsn == truncate[0]) & (seq > truncate[1]))


def after_truncate(rows: DataFrame, truncate: tuple[int, int] | None) -> DataFrame:
    """Rows not cut off by `truncate` (tombstones without a position stay: deleting is safe)."""
    return rows if truncate is None else rows.where(_after(truncate))


def table_batch(
    rows: DataFrame,
    version: Version,
    columns: dict[str, DataType],
    truncates: list[Truncate],
    offsets: dict[int, int],
    earlier: Truncate | None = None,
    records: int = 0,
) -> TableBatch:
    """`version`: the newest version of the batch (names the table and its key); `earlier`:
    the table's newest truncate from earlier batches."""
    known = sorted({*truncates, *([earlier] if earlier else [])})
    latest = after_truncate(last_per_key(rows, columns), known[-1][:2] if known else None)
    keys = [c.name for c in version.columns if c.key]
    return TableBatch(version.topic, version.schema, version.table, columns, keys, rows, latest, truncates, known,
                      offsets, records)
