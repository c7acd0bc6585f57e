"""`cdc verify` without a server: what its report says of counts taken after the snapshot, and
the warehouse's side read by delta-rs, without a Spark session, where that is cheaper."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from cdc.verify import run
from cdc.verify.postgres import Snapshot
from compaction.canonical import Column, row_values
from compaction.verify import Found, Outcome, TableSpec, digest_of
from sinks.stores.delta import read as read_delta_rs
from sinks.stores.delta.read import DIRECT_BYTES, ReaderError, WarehouseSide, choose

COLUMNS = (Column("id", {"type": "int32"}), Column("v", {"type": "int32"}))
SPEC = TableSpec("p.public.t", "public.t", COLUMNS, 2)


# -- the counts: each names its moment ----------------------------------------------------


class _Conn:
    def __init__(self, wal: int) -> None:
        self.wal = wal

    def execute(self, sql: str, params: Any = None) -> Any:
        return SimpleNamespace(fetchone=lambda: (self.wal,))


class _Source:
    """PostgreSQL in a round: its rows at the round's snapshot and now."""

    def __init__(self, rows: dict[bytes, list[Any]]) -> None:
        self.rows, self.lsn = rows, 0x100
        self.catalog = SimpleNamespace(conn=_Conn(0x300))

    def snapshot(self) -> Snapshot:
        self.lsn += 0x100
        return Snapshot(self.lsn, self.lsn)

    def fetch(self, table: Any, keys: list[bytes], now: bool = False) -> dict[bytes, Found]:
        return {k: Found(self.rows[k]) for k in keys if k in self.rows}


class _Side:
    name = "topic"

    def __init__(self, found: dict[bytes, Found]) -> None:
        self.found = found

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        return {k: self.found[k] for k in keys if k in self.found}


def test_a_side_counted_after_the_snapshot_says_when_and_how_many_keys_changed_meanwhile() -> None:
    """Counts that differ only because the side was read after PostgreSQL's snapshot are not shown
    as a bare `ok`: the line names the snapshot, the keys that changed, and where they were
    checked again; a true mismatch found in the same round stays one."""
    added, changed, forged = b'{"id":7}', b'{"id":8}', b'{"id":9}'
    table = SimpleNamespace(spec=SPEC, why_python=None)
    outcome = Outcome("topic", SPEC.display, 1345, 1709)
    report = run.Report(0x100, ["topic"], [(table, 1345, [outcome])])  # type: ignore[list-item]
    source = _Source({added: [7, 1], changed: [8, 2], forged: [9, 1]})
    side = _Side({added: Found([7, 1], (0x180, 0)), changed: Found([8, 2], (0x190, 0)), forged: Found([9, 5], (0x50, 0))})
    waiter = SimpleNamespace(config=SimpleNamespace(source=SimpleNamespace(slot="s")), topics=lambda lsn: None)
    pending = {("topic", SPEC.topic): {added: "extra", changed: "different", forged: "different"}}
    run._rounds(report, source, [side], waiter, pending, source.catalog)  # type: ignore[arg-type]

    assert (outcome.settled, outcome.rechecked_at, list(outcome.mismatches)) == (2, "0/200", [forged])
    lines = report.render().splitlines()
    assert lines[2] == (
        "  topic  1,709 rows  MISMATCH: 0 missing, 0 extra, 1 different; counted after the snapshot at LSN 0/100: "
        "2 keys changed in between, each equal to PostgreSQL when checked again (up to LSN 0/200)"
    )
    assert report.as_json()["tables"][0]["sides"][0] | {"examples": []} == {
        "table": "public.t", "side": "topic", "ok": False, "rows": {"postgres": 1345, "topic": 1709},
        "missing": 0, "extra": 0, "different": 1, "changing": 0, "settled": 2, "rechecked_lsn": "0/200",
        "reader": None, "examples": [], "error": None, "waited_seconds": 0.0, "seconds": 0.0,
    }


