"""The real Debezium PostgreSQL connector (3.3.1.Final on Kafka Connect 4.1.1) as the oracle.

One database, four pipelines: cdc and Debezium, each with JsonConverter schemas on and
off, over the same fixture tables (tests/debezium_oracle.py): an aligned snapshot, then
inserts, updates, deletes with tombstones, a key change, REPLICA IDENTITY FULL before
images, unchanged TOASTed values, a schema change and a truncate. Events are paired per
table, key and order and compared field by field (keys, values, source, schemas). Every
difference must be one docs/events.md documents (`DOCUMENTED`), and every documented one must
still be observed: a fix on either side, or a new difference, fails here.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson
import psycopg
import pytest

from cdc.local.connect import LocalKafkaConnect, debezium_connector
from cdc.local.postgres import LocalPostgres
from compaction.table import position_of
from tests import debezium_oracle as oracle
from tests.support import DaemonProcess, slot_active, start_streaming, wait_for, write_config

pytestmark = [pytest.mark.integration, pytest.mark.debezium]

SNAPSHOT_ROWS = 11  # rows SNAPSHOT_SQL leaves in the captured tables


@dataclass
class Run:
    cdc: dict[bool, oracle.Pipeline]  # schemas on/off -> pipeline
    debezium: dict[bool, oracle.Pipeline]
    types: dict[str, dict[str, str]]  # table -> column -> format_type


def _topics(servers: str, prefix: str) -> list[str]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=servers, client_id="cdc-oracle")
    try:
        return sorted(t for t in admin.list_topics() if t.startswith(prefix + ".") and "__cdc" not in t)
    finally:
        admin.close()


def _column_types(dsn: str) -> dict[str, dict[str, str]]:
    rows = psycopg.connect(dsn, autocommit=True).execute(
        "SELECT n.nspname || '.' || c.relname, a.attname, format_type(a.atttypid, a.atttypmod) "
        "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped "
        "AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
    ).fetchall()
    out: dict[str, dict[str, str]] = {}
    for table, column, shown in rows:
        out.setdefault(table, {})[column] = shown
    return out


def _ops(p: oracle.Pipeline) -> list[str]:
    return [e.value["op"] if e.value else "tombstone" for events in p.events.values() for e in events]


def _truncated_keys(p: oracle.Pipeline) -> int:
    """Keys whose row a truncate removed: by position, each key's latest event older than its
    table's newest truncate is a live row (the partitions' records interleave in any order)."""
    count = 0
    for events in p.events.values():
        truncates = [position_of(e.value) for e in events if e.value and e.value["op"] == "t"]
        if not truncates:
            continue
        latest: dict[str, tuple[tuple[int, int], str]] = {}
        for e in events:
            if e.value is not None and e.value["op"] != "t" and position_of(e.value) < max(truncates):
                key = orjson.dumps(e.key).decode()
                if key not in latest or latest[key][0] < position_of(e.value):
                    latest[key] = (position_of(e.value), e.value["op"])
        count += sum(1 for _, op in latest.values() if op != "d")
    return count


def _read_all(servers: str, pipelines: list[oracle.Pipeline], done: Callable[[oracle.Pipeline], bool]) -> None:
    """Poll every pipeline's topics until `done` holds for all (deadline, no sleeps beyond polling)."""
    def ready() -> bool:
        for p in pipelines:
            p.read(servers, _topics(servers, p.prefix))
        return all(done(p) for p in pipelines)

    wait_for(ready, 180, "every pipeline's events", poll=1.0)


