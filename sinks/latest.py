"""The last change of each key in a batch, from the events' JSON (the stores that keep rows
as JSON: the cache and the search index).

Spark's Kafka source reads each topic partition into one Spark partition, in offset order
(no minPartitions is set), and the job only coalesces them, which appends whole topic
partitions one after the other. So a key's changes of a batch meet in one Spark partition,
in offset order, which is the key's position order: one pass in arrival order folds each
key's changes into its last one, with no sort (sorting a large batch's partitions made the
JVM spill and run out of heap, measured at 1,000,000 records a batch). The executor's
Python holds a partition's last change per key until it has read the partition, as the
sort held the rows before its first one. An unchanged
TOASTed value takes the batch's newest value of its column; what the batch lacks the
store fills from the row it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sinks.versions import UNAVAILABLE_FORMS

#: what the fold reads of a change row (sinks.envelope.CHANGE_COLUMNS)
COLUMNS = (
    "_cdc_topic", "_cdc_key", "_cdc_op", "_cdc_lsn", "_cdc_seq", "_cdc_partition", "_cdc_offset", "_cdc_tombstone",
    "after",
)

# the unchanged-TOAST forms as values of the parsed `after` (sinks.versions has them as JSON text)
_PLACEHOLDERS = tuple(orjson.loads(text) if text.startswith(("[", "{")) else text for text in UNAVAILABLE_FORMS)


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


@dataclass
class Change:
    """The last change of a key in a batch."""

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


def last_changes(rows: Iterable[Sequence[Any]]) -> Iterator[tuple[str, Change]]:
    """Rows (COLUMNS, in that order), each topic partition's in offset order -> (topic, the
    last change of each key), in the order the keys first came. A tombstone keeps its d's
    position. Rows out of offset order raise OutOfOrder: the fold relies on that order."""
    changes: dict[tuple[str, str], Change] = {}
    offsets: dict[tuple[str, int], int] = {}
    for topic, raw, op, lsn, seq, partition, offset, tombstone, after in rows:
        before = offsets.get((topic, partition), -1)
        if offset <= before:
            raise OutOfOrder(
                f"records of {topic} partition {partition} reached a writer out of offset order ({offset} after "
                f"{before}): each Kafka partition must reach one Spark partition in order (do not set the Kafka "
                "source's minPartitions, nor repartition the batch)"
            )
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
