"""Fast unit tests of the snapshot pieces that need no database and no broker: the COPY text
parser, the start-up plan, transaction visibility, the incremental snapshot bookkeeping,
the durable state's serialization and the generated COPY SQL."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from cdc.events.changes import ColumnDef
from cdc.events.records import TRUNCATE_KEY, Column, Record, TableEvents, Txn
from cdc.source.catalog import CapturedTable
from snapshot.copy_text import parse_line
from snapshot.incremental import (
    MESSAGE_PREFIX,
    RECENT_COMMITS,
    Chunk,
    IncrementalSnapshots,
    Visibility,
    signal_message,
)
from snapshot.plan import Plan, SnapshotRefused, captured_names, plan
from snapshot.state import Incremental, SnapshotState, state_topic
from snapshot.tables import SnapshotTable

# ------------------------------------------------------------------------- helpers


def _captured(
    schema: str, table: str, keys: tuple[str, ...] = ("id",), oid: int = 16384
) -> CapturedTable:
    return CapturedTable(oid, schema, table, "d", keys, True, ())


CAPTURED = [
    _captured("public", "a", oid=1),
    _captured("public", "b", oid=2),
    _captured("public", "order", oid=3),  # a keyword: displayed quoted
    _captured("Odd", "My Table", oid=4),
    _captured("sales", "items", oid=5),
]
NAMES = ["public.a", "public.b", "public.c"]


# ------------------------------------------------------------------ copy_text.parse_line


@pytest.mark.parametrize(
    ("line", "values"),
    [
        (b"1\tabc\tx y\n", ["1", "abc", "x y"]),
        (b"1\tabc", ["1", "abc"]),  # without its newline
        (b"42\n", ["42"]),
        (b"\\N\n", [None]),
        (b"1\t\\N\t\\N\n", ["1", None, None]),
        (b"\t\n", ["", ""]),  # two empty strings, not NULL
        (b"\n", [""]),  # one column holding an empty string
        (b"\t\\N\t\n", ["", None, ""]),
        (b"a\\\\b\n", ["a\\b"]),
        (b"a\\tb\n", ["a\tb"]),
        (b"a\\nb\n", ["a\nb"]),
        (b"a\\rb\n", ["a\rb"]),
        (b"a\\bb\n", ["a\bb"]),
        (b"a\\fb\n", ["a\fb"]),
        (b"a\\vb\n", ["a\vb"]),
        (b"\\\\N\n", ["\\N"]),  # the text backslash-N, which COPY writes as \\N
        (b"x\t\\\\N\t\\N\n", ["x", "\\N", None]),
        (b"\\\\\\\\\n", ["\\\\"]),  # two backslashes
        (b"\\\\t\n", ["\\t"]),  # backslash then a letter t, not a tab
        (b"\\t\\n\\r\\b\\f\\v\\\\\n", ["\t\n\r\b\f\v\\"]),
        ("caf\u00e9\t\u65e5\u672c\t\U0001f600\n".encode(), ["caf\u00e9", "\u65e5\u672c", "\U0001f600"]),
        ("\u00e9\\t\u00e9\n".encode(), ["\u00e9\t\u00e9"]),
        (b"a\\n\n", ["a\n"]),  # an escaped newline just before the line's own newline
        (b"a\n\n", ["a\n"]),  # only one trailing newline is the line's
    ],
)
def test_parse_line(line: bytes, values: list[str | None]) -> None:
    assert parse_line(line) == values


def test_parse_line_accepts_memoryview() -> None:
    assert parse_line(memoryview(b"1\t\\N\tx\\ty\n")) == ["1", None, "x\ty"]


@pytest.mark.parametrize("escape", ["N", "x", "0", "a", "."])
def test_parse_line_rejects_unexpected_escape(escape: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_line(f"ok\tab\\{escape}c\n".encode())
    assert str(e.value) == f"unexpected COPY escape \\{escape}"


# ----------------------------------------------------------------------- plan.plan


def _state(**kwargs: Any) -> SnapshotState:
    return SnapshotState("cdc", **kwargs)


def _plan(
    mode: str,
    exists: bool,
    lost: bool,
    state: SnapshotState | None,
    only: list[str] | None = None,
) -> Plan:
    return plan(mode, "cdc", "p", exists, lost, state, list(NAMES), only)


@pytest.mark.parametrize("mode", ["initial", "when_needed"])
def test_plan_new_slot_snapshots_everything(mode: str) -> None:
    assert _plan(mode, False, False, None) == Plan(
        _state(initial="running"), create_slot=True, initial=NAMES
    )


def test_plan_new_slot_never() -> None:
    assert _plan("never", False, False, None) == Plan(_state(initial="skipped"), create_slot=True)


def test_plan_new_slot_initial_only_stops() -> None:
    assert _plan("initial_only", False, False, None) == Plan(
        _state(initial="running"), create_slot=True, initial=NAMES, stop_when_done=True
    )


def test_plan_new_slot_only() -> None:
    assert _plan("initial", False, False, None, only=["public.b"]) == Plan(
        _state(initial="running"), create_slot=True, initial=["public.b"]
    )
    assert _plan("never", False, False, None, only=["public.b"]) == Plan(
        _state(initial="skipped"), create_slot=True
    )


@pytest.mark.parametrize("state", [_state(initial="pending"), _state(initial="skipped")])
@pytest.mark.parametrize("mode", ["initial", "initial_only", "when_needed"])
def test_plan_slot_absent_without_snapshot_is_a_new_slot(mode: str, state: SnapshotState) -> None:
    """A state that never recorded a snapshot does not block a new slot (and cuts nothing off)."""
    assert _plan(mode, False, False, state) == Plan(
        _state(initial="running"),
        create_slot=True,
        initial=NAMES,
        stop_when_done=mode == "initial_only",
    )


def test_plan_slot_never_created_is_not_a_lost_snapshot() -> None:
    """The daemon writes initial="running" *before* it creates the slot (cdc/daemon.py
    _create_slot). If slot creation then fails (max_replication_slots reached, a crash, a
    broker timeout in deliver()), no slot ever existed and no row was sent: the next start
    must simply try again, not refuse claiming a snapshot was taken through the slot."""
    never_created = _state(initial="running")  # consistent_point None, done []
    assert _plan("initial", False, False, never_created) == Plan(
        _state(initial="running"), create_slot=True, initial=NAMES
    )


@pytest.mark.parametrize("mode", ["initial", "initial_only", "when_needed"])
def test_plan_existing_slot_without_state_snapshots_incrementally(mode: str) -> None:
    result = _plan(mode, True, False, None)
    assert result == Plan(
        _state(initial="running"), incremental=NAMES, stop_when_done=mode == "initial_only"
    )


def test_plan_existing_slot_never() -> None:
    assert _plan("never", True, False, None) == Plan(_state(initial="skipped"))
    partial = _state(initial="skipped", done=["public.a"])
    result = _plan("never", True, False, partial)
    assert result == Plan(_state(initial="skipped", done=["public.a"]))
    assert result.state is partial


@pytest.mark.parametrize("mode", ["initial", "initial_only", "when_needed"])
def test_plan_existing_slot_snapshots_tables_not_done(mode: str) -> None:
    state = _state(initial="running", consistent_point=1000, done=["public.b"])
    result = _plan(mode, True, False, state)
    assert result == Plan(
        _state(initial="running", consistent_point=1000, done=["public.b"]),
        incremental=["public.a", "public.c"],
        stop_when_done=mode == "initial_only",
    )
    assert result.state is state  # the durable state carries on, not a fresh one


def test_plan_existing_slot_all_done() -> None:
    state = _state(initial="done", consistent_point=1000, done=list(reversed(NAMES)))
    assert _plan("initial", True, False, state) == Plan(state)


def test_plan_existing_slot_does_not_requeue() -> None:
    state = _state(
        initial="done",
        done=["public.a"],
        incremental=Incremental(["public.c"], after=["7"], chunks=2, rows=4096),
    )
    result = _plan("initial", True, False, state)
    assert result.incremental == ["public.b"]
    assert result.state.incremental == Incremental(["public.c"], after=["7"], chunks=2, rows=4096)
    assert result.create_slot is False and result.initial == [] and result.truncate_first is False


def test_plan_existing_slot_only() -> None:
    state = _state(initial="done", done=["public.a"], incremental=Incremental(["public.c"]))
    assert _plan("initial", True, False, state, only=["public.b"]).incremental == ["public.b"]
    assert _plan("initial", True, False, state, only=["public.a"]).incremental == []
    assert _plan("initial", True, False, state, only=["public.c"]).incremental == []
    assert _plan("initial", True, False, None, only=["public.c", "public.a"]).incremental == [
        "public.c",
        "public.a",
    ]
    assert _plan("never", True, False, None, only=["public.c"]).incremental == []


GONE = (
    "slot cdc is gone but the topics hold a snapshot taken through it (p.__cdc_state), so changes "
    'made meanwhile were never captured: set [snapshot] mode = "when_needed" to take a new snapshot '
    "(older rows are cut off by a truncate event), or delete the topics to start over"
)
SNAPSHOTTED = [
    _state(initial="done", consistent_point=1000, done=list(NAMES)),
    _state(initial="running", consistent_point=1000),  # interrupted initial snapshot
    _state(initial="running", consistent_point=1000, done=["public.a"]),
    _state(initial="skipped", done=["public.b"]),  # mode never, then an incremental snapshot
]


@pytest.mark.parametrize("state", SNAPSHOTTED)
@pytest.mark.parametrize("mode", ["initial", "initial_only"])
def test_plan_slot_gone_after_snapshot_refused(mode: str, state: SnapshotState) -> None:
    with pytest.raises(SnapshotRefused) as e:
        _plan(mode, False, False, state)
    assert str(e.value) == GONE
    assert "when_needed" in str(e.value)
    assert state_topic("p") in str(e.value)


@pytest.mark.parametrize("state", SNAPSHOTTED)
def test_plan_slot_gone_after_snapshot_when_needed_resnapshots(state: SnapshotState) -> None:
    assert _plan("when_needed", False, False, state) == Plan(
        _state(initial="running"), create_slot=True, initial=NAMES, truncate_first=True
    )


@pytest.mark.parametrize("state", SNAPSHOTTED)
def test_plan_slot_gone_after_snapshot_never_streams(state: SnapshotState) -> None:
    assert _plan("never", False, False, state) == Plan(_state(initial="skipped"), create_slot=True)


LOST = (
    "slot cdc has lost WAL it needed (wal_status=lost), so changes are missing from it: set "
    '[snapshot] mode = "when_needed" to drop it and take a new snapshot, or drop it yourself with '
    "SELECT pg_drop_replication_slot('cdc') and start again with a fresh snapshot of the tables"
)


@pytest.mark.parametrize("state", [None, *SNAPSHOTTED])
@pytest.mark.parametrize("mode", ["initial", "initial_only", "never"])
def test_plan_lost_slot_refused(mode: str, state: SnapshotState | None) -> None:
    with pytest.raises(SnapshotRefused) as e:
        _plan(mode, True, True, state)
    assert str(e.value) == LOST


@pytest.mark.parametrize("state", SNAPSHOTTED)
def test_plan_lost_slot_when_needed_after_snapshot(state: SnapshotState) -> None:
    assert _plan("when_needed", True, True, state) == Plan(
        _state(initial="running"),
        create_slot=True,
        drop_lost_slot=True,
        initial=NAMES,
        truncate_first=True,
    )


@pytest.mark.parametrize("state", [None, _state(initial="skipped"), _state(initial="pending")])
def test_plan_lost_slot_when_needed_without_snapshot(state: SnapshotState | None) -> None:
    """Nothing in the topics came from a snapshot: drop and recreate, no truncate."""
    assert _plan("when_needed", True, True, state) == Plan(
        _state(initial="running"), create_slot=True, drop_lost_slot=True, initial=NAMES
    )


def test_plan_lost_slot_when_needed_only() -> None:
    assert _plan("when_needed", True, True, None, only=["public.c"]) == Plan(
        _state(initial="running"), create_slot=True, drop_lost_slot=True, initial=["public.c"]
    )


def test_plan_does_not_mutate_inputs() -> None:
    tables = list(NAMES)
    state = _state(initial="done", consistent_point=5, done=["public.a"])
    before = copy.deepcopy(state)
    plan("initial", "cdc", "p", True, False, state, tables)
    assert tables == NAMES and state == before


# ------------------------------------------------------------------ plan.captured_names


def test_captured_names_none_means_all() -> None:
    assert captured_names(CAPTURED, None) is None
    assert captured_names(CAPTURED, []) is None


def test_captured_displays() -> None:
    assert [t.display for t in CAPTURED] == [
        "public.a",
        "public.b",
        'public."order"',
        '"Odd"."My Table"',
        "sales.items",
    ]


@pytest.mark.parametrize(
    ("patterns", "names"),
    [
        (["public.a"], ["public.a"]),
        (["public.*"], ["public.a", "public.b", 'public."order"']),
        (["sales.items", "public.a"], ["sales.items", "public.a"]),
        (["public.a", "public.*"], ["public.a", "public.b", 'public."order"']),  # no duplicates
        (["public.b", "public.b"], ["public.b"]),
        (["PUBLIC.A"], ["public.a"]),  # unquoted names fold to lower case
        (['"public"."a"'], ["public.a"]),
        (['public."order"'], ['public."order"']),
        (['"Odd"."My Table"'], ['"Odd"."My Table"']),
        (['"Odd".*'], ['"Odd"."My Table"']),
        ([' "Odd" . "My Table" '], ['"Odd"."My Table"']),
    ],
)
def test_captured_names(patterns: list[str], names: list[str]) -> None:
    assert captured_names(CAPTURED, patterns) == names


@pytest.mark.parametrize("pattern", ["public.nope", "odd.*", "Odd.*", '"Public".a', "public.A2"])
def test_captured_names_unknown_table(pattern: str) -> None:
    with pytest.raises(ValueError) as e:
        captured_names(CAPTURED, ["public.a", pattern])
    assert str(e.value) == (
        f"table {pattern} is not one of the captured tables "
        '(public.a, public.b, public."order", "Odd"."My Table", sales.items): '
        "check the name, or add it to [source] tables"
    )


def test_captured_names_bad_pattern() -> None:
    with pytest.raises(ValueError) as e:
        captured_names(CAPTURED, ["orders"])
    assert str(e.value) == (
        "table pattern 'orders' has no schema: write it as schema.table, e.g. public.orders"
    )


# --------------------------------------------------------------------- Visibility

EPOCH = 1 << 32


def test_visibility_plain() -> None:
    v = Visibility("100:105:101,103")
    assert v.xmax == 105 and v.in_progress == {101, 103}
    assert [x for x in range(95, 110) if v.sees(x)] == [95, 96, 97, 98, 99, 100, 102, 104]
    assert v.sees(101) is False and v.sees(103) is False  # in progress
    assert v.sees(105) is False and v.sees(106) is False and v.sees(1_000_000) is False
    assert v.sees(None) is False
    assert v.sees(3) is True  # long committed


def test_visibility_without_in_progress() -> None:
    v = Visibility("200:200:")
    assert v.in_progress == set()
    assert v.sees(199) is True and v.sees(200) is False and v.sees(201) is False


def test_visibility_epoch_above_zero() -> None:
    """xid8 values carry the epoch; pgoutput's xids are 32-bit."""
    xmin, xmax = 7 * EPOCH + 1000, 7 * EPOCH + 1010
    v = Visibility(f"{xmin}:{xmax}:{7 * EPOCH + 1003},{7 * EPOCH + 1008}")
    assert v.xmax == 1010 and v.in_progress == {1003, 1008}
    assert [x for x in range(995, 1015) if v.sees(x)] == [
        995, 996, 997, 998, 999, 1000, 1001, 1002, 1004, 1005, 1006, 1007, 1009,
    ]


