"""`cdc verify`'s comparison: PostgreSQL against the topics read as tables and every store.

Each side of a comparison hashes its rows where they are (compaction.canonical): PostgreSQL
in SQL, the Delta warehouse in Spark (a small table is read here, by delta-rs), and the
sides without compute of their own (the topic, the cache, the search index) here, as they
are read. A side answers three questions about a table: its digest (per key segment, the row
count and the XOR of the row hashes), the row hashes of some segments, and the rows of some
keys with their positions. The comparison narrows down only where digests differ, as
data-diff tools do: segments first, then the row hashes of the differing segments, then the
rows of the differing keys.

A difference found while writers keep writing may only be a change in flight: the side
applied a change after PostgreSQL's snapshot, or not yet the one before. So every differing
key is looked at again in rounds, each at a newer snapshot, once the side is complete up to
it (`judge`): a key that agrees is dropped (and counted: it changed between the snapshot and
the side's read, which is why the counts may differ); a key whose side row or delete marker
is from a commit the round's snapshot sees for sure (at or below its `visible` LSN: a commit
just below the snapshot's own LSN may not be visible yet) or whose position no commit can
have (forged, from the future), or, with no position, whose PostgreSQL row did not change
from the snapshot until after the side was read (so the side cannot be ahead of it), is a
mismatch; any other key changed during the check and is reported as such, not as a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from compaction.canonical import Column, bucket, row_hash, row_text

Digest = dict[int, tuple[int, int]]  # segment -> (rows, XOR of the row hashes)
T = TypeVar("T")
EXAMPLES = 5  # differing keys shown per table and side


@dataclass(frozen=True)
class TableSpec:
    """A table as every side compares it: its topic, its columns (PostgreSQL's, in order) and
    how many bits of the key's hash make a segment."""

    topic: str
    display: str
    columns: tuple[Column, ...]
    bits: int


@dataclass(frozen=True)
class Found:
    """One key on one side: its canonical values (None: no row) and the position of its row or
    of its delete marker (None: the side does not know)."""

    values: list[Any] | None
    position: tuple[int, int] | None = None


class Side(Protocol):
    name: str

    def digest(self, table: TableSpec) -> Digest: ...

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]: ...

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]: ...


def digest_of(pairs: Iterable[tuple[bytes, T]], values: Callable[[T], list[Any]], bits: int) -> Digest:
    """The digest of rows read here (a side without compute of its own): `pairs` are
    (key, the row as the side holds it), `values` its canonical values. Memory holds the
    segments only, whatever the table's size."""
    out: Digest = {}
    for key, raw in pairs:
        h = row_hash(row_text(values(raw)))
        segment = bucket(key, bits)
        rows, xor = out.get(segment, (0, 0))
        out[segment] = (rows + 1, xor ^ h)
    return out


def hashes_of(pairs: Iterable[tuple[bytes, T]], values: Callable[[T], list[Any]], bits: int,
              segments: set[int]) -> dict[bytes, int]:
    """The row hashes of some segments, from another read of the rows (only where digests
    differ: the common case, every side agreeing, reads each side once)."""
    return {key: row_hash(row_text(values(raw))) for key, raw in pairs if bucket(key, bits) in segments}


def differing(reference: Digest, side: Digest) -> set[int]:
    return {s for s in reference.keys() | side.keys() if reference.get(s, (0, 0)) != side.get(s, (0, 0))}


def candidates(reference: dict[bytes, int], side: dict[bytes, int]) -> dict[bytes, str]:
    """Keys of the differing segments that differ: key -> missing, extra or different."""
    out = {k: "missing" for k in reference.keys() - side.keys()}
    out.update({k: "extra" for k in side.keys() - reference.keys()})
    out.update({k: "different" for k in reference.keys() & side.keys() if reference[k] != side[k]})
    return out


def judge(reference: list[Any] | None, side: Found | None, visible: int, wal: int, stable: bool) -> str:
    """One key in a round at a snapshot that sees every commit at or below `visible` (the
    server's WAL was at `wal` after the side was read; `stable`: PostgreSQL's row did not change
    from the snapshot until after that): `agree`, a mismatch (`missing`, `extra`, `different`)
    or `changing`."""
    values = None if side is None else side.values
    if values == reference:
        return "agree"
    commit = None if side is None or side.position is None else side.position[0]
    decisive = (commit is not None and (commit <= visible or commit > wal)) or (commit is None and stable)
    if not decisive:
        return "changing"
    return "missing" if values is None else "extra" if reference is None else "different"


@dataclass
class Outcome:
    """One table on one side against PostgreSQL."""

    side: str
    table: str
    reference_rows: int
    rows: int
    mismatches: dict[bytes, str] = field(default_factory=dict)  # key -> missing, extra, different
    changing: list[bytes] = field(default_factory=list)  # keys changed while they were checked
    settled: int = 0  # keys that differed, changed after the snapshot, and agreed when checked again
    rechecked_at: str | None = None  # the LSN of the last snapshot a key agreed at
    reader: str | None = None  # how the side was read, where it has a choice (the warehouse)
    examples: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # the side could not be compared (why)
    waited: float = 0.0  # seconds until the side was complete up to the snapshot
    seconds: float = 0.0  # its digest and the narrowing

    def count(self, kind: str) -> int:
        return sum(1 for k in self.mismatches.values() if k == kind)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.mismatches

    def as_json(self) -> dict[str, Any]:
        return {
            "table": self.table, "side": self.side, "ok": self.ok,
            "rows": {"postgres": self.reference_rows, self.side: self.rows},
            "missing": self.count("missing"), "extra": self.count("extra"), "different": self.count("different"),
            "changing": len(self.changing), "settled": self.settled, "rechecked_lsn": self.rechecked_at,
            "reader": self.reader, "examples": self.examples, "error": self.error,
            "waited_seconds": round(self.waited, 2), "seconds": round(self.seconds, 2),
        }


def example(key: bytes, kind: str, columns: tuple[Column, ...], reference: list[Any] | None,
            side: list[Any] | None, side_name: str) -> dict[str, Any]:
    """One differing key for the report, with the columns that differ."""
    out: dict[str, Any] = {"key": key.decode(errors="replace"), "kind": kind}
    if reference is not None and side is not None:
        out["columns"] = {
            c.name: {"postgres": a, side_name: b}
            for c, a, b in zip(columns, reference, side, strict=True) if a != b
        }
    return out