def test_a_side_whose_keys_did_not_change_keeps_its_plain_line() -> None:
    table = SimpleNamespace(spec=SPEC, why_python=None)
    quiet = Outcome("topic", SPEC.display, 4, 4)
    still = Outcome("cache", SPEC.display, 4, 5, changing=[b'{"id":1}'])
    report = run.Report(0x100, ["topic", "cache"], [(table, 4, [quiet, still])])  # type: ignore[list-item]
    assert report.render().splitlines()[2:5] == [
        "  topic  4 rows  ok",
        "  cache  5 rows  ok; counted after the snapshot at LSN 0/100: 1 key changed in between",
        "    1 keys changed while they were checked (not compared)",
    ]


# -- the warehouse: delta-rs or Spark, per table ----------------------------------------------


@pytest.mark.parametrize(("reader", "root", "facts", "spark"), [
    ("auto", "/w", {"table": True, "reader_version": 3, "reader_features": ["timestampNtz"], "bytes": 10}, None),
    ("auto", "/w", {"table": False}, None),
    ("auto", "file:/w", {"table": True, "reader_version": 1, "bytes": 10}, None),
    ("spark", "/w", {"table": True, "reader_version": 1, "bytes": 10}, "[delta] verify_reader = spark"),
    ("auto", "s3a://b/w", {"table": True, "reader_version": 1, "bytes": 10}, "a remote warehouse (its credentials are Spark's)"),
    ("auto", "/w", {"table": True, "reader_version": 3, "reader_features": ["deletionVectors", "timestampNtz"], "bytes": 10},
     "table features delta-rs cannot read: deletionVectors"),
    ("auto", "/w", {"table": True, "reader_version": 2, "column_mapping": "name", "bytes": 10},
     "table features delta-rs cannot read: columnMapping"),
    ("auto", "/w", {"table": True, "reader_version": 3, "reader_features": ["typeWidening"], "bytes": 10},
     "table features delta-rs cannot read: typeWidening"),
    ("auto", "/w", {"table": True, "reader_version": 1, "bytes": DIRECT_BYTES + 1},
     f"{DIRECT_BYTES + 1:,} bytes of data files, more than {DIRECT_BYTES:,} (Spark hashes where the data is)"),
    ("delta-rs", "/w", {"table": True, "reader_version": 1, "bytes": DIRECT_BYTES + 1}, None),
])
def test_which_reader_a_table_gets(reader: str, root: str, facts: dict[str, Any], spark: str | None) -> None:
    assert choose(reader, root, facts) == spark


def test_dates_and_timestamps_come_as_numbers_and_an_infinity_spark_wrapped_goes_to_spark() -> None:
    batch = pa.RecordBatch.from_pydict({
        "d": pa.array([19782, -1], pa.date32()),
        "ts": pa.array([1704164645678901, None], pa.timestamp("us")),
        "tz": pa.array([-62135596800000000, 253402300799999999], pa.timestamp("us", "UTC")),
        "da": pa.array([[0, None]], pa.list_(pa.date32())).take([0, 0]),
    })
    assert read_delta_rs._numbers(batch).to_pydict() == {
        "d": [19782, -1], "ts": [1704164645678901, None], "tz": [-62135596800000000, 253402300799999999],
        "da": [[0, None], [0, None]],
    }
    # how pyarrow reads Spark's INT96 of timestamptz 'infinity' (measured): Spark alone reads it back
    wrapped = pa.RecordBatch.from_pydict({"tz": pa.array([-7054632392601674385], pa.timestamp("us", "UTC"))})
    with pytest.raises(ReaderError, match="column tz holds a timestamp beyond years 1 to 9999"):
        read_delta_rs._numbers(wrapped)


