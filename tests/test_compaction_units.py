"""The topic read as a table, on hand-made records: the fold's rules one by one (no server)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cdc.events.records import TOAST_PLACEHOLDER, TOAST_PLACEHOLDER_BYTES, TRUNCATE_KEY
from cdc.kafka.reader import TopicRecord
from compaction.table import KeyState, MalformedEvent, TopicTable, build


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
