"""The PostgreSQL read model (sinks/stores/postgres): `cdc sink postgres` keeps each captured
table as `cdc_<schema>.<table>` in another database; `cdc verify` hashes it there; `cdc top`
counts it; `cdc postgres rebuild` fills new schemas and switches them in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support import (
    Sink,
    acct_changes_captured,
    acct_rows,
    slot_of,
    wait_caught_up,
    write_config,
)
from tests.test_sink_cache import BIG

REPO = Path(__file__).resolve().parent.parent


def _cdc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cdc", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _read_model(dsn: str, table: str = "cdc_public.acct") -> dict[int, tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute(f"SELECT id, version, note FROM {table}")}


@pytest.mark.integration
@pytest.mark.fast
def test_the_read_model_holds_the_rows_verifies_counts_and_rebuilds(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, read_model: str
) -> None:
    daemon = acct_changes_captured(db, run_daemon)
    config = str(write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                              postgres={"dsn": read_model}, spark={"checkpoint_dir": str(tmp_path / "checkpoints")}))

    done = _cdc("sink", "postgres", "--once", "--config", config)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 dead letters" in done.stdout
    assert _read_model(read_model) == acct_rows(db)
    with psycopg.connect(read_model, autocommit=True) as conn:
        columns = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = 'cdc_public' "
            "AND table_name = 'acct' ORDER BY ordinal_position").fetchall()
    assert columns == [("_cdc_key", "text"), ("_cdc_lsn", "bigint"), ("_cdc_seq", "bigint"),
                       ("_cdc_partition", "integer"), ("_cdc_offset", "bigint"), ("id", "integer"),
                       ("version", "integer"), ("note", "text")]

    rows = len(acct_rows(db))
    agreed = _cdc("verify", "--stores", "postgres", "--tables", "public.acct", "--config", config)
    assert agreed.returncode == 0, agreed.stdout + agreed.stderr[-3000:]
    assert f"  read-model  {rows} rows  ok" in agreed.stdout.splitlines(), agreed.stdout
    with psycopg.connect(read_model, autocommit=True) as conn:
        conn.execute("UPDATE cdc_public.acct SET version = -7, note = 'changed' WHERE id = 1")
    tampered = _cdc("verify", "--stores", "postgres", "--tables", "public.acct", "--config", config)
    assert tampered.returncode == 1, tampered.stdout
    assert f"  read-model  {rows} rows  MISMATCH: 0 missing, 0 extra, 1 different" in tampered.stdout.splitlines()
    assert '    different {"id":1}; version: postgres 1, read-model -7; note: postgres "n1", read-model "changed"' in \
        tampered.stdout.splitlines(), tampered.stdout

    top = _cdc("top", "--once", "--config", config)
    assert top.returncode == 0, top.stderr[-3000:]
    assert "postgres" in top.stdout

    rebuilt = _cdc("postgres", "rebuild", "--config", config)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert rebuilt.stdout.splitlines() == [f"postgres rebuild: 1 tables switched in, {rows} rows"]
    assert _read_model(read_model) == acct_rows(db)  # the tampered row came back from the topics
    with psycopg.connect(read_model, autocommit=True) as conn:
        schemas = [r[0] for r in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'cdc%' "
                                              "ORDER BY 1")]
    assert schemas == ["cdc_public"]

    db.execute("UPDATE public.acct SET version = 9 WHERE id = 2")
    db.execute("TRUNCATE public.acct")
    db.execute("INSERT INTO public.acct VALUES (1, 3, 'after the truncate')")
    wait_caught_up(db.dsn, slot_of(topic_prefix), daemon)
    again = _cdc("sink", "postgres", "--once", "--config", config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _read_model(read_model) == acct_rows(db) == {1: (3, "after the truncate")}
    assert daemon.stop() == 0


@pytest.mark.integration
def test_the_read_model_follows_added_dropped_and_retyped_columns_and_keeps_toasted_values(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, read_model: str
) -> None:
    """ADD COLUMN adds it; DROP COLUMN keeps it, null in newer rows; a widened type is altered in
    place; an unchanged TOASTed value keeps the stored one; a type its stored values do not
    convert to stops the job in one line naming the fix: an event of the new type for every row,
    then `cdc postgres rebuild`, which fills the table again with the new type."""
    db.execute("CREATE TABLE public.doc (id int PRIMARY KEY, n int, body text, gone text)")
    db.execute(f"INSERT INTO public.doc SELECT g, g, {BIG}, 'g' || g FROM generate_series(1, 20) g")
    daemon, slot = run_daemon(["public.*"])
    config = str(write_config(tmp_path / "sink.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
                              postgres={"dsn": read_model}, spark={"checkpoint_dir": str(tmp_path / "checkpoints")}))
    sink = Sink(Path(config), tmp_path / "sink.log", store="postgres")
    sink.once()
    db.execute("ALTER TABLE public.doc ADD COLUMN added text")
    db.execute("ALTER TABLE public.doc DROP COLUMN gone")
    db.execute("ALTER TABLE public.doc ALTER COLUMN n TYPE bigint")
    db.execute("UPDATE public.doc SET added = 'a' || id, n = n * 10000000000 WHERE id <= 10")  # body: unchanged, TOASTed
    wait_caught_up(db.dsn, slot, daemon)
    sink.once()

    def held() -> dict[int, tuple]:
        with psycopg.connect(read_model, autocommit=True) as conn:
            return {r[0]: r[1:] for r in conn.execute("SELECT id, n, md5(body), added, gone FROM cdc_public.doc")}

    source = {r[0]: r[1:] for r in db.fetchall("SELECT id, n, md5(body), added FROM public.doc")}
    assert held() == {i: (*row, None if i <= 10 else f"g{i}") for i, row in source.items()}
    with psycopg.connect(read_model, autocommit=True) as conn:
        types = dict(conn.execute("SELECT column_name, data_type FROM information_schema.columns "
                                  "WHERE table_schema = 'cdc_public' AND table_name = 'doc'").fetchall())
    assert (types["n"], types["added"], types["gone"]) == ("bigint", "text", "text")

    db.execute("ALTER TABLE public.doc ALTER COLUMN added TYPE int USING 0")
    db.execute("UPDATE public.doc SET added = id WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    stopped = sink.once(exit_code=1)
    assert "public.doc: column added changed from text to integer, which its stored values do not convert to " \
        "(invalid input syntax for type integer" in stopped
    assert "give every row an event of the new type (an UPDATE of each row in the source), then run `cdc postgres " \
        "rebuild` to fill the table again with the new type" in stopped
    db.execute("UPDATE public.doc SET added = id")
    wait_caught_up(db.dsn, slot, daemon)
    rebuilt = _cdc("postgres", "rebuild", "--config", config)
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    sink.once()
    source = {r[0]: r[1:] for r in db.fetchall("SELECT id, n, md5(body), added FROM public.doc")}
    assert {i: row[:3] for i, row in held().items()} == source
    assert daemon.stop() == 0


def test_an_unset_dsn_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    """`cdc sink postgres` and `cdc verify --stores postgres` refuse an empty [postgres] dsn
    before anything starts."""
    config = tmp_path / "cdc.toml"
    config.write_text("[postgres]\n")
    expected = "error: [postgres] dsn is empty: set it to the read model's database (a libpq DSN or URI)"
    for args in (("sink", "postgres", "--once"), ("verify", "--stores", "postgres")):
        done = _cdc(*args, "--config", str(config), timeout=120)
        assert (done.returncode, done.stderr.strip()) == (1, expected), done.stderr


@pytest.mark.integration
@pytest.mark.fast
def test_a_task_spark_runs_again_stages_its_rows_once(read_model: str) -> None:
    """The executors stage a batch's rows each in a transaction of its own: a task Spark runs
    again (its executor lost after it staged) replaces what its first attempt staged, and the
    batch's MERGE, which needs one row per key, applies every change once."""
    import pyarrow as pa

    from sinks.latest import ROWS
    from sinks.stores.postgres import PostgresConfig
    from sinks.stores.postgres.store import PostgresStore
    from sinks.versions import ColumnShape, Registry, Version

    topic = "p.public.acct"
    registry = Registry([Version("public", "acct", topic, 0, (
        ColumnShape("id", "int4", -1, True, {"type": "int32"}), ColumnShape("note", "text", -1, False, {"type": "string"})))])
    ids = range(1, 101)
    batch = pa.table({
        "_cdc_topic": [topic] * 100, "_cdc_key": [f'{{"id":{i}}}' for i in ids], "_cdc_op": ["c"] * 100,
        "_cdc_lsn": [1000 + i for i in ids], "_cdc_seq": [1000 + i for i in ids], "_cdc_partition": [0] * 100,
        "_cdc_offset": list(ids), "_cdc_tombstone": [False] * 100,
        "after": [f'{{"id":{i},"note":"n{i}"}}' for i in ids]}, schema=ROWS)
    store = PostgresStore(PostgresConfig(dsn=read_model))
    store.open(resumed=False)
    try:
        store.prepare([topic], registry)
        task = store.partition_writer(registry, {})
        list(task(batch.slice(0, 40).to_batches()))  # the first attempt staged part of the rows, then its executor died
        list(task(batch.to_batches()))  # Spark runs the task again
        store.merge()
        store.save({"batch": 0})
    finally:
        store.close()
    with psycopg.connect(read_model, autocommit=True) as conn:
        held = dict(conn.execute("SELECT id, note FROM cdc_public.acct").fetchall())
    assert held == {i: f"n{i}" for i in ids}