_WRITE = r"""
import decimal, os, sys
import pyarrow as pa
from deltalake import write_deltalake
write_deltalake(sys.argv[1], pa.table({
    "_cdc_key": ['{"id":1}', '{"id":2}', '{"id":3}'], "_cdc_lsn": pa.array([10, 20, None], pa.int64()),
    "_cdc_seq": pa.array([1, 2, None], pa.int64()), "id": pa.array([1, 2, 3], pa.int32()),
    "n": pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("-2.00")], pa.decimal128(12, 2)),
    "f": pa.array([1.1, None, 3.0], pa.float32()), "d": pa.array([0, 1, None], pa.date32()),
    "tz": pa.array([1704164645120000, None, 0], pa.timestamp("us", "UTC")),
}))
sys.stdout.flush()
os._exit(0)
"""
TYPED = (
    Column("id", {"type": "int32"}), Column("n", {"type": "string"}), Column("f", {"type": "float"}),
    Column("d", {"type": "int32", "name": "io.debezium.time.Date"}),
    Column("tz", {"type": "string", "name": "io.debezium.time.ZonedTimestamp"}), Column("gone", {"type": "string"}),
)
EVENTS = {  # the rows as their events carry them
    b'{"id":1}': {"id": 1, "n": "1.50", "f": 1.1, "d": 0, "tz": "2024-01-02T03:04:05.12Z"},
    b'{"id":2}': {"id": 2, "d": 1},
    b'{"id":3}': {"id": 3, "n": "-2.00", "f": 3.0, "tz": "1970-01-01T00:00:00Z"},
}


@pytest.fixture
def warehouse(tmp_path: Path) -> tuple[str, TableSpec]:
    """A warehouse whose `current/` table delta-rs wrote (in a child: it can abort at exit)."""
    spec = TableSpec("p.public.typed", "public.typed", TYPED, 1)
    root = str(tmp_path / "warehouse")
    subprocess.run([sys.executable, "-c", _WRITE, f"{root}/current/public/typed"], check=True)
    return root, spec


class _NoSpark:
    def __call__(self) -> Any:
        raise AssertionError("a Spark session was asked for")


def test_a_small_warehouse_table_is_read_with_delta_rs_without_a_spark_session(warehouse: tuple[str, TableSpec]) -> None:
    root, spec = warehouse
    side = WarehouseSide(root, "auto", _NoSpark())
    try:
        expected = digest_of(EVENTS.items(), lambda event: row_values(event, TYPED), spec.bits)
        assert side.digest(spec) == expected
        assert side.how(spec) == "delta-rs"
        assert side.fetch(spec, [b'{"id":1}', b'{"id":3}', b'{"id":4}']) == {
            b'{"id":1}': Found(row_values(EVENTS[b'{"id":1}'], TYPED), (10, 1)),
            b'{"id":3}': Found(row_values(EVENTS[b'{"id":3}'], TYPED), None),
        }
        assert set(side.hashes(spec, {0, 1})) == set(EVENTS)
        assert side.digest(TableSpec("p.public.none", "public.none", TYPED, 1)) == {}  # no table yet
    finally:
        side.close()


class _SparkSide:
    name = "delta"

    def __init__(self, spark: Any, root: str) -> None:
        self.spark, self.root = spark, root

    def digest(self, table: TableSpec) -> dict[int, tuple[int, int]]:
        return {0: (99, 0)}


def test_spark_reads_what_delta_rs_cannot_or_is_told_not_to(warehouse: tuple[str, TableSpec],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import sinks.stores.delta.read_spark

    root, spec = warehouse
    monkeypatch.setattr(sinks.stores.delta.read_spark, "DeltaSide", _SparkSide)
    asked: list[str] = []
    forced = WarehouseSide(root, "spark", lambda: asked.append("session") or "session")
    assert (forced.digest(spec), forced.how(spec), asked) == ({0: (99, 0)}, "spark", ["session"])
    forced.close()

    def unreadable(*_: Any) -> Any:
        raise ReaderError("DeltaProtocolError: unsupported reader features")

    monkeypatch.setattr(read_delta_rs.DeltaRs, "batches", unreadable)
    falls_back = WarehouseSide(root, "auto", lambda: "session")
    try:
        assert (falls_back.digest(spec), falls_back.how(spec)) == ({0: (99, 0)}, "spark")
    finally:
        falls_back.close()