def test_visibility_wraparound() -> None:
    """xmin is just below an epoch boundary, xmax just above: the low 32 bits wrap."""
    xmin = 2 * EPOCH - 10  # low bits 0xFFFFFFF6
    xmax = 3 * EPOCH + 5
    v = Visibility(f"{xmin}:{xmax}:{2 * EPOCH - 6},{2 * EPOCH - 1},{3 * EPOCH + 3}")
    assert v.xmax == 5
    assert v.in_progress == {0xFFFFFFFA, 0xFFFFFFFF, 3}
    # before the wrap: committed ones are visible, the in-progress ones not
    assert v.sees(0xFFFFFFF5) is True
    assert v.sees(0xFFFFFFF6) is True
    assert v.sees(0xFFFFFFFA) is False
    assert v.sees(0xFFFFFFFE) is True
    assert v.sees(0xFFFFFFFF) is False
    # after the wrap
    assert v.sees(3) is False
    assert v.sees(4) is True
    assert v.sees(5) is False  # xmax itself
    assert v.sees(6) is False
    assert v.sees(0x7FFFFFFF) is False  # far ahead
    assert v.sees(0x80000000) is False
    # far behind (but within 2^31): long committed
    assert v.sees(0x80000006) is True
    assert v.sees(1_000_000_000 + 0x80000000) is True