@pytest.fixture(scope="module")
def run(pg: LocalPostgres, broker_servers: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    name = f"t_dbz_oracle_{uuid.uuid4().hex[:8]}"
    dsn = pg.create_database(name)
    base = tmp_path_factory.mktemp("oracle")
    daemons: list[DaemonProcess] = []
    connect = None
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(oracle.SCHEMA_SQL)
            for sql in oracle.SNAPSHOT_SQL:
                conn.execute(sql)
        tag = uuid.uuid4().hex[:6]
        cdc = {s: oracle.Pipeline("cdc", f"cdc{'s' if s else 'p'}{tag}", s) for s in (True, False)}
        dbz = {s: oracle.Pipeline("debezium", f"dbz{'s' if s else 'p'}{tag}", s) for s in (True, False)}
        connectors = {
            p.prefix: debezium_connector(
                p.prefix, dsn_host="127.0.0.1", dsn_port=pg.port, dbname=name, prefix=p.prefix,
                tables=oracle.DEBEZIUM_TABLES, schemas=p.schemas,
            )
            for p in dbz.values()
        }
        connect = LocalKafkaConnect(base / "connect", broker_servers, connectors)
        connect.start()
        for p in cdc.values():
            folder = base / p.prefix
            folder.mkdir()
            config = write_config(
                folder / "cdc.toml", dsn, broker_servers, p.prefix, oracle.TABLES,
                events={"schemas": p.schemas},
            )
            daemons.append(start_streaming(config, folder / "daemon.log", dsn, "s_" + p.prefix.lower()))
        for connector in connectors.values():
            wait_for(lambda c=connector: slot_active(dsn, c["slot.name"]), 120, "Debezium's slot")
        pipelines = [*cdc.values(), *dbz.values()]
        _read_all(broker_servers, pipelines, lambda p: _ops(p).count("r") >= SNAPSHOT_ROWS)

        with psycopg.connect(dsn, autocommit=True) as conn:
            for sql in oracle.STREAM_SQL:
                conn.execute(sql)
        expected: dict[str, int] = {}

        def settled(p: oracle.Pipeline) -> bool:
            """The marker arrived, and the count did not move since the last read."""
            if "public.marker" not in p.events:
                return False
            if p.name == "cdc" and _ops(p).count("tombstone") < _ops(p).count("d") + _truncated_keys(p):
                return False  # the truncate clean-up's tombstones follow the slot's confirmation
            total, last = p.count(), expected.get(p.prefix)
            expected[p.prefix] = total
            return total == last

        _read_all(broker_servers, pipelines, settled)
        yield Run(cdc, dbz, _column_types(dsn))
    finally:
        for daemon in daemons:
            if daemon.alive():
                daemon.stop()
        if connect is not None:
            connect.stop()
        pg.drop_database(name)


def _phase(event: oracle.Event) -> str:
    return "snapshot" if event.value is not None and event.value["op"] == "r" else "stream"


@pytest.mark.parametrize("schemas", [True, False], ids=["schemas", "plain"])
def test_every_difference_from_debezium_is_documented(run: Run, schemas: bool) -> None:
    diffs = oracle.compare(run.cdc[schemas], run.debezium[schemas], _phase, run.types)
    unexplained = [d for d in diffs if oracle.explain(d) is None]
    assert not unexplained, "\n".join(repr(d)[:600] for d in unexplained)


def test_every_documented_difference_is_still_observed(run: Run) -> None:
    seen = {
        oracle.explain(d)
        for schemas in (True, False)
        for d in oracle.compare(run.cdc[schemas], run.debezium[schemas], _phase, run.types)
    }
    assert set(oracle.DOCUMENTED) - seen == set(), "documented but no longer observed: fix docs/events.md and DOCUMENTED"


def test_both_sides_saw_every_kind_of_event(run: Run) -> None:
    for side in (run.cdc, run.debezium):
        for pipeline in side.values():
            ops = _ops(pipeline)
            assert {"r", "c", "u", "d", "t", "tombstone"} <= set(ops), (pipeline.prefix, sorted(set(ops)))
            if side is run.debezium:
                assert ops.count("d") == ops.count("tombstone")
            else:  # one per delete, and one per key a truncate removed (truncate clean-up)
                assert ops.count("tombstone") == ops.count("d") + _truncated_keys(pipeline)


def test_schema_change_shows_in_the_next_event(run: Run) -> None:
    """ADD COLUMN with a default, SET NOT NULL and DROP NOT NULL: pgoutput's Relation message
    carries none of it; the renderer reads it from the catalog, as Debezium does."""
    for side in (run.cdc, run.debezium):
        events = [e for e in side[True].events["public.evolve"] if e.value and e.value["op"] == "u"]
        assert events, side[True].prefix
        after = next(f for f in events[-1].schema["fields"] if f["field"] == "after")  # type: ignore[index]
        fields = {f["field"]: f for f in after["fields"]}
        assert fields["added"]["default"] == 5 and fields["added"]["optional"] is True
        assert fields["a"]["optional"] is False and fields["note"]["optional"] is True
        assert fields["note"]["default"] == "n"
        assert events[-1].value["after"]["added"] == 5  # type: ignore[index]
