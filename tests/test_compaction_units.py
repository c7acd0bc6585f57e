"""compaction/ without a server: the topic read as a table on hand-made records, the canonical
form, the narrowing and the rounds of `cdc verify`, the tombstone horizon's states."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cdc.config import TopicConfig
from cdc.events.records import TOAST_PLACEHOLDER, TOAST_PLACEHOLDER_BYTES, TRUNCATE_KEY, Record
from cdc.kafka.reader import TopicRecord
from compaction.canonical import (
    Column,
    bits_for,
    bucket,
    float_text,
    row_hash,
    row_text,
    row_values,
)
from compaction.horizon import Horizon, SinkLag
from compaction.table import KeyState, MalformedEvent, TopicTable, build
from compaction.truncates import TruncateCleanups
from compaction.verify import Found, candidates, differing, judge


def key(i: int) -> bytes:
    return orjson.dumps({"id": i})


def event(op: str, commit: int, change: int, after: dict[str, Any] | None = None, schemas: bool = False) -> bytes:
    body = {
        "before": None, "after": after, "op": op,
        "source": {"sequence": orjson.dumps([str(commit), str(change)]).decode(), "lsn": change},
    }
    return orjson.dumps({"schema": {}, "payload": body} if schemas else body)


class Log:
    """Records of one topic, each given its partition; offsets counted per partition."""

    def __init__(self) -> None:
        self.records: list[TopicRecord] = []
        self._next: dict[int, int] = {}

    def add(self, partition: int, k: bytes, value: bytes | None) -> Log:
        offset = self._next.get(partition, 0)
        self._next[partition] = offset + 1
        self.records.append(TopicRecord("p.public.t", partition, offset, k, value))
        return self

    def row(self, partition: int, i: int, commit: int, change: int, **values: Any) -> Log:
        return self.add(partition, key(i), event("c", commit, change, {"id": i, **values}))


def test_latest_record_wins_and_deletes_remove() -> None:
    log = Log().row(0, 1, 100, 10, v="a").row(0, 1, 200, 20, v="b").row(1, 2, 100, 11, v="x")
    log.add(1, key(2), event("d", 300, 30)).add(1, key(2), None)  # a delete and its tombstone
    log.row(2, 3, 100, 12, v="y").add(2, key(3), None)  # a lone tombstone (its d compacted away)
    table = build(log.records)
    assert table.state() == {key(1): {"id": 1, "v": "b"}}
    assert table.lookup([key(1), key(2), key(3), key(4)]) == {
        key(1): KeyState({"id": 1, "v": "b"}, (200, 20)),
        key(2): KeyState(None, (300, 30)),  # a delete marker: where the row went
        key(3): KeyState(None, (100, 12)),
    }
    assert table.order_violations() == []
    assert table.records == 7 and table.max_commit == 300


def test_a_truncate_removes_older_rows_by_position_whatever_the_reading_order() -> None:
    truncate = event("t", 500, 50)
    rows = Log().row(0, 1, 100, 10, v="old").row(1, 2, 600, 60, v="new").row(2, 3, 400, 40, v="old")
    for first in (True, False):  # the truncate's partition read before or after the rows' partitions
        log = Log()
        if first:
            log.add(1, TRUNCATE_KEY, truncate)
        log.records += rows.records
        if not first:
            log.add(1, TRUNCATE_KEY, truncate)
        table = build(log.records)
        assert table.state() == {key(2): {"id": 2, "v": "new"}}
        assert table.truncated_at == (500, 50)
        assert table.lookup([key(1)]) == {key(1): KeyState(None, (500, 50))}


def test_a_truncate_inside_a_transaction_keeps_the_rows_inserted_after_it() -> None:
    # BEGIN; INSERT 1; TRUNCATE; INSERT 2; COMMIT (commit LSN 900): positions order the three
    log = Log().row(0, 1, 900, 10).add(2, TRUNCATE_KEY, event("t", 900, 20)).row(1, 2, 900, 30)
    assert build(log.records).state() == {key(2): {"id": 2}}


def test_only_the_newest_truncate_counts() -> None:
    log = Log().add(0, TRUNCATE_KEY, event("t", 800, 1)).add(0, TRUNCATE_KEY, event("t", 300, 1))
    log.row(1, 1, 500, 5)
    assert build(log.records).state() == {}


def test_toast_placeholders_take_the_keys_earlier_value_or_are_reported() -> None:
    big = "x" * 3000
    log = Log().row(0, 1, 100, 10, v=1, body=big, data="AAEC", tags=["a"])
    log.row(0, 1, 200, 20, v=2, body=TOAST_PLACEHOLDER, data=TOAST_PLACEHOLDER_BYTES, tags=[TOAST_PLACEHOLDER])
    log.row(1, 2, 300, 30, v=1, body=TOAST_PLACEHOLDER, data="AA==", tags=None)  # no earlier record (compacted)
    log.row(0, 1, 400, 40, v=3, body=TOAST_PLACEHOLDER, data=TOAST_PLACEHOLDER_BYTES, tags=[TOAST_PLACEHOLDER])
    table = build(log.records)
    assert table.state() == {
        key(1): {"id": 1, "v": 3, "body": big, "data": "AAEC", "tags": ["a"]},
        key(2): {"id": 2, "v": 1, "body": None, "data": "AA==", "tags": None},  # never the placeholder
    }
    assert table.unresolved() == {key(2): ("body",)}


def test_a_placeholder_after_a_delete_is_unresolved() -> None:
    log = Log().row(0, 1, 100, 10, body="kept").add(0, key(1), event("d", 200, 20)).add(0, key(1), None)
    log.row(0, 1, 300, 30, body=TOAST_PLACEHOLDER)
    table = build(log.records)
    assert table.state() == {key(1): {"id": 1, "body": None}}
    assert table.unresolved() == {key(1): ("body",)}


def test_an_unresolved_column_stays_unresolved_in_later_records() -> None:
    log = Log().row(0, 1, 100, 10, v=1, body=TOAST_PLACEHOLDER).row(0, 1, 200, 20, v=2, body=TOAST_PLACEHOLDER)
    assert build(log.records).unresolved() == {key(1): ("body",)}


def test_order_violations_name_keys_written_out_of_position_order() -> None:
    log = Log().row(0, 1, 200, 20, v="new").row(0, 1, 100, 10, v="stale").row(1, 2, 100, 10)
    assert build(log.records).order_violations() == [key(1)]


def test_the_schema_wrapped_form_reads_the_same() -> None:
    log = Log().add(0, key(1), event("r", 100, 0, {"id": 1}, schemas=True))
    assert build(log.records).state() == {key(1): {"id": 1}}


def test_malformed_records_name_where_they_are() -> None:
    with pytest.raises(MalformedEvent, match=r"record without a key at p\.public\.t\[0\]@0"):
        build(Log().add(0, None, event("c", 1, 1, {"id": 1})).records)  # type: ignore[arg-type]
    with pytest.raises(MalformedEvent, match=r"malformed event at p\.public\.t\[0\]@0"):
        build(Log().add(0, key(1), b'{"op": "c"}').records)


def test_memory_holds_at_most_flush_every_keys_and_the_rest_lives_on_disk(tmp_path) -> None:
    log = Log()
    for i in range(3000):
        log.row(i % 3, i, 100 + i, 1, v=i)
    for i in range(0, 3000, 2):
        log.row(i % 3, i, 10000 + i, 1, v=-i)
    table = TopicTable(tmp_path / "t.sqlite", flush_every=100)
    for r in log.records:
        table.add(r.key, r.value)
        assert len(table._pending) < 100
    rows = list(table.rows())
    assert [r.key for r in rows] == sorted(key(i) for i in range(3000))  # key byte order
    assert {orjson.loads(r.key)["id"]: r.row["v"] for r in rows} == {i: -i if i % 2 == 0 else i for i in range(3000)}
    table.close()
    assert (tmp_path / "t.sqlite").exists()  # a file the caller named stays


def test_the_fold_goes_on_with_newer_records() -> None:
    first = Log().row(0, 1, 100, 10, v=1)
    table = build(first.records)
    assert table.state() == {key(1): {"id": 1, "v": 1}}
    table.extend(Log().row(0, 1, 200, 20, v=2).row(0, 2, 200, 21, v=1).records)
    assert table.state() == {key(1): {"id": 1, "v": 2}, key(2): {"id": 2, "v": 1}}


# -- the canonical form and the judge of a key in a round (compaction.canonical, compaction.verify)



@pytest.mark.parametrize(("value", "text"), [
    (100.0, "100"), (0.5, "0.5"), (1e300, "1" + "0" * 300), (1.5e-7, "0.00000015"), (-0.0, "0"), (-2.25, "-2.25"),
    (float("nan"), "NaN"), (float("inf"), "Infinity"), (float("-inf"), "-Infinity"), (0.1, "0.1"),
])
def test_floats_are_the_shortest_decimal_in_full(value: float, text: str) -> None:
    assert float_text(value) == text


def test_a_row_in_canonical_form() -> None:
    columns = (
        Column("id", {"type": "int32"}), Column("f", {"type": "double"}), Column("doc", {"type": "string", "name": "io.debezium.data.Json"}),
        Column("xs", {"type": "array", "items": {"type": "float"}}), Column("gone", {"type": "string"}),
        Column("p", {"type": "struct", "fields": [{"field": "x", "type": "double"}, {"field": "srid", "type": "int32"}]}),
    )
    row = {"id": 1, "f": 100.0, "doc": '{"b": 1, "a": [1.0, "x"]}', "xs": [1.5, None, "NaN"], "p": {"x": 2.0, "srid": None}}
    values = row_values(row, columns)
    assert values == [1, "100", {"b": 1, "a": [1.0, "x"]}, ["1.5", None, "NaN"], None, {"x": "2", "srid": None}]
    assert row_text(values) == b'[1,"100",{"a":[1.0,"x"],"b":1},["1.5",null,"NaN"],null,{"srid":null,"x":"2"}]'
    # the same document spelled otherwise (the search index parses JSON columns) hashes the same
    assert row_hash(row_text(row_values({**row, "doc": {"a": [1.0, "x"], "b": 1}}, columns))) == row_hash(row_text(values))
    assert row_values({"id": 1}, columns[:1], unresolved=["id"]) == [{"unavailable": "toast"}]


def test_segments_are_ranges_of_the_keys_hash() -> None:
    assert bucket(b'{"id":1}', 0) == 0
    assert bucket(b'{"id":1}', 16) >> 4 == bucket(b'{"id":1}', 12)  # narrower segments nest in wider ones
    assert (bits_for(0), bits_for(64), bits_for(1_000_000)) == (0, 0, 14)


def test_narrowing_names_missing_extra_and_different_keys() -> None:
    assert differing({0: (2, 5), 1: (1, 3)}, {0: (2, 5), 2: (1, 1)}) == {1, 2}
    assert candidates({b"a": 1, b"b": 2, b"c": 3}, {b"b": 2, b"c": 4, b"d": 5}) == {
        b"a": "missing", b"c": "different", b"d": "extra",
    }


def test_a_round_tells_changes_in_flight_from_mismatches() -> None:
    visible, wal = 1000, 2000  # the round's snapshot sees every commit up to 1000
    assert judge([1], Found([1], (500, 1)), visible, wal, stable=False) == "agree"
    assert judge([1], Found([2], (900, 1)), visible, wal, stable=False) == "different"  # a commit the snapshot sees
    assert judge([1], Found([2], (1500, 1)), visible, wal, stable=False) == "changing"  # a commit it may not see: in flight
    assert judge([1], Found([2], (5000, 1)), visible, wal, stable=False) == "different"  # a position no commit has
    assert judge([1], Found(None, (1500, 1)), visible, wal, stable=True) == "changing"  # deleted after the snapshot
    assert judge([1], None, visible, wal, stable=True) == "missing"  # no trace, and the row did not change
    assert judge([1], None, visible, wal, stable=False) == "changing"
    assert judge(None, Found([1], None), visible, wal, stable=True) == "extra"  # a row nobody wrote


def test_the_horizon_warns_at_half_and_reports_past_it() -> None:
    def at(lag_ms: int) -> Horizon:
        return Horizon(SinkLag("cache", 1, 1, lag_ms), 20_000, "p.public.t")

    assert (at(9_000).state, at(9_000).message()) == ("ok", None)
    assert at(10_000).state == "warning"
    assert at(12_000).message() == (
        "sink cache is 12 s behind; tombstones may be dropped 20 s after they are written (delete.retention.ms of "
        "p.public.t = 20 s): get it applying again (cdc sink cache) within 8 s, or raise delete.retention.ms on the "
        "table topics to buy time"
    )
    assert at(20_000).state == "past"
    assert at(25_000).message().startswith(  # type: ignore[union-attr]
        "sink cache is 25 s behind, past the tombstone horizon (delete.retention.ms of p.public.t = 20 s): deletes it "
        "has not applied may be gone from the topics"
    )


@pytest.mark.parametrize("on", [True, False])
def test_a_truncate_starts_a_clean_up_unless_switched_off_and_a_request_always_does(on: bool) -> None:
    cleanups = TruncateCleanups(TopicConfig(truncate_cleanup=on))
    cleanups.truncated([Record("p.public.t", TRUNCATE_KEY, b"{}", "public.t")])
    cleanups.committed(100)
    assert cleanups.tracking is on
    cleanups.requested({"p.public.u": "public.u"})
    cleanups.committed(200)
    assert cleanups.tracking


def test_a_rewind_or_a_stop_does_not_wait_for_a_clean_up_read_stuck_on_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon rewinds after a broker failure, and may be stopped during one: a truncate
    clean-up reading the topic from that broker holds neither. The read, left to itself, stops
    at its next record and drops its table; the clean-up starts over at the next commit."""
    import threading

    import compaction.truncates as truncates

    log = Log().row(0, 1, 100, 10, v="old").row(1, 2, 600, 60, v="new").add(2, TRUNCATE_KEY, event("t", 500, 50))
    reading, broker_back = threading.Event(), threading.Event()
    tables: list[TopicTable] = []

    class Kept(TopicTable):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            tables.append(self)

    def stuck(_config: TopicConfig, _topic: str) -> Any:
        yield log.records[0]
        reading.set()
        broker_back.wait()  # the broker is down: no next record until it is back
        yield from log.records[1:]

    def stuck_clean_up() -> tuple[TruncateCleanups, threading.Thread]:
        reading.clear()
        cleanups = TruncateCleanups(TopicConfig())
        cleanups.truncated([Record("p.public.t", TRUNCATE_KEY, event("t", 500, 50), "public.t")])
        cleanups.committed(500)
        assert cleanups.poll(500) == [] and reading.wait(30)
        read = cleanups._active["p.public.t"].thread
        assert read is not None
        return cleanups, read

    def returns(call: Any) -> bool:
        done = threading.Thread(target=call, daemon=True)
        done.start()
        done.join(30)
        return not done.is_alive()

    monkeypatch.setattr(truncates, "TopicTable", Kept)
    monkeypatch.setattr(truncates, "read_topic", stuck)
    monkeypatch.setattr(truncates, "SHUTDOWN_WAIT_S", 0.0)
    cleanups, read = stuck_clean_up()
    assert returns(cleanups.rewind)  # while the read still waits for the broker
    stopped, read_at_stop = stuck_clean_up()
    assert returns(stopped.close)
    broker_back.set()
    for thread in (read, read_at_stop):
        thread.join(30)
        assert not thread.is_alive()
    assert len(tables) == 2 and not any(table.path.exists() for table in tables)  # both dropped their tables

    monkeypatch.setattr(truncates, "read_topic", lambda _config, _topic: iter(log.records))  # a broker back
    cleanups.committed(700)  # the rewound clean-up starts over, and reads a broker that is back
    assert cleanups.tracking
    tombstones = cleanups.poll(700)  # starts the read, which may be done already
    if cleanups.tracking:
        again = cleanups._active["p.public.t"].thread
        assert again is not None
        again.join(30)
        tombstones += cleanups.poll(700)
    assert [(r.topic, r.key, r.value) for r in tombstones] == [("p.public.t", key(1), None)]
    assert not cleanups.tracking
