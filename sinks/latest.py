"""The last change of each key in a batch, from the events' JSON (the stores that keep rows
as JSON: the cache and the search index).

The job's stream (sinks.kafka_source) reads each topic partition of a batch into one
Spark partition, its records together and in offset order, and the job only coalesces
them, which appends whole Spark partitions one after the other. So a key's changes of a batch meet in one Spark partition,
in offset order, which is the key's position order: the last row of a key in arrival order
is its last change, with no sort (sorting a large batch's partitions made the JVM spill and
run out of heap at a million records a batch). An unchanged TOASTed value takes
the batch's newest value of its column; what the batch lacks the store fills from the row
it holds.

The rows reach the executors' Python as Arrow batches (sinks.rows), and `fold` works on
their columns: the arrival order checked, each key's last row found, in bulk. Only keys
whose last change depends on their earlier ones (a tombstone takes its d's position; an
unchanged TOASTed value the newest one before it) go row by row through `last_changes`,
which holds those rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from sinks.json_columns import concatenated, written_by_orjson
from sinks.versions import UNAVAILABLE_FORMS

#: what the fold reads of a change row (sinks.envelope.CHANGE_COLUMNS)
COLUMNS = (
    "_cdc_topic", "_cdc_key", "_cdc_op", "_cdc_lsn", "_cdc_seq", "_cdc_partition", "_cdc_offset", "_cdc_tombstone",
    "after",
)
#: COLUMNS as Arrow carries them from Spark (mapInArrow)
ROWS = pa.schema([
    ("_cdc_topic", pa.string()), ("_cdc_key", pa.string()), ("_cdc_op", pa.string()), ("_cdc_lsn", pa.int64()),
    ("_cdc_seq", pa.int64()), ("_cdc_partition", pa.int32()), ("_cdc_offset", pa.int64()),
    ("_cdc_tombstone", pa.bool_()), ("after", pa.string()),
])
#: the last change of each key, a row each: `kind` u (insert, update, snapshot read) or d
#: (delete, tombstone); `lsn`/`seq` null and `pos` '' for a tombstone whose d is not in the
#: batch; `row` the row's JSON (null for a delete); `missing` its unchanged TOASTed columns
#: that neither the event nor the batch had (the store fills them)
LAST = pa.schema([
    ("topic", pa.string()), ("key", pa.string()), ("kind", pa.string()), ("lsn", pa.int64()), ("seq", pa.int64()),
    ("pos", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("row", pa.string()),
    ("missing", pa.list_(pa.string())),
])

# the unchanged-TOAST forms as values of the parsed `after` (sinks.versions has them as JSON text)
_PLACEHOLDERS = tuple(orjson.loads(text) if text.startswith(("[", "{")) else text for text in UNAVAILABLE_FORMS)
# every form holds one of these in its JSON text: a row without them has no unchanged value
_PLACEHOLDER_TEXT = tuple(sorted({p for p in _PLACEHOLDERS if isinstance(p, str)}))
_PLACEHOLDER_BYTES = tuple(p.encode() for p in _PLACEHOLDER_TEXT)


def position(lsn: int | None, seq: int | None) -> str:
    """A position as text that orders like (commit LSN, change LSN); '' when unknown."""
    return "" if lsn is None or seq is None else f"{lsn:016x}{seq:016x}"


def parse_position(text: str) -> tuple[int, int] | None:
    """`position`'s text back as (commit LSN, change LSN); None when unknown."""
    return (int(text[:16], 16), int(text[16:], 16)) if len(text) == 32 else None


def canonical_key(raw: str) -> str:
    """The key's canonical JSON: the record key, or its payload when it carries a schema."""
    key = orjson.loads(raw)
    if isinstance(key, dict) and key.keys() == {"schema", "payload"}:
        key = key["payload"]
    return orjson.dumps(key).decode()


def canonical_keys(raw: pa.ChunkedArray) -> pa.ChunkedArray | list[str]:
    """`canonical_key` of each key: the keys as they are when they are canonical already (cdc's
    own are), found by one parse of them all, or else one by one."""
    texts = raw.to_pylist()
    if not any('"payload"' in text for text in texts) and written_by_orjson(texts):
        return raw
    return list(map(canonical_key, texts))


@dataclass
class Change:
    """The last change of a key in a batch (the row-by-row fold's; `fold` has them as columns)."""

    key: str  # canonical JSON
    kind: str  # u (insert, update, snapshot read) or d (delete, tombstone)
    lsn: int | None  # commit LSN; None for a tombstone whose d is not in the batch
    seq: int | None  # change LSN
    partition: int
    offset: int
    row: dict[str, Any] | None = None
    missing: tuple[str, ...] = ()  # TOASTed columns neither the event nor the batch had

    @property
    def pos(self) -> str:
        return position(self.lsn, self.seq)


_TEXT_PLACEHOLDERS = frozenset(p for p in _PLACEHOLDERS if isinstance(p, str))
_OTHER_PLACEHOLDERS = tuple(p for p in _PLACEHOLDERS if not isinstance(p, str))