def test_visibility_xmax_at_epoch_start() -> None:
    v = Visibility(f"{4 * EPOCH - 3}:{4 * EPOCH}:{4 * EPOCH - 2}")
    assert v.xmax == 0 and v.in_progress == {0xFFFFFFFE}
    assert v.sees(0xFFFFFFFD) is True
    assert v.sees(0xFFFFFFFE) is False
    assert v.sees(0xFFFFFFFF) is True
    assert v.sees(3) is False  # the first normal xid of the new epoch


# ----------------------------------------------------------- IncrementalSnapshots


class _NoCatalog:
    """Only next_chunk talks to the catalog; none of these tests call it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"catalog.{name} used")


TABLES = [_captured("public", "a", oid=1), _captured("public", "b", oid=2), _captured("s", "c", oid=3)]


def _config(slot: str = "cdc") -> Any:
    return SimpleNamespace(
        source=SimpleNamespace(slot=slot), snapshot=SimpleNamespace(chunk_size=2)
    )


def _snapshots(durable: SnapshotState | None = None) -> IncrementalSnapshots:
    return IncrementalSnapshots(
        _config(), _NoCatalog(), TABLES, durable if durable is not None else _state(initial="done")
    )


def _events(table: str = "a") -> TableEvents:
    columns = [
        Column("id", int, None, {}),
        Column("v", str, None, {}),
    ]
    return TableEvents("p", "db", "public", table, f"p.public.{table}", columns, [0])


def _chunk(
    rows: dict[int, str],
    watermark: str = "w1",
    snapshot: str = "100:105:101,103",
    last_key: list[str] | None = None,
    exhausted: bool = False,
    table: str = "a",
) -> Chunk:
    events = _events(table)
    rendered = dict(events.encode([str(key), value]) for key, value in rows.items())
    return Chunk(
        _snapshot_table(_captured("public", table), ["id", "v"], ("integer",)),
        events,
        watermark,
        Visibility(snapshot),
        rendered,
        last_key,
        exhausted,
    )


def _key(i: int) -> bytes:
    return orjson.dumps({"id": i})


def _record(key: bytes, table: str = "a") -> Record:
    return Record(f"p.public.{table}", key, b"{}", f"public.{table}")


def _watermark(id_: str, slot: str = "cdc") -> bytes:
    return orjson.dumps({"slot": slot, "type": "watermark", "id": id_})


def test_signal_message() -> None:
    body = orjson.loads(signal_message("cdc", ["public.a", "s.c"]))
    assert set(body) == {"slot", "type", "tables", "id"}
    assert body["slot"] == "cdc" and body["type"] == "snapshot"
    assert body["tables"] == ["public.a", "s.c"]
    assert len(body["id"]) == 32 and int(body["id"], 16) >= 0
    assert orjson.loads(signal_message("cdc", []))["id"] != body["id"]
    assert MESSAGE_PREFIX == "cdc"


def test_recent_commits_keep_the_newest() -> None:
    """A chunk is read again when its snapshot counts one of the last RECENT_COMMITS streamed
    commits as running: the older ones are forgotten, oldest first."""
    snapshots = _snapshots()
    for xid in range(1, 3 * RECENT_COMMITS + 1):
        snapshots.note_commit(xid)
    snapshots.note_commit(None)  # a commit without an xid: nothing to remember
    assert list(snapshots.recent) == list(range(2 * RECENT_COMMITS + 1, 3 * RECENT_COMMITS + 1))


def test_request_queues_and_dedupes() -> None:
    inc = _snapshots()
    assert inc.busy is False
    assert inc.request(["public.a", "s.c", "public.a"]) is True
    assert inc.live.incremental == Incremental(["public.a", "s.c"])
    assert inc.durable.incremental == Incremental(["public.a", "s.c"])
    assert inc.live.incremental is not inc.durable.incremental
    assert inc.busy is True
    # already queued: nothing changes
    assert inc.request(["s.c"]) is False
    assert inc.request(["public.a", "s.c"]) is False
    assert inc.durable.incremental == Incremental(["public.a", "s.c"])
    # one new, one queued: only the new one is appended
    assert inc.request(["s.c", "public.b"]) is True
    assert inc.live.incremental == Incremental(["public.a", "s.c", "public.b"])
    assert inc.durable.incremental == Incremental(["public.a", "s.c", "public.b"])


def test_request_ignores_unknown_tables() -> None:
    inc = _snapshots()
    assert inc.request(["public.zzz", "a", "public.A"]) is False
    assert inc.live.incremental is None and inc.durable.incremental is None
    assert inc.request(["public.zzz", "public.b"]) is True
    assert inc.live.incremental == Incremental(["public.b"])


def test_request_keeps_current_table_position() -> None:
    durable = _state(initial="done", incremental=Incremental(["public.a"], after=["9"], chunks=3, rows=6))
    inc = _snapshots(durable)
    assert inc.request(["public.b"]) is True
    assert inc.durable.incremental == Incremental(["public.a", "public.b"], after=["9"], chunks=3, rows=6)
    assert inc.live.incremental == Incremental(["public.a", "public.b"], after=["9"], chunks=3, rows=6)


def test_request_reaches_pending_progress() -> None:
    """A request made while chunk progress waits for confirmation must survive that progress
    becoming durable."""
    inc = _snapshots()
    inc.progress.append((100, _state(initial="done")))
    inc.progress.append((200, _state(initial="done", incremental=Incremental(["s.c"], after=["1"]))))
    assert inc.request(["public.a"]) is True
    assert inc.progress[0][1].incremental == Incremental(["public.a"])
    assert inc.progress[1][1].incremental == Incremental(["s.c", "public.a"], after=["1"])
    assert inc.confirmed(300) == _state(initial="done", incremental=Incremental(["s.c", "public.a"], after=["1"]))


def test_request_table_done_earlier_is_snapshotted_again() -> None:
    inc = _snapshots(_state(initial="done", done=["public.a"]))
    assert inc.request(["public.a"]) is True
    assert inc.live.incremental == Incremental(["public.a"])
    assert inc.live.done == ["public.a"]


def test_on_message_snapshot_signal() -> None:
    inc = _snapshots()
    assert inc.on_message(signal_message("cdc", ["public.b", "s.c"]), 10, None) == ([], True)
    assert inc.durable.incremental == Incremental(["public.b", "s.c"])
    assert inc.live.incremental == Incremental(["public.b", "s.c"])
    # the same signal read again (e.g. after a rewind): nothing changes
    assert inc.on_message(signal_message("cdc", ["public.b"]), 10, None) == ([], False)
    assert inc.on_message(signal_message("cdc", ["public.nope"]), 10, None) == ([], False)


@pytest.mark.parametrize(
    "content",
    [
        orjson.dumps({"slot": "other", "type": "snapshot", "tables": ["public.a"], "id": "s1"}),  # another daemon's slot
        orjson.dumps({"type": "snapshot", "tables": ["public.a"]}),  # no slot
        orjson.dumps({"slot": "CDC", "type": "snapshot", "tables": ["public.a"]}),
        orjson.dumps({"slot": "cdc", "type": "other", "tables": ["public.a"]}),
        orjson.dumps({"slot": "cdc", "tables": ["public.a"]}),
        orjson.dumps({"slot": "cdc", "type": "watermark", "id": "w1"}),  # no chunk open
        b"{not json",
        b"",
        b"\xff\xfe",
        b"snapshot public.a",
        b'["cdc", "snapshot"]',
        b'"cdc"',
        b"null",
        b"42",
    ],
)
def test_on_message_ignores(content: bytes) -> None:
    inc = _snapshots()
    assert inc.on_message(content, 10, None) == ([], False)
    assert inc.live == inc.durable == _state(initial="done")
    assert inc.chunk is None and not inc.progress


@pytest.mark.parametrize(
    "body",
    [
        {"slot": "cdc", "type": "snapshot", "tables": None},
        {"slot": "cdc", "type": "snapshot", "tables": 5},
        {"slot": "cdc", "type": "snapshot", "tables": "public.a"},
    ],
)
def test_on_message_ignores_malformed_tables(body: dict) -> None:
    """Anyone who may call pg_logical_emit_message can write a 'cdc' message. One the daemon
    cannot handle must be ignored like malformed JSON: an exception here would recur every
    time the slot replays the message, so the daemon could never get past it."""
    inc = _snapshots()
    assert inc.on_message(orjson.dumps(body), 10, None) == ([], False)
    assert inc.live.incremental is None


def test_on_message_ignores_other_watermarks() -> None:
    inc = _snapshots(_state(initial="done", incremental=Incremental(["public.a"])))
    chunk = _chunk({1: "x"}, watermark="w1")
    inc.chunk = chunk
    txn = Txn(500, 1_700_000_000_000_000, 77)
    for content in (_watermark("w0"), _watermark("w1", slot="other")):
        assert inc.on_message(content, 450, txn) == ([], False)
        assert inc.chunk is chunk
    assert not inc.progress


def test_on_message_watermark_closes_chunk() -> None:
    durable = _state(initial="running", done=["s.c"], incremental=Incremental(["public.a", "public.b"]))
    inc = _snapshots(durable)
    inc.chunk = _chunk({1: "x", 2: "y"}, watermark="w1", last_key=["2"])
    txn = Txn(500, 1_700_000_000_000_000, 77)
    records, changed = inc.on_message(_watermark("w1"), 450, txn)
    assert changed is False
    assert inc.chunk is None
    assert [(r.topic, r.key, r.table) for r in records] == [
        ("p.public.a", _key(1), "public.a"),
        ("p.public.a", _key(2), "public.a"),
    ]
    values = [orjson.loads(r.value) for r in records]  # type: ignore[arg-type]
    assert [v["after"] for v in values] == [{"id": 1, "v": "x"}, {"id": 2, "v": "y"}]
    assert {v["op"] for v in values} == {"r"}
    assert all(v["before"] is None for v in values)
    source = values[0]["source"]
    assert source["snapshot"] == "incremental"
    assert source["sequence"] == '["500","0"]'
    assert source["lsn"] == 500 and source["txId"] is None
    # live moved on, the durable state waits for the slot to be confirmed past 450
    after = Incremental(["public.a", "public.b"], after=["2"], chunks=1, rows=2)
    assert inc.live.incremental == after
    assert inc.durable.incremental == Incremental(["public.a", "public.b"])
    assert list(inc.progress) == [(450, _state(initial="running", done=["s.c"], incremental=after))]
    assert inc.progress[0][1] is not inc.live
    # the last chunk of public.a: the table is done, public.b is next from its start
    inc.chunk = _chunk({3: "z"}, watermark="w2", last_key=["3"], exhausted=True)
    records, _ = inc.on_message(_watermark("w2"), 600, Txn(650, 1_700_000_000_000_001, 78))
    assert [r.key for r in records] == [_key(3)]
    assert inc.live == _state(initial="running", done=["s.c", "public.a"], incremental=Incremental(["public.b"]))
    # public.b's only chunk is empty and exhausted: nothing queued any more
    inc.chunk = _chunk({}, watermark="w3", table="b", exhausted=True)
    assert inc.on_message(_watermark("w3"), 700, Txn(750, 1, 79)) == ([], False)
    # the queue is empty: the interrupted initial snapshot now counts as finished
    assert inc.live == _state(initial="done", done=["s.c", "public.a", "public.b"])
    assert inc.busy is False
    assert [lsn for lsn, _ in inc.progress] == [450, 600, 700]
    assert inc.durable == durable  # nothing confirmed yet


@pytest.mark.parametrize("initial", ["skipped", "done", "pending"])
def test_last_chunk_leaves_other_initial_states(initial: str) -> None:
    inc = _snapshots(_state(initial=initial, incremental=Incremental(["public.a"])))
    inc.chunk = _chunk({1: "x"}, watermark="w1", last_key=["1"], exhausted=True)
    records, changed = inc.on_message(_watermark("w1"), 10, Txn(20, 1, 5))
    assert [r.key for r in records] == [_key(1)] and changed is False
    assert inc.live == _state(initial=initial, done=["public.a"])
    assert list(inc.progress) == [(10, _state(initial=initial, done=["public.a"]))]


def test_confirmed_makes_progress_durable_in_order() -> None:
    inc = _snapshots(_state(initial="done", incremental=Incremental(["public.a"])))
    s1 = _state(initial="done", incremental=Incremental(["public.a"], after=["2"], chunks=1, rows=2))
    s2 = _state(initial="done", incremental=Incremental(["public.a"], after=["4"], chunks=2, rows=4))
    s3 = _state(initial="done", done=["public.a"])
    inc.progress.extend([(100, s1), (200, s2), (300, s3)])
    assert inc.confirmed(50) is None
    assert inc.confirmed(100) is None  # confirmed *up to* the watermark is not past it
    assert inc.durable == _state(initial="done", incremental=Incremental(["public.a"]))
    assert inc.confirmed(101) is s1
    assert inc.durable is s1
    assert inc.confirmed(101) is None
    assert inc.confirmed(1000) is s3  # several at once: the latest wins
    assert inc.durable is s3
    assert not inc.progress
    assert inc.confirmed(2000) is None and inc.durable is s3


def test_confirmed_does_not_touch_live() -> None:
    inc = _snapshots(_state(initial="done", incremental=Incremental(["public.a"])))
    inc.live.incremental = Incremental(["public.a"], after=["6"], chunks=3, rows=6)
    live = inc.live
    inc.progress.append((100, _state(initial="done", incremental=Incremental(["public.a"], after=["2"]))))
    inc.confirmed(150)
    assert inc.live is live
    assert inc.live.incremental == Incremental(["public.a"], after=["6"], chunks=3, rows=6)


def test_rewind_forgets_what_is_not_durable() -> None:
    durable = _state(initial="done", incremental=Incremental(["public.a", "s.c"], after=["2"], chunks=1, rows=2))
    inc = _snapshots(durable)
    inc.live.incremental = Incremental(["s.c"], chunks=0, rows=0)
    inc.live.mark_done("public.a")
    inc.progress.append((100, copy.deepcopy(inc.live)))
    inc.chunk = _chunk({1: "x"})
    inc.rewind()
    assert inc.chunk is None
    assert not inc.progress
    assert inc.live == _state(
        initial="done", incremental=Incremental(["public.a", "s.c"], after=["2"], chunks=1, rows=2)
    )
    assert inc.live is not inc.durable
    assert inc.live.incremental is not inc.durable.incremental
    inc.live.incremental.tables.pop(0)  # type: ignore[union-attr]
    assert inc.durable.incremental.tables == ["public.a", "s.c"]  # type: ignore[union-attr]


def test_rewind_after_confirmed() -> None:
    inc = _snapshots(_state(initial="done", incremental=Incremental(["public.a"])))
    s1 = _state(initial="done", incremental=Incremental(["public.a"], after=["2"], chunks=1, rows=2))
    s2 = _state(initial="done", done=["public.a"])
    inc.progress.extend([(100, s1), (200, s2)])
    inc.live = copy.deepcopy(s2)
    inc.confirmed(150)
    inc.rewind()
    assert inc.live == s1 and inc.live is not s1
    assert inc.busy is True


def test_constructor_copies_durable() -> None:
    durable = _state(initial="done", incremental=Incremental(["public.a"]))
    inc = _snapshots(durable)
    assert inc.durable is durable
    assert inc.live == durable and inc.live is not durable
    assert inc.live.incremental is not durable.incremental
    assert set(inc.captured) == {"public.a", "public.b", "s.c"}


def test_saw_without_chunk_is_a_no_op() -> None:
    inc = _snapshots()
    inc.saw([_record(_key(1))], 104)
    assert inc.chunk is None


def test_saw_drops_keys_of_invisible_transactions() -> None:
    inc = _snapshots()
    inc.chunk = _chunk({1: "a", 2: "b", 3: "c", 4: "d", 5: "e"}, snapshot="100:105:101,103")
    inc.saw([_record(_key(1))], 102)  # visible: the chunk already has it
    inc.saw([_record(_key(2))], 99)
    assert list(inc.chunk.rows) == [_key(1), _key(2), _key(3), _key(4), _key(5)]
    inc.saw([_record(_key(1))], 101)  # in progress at the snapshot
    assert list(inc.chunk.rows) == [_key(2), _key(3), _key(4), _key(5)]
    inc.saw([_record(_key(2)), _record(_key(3)), _record(_key(99))], 105)  # started after
    assert list(inc.chunk.rows) == [_key(4), _key(5)]
    inc.saw([_record(_key(4))], None)  # unknown transaction: not visible
    assert list(inc.chunk.rows) == [_key(5)]
    assert inc.chunk.rows[_key(5)] == b'{"id":5,"v":"e"}'


def test_saw_ignores_other_tables() -> None:
    inc = _snapshots()
    inc.chunk = _chunk({1: "a", 2: "b"})
    inc.saw([_record(_key(1), table="b"), _record(TRUNCATE_KEY, table="b")], 200)
    assert list(inc.chunk.rows) == [_key(1), _key(2)]


def test_saw_truncate_clears_chunk() -> None:
    inc = _snapshots()
    inc.chunk = _chunk({1: "a", 2: "b"})
    inc.saw([_record(TRUNCATE_KEY)], 100)  # visible: the chunk saw the table after it
    assert list(inc.chunk.rows) == [_key(1), _key(2)]
    inc.saw([_record(TRUNCATE_KEY)], 103)
    assert inc.chunk.rows == {}


def test_saw_wraparound() -> None:
    inc = _snapshots()
    inc.chunk = _chunk({1: "a", 2: "b", 3: "c"}, snapshot=f"{2 * EPOCH - 5}:{3 * EPOCH + 4}:{2 * EPOCH - 2}")
    inc.saw([_record(_key(1))], 0xFFFFFFFD)  # committed before the snapshot, before the wrap
    inc.saw([_record(_key(2))], 0xFFFFFFFE)  # in progress
    inc.saw([_record(_key(3))], 4)  # xmax, after the wrap
    assert list(inc.chunk.rows) == [_key(1)]


# -------------------------------------------------------------------------- state


def test_state_round_trip() -> None:
    state = SnapshotState(
        "cdc",
        initial="running",
        consistent_point=0x1_6B37_4D48,
        done=["public.a", '"Odd"."My Table"'],
        incremental=Incremental(["s.c", "public.b"], after=["it's", "caf\u00e9"], chunks=3, rows=6000),
    )
    data = state.to_bytes()
    assert state.updated_ms > 1_600_000_000_000
    assert orjson.loads(data) == {
        "slot": "cdc",
        "initial": "running",
        "consistent_point": 0x1_6B37_4D48,
        "done": ["public.a", '"Odd"."My Table"'],
        "incremental": {"tables": ["s.c", "public.b"], "after": ["it's", "caf\u00e9"], "chunks": 3, "rows": 6000},
        "updated_ms": state.updated_ms,
    }
    back = SnapshotState.from_bytes(data)
    assert back == state
    assert isinstance(back.incremental, Incremental)


@pytest.mark.parametrize(
    "state",
    [
        SnapshotState("cdc"),
        SnapshotState("s1", initial="skipped"),
        SnapshotState("s1", initial="done", consistent_point=0, done=["public.a"]),
        SnapshotState("cdc", initial="done", incremental=Incremental([])),
        SnapshotState("cdc", initial="done", incremental=Incremental(["public.a"])),
    ],
)
def test_state_round_trip_variants(state: SnapshotState) -> None:
    back = SnapshotState.from_bytes(state.to_bytes())
    assert back == state
    assert back.incremental == state.incremental


def test_state_defaults() -> None:
    state = SnapshotState("cdc")
    assert (state.initial, state.consistent_point, state.done, state.incremental) == ("pending", None, [], None)
    assert SnapshotState("x").done is not state.done
    assert Incremental(["t"]) == Incremental(["t"], None, 0, 0)
    assert state_topic("dbserver1") == "dbserver1.__cdc_state"


def test_mark_done_idempotent() -> None:
    state = SnapshotState("cdc")
    state.mark_done("public.b")
    state.mark_done("public.a")
    state.mark_done("public.b")
    state.mark_done("public.a")
    assert state.done == ["public.b", "public.a"]


# ------------------------------------------------------------------------- tables


def _snapshot_table(
    captured: CapturedTable, columns: list[str], key_types: tuple[str, ...]
) -> SnapshotTable:
    keys = set(captured.key_columns)
    return SnapshotTable(captured, tuple(ColumnDef(c, 25, -1, c in keys) for c in columns), key_types)


SINGLE = _snapshot_table(_captured("public", "orders"), ["id", "customer", "total"], ("integer",))
COMPOSITE = _snapshot_table(
    _captured("sales", "lines", keys=("order_id", "line")),
    ["line", "note", "order_id"],  # attribute order differs from key order
    ("bigint", "smallint"),
)
ODD = _snapshot_table(
    _captured('my.sch"ema', 'Odd "T" x', keys=("Key Col", 'k"q')),
    ["Key Col", "Value", 'k"q', "a.b"],
    ("character varying(20)", '"My Enum"'),
)


def test_key_indexes_and_display() -> None:
    assert SINGLE.key_indexes == [0]
    assert COMPOSITE.key_indexes == [2, 0]
    assert ODD.key_indexes == [0, 2]
    assert SINGLE.display == "public.orders"
    assert ODD.display == '"my.sch""ema"."Odd ""T"" x"'


@pytest.mark.parametrize(
    ("kwargs", "sql"),
    [
        ({}, 'COPY (SELECT "id", "customer", "total" FROM "public"."orders") TO STDOUT'),
        (
            {"limit": 2048},
            'COPY (SELECT "id", "customer", "total" FROM "public"."orders" ORDER BY "id" LIMIT 2048) TO STDOUT',
        ),
        (
            {"after": ["41"], "limit": 10},
            'COPY (SELECT "id", "customer", "total" FROM "public"."orders" '
            "WHERE (\"id\") > ('41'::integer) ORDER BY \"id\" LIMIT 10) TO STDOUT",
        ),
        (
            {"upto": ["99"]},
            'COPY (SELECT "id", "customer", "total" FROM "public"."orders" '
            "WHERE (\"id\") <= ('99'::integer)) TO STDOUT",
        ),
        (
            {"after": ["-5"], "upto": ["99"]},
            'COPY (SELECT "id", "customer", "total" FROM "public"."orders" '
            "WHERE (\"id\") > ('-5'::integer) AND (\"id\") <= ('99'::integer)) TO STDOUT",
        ),
        (
            {"after": ["1"], "upto": ["2"], "limit": 3},
            'COPY (SELECT "id", "customer", "total" FROM "public"."orders" '
            "WHERE (\"id\") > ('1'::integer) AND (\"id\") <= ('2'::integer) "
            'ORDER BY "id" LIMIT 3) TO STDOUT',
        ),
        (
            {"limit": 7.9},
            'COPY (SELECT "id", "customer", "total" FROM "public"."orders" ORDER BY "id" LIMIT 7) TO STDOUT',
        ),
    ],
)
def test_copy_sql_single_key(kwargs: dict, sql: str) -> None:
    assert SINGLE.copy_sql(**kwargs) == sql


def test_copy_sql_composite_key() -> None:
    assert COMPOSITE.copy_sql() == 'COPY (SELECT "line", "note", "order_id" FROM "sales"."lines") TO STDOUT'
    assert COMPOSITE.copy_sql(after=["7", "3"], upto=["9", "1"], limit=500) == (
        'COPY (SELECT "line", "note", "order_id" FROM "sales"."lines" '
        "WHERE (\"order_id\", \"line\") > ('7'::bigint, '3'::smallint) "
        "AND (\"order_id\", \"line\") <= ('9'::bigint, '1'::smallint) "
        'ORDER BY "order_id", "line" LIMIT 500) TO STDOUT'
    )
    assert COMPOSITE.copy_sql(upto=["9", "1"]) == (
        'COPY (SELECT "line", "note", "order_id" FROM "sales"."lines" '
        "WHERE (\"order_id\", \"line\") <= ('9'::bigint, '1'::smallint)) TO STDOUT"
    )


def test_copy_sql_odd_identifiers_and_literals() -> None:
    assert ODD.copy_sql(after=["O'Brien", "it''s"], limit=1) == (
        'COPY (SELECT "Key Col", "Value", "k""q", "a.b" FROM "my.sch""ema"."Odd ""T"" x" '
        "WHERE (\"Key Col\", \"k\"\"q\") > ('O''Brien'::character varying(20), 'it''''s'::\"My Enum\") "
        'ORDER BY "Key Col", "k""q" LIMIT 1) TO STDOUT'
    )
    assert ODD.copy_sql(upto=["back\\slash", ""]) == (
        'COPY (SELECT "Key Col", "Value", "k""q", "a.b" FROM "my.sch""ema"."Odd ""T"" x" '
        "WHERE (\"Key Col\", \"k\"\"q\") <= ('back\\slash'::character varying(20), ''::\"My Enum\")) TO STDOUT"
    )


def test_copy_sql_key_arity_must_match() -> None:
    with pytest.raises(ValueError):
        COMPOSITE.copy_sql(after=["7"])
    with pytest.raises(ValueError):
        SINGLE.copy_sql(upto=["1", "2"])
    with pytest.raises(ValueError):
        SINGLE.copy_sql(after=["a\x00b"])  # no NUL in a PostgreSQL literal


@pytest.mark.parametrize(
    ("table", "percent", "sql"),
    [
        (
            SINGLE,
            1.5,
            'COPY (SELECT "id" FROM "public"."orders" TABLESAMPLE SYSTEM (1.500000) ORDER BY "id") TO STDOUT',
        ),
        (
            COMPOSITE,
            0.0123456789,
            'COPY (SELECT "order_id", "line" FROM "sales"."lines" TABLESAMPLE SYSTEM (0.012346) '
            'ORDER BY "order_id", "line") TO STDOUT',
        ),
        (
            ODD,
            100,
            'COPY (SELECT "Key Col", "k""q" FROM "my.sch""ema"."Odd ""T"" x" TABLESAMPLE SYSTEM (100.000000) '
            'ORDER BY "Key Col", "k""q") TO STDOUT',
        ),
    ],
)
def test_sample_keys_sql(table: SnapshotTable, percent: float, sql: str) -> None:
    assert table.sample_keys_sql(percent) == sql


# -- progress display --------------------------------------------------------------------------
def test_progress_line_shows_rows_rate_and_eta(monkeypatch):
    from snapshot import progress as progress_module

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = progress_module.Progress({"public.t": 100_000, "public.empty": 0}, mode="log")
    now[0] += 10.0
    progress.add("public.t", 25_000)
    assert progress.line("public.t", now[0]) == (
        "snapshot public.t: 25,000/100,000 rows (25%), 2,500 rows/s, ETA 30 s"
    )
    assert progress.line("public.empty", now[0]) == "snapshot public.empty: 0/0 rows (100%), 0 rows/s, done"
    progress.add("public.t", 80_000)  # more rows than estimated: the estimate follows
    assert progress.line("public.t", now[0]) == (
        "snapshot public.t: 105,000/105,000 rows (100%), 10,500 rows/s, done"
    )