def _unavailable(value: Any) -> bool:
    if isinstance(value, str):
        return value in _TEXT_PLACEHOLDERS
    return isinstance(value, (list, dict)) and value in _OTHER_PLACEHOLDERS


class OutOfOrder(Exception):
    """A Spark partition whose records of a topic partition are not in offset order: the fold
    would keep an older change of a key."""


def _out_of_order(topic: str, partition: int, offset: int, before: int) -> OutOfOrder:
    return OutOfOrder(
        f"records of {topic} partition {partition} reached a writer out of offset order ({offset} after "
        f"{before}): each Kafka partition must reach one Spark partition in order (do not set the Kafka "
        "source's minPartitions, nor repartition the batch)"
    )


def last_changes(rows: Iterable[Sequence[Any]]) -> Iterator[tuple[str, Change]]:
    """Rows (COLUMNS, in that order), each topic partition's in offset order -> (topic, the
    last change of each key), in the order the keys first came. A tombstone keeps its d's
    position. Rows out of offset order raise OutOfOrder: the fold relies on that order."""
    changes: dict[tuple[str, str], Change] = {}
    offsets: dict[tuple[str, int], int] = {}
    for topic, raw, op, lsn, seq, partition, offset, tombstone, after in rows:
        before = offsets.get((topic, partition), -1)
        if offset <= before:
            raise _out_of_order(topic, partition, offset, before)
        offsets[(topic, partition)] = offset
        last = changes.get((topic, raw))
        key = last.key if last is not None else canonical_key(raw)
        if tombstone:
            lsn, seq = (last.lsn, last.seq) if last is not None and last.kind == "d" else (None, None)
            change = Change(key, "d", lsn, seq, partition, offset)
        elif op == "d":
            change = Change(key, "d", lsn, seq, partition, offset)
        else:
            row = orjson.loads(after)
            earlier = last.row if last is not None and last.row is not None else {}
            missing = []
            for name, value in row.items():
                if _unavailable(value):
                    if name in earlier and name not in (last.missing if last else ()):
                        row[name] = earlier[name]
                    else:
                        missing.append(name)
            change = Change(key, "u", lsn, seq, partition, offset, row, tuple(missing))
        changes[(topic, raw)] = change
    for (topic, _raw), change in changes.items():
        yield topic, change


# --------------------------------------------------------------------------- columns


def as_rows(rows: Iterable[Sequence[Any]]) -> pa.Table:
    """Change rows (COLUMNS, in that order) as the Arrow table Spark hands the writers."""
    return pa.Table.from_pylist([dict(zip(COLUMNS, row, strict=True)) for row in rows], schema=ROWS)


def check_order(rows: pa.Table) -> None:
    """Each topic partition's rows in offset order, else OutOfOrder naming the first that is not.
    A Spark partition holds runs of one topic partition (whole ones, appended): the offsets
    rise within each run, and each run starts above where its topic partition's last run ended."""
    n = rows.num_rows
    if n == 0:
        return
    topic, partition, offset = rows["_cdc_topic"], rows["_cdc_partition"], rows["_cdc_offset"]
    head, tail = slice(0, n - 1), slice(1, n)  # row i - 1 beside row i
    same = pc.and_(pc.equal(topic[tail], topic[head]), pc.equal(partition[tail], partition[head]))
    falling = pc.and_(same, pc.less_equal(offset[tail], offset[head]))
    first_falling = pc.index(falling, True).as_py()  # row first_falling + 1 is out of order; -1: none
    starts = [0, *(i + 1 for i in pc.indices_nonzero(pc.invert(same)).to_pylist()), n]
    ends: dict[tuple[str, int], int] = {}
    for start, stop in zip(starts, starts[1:], strict=False):
        run = (topic[start].as_py(), partition[start].as_py())
        first = offset[start].as_py()
        if first <= ends.get(run, -1):
            raise _out_of_order(*run, first, ends[run])
        if start <= first_falling < stop - 1:
            at = first_falling + 1
            raise _out_of_order(*run, offset[at].as_py(), offset[at - 1].as_py())
        ends[run] = offset[stop - 1].as_py()


def fold(rows: pa.Table) -> pa.Table:
    """A Spark partition's change rows (ROWS), each topic partition's in offset order -> the
    last change of each key (LAST), in the order the keys first came. Rows out of offset
    order raise OutOfOrder."""
    rows = rows.select(list(COLUMNS)).cast(ROWS)
    check_order(rows)
    n = rows.num_rows
    keys = rows.select(["_cdc_topic", "_cdc_key"]).append_column("_i", pa.array(range(n), pa.int64()))
    groups = keys.group_by(["_cdc_topic", "_cdc_key"], use_threads=False).aggregate([("_i", "max"), ("_i", "count")])
    last = rows.take(groups["_i_max"])
    tombstone = last["_cdc_tombstone"]
    upsert = pc.and_(pc.invert(tombstone), pc.fill_null(pc.not_equal(last["_cdc_op"], "d"), True))
    # a key whose last change depends on its earlier ones: a tombstone after other changes
    # (its d's position), a row with unchanged TOASTed values (the newest value before them)
    history = pc.and_(tombstone, pc.greater(groups["_i_count"], 1))
    if _any_placeholder(rows["after"]):
        history = pc.or_(history, pc.and_(upsert, _holds_placeholder(last["after"])))
    lsn = pc.if_else(tombstone, pa.scalar(None, pa.int64()), last["_cdc_lsn"])
    seq = pc.if_else(tombstone, pa.scalar(None, pa.int64()), last["_cdc_seq"])
    out = pa.table({
        "topic": last["_cdc_topic"], "key": canonical_keys(last["_cdc_key"]),
        "kind": pc.if_else(upsert, "u", "d"), "lsn": lsn, "seq": seq, "pos": position_texts(lsn, seq),
        "partition": last["_cdc_partition"], "offset": last["_cdc_offset"],
        "row": pc.if_else(upsert, last["after"], pa.scalar(None, pa.string())), "missing": _none_missing(len(last)),
    }, schema=LAST)
    if not pc.any(history).as_py():
        return out
    return _with_history(rows, last, out, history)


def _any_placeholder(after: pa.ChunkedArray) -> bool:
    """Whether any row's JSON text in `after` may hold an unchanged TOASTed value: one search of
    the text of all rows (most batches hold none, and then no row needs looking at)."""
    text = concatenated(after)
    return any(placeholder in text for placeholder in _PLACEHOLDER_BYTES)


def _holds_placeholder(after: pa.ChunkedArray) -> pa.ChunkedArray:
    """Rows whose JSON text may hold an unchanged TOASTed value (every form's text holds one of
    the placeholders: a superset, which `last_changes` then judges value by value)."""
    found = pc.match_substring(after, _PLACEHOLDER_TEXT[0])
    for text in _PLACEHOLDER_TEXT[1:]:
        found = pc.or_(found, pc.match_substring(after, text))
    return pc.fill_null(found, False)


def position_texts(lsn: pa.ChunkedArray, seq: pa.ChunkedArray) -> pa.ChunkedArray:
    """`position` of each (lsn, seq) pair, '' where they are null."""
    pairs = zip(pc.fill_null(lsn, 0).to_pylist(), pc.fill_null(seq, 0).to_pylist(), strict=True)
    return pc.if_else(pc.is_null(lsn), "", pa.array(list(map("%016x%016x".__mod__, pairs)), pa.string()))


def _none_missing(n: int) -> pa.Array:
    """`n` empty lists of TOASTed columns: every offset 0 (zeros, not a list built in Python)."""
    offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(bytes(4 * (n + 1)))])
    return pa.ListArray.from_arrays(offsets, pa.array([], pa.string()))


def _with_history(rows: pa.Table, last: pa.Table, out: pa.Table, history: pa.ChunkedArray) -> pa.Table:
    """`out` with the keys of `history` folded row by row over every change of theirs in
    `rows` (arrival order), each in its place."""
    def names(topic: pa.ChunkedArray, key: pa.ChunkedArray) -> pa.ChunkedArray:
        return pc.binary_join_element_wise(topic, key, "\n")  # no topic name holds a newline

    wanted = names(last["_cdc_topic"], last["_cdc_key"]).filter(history)
    theirs = rows.filter(pc.is_in(names(rows["_cdc_topic"], rows["_cdc_key"]), value_set=wanted.combine_chunks()))
    folded = last_changes(zip(*(theirs[name].to_pylist() for name in COLUMNS), strict=True))
    redone = changes_table([
        (topic, c.key, c.kind, c.lsn, c.seq, c.partition, c.offset,
         None if c.row is None else orjson.dumps(c.row).decode(), list(c.missing))
        for topic, c in folded
    ])
    # `last_changes` yields the keys in the order they first came, as `out` holds them
    places = pc.indices_nonzero(history)
    order = pc.sort_indices(pa.concat_arrays([pc.indices_nonzero(pc.invert(history)), places]))
    return pa.concat_tables([out.filter(pc.invert(history)), redone]).take(order)


def changes_table(changes: Iterable[tuple[Any, ...]]) -> pa.Table:
    """Last changes from Python values: (topic, key, kind, lsn, seq, partition, offset, row
    JSON or None, missing columns) each."""
    columns = list(zip(*changes, strict=True)) or [()] * 9
    topic, key, kind, lsn, seq, partition, offset, row, missing = columns
    return pa.table({
        "topic": topic, "key": key, "kind": kind, "lsn": lsn, "seq": seq,
        "pos": [position(*pair) for pair in zip(lsn, seq, strict=True)], "partition": partition,
        "offset": offset, "row": row, "missing": missing,
    }, schema=LAST)
