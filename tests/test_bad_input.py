"""Every bad input: one `error: ...` line naming the fix, exit 1, and nothing lost.

End to end: `python -m cdc run --config ...` as a subprocess against the session's real
PostgreSQL cluster and broker (plus two throwaway clusters for server settings the shared
one must not have). Where the daemon refuses to start while a slot exists, the slot's
confirmed_flush_lsn must not have moved: a refusal never confirms anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic
from cdc.local.kafka import LocalKafka
from cdc.local.postgres import LocalPostgres
from cdc.local.process import free_port
from cdc.naming import topic_name
from cdc.source.replication import ReplicationConnection
from compaction.table import payload_of
from tests.support import (
    cdc,
    confirmed_lsn,
    slot_of,
    start_streaming,
    topic_records,
    topic_table,
    wait_caught_up,
    wait_for,
    write_config,
)

SECRET = "s3cret"


# ------------------------------------------------------------------------------ helpers


def refused(result: subprocess.CompletedProcess) -> str:
    """The one error line's message; fails unless exit 1, no traceback, exactly one line."""
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 1, output
    assert "Traceback" not in result.stderr + result.stdout, output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines, output
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, output  # one error line ...
    assert lines[-1] == errors[0], output  # ... and nothing after it (a multi-line message would be)
    return errors[0][len("error: "):]


def run(config: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return cdc("run", "--config", str(config), *args, env=env, timeout=timeout)


def make_slot(db, slot: str, publication_for: str | None = None) -> int:
    """An existing slot (as a previous run leaves it, after its publication when
    `publication_for` names the tables); returns its confirmed_flush_lsn."""
    if publication_for:
        publication = "p_" + slot[len("s_"):]
        db.execute(f'CREATE PUBLICATION "{publication}" FOR TABLE {publication_for} WITH (publish_via_partition_root = true)')
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    lsn = confirmed_lsn(db.dsn, slot)
    assert lsn is not None
    return lsn


def slot_row(db, slot: str) -> tuple | None:
    rows = db.fetchall(
        "SELECT confirmed_flush_lsn - '0/0', active_pid, wal_status FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    return rows[0] if rows else None


@pytest.fixture
def config_for(tmp_path, db, broker_servers, topic_prefix):
    """A config on the test's database, broker and prefix; sections override keys."""

    def make(tables: list[str], dsn: str | None = None, **sections) -> Path:
        sections.setdefault("daemon", {}).setdefault("log_level", "WARNING")
        return write_config(tmp_path / "cdc.toml", dsn or db.dsn, broker_servers, topic_prefix, tables, **sections)

    return make


@pytest.fixture
def role(pg, db) -> Iterator:
    """Create login roles in the cluster (roles are cluster-wide: unique names); dropped afterwards."""
    made: list[str] = []

    def create(attributes: str = "") -> str:
        name = f"r_{uuid.uuid4().hex[:10]}"
        db.execute(sql.SQL("CREATE ROLE {} LOGIN " + attributes).format(sql.Identifier(name)))
        made.append(name)
        return name

    yield create
    with psycopg.connect(pg.dsn(db.name), autocommit=True) as conn:
        for name in made:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    with psycopg.connect(pg.dsn(), autocommit=True) as conn:
        for name in made:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def as_user(dsn: str, user: str) -> str:
    return f"{dsn} user={user}"  # libpq: the last occurrence of a key wins


# ------------------------------------------------------------------- 1. wrong config


CONFIG_CASES = {
    "unknown key": (
        '[topic]\npartiton = 3\n', {},
        "unknown key 'partiton' in [topic]: did you mean 'partitions'? (remove it or fix the spelling)",
    ),
    "unknown key, nothing close": (
        '[source]\ncolour = "red"\n', {},
        "unknown key 'colour' in [source]: remove it (known keys: dsn, protocol_version,",
    ),
    "unknown section": (
        '[sources]\ndsn = "x"\n', {},
        "unknown section [sources] in {path}: did you mean [source]? (remove it or fix the spelling)",
    ),
    "unknown section, nothing close": (
        '[kafka]\nbootstrap_servers = "x"\n', {},
        "unknown section [kafka] in {path}: remove it (sections: source, topic, events, snapshot, daemon, spark, delta, search, cache, postgres)",
    ),
    "bad type": (
        '[topic]\npartitions = "x"\n', {},
        "[topic] partitions = 'x' is not a whole number: set it to one, e.g. partitions = 1",
    ),
    "float for an int": (
        '[topic]\npartitions = 3.5\n', {},
        "[topic] partitions = 3.5 is not a whole number: set it to one, e.g. partitions = 1",
    ),
    "bool for a float": (
        '[source]\nslot_wait_s = true\n', {},
        "[source] slot_wait_s = true is not a number: set it to one, e.g. slot_wait_s = 10.0",
    ),
    "bad log level": (
        '[daemon]\nlog_level = "verbose"\n', {},
        "[daemon] log_level 'verbose' is not a level: use DEBUG, INFO, WARNING, ERROR or CRITICAL",
    ),
    "bad boolean": (
        '[topic]\nallow_non_compacted = "maybe"\n', {},
        "[topic] allow_non_compacted = 'maybe' is not true or false: set it to one, e.g. allow_non_compacted = false",
    ),
    "env override": (
        "", {"CDC_TOPIC_PARTITIONS": "abc"},
        "CDC_TOPIC_PARTITIONS = 'abc' is not a whole number: set it to one, e.g. CDC_TOPIC_PARTITIONS=1",
    ),
    "env override of a known section with an unknown key": (
        "", {"CDC_SOURCE_TABLE": "public.x"},
        "unknown environment variable CDC_SOURCE_TABLE: did you mean CDC_SOURCE_TABLES? (remove it or fix the spelling)",
    ),
    "section not a table": (
        "source = 3\n", {},
        "[source] in {path} must be a table: write it as a [source] section",
    ),
    "invalid TOML": (
        "[topic]\npartitions = 3 x\n", {},
        "config file {path} is not valid TOML: Expected newline or end of document after a statement (at line 2, column 16)",
    ),
    "not UTF-8": (
        b"[topic]\nprefix = \"caf\xe9\"\n", {},
        "config file {path} is not UTF-8 text: save it as UTF-8",
    ),
    "table pattern without schema": (
        '[source]\ntables = ["orders"]\n', {},
        "table pattern 'orders' has no schema: write it as schema.table, e.g. public.orders",
    ),
    "empty table list": (
        "[source]\ntables = []\n", {},
        '[source] tables is empty: list the tables to capture, e.g. tables = ["public.*"]',
    ),
    "bad prefix characters": (
        '[topic]\nprefix = "my prefix!"\n', {},
        "topic prefix 'my prefix!' has characters Kafka does not allow (' !'): use only ASCII letters, digits, '.', '_' and '-', e.g. dbserver1",
    ),
    "bad prefix from the environment": (
        "", {"CDC_TOPIC_PREFIX": "a/b"},
        "topic prefix 'a/b' has characters Kafka does not allow ('/')",
    ),
    "bad slot name": (
        '[source]\nslot = "My-Slot"\n', {},
        "[source] slot 'My-Slot' must be lower-case letters, digits and underscores",
    ),
    "min.insync.replicas above the replication factor": (
        "[topic]\nmin_insync_replicas = 2\n", {},
        "[topic] min_insync_replicas = 2 is more than replication_factor = 1, so every write would fail with "
        "NotEnoughReplicas: lower min_insync_replicas or raise replication_factor",
    ),
    "streaming without protocol 2": (
        "[source]\nstreaming = true\n", {},
        "[source] streaming needs protocol_version = 2",
    ),
    "secret of the wrong type": (
        "[topic]\nsasl_password = 12345\n", {},
        "[topic] sasl_password = <hidden> is not a string",
    ),
}


@pytest.fixture(scope="module")
def config_results(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every config case run at once (each is a separate `cdc run` process; no services needed)."""
    base = tmp_path_factory.mktemp("config-cases")
    paths = {}
    for i, (case, (text, _, _)) in enumerate(CONFIG_CASES.items()):
        path = paths[case] = base / f"case{i}.toml"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {case: pool.submit(run, paths[case], env=CONFIG_CASES[case][1], timeout=60) for case in CONFIG_CASES}
        return {case: (paths[case], future.result()) for case, future in futures.items()}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_mistakes(case, config_results):
    path, result = config_results[case]
    expected = CONFIG_CASES[case][2]
    message = refused(result)
    assert expected.format(path=path) in message
    if case == "secret of the wrong type":
        assert "12345" not in message


def test_config_file_missing(tmp_path):
    missing = tmp_path / "nope.toml"
    message = refused(run(missing, timeout=30))
    assert message == f"config file {missing} not found: pass an existing file to --config"


def test_config_path_is_a_directory(tmp_path):
    message = refused(run(tmp_path, timeout=30))
    assert message.startswith(f"cannot read config file {tmp_path} (")
    assert message.endswith("): pass a readable TOML file to --config")


# -------------------------------------------------------------- 2. PostgreSQL unreachable


@pytest.mark.parametrize(
    "dsn",
    [
        f"host=127.0.0.1 port={{port}} user=cdc password={SECRET} dbname=app",
        f"postgresql://cdc:{SECRET}@127.0.0.1:{{port}}/app?sslmode=disable",
        f"host=127.0.0.1 port={{port}} user=cdc password='{SECRET} x' dbname=app",
    ],
    ids=["key-value", "uri", "quoted"],
)
def test_postgres_unreachable_names_the_dsn_but_never_the_password(dsn, config_for):
    port = free_port()  # nothing listens there
    config = config_for(["public.*"], dsn=dsn.format(port=port))
    started = time.monotonic()
    result = run(config)
    message = refused(result)
    assert time.monotonic() - started < 30
    assert message.startswith("cannot connect to PostgreSQL (")
    assert f'port {port} failed: Connection refused' in message
    assert "): check [source] dsn / CDC_SOURCE_DSN, now " in message
    assert message.endswith(f"cdc:***@127.0.0.1:{port}/app?sslmode=disable" if "://" in dsn
                            else "dbname=app")  # the redacted DSN, whole
    assert SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "dsn, reason",
    [
        (f"nonsense password={SECRET}", 'missing "=" after "nonsense" in connection info string'),
        (f"host=127.0.0.1 port={{port}} dbname={{db}} user=nobody password={SECRET}", 'FATAL:  role "nobody" does not exist'),
        (f"host=127.0.0.1 port={{port}} dbname=nodb user=postgres password={SECRET}", 'FATAL:  database "nodb" does not exist'),
        (f"postgresql://postgres:{SECRET}@127.0.0.1:{{port}}/x?connect_timeout=soon", "bad value for connect_timeout: 'soon'"),
    ],
    ids=["syntax", "unknown-role", "unknown-database", "bad-option"],
)
def test_postgres_refuses_the_dsn(dsn, reason, pg, db, config_for):
    result = run(config_for(["public.*"], dsn=dsn.format(port=pg.port, db=db.name)))
    message = refused(result)
    assert message.startswith("cannot connect to PostgreSQL (")
    assert reason in message and "check [source] dsn / CDC_SOURCE_DSN, now " in message
    assert SECRET not in result.stdout + result.stderr


def test_postgres_unreachable_from_the_environment_hides_the_password(config_for):
    port = free_port()
    config = config_for(["public.*"])
    result = run(config, env={"CDC_SOURCE_DSN": f"host=127.0.0.1 port={port} password={SECRET} dbname=x"})
    message = refused(result)
    assert message.endswith(f"check [source] dsn / CDC_SOURCE_DSN, now host=127.0.0.1 port={port} password=*** dbname=x")
    assert SECRET not in result.stdout + result.stderr


# ------------------------------------------------------------------ 3. wal_level


@pytest.fixture
def replica_pg(tmp_path) -> Iterator[LocalPostgres]:
    cluster = LocalPostgres(tmp_path / "pg-replica", settings={"wal_level": "replica"})
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def test_wal_level_not_logical(replica_pg, tmp_path, broker_servers, topic_prefix):
    replica_pg.create_database("app")
    dsn = replica_pg.dsn("app")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    config = write_config(tmp_path / "cdc.toml", dsn, broker_servers, topic_prefix, ["public.t"])
    message = refused(run(config))
    assert message == (
        "wal_level is 'replica', logical decoding needs 'logical': run ALTER SYSTEM SET wal_level = logical "
        "(or set it in postgresql.conf) and restart PostgreSQL"
    )


# ------------------------------------------------------------------ 4. roles


def test_role_without_replication(db, role, config_for, topic_prefix):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    name = role()
    db.execute(sql.SQL("GRANT SELECT ON public.t TO {}").format(sql.Identifier(name)))
    slot = slot_of(topic_prefix)
    before = make_slot(db, slot)
    message = refused(run(config_for(["public.t"], dsn=as_user(db.dsn, name))))
    assert message == f'role {name} lacks the REPLICATION attribute: run ALTER ROLE "{name}" REPLICATION as a superuser'
    assert confirmed_lsn(db.dsn, slot) == before


def test_role_without_select(db, role, config_for, topic_prefix):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    name = role("REPLICATION")
    slot = slot_of(topic_prefix)
    before = make_slot(db, slot)
    message = refused(run(config_for(["public.t"], dsn=as_user(db.dsn, name))))
    assert message == f'role {name} lacks SELECT on public.t: run GRANT SELECT ON "public"."t" TO "{name}"'
    assert confirmed_lsn(db.dsn, slot) == before


def test_role_without_usage_on_the_schema(db, role, config_for):
    db.execute("CREATE SCHEMA app")
    db.execute("CREATE TABLE app.t (id int PRIMARY KEY)")
    name = role("REPLICATION")
    db.execute(sql.SQL("GRANT SELECT ON app.t TO {}").format(sql.Identifier(name)))
    message = refused(run(config_for(["app.t"], dsn=as_user(db.dsn, name))))
    assert message == (
        f'role {name} lacks USAGE on schema "app", so it cannot read app.t: run GRANT USAGE ON SCHEMA "app" TO "{name}"'
    )


def test_role_that_cannot_create_the_publication(db, role, config_for, topic_prefix):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    name = role("REPLICATION")
    db.execute(sql.SQL("GRANT SELECT ON public.t TO {}").format(sql.Identifier(name)))
    message = refused(run(config_for(["public.t"], dsn=as_user(db.dsn, name))))
    assert message.startswith(f"cannot create or alter publication p_{topic_prefix.lower()} (")
    assert "the role must own the tables (or create it as a superuser: CREATE PUBLICATION" in message
    assert db.fetchall("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot_of(topic_prefix),)) == [(0,)]


# ------------------------------------------------------------------ 5. tables


TABLE_CASES = {
    "table not found": (
        "CREATE TABLE public.orders (id int PRIMARY KEY)",
        ["public.orders", "public.missing"],
        "table public.missing not found in database {db}: check [source] tables "
        "(identifiers are case-folded unless double-quoted)",
    ),
    "table only differs in case": (
        'CREATE TABLE public."Orders" (id int PRIMARY KEY)',
        ["public.Orders"],
        "table public.Orders not found in database {db}: check [source] tables "
        '(identifiers are case-folded unless double-quoted; did you mean public."Orders"?)',
    ),
    "schema.* matching nothing": (
        "CREATE SCHEMA empty; CREATE TABLE public.t (id int PRIMARY KEY)",
        ["public.t", "empty.*"],
        "no tables match empty.* in database {db}: create them first or remove the pattern from [source] tables",
    ),
    "schema.* of a missing schema": (
        "CREATE TABLE public.t (id int PRIMARY KEY)",
        ["nosuch.*"],
        "no tables match nosuch.* in database {db}: create them first or remove the pattern from [source] tables",
    ),
    "no primary key, no replica identity index": (
        "CREATE TABLE public.log (at timestamptz, msg text)",
        ["public.log"],
        "table public.log has no primary key and no replica identity index, so its rows have no key in a "
        'compacted topic: add a primary key, or ALTER TABLE "public"."log" REPLICA IDENTITY USING INDEX <unique index>',
    ),
    "replica identity full without a key": (
        "CREATE TABLE public.log (at timestamptz, msg text); ALTER TABLE public.log REPLICA IDENTITY FULL",
        ["public.log"],
        "table public.log has no primary key and no replica identity index",
    ),
    "a view": (
        "CREATE TABLE public.t (id int PRIMARY KEY); CREATE VIEW public.v AS SELECT * FROM public.t",
        ["public.v"],
        "public.v is a view, not a table: logical decoding captures tables only; remove it from [source] tables",
    ),
    "a partition": (
        "CREATE TABLE public.m (id int PRIMARY KEY) PARTITION BY RANGE (id); "
        "CREATE TABLE public.m_1 PARTITION OF public.m FOR VALUES FROM (0) TO (10)",
        ["public.m_1"],
        "table public.m_1 is a partition of public.m: partitions publish through their root table, "
        "so list public.m in [source] tables instead",
    ),
    "unlogged table": (
        "CREATE TABLE public.t (id int PRIMARY KEY); CREATE UNLOGGED TABLE public.scratch (id int PRIMARY KEY)",
        ["public.*"],
        "table public.scratch is UNLOGGED, so its changes never reach the WAL and logical decoding cannot see them: "
        'run ALTER TABLE "public"."scratch" SET LOGGED, or leave it out of [source] tables',
    ),
    "replica identity nothing": (
        "CREATE TABLE public.t (id int PRIMARY KEY); ALTER TABLE public.t REPLICA IDENTITY NOTHING",
        ["public.t"],
        'table public.t has REPLICA IDENTITY NOTHING, so deletes carry no key: '
        'run ALTER TABLE "public"."t" REPLICA IDENTITY DEFAULT (or FULL)',
    ),
}


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_table_mistakes(case, db, config_for, topic_prefix, broker_servers):
    setup, tables, expected = TABLE_CASES[case]
    for statement in setup.split("; "):
        db.execute(statement)
    slot = slot_of(topic_prefix)
    before = make_slot(db, slot)
    message = refused(run(config_for(tables)))
    assert expected.format(db=db.name) in message
    assert confirmed_lsn(db.dsn, slot) == before
    # refused before any topic or publication was made
    assert db.fetchall("SELECT count(*) FROM pg_publication") == [(0,)]


# ------------------------------------------------------------------ 6. broker unreachable


def test_broker_unreachable(db, config_for, topic_prefix):
    """`cdc run`, `cdc tail`, `cdc status` and `cdc verify` (run side by side: each waits out a
    client timeout)."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    slot = slot_of(topic_prefix)
    before = make_slot(db, slot)
    port = free_port()
    # each gives up after [topic] connect_timeout_s (30 s by default; `cdc run`'s check 15 s at most)
    config = config_for(["public.t"], topic={"bootstrap_servers": f"127.0.0.1:{port}", "connect_timeout_s": 3})

    def timed(*args: str) -> tuple[float, subprocess.CompletedProcess]:
        started = time.monotonic()
        result = cdc(*args, "--config", str(config), timeout=90)
        return time.monotonic() - started, result

    with ThreadPoolExecutor(max_workers=4) as pool:
        running, tailing = pool.submit(timed, "run"), pool.submit(timed, "tail", "public.t")
        statuses, verifying = pool.submit(timed, "status"), pool.submit(timed, "verify")
        (run_s, run_result), (tail_s, tail_result) = running.result(), tailing.result()
        (_, status_result), (_, verify_result) = statuses.result(), verifying.result()

    message = refused(run_result)
    assert run_s < 30
    assert message.startswith(f"cannot reach the Kafka broker at 127.0.0.1:{port} (")
    assert message.endswith("start it or fix [topic] bootstrap_servers / CDC_TOPIC_BOOTSTRAP_SERVERS")
    assert confirmed_lsn(db.dsn, slot) == before

    assert tail_s < 60  # [topic] connect_timeout_s bounds it
    assert refused(tail_result) == (
        f"cannot read topic {topic_prefix}.public.t from the Kafka broker at 127.0.0.1:{port} (KafkaTimeoutError): "
        "start it or fix [topic] bootstrap_servers / CDC_TOPIC_BOOTSTRAP_SERVERS"
    )
    # the sink jobs' progress records, read by both (a traceback before)
    for result in (status_result, verify_result):
        assert refused(result) == (
            f"cannot reach the Kafka broker at 127.0.0.1:{port} (KafkaTimeoutError): "
            "start it or fix [topic] bootstrap_servers / CDC_TOPIC_BOOTSTRAP_SERVERS"
        )


def test_broker_refuses_to_create_the_topic(db, config_for, topic_prefix):
    """A single-broker cluster cannot hold 3 replicas: the broker's reason, and what to change."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    message = refused(run(config_for(["public.t"], topic={"replication_factor": 3, "min_insync_replicas": 2})))
    topic = topic_name(topic_prefix, "public", "t")
    assert message.startswith(f"the broker refused to create topic {topic} (InvalidReplicationFactorError")
    assert message.endswith(
        "): fix [topic] partitions = 3, replication_factor = 3, min_insync_replicas = 2 or max_message_bytes = 1048588 "
        "for this cluster, or create the topic yourself with cleanup.policy=compact"
    )
    assert db.fetchall("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot_of(topic_prefix),)) == [(0,)]


def test_table_whose_topic_name_is_too_long(db, config_for, topic_prefix):
    name = "é" * 31  # 62 bytes, 186 characters once escaped for Kafka
    db.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    db.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(sql.Identifier(name, name)))
    message = refused(run(config_for([f'"{name}".*'])))
    assert message == (
        f'topic for table "{name}"."{name}" would be {len(topic_prefix) + 2 + 2 * 186} characters, over Kafka\'s '
        "limit of 249: no prefix is short enough; leave this table out of the capture or rename it"
    )


def test_tables_whose_topics_clash_in_kafka(db, config_for, topic_prefix):
    db.execute("CREATE SCHEMA s")
    db.execute("CREATE SCHEMA s_a")
    db.execute("CREATE TABLE s.a_b (id int PRIMARY KEY)")
    db.execute("CREATE TABLE s_a.b (id int PRIMARY KEY)")
    message = refused(run(config_for(["s.*", "s_a.*"])))
    assert message == (
        f"tables s.a_b and s_a.b would get topics {topic_prefix}.s.a_b and {topic_prefix}.s_a.b, which Kafka "
        "cannot hold side by side ('.' and '_' are the same in its metric names): leave one out of [source] tables, "
        "or capture it with a second cdc run under another [topic] prefix"
    )


# ------------------------------------------------------------------ 7. non-compacted topic


def _create_delete_topic(servers: str, name: str) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=servers, client_id="test-bad-input")
    try:
        admin.create_topics([NewTopic(name, 1, 1, topic_configs={"cleanup.policy": "delete"})])
    finally:
        admin.close()


def test_non_compacted_topic_is_refused_then_allowed(db, config_for, topic_prefix, broker_servers, tmp_path):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    topic = topic_name(topic_prefix, "public", "t")
    _create_delete_topic(broker_servers, topic)
    slot = slot_of(topic_prefix)
    before = make_slot(db, slot, publication_for="public.t")
    db.execute("INSERT INTO public.t VALUES (1, 'kept')")  # written while the daemon refuses

    message = refused(run(config_for(["public.t"])))
    assert message == (
        f"topic {topic} has cleanup.policy=delete, not compact: compaction is what keeps the latest row per key, "
        "so set cleanup.policy=compact on it, or set [topic] allow_non_compacted = true to use it anyway"
    )
    assert confirmed_lsn(db.dsn, slot) == before

    config = config_for(
        ["public.t"], topic={"allow_non_compacted": True}, daemon={"log_level": "INFO"},
        snapshot={"mode": "never"},  # the slot was made by hand: only the streamed rows matter here
    )
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    try:
        db.execute("INSERT INTO public.t VALUES (2, 'new')")
        wait_caught_up(db.dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0
    assert f"topic {topic} is not compacted (cleanup.policy=delete), as allowed" in daemon.output()
    rows = [v["after"] for _, v in topic_records(broker_servers, topic_prefix, "public", "t")]
    assert rows == [{"id": 1, "v": "kept"}, {"id": 2, "v": "new"}]  # the refusal lost nothing


def test_slot_older_than_its_publication(db, config_for, topic_prefix):
    """A slot whose publication is missing (dropped, renamed in the config, or the slot made by
    hand) would fail every start with "publication does not exist": refused up front."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    slot = slot_of(topic_prefix)
    before = make_slot(db, slot)
    db.execute("INSERT INTO public.t VALUES (1)")
    message = refused(run(config_for(["public.t"])))
    assert message == (
        f"publication p_{topic_prefix.lower()} does not exist but slot {slot} does, and a slot cannot decode "
        "through a publication created after it: set [source] publication to the one the slot was streamed with, "
        f"or drop the slot (SELECT pg_drop_replication_slot('{slot}')) and start again with a fresh snapshot of the tables"
    )
    assert confirmed_lsn(db.dsn, slot) == before
    assert db.fetchall("SELECT count(*) FROM pg_publication") == [(0,)]


# ------------------------------------------------------------------ 8. slot in use


def test_slot_in_use_names_the_pid(db, config_for, topic_prefix):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    slot, publication = slot_of(topic_prefix), "p_" + topic_prefix.lower()
    db.execute(f'CREATE PUBLICATION "{publication}" FOR TABLE public.t')
    holder = ReplicationConnection(db.dsn)
    try:
        created = holder.create_slot(slot)
        holder.start(slot, created.consistent_point, publication, 1, False)
        pid = wait_for(lambda: slot_row(db, slot)[1], 10, "the test's walsender to hold the slot")
        db.execute("INSERT INTO public.t VALUES (1)")
        before = confirmed_lsn(db.dsn, slot)
        started = time.monotonic()
        message = refused(run(config_for(["public.t"], source={"slot_wait_s": 1})))
        assert time.monotonic() - started < 20
        assert message == (
            f"slot {slot} is in use by PID {pid} (another cdc run?): stop that process, "
            "or set [source] slot to another name"
        )
        assert confirmed_lsn(db.dsn, slot) == before
        assert slot_row(db, slot)[1] == pid  # the other holder was left alone
    finally:
        holder.close()


def test_second_daemon_on_the_same_slot(db, config_for, topic_prefix, tmp_path):
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    slot = slot_of(topic_prefix)
    config = config_for(["public.t"], source={"slot_wait_s": 1})
    first = start_streaming(config, tmp_path / "first.log", db.dsn, slot)
    try:
        pid = slot_row(db, slot)[1]
        message = refused(run(config))
        assert message.startswith(f"slot {slot} is in use by PID {pid} (another cdc run?)")
        assert first.alive()
        db.execute("INSERT INTO public.t VALUES (1)")
        wait_caught_up(db.dsn, slot, first)  # the first one keeps working
    finally:
        assert first.stop() == 0


# ------------------------------------------------------------------ 9. lost slot


@pytest.fixture(scope="module")
def tight_pg(tmp_path_factory) -> Iterator[LocalPostgres]:
    """A cluster with tight limits: a slot is invalidated as soon as it holds back more than 1 MB
    of WAL, two slots at most, one walsender at most. Each test uses its own database."""
    cluster = LocalPostgres(
        tmp_path_factory.mktemp("pg-tight"),
        settings={"max_slot_wal_keep_size": "1MB", "max_replication_slots": "2", "max_wal_senders": "1"},
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def tight_db(tight_pg, request) -> Iterator[str]:
    """A database of its own on the tight cluster (dropped with its slots); returns its DSN."""
    name = "t_" + uuid.uuid4().hex[:10]
    dsn = tight_pg.create_database(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.t (id serial PRIMARY KEY, v text)")
    try:
        yield dsn
    finally:
        tight_pg.drop_database(name)


def make_lost_slot(dsn: str, slot: str) -> int:
    """A slot whose WAL is gone (wal_status lost); returns its confirmed_flush_lsn."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        before = confirmed_lsn(dsn, slot)

        def lost() -> bool:  # a full segment past the slot, then a checkpoint removes it
            conn.execute("INSERT INTO public.t (v) VALUES ('x')")
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
            row = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            return row[0] == "lost"

        wait_for(lost, 30, "PostgreSQL to mark the slot lost", poll=0)
    return before


def test_lost_slot_says_how_to_recover(tight_db, tmp_path, broker_servers, topic_prefix):
    dsn = tight_db
    slot = slot_of(topic_prefix)
    before = make_lost_slot(dsn, slot)
    config = write_config(tmp_path / "cdc.toml", dsn, broker_servers, topic_prefix, ["public.t"])
    message = refused(run(config))
    assert message == (
        f"slot {slot} has lost WAL it needed (wal_status=lost), so changes are missing from it: set [snapshot] "
        f"mode = \"when_needed\" to drop it and take a new snapshot, or drop it yourself with "
        f"SELECT pg_drop_replication_slot('{slot}') and start again with a fresh snapshot of the tables"
    )
    # the evidence stays: the slot is neither dropped nor replaced, and it did not move
    assert confirmed_lsn(dsn, slot) == before
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchall() == [("lost",)]


def test_lost_slot_recovers_under_when_needed(tight_db, tmp_path, broker_servers, topic_prefix):
    """mode = when_needed drops the lost slot, takes a new aligned snapshot and streams on."""
    dsn = tight_db
    slot = slot_of(topic_prefix)
    make_lost_slot(dsn, slot)
    config = write_config(
        tmp_path / "cdc.toml", dsn, broker_servers, topic_prefix, ["public.t"],
        snapshot={"mode": "when_needed"}, daemon={"log_level": "INFO"},
    )
    daemon = start_streaming(config, tmp_path / "daemon.log", dsn, slot)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO public.t (v) VALUES ('after')")
        wait_caught_up(dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0
    assert f"dropping slot {slot}, which lost WAL it needed, to take a new snapshot" in daemon.output()
    with psycopg.connect(dsn, autocommit=True) as conn:
        source = {r[0]: r[1] for r in conn.execute("SELECT id, v FROM public.t").fetchall()}
    table = topic_table(broker_servers, topic_prefix, "public", "t")
    assert {json.loads(k)["id"]: v["v"] for k, v in table.state().items()} == source
    assert table.order_violations() == []


def test_dropped_slot_is_refused_then_resnapshot_cuts_off_old_rows(
    db, tmp_path, broker_servers, topic_prefix, config_for
):
    """A slot gone after a snapshot: changes were missed. `initial` refuses; `when_needed` takes a
    new snapshot, and rows deleted while the slot was gone leave the topic read as a table."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.t SELECT g, 'v' || g FROM generate_series(1, 50) g")
    slot = slot_of(topic_prefix)
    config = config_for(["public.t"], daemon={"log_level": "INFO"})
    daemon = start_streaming(config, tmp_path / "first.log", db.dsn, slot)
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    db.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    db.execute("DELETE FROM public.t WHERE id <= 10")  # never captured: the slot is gone
    db.execute("UPDATE public.t SET v = 'missed' WHERE id = 20")

    message = refused(run(config))
    assert message.startswith(f"slot {slot} is gone but the topics hold a snapshot taken through it")
    assert 'set [snapshot] mode = "when_needed" to take a new snapshot' in message

    config = config_for(["public.t"], daemon={"log_level": "INFO"}, snapshot={"mode": "when_needed"})
    daemon = start_streaming(config, tmp_path / "second.log", db.dsn, slot)
    try:
        db.execute("UPDATE public.t SET v = 'streamed' WHERE id = 30")
        wait_caught_up(db.dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0
    source = {r[0]: r[1] for r in db.fetchall("SELECT id, v FROM public.t")}
    table = topic_table(broker_servers, topic_prefix, "public", "t")
    assert {json.loads(k)["id"]: v["v"] for k, v in table.state().items()} == source
    assert table.order_violations() == []
    ops = [v["op"] for _, v in topic_records(broker_servers, topic_prefix, "public", "t") if v is not None]
    assert ops.count("t") == 1 and ops.count("r") == 50 + 40


def test_all_replication_slots_in_use(tight_db, tmp_path, broker_servers, topic_prefix):
    with psycopg.connect(tight_db, autocommit=True) as conn:
        for other in ("other_1", "other_2"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (other,))
    config = write_config(tmp_path / "cdc.toml", tight_db, broker_servers, topic_prefix, ["public.t"])
    message = refused(run(config))
    assert message == (
        f"cannot create slot {slot_of(topic_prefix)}: all replication slots are in use: drop a slot nobody uses "
        "(see SELECT slot_name, active FROM pg_replication_slots) or raise max_replication_slots and restart PostgreSQL"
    )


def test_all_wal_senders_in_use(tight_db, tmp_path, broker_servers, topic_prefix):
    holder = ReplicationConnection(tight_db)  # the cluster's only walsender
    try:
        config = write_config(tmp_path / "cdc.toml", tight_db, broker_servers, topic_prefix, ["public.t"])
        message = refused(run(config))
    finally:
        holder.close()
    assert message.startswith("cannot open a replication connection: ")
    assert "number of requested standby connections exceeds max_wal_senders (currently 1)" in message
    assert message.endswith(
        ": stop a replication client nobody needs (see pg_stat_replication) or raise max_wal_senders and restart PostgreSQL"
    )


# ------------------------------------------------------------------ 10. odd identifiers


ODD_SCHEMA, ODD_TABLE = 'Odd "S" . x', "tä ble"


def test_odd_identifiers_are_captured(db, config_for, topic_prefix, broker_servers, tmp_path):
    schema, table = sql.Identifier(ODD_SCHEMA), sql.Identifier(ODD_SCHEMA, ODD_TABLE)
    db.execute(sql.SQL("CREATE SCHEMA {}").format(schema))
    db.execute(sql.SQL('CREATE TABLE {} (id int PRIMARY KEY, "wé ird" text)').format(table))
    slot = slot_of(topic_prefix)
    config = config_for(['"Odd ""S"" . x".*'], daemon={"log_level": "INFO"})
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    try:
        db.execute(sql.SQL("INSERT INTO {} VALUES (1, 'ünï \"q\"')").format(table))
        wait_caught_up(db.dsn, slot, daemon)
    finally:
        assert daemon.stop() == 0

    topic = topic_name(topic_prefix, ODD_SCHEMA, ODD_TABLE)
    assert topic == f"{topic_prefix}.Odd-20-22S-22-20-2e-20x.t-c3-a4-20ble"
    records = topic_records(broker_servers, topic_prefix, ODD_SCHEMA, ODD_TABLE)
    assert [(k, v["op"], v["after"]) for k, v in records] == [(b'{"id":1}', "c", {"id": 1, "wé ird": 'ünï "q"'})]
    assert (records[0][1]["source"]["schema"], records[0][1]["source"]["table"]) == (ODD_SCHEMA, ODD_TABLE)

    result = cdc("tail", '"Odd ""S"" . x"."tä ble"', "--raw", "--config", str(config), timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["key"], r["value"]["op"], r["value"]["after"]) for r in lines] == [
        ('{"id":1}', "c", {"id": 1, "wé ird": 'ünï "q"'})
    ]
    pretty = cdc("tail", '"Odd ""S"" . x"."tä ble"', "--config", str(config), timeout=60)
    assert pretty.returncode == 0, pretty.stderr
    assert pretty.stdout.startswith(f"--- {topic} [")
    assert '"wé ird": "ünï \\"q\\""' in pretty.stdout


def test_tail_of_a_table_without_topic(config_for, topic_prefix):
    config = config_for(["public.*"])
    message = refused(cdc("tail", "public.nothing_here", "--config", str(config), timeout=60))
    assert message == (
        f"topic {topic_prefix}.public.nothing_here does not exist: check the table name and [topic] prefix = "
        f"{topic_prefix} (cdc run creates the topics of the tables in [source] tables)"
    )


def test_tail_needs_one_table(config_for):
    config = config_for(["public.*"])
    assert refused(cdc("tail", "public.*", "--config", str(config), timeout=30)) == "tail needs one table, not public.*"
    assert refused(cdc("tail", "orders", "--config", str(config), timeout=30)) == (
        "table pattern 'orders' has no schema: write it as schema.table, e.g. public.orders"
    )


def test_verify_store_mistakes(config_for):
    """`cdc verify --stores` knows the registered stores and what each side needs, before it
    reads anything."""
    config = str(config_for(["public.*"]))
    assert refused(cdc("verify", "--stores", "warehouse", "--config", config, timeout=60)) == (
        "unknown store 'warehouse' in --stores: use delta, search, cache, postgres"
    )
    assert refused(cdc("verify", "--stores", "cache,delta", "--config", config, timeout=60)) == (
        "[delta] path is not set: set it (or CDC_DELTA_PATH), or leave delta out of --stores"
    )


# ------------------------------------------------------------------ 11. help


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], ["Change data capture", "run", "status", "tail", "config", "Stream changes from the replication slot"]),
        (["run"], ["Stream changes from the replication slot into the topics", "--config", "CDC_<SECTION>_<KEY>"]),
        (["status"], ["Slot state", "confirmed LSN", "--json", "--config"]),
        (["tail"], ["Print the events of TABLE's topic", "--follow", "--raw", "--config"]),
        (["config"], ["Print the effective configuration", "secrets masked"]),
    ],
    ids=["cdc", "run", "status", "tail", "config"],
)
def test_help(args, expected):
    result = cdc(*args, "--help", timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for text in expected:
        assert text in result.stdout, result.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["runn"], "No such command 'runn'. Did you mean 'run'? (run python -m cdc --help)"),
        (["run", "--bogus"], "No such option '--bogus' (run python -m cdc run --help)"),
        (["tail"], "Missing argument 'TABLE' (run python -m cdc tail --help)"),
        (["status", "--config"], "Option '--config' requires an argument (run "),
    ],
    ids=["unknown-verb", "unknown-option", "missing-argument", "option-without-value"],
)
def test_usage_mistakes(args, expected):
    assert refused(cdc(*args, timeout=30)).startswith(expected)


# ------------------------------------------------------------------ 12. secrets never leave the process


# Every character that trips a DSN: '%', spaces, quotes, '@', '=', '/', '\', ':' and non-ASCII
HARD = "S%q 'x\"@=/\\:é€-s3cr3t"


def uri_dsn(db, password: str) -> str:
    from urllib.parse import quote

    params = psycopg.conninfo.conninfo_to_dict(db.dsn)
    return f"postgresql://{params['user']}:{quote(password, safe='')}@{params['host']}:{params['port']}/{params['dbname']}"


def kv_dsn(db, password: str) -> str:
    return db.dsn + " password='" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"


def leaks(text: str, password: str) -> list[str]:
    """The secret, or any piece of it as it could be spelt, found in `text`."""
    from urllib.parse import quote

    spellings = {password, quote(password, safe=""), json.dumps(password)[1:-1], repr(password)[1:-1], "s3cr3t"}
    return [s for s in spellings if s in text]


@pytest.mark.parametrize("form, where", [("uri", "file"), ("kv", "env")])
def test_secrets_never_appear_on_success(form, where, db, tmp_path, broker_servers, topic_prefix):
    """A daemon at DEBUG level, then every verb, with secrets in the DSN and the SASL password."""
    dsn = (uri_dsn if form == "uri" else kv_dsn)(db, HARD)
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    db.execute("INSERT INTO public.t VALUES (1, 'snap')")
    env = {"CDC_TOPIC_SASL_PASSWORD": HARD}
    if where == "env":
        env["CDC_SOURCE_DSN"] = dsn
    config = write_config(
        tmp_path / "cdc.toml", dsn if where == "file" else db.dsn, broker_servers, topic_prefix, ["public.t"],
        daemon={"log_level": "DEBUG"},
    )
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot, env=env)
    try:
        db.execute("INSERT INTO public.t VALUES (2, 'streamed')")
        wait_caught_up(db.dsn, slot, daemon)
        second = cdc("run", "--config", str(config), env={**env, "CDC_SOURCE_SLOT_WAIT_S": "0"}, timeout=60)
        assert refused(second).startswith(f"slot {slot} is in use")  # a failure path while the first streams
        outputs = {"second run": second.stdout + second.stderr}
        for verb in (["status"], ["status", "--json"], ["tail", "public.t"], ["config"], ["snapshot", "--tables", "public.t"]):
            result = cdc(*verb, "--config", str(config), env=env, timeout=60)
            assert result.returncode == 0, result.stderr
            outputs[" ".join(verb)] = result.stdout + result.stderr
    finally:
        assert daemon.stop() == 0
    outputs["daemon log"] = daemon.output()
    assert "DEBUG" in outputs["daemon log"]
    for name, text in outputs.items():
        assert not leaks(text, HARD), (name, leaks(text, HARD), text[-2000:])


FAILING_DSNS = {
    "uri, '%' not encoded": "postgresql://u:{pw}%zz@127.0.0.1:{port}/x",
    "uri, space": "postgresql://u:{pw} x@127.0.0.1:{port}/x",
    "uri, '/' not encoded": "postgresql://u:{pw}/x@127.0.0.1:{port}/x",
    "kv, unquoted space": "host=127.0.0.1 port={port} password={pw} Zz{pw} dbname=x",
    "kv, unterminated quote": "host=127.0.0.1 port={port} password='{pw} dbname=x",
    "kv, unreachable": "host=127.0.0.1 port={free} password='{pw}' dbname=x",
    "uri, unknown database": "postgresql://postgres:{pw}@127.0.0.1:{port}/no_such_db",
}


@pytest.mark.parametrize("case", list(FAILING_DSNS))
def test_secrets_never_appear_on_failure(case, pg, tmp_path, broker_servers, topic_prefix):
    """Each way a DSN fails, through every verb that reads it, from the file and the environment."""
    pw = "Pw3cret-Abc"
    dsn = FAILING_DSNS[case].format(pw=pw, port=pg.port, free=free_port())
    file_config = write_config(tmp_path / "file.toml", dsn, broker_servers, topic_prefix, ["public.*"])
    env_config = write_config(tmp_path / "env.toml", "host=unused", broker_servers, topic_prefix, ["public.*"])
    runs = [
        (verb, config, env)
        for verb in (["run"], ["snapshot"], ["status"])
        for config, env in ((file_config, {}), (env_config, {"CDC_SOURCE_DSN": dsn}))
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda r: cdc(*r[0], "--config", str(r[1]), env=r[2], timeout=60), runs))
    for (verb, _, env), result in zip(runs, results, strict=True):
        message = refused(result)
        assert "dsn" in message.lower() or "PostgreSQL" in message, message
        for piece in (pw, "Zz" + pw, pw[:6], pw[-6:]):
            assert piece not in result.stdout + result.stderr, (verb, env, result.stderr)


# ------------------------------------------------------------------ 13. start-up resources and broker protocols


def test_metrics_port_in_use(db, config_for):
    import socket

    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = refused(run(config_for(["public.t"], daemon={"metrics_port": port, "log_level": "WARNING"})))
    assert message == (
        f"cannot serve metrics on 127.0.0.1:{port} (Address already in use): set [daemon] metrics_port to a free "
        "port (0 turns metrics off) or fix metrics_host"
    )
    assert db.fetchall("SELECT count(*) FROM pg_replication_slots") == [(0,)]


@pytest.mark.parametrize(
    "topic, expected",
    [
        ({"security_protocol": "SSL"}, "the TLS handshake failed: this listener does not speak TLS (security_protocol = SSL)"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "u",
          "sasl_password": "Kafka-s3cret"},
         "the SASL handshake failed: this listener does not speak security_protocol = SASL_PLAINTEXT"),
    ],
    ids=["tls-to-plaintext", "sasl-to-plaintext"],
)
def test_broker_protocol_mistakes_say_what_failed(topic, expected, db, config_for, broker_servers):
    """Not "cannot reach": the broker is there and answered, in another protocol."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    config = config_for(["public.t"], topic={**topic, "connect_timeout_s": 3})  # each gives up after it
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = pool.submit(run, config, timeout=90)
        tailing = pool.submit(cdc, "tail", "public.t", "--config", str(config), timeout=90)
        results = {"run": running.result(), "tail": tailing.result()}
    for verb, result in results.items():
        message = refused(result)
        assert message.startswith(f"cannot use the Kafka broker at {broker_servers}: {expected} ("), (verb, message)
        assert "Kafka-s3cret" not in result.stdout + result.stderr


# ------------------------------------------------------------------ 14. Debezium's truncate switch


@pytest.mark.parametrize("skipped", ["t", "none"])
def test_skipped_operations_truncate(skipped, db, run_daemon, broker_servers, topic_prefix):
    """`[events] skipped_operations = "t"`: no `t` event reaches the topic; "none": the event as always."""
    from cdc.events.records import TRUNCATE_KEY

    db.execute("CREATE TABLE public.t (id int PRIMARY KEY, v text)")
    daemon, slot = run_daemon(["public.t"], events={"skipped_operations": skipped})
    db.execute("INSERT INTO public.t VALUES (1, 'a'), (2, 'b')")
    db.execute("TRUNCATE public.t")
    db.execute("INSERT INTO public.t VALUES (3, 'c')")
    wait_caught_up(db.dsn, slot, daemon)
    records = topic_records(broker_servers, topic_prefix, "public", "t")
    ops = [v["op"] for _, v in records if v is not None]
    if skipped == "t":
        assert ops == ["c", "c", "c"]
        assert TRUNCATE_KEY not in {k for k, _ in records}
    else:
        assert sorted(ops) == ["c", "c", "c", "t"]  # partitions interleave: per-key order is checked elsewhere
        assert [v["op"] for k, v in records if k == TRUNCATE_KEY] == ["t"]


def test_sasl_plain_streams_and_a_wrong_password_says_authentication_failed(db, tmp_path):
    """A broker with a SASL/PLAIN listener: the right account streams through it; a wrong
    password is one line saying authentication failed, and the password is never shown."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    password = "Kafka-s3cret é"
    with LocalKafka(tmp_path / "kafka", sasl_users={"alice": password}) as kafka:
        sasl = {"bootstrap_servers": kafka.sasl_bootstrap_servers, "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "PLAIN", "sasl_username": "alice"}
        wrong = write_config(tmp_path / "wrong.toml", db.dsn, "", "tw", ["public.t"],
                             topic={**sasl, "sasl_password": "not-" + password, "connect_timeout_s": 3})
        result = run(wrong, timeout=90)
        message = refused(result)
        assert message.startswith(
            f"cannot use the Kafka broker at {kafka.sasl_bootstrap_servers}: authentication failed ("
        ), message
        assert message.endswith("check [topic] sasl_username, sasl_password and sasl_mechanism"), message
        assert password not in result.stdout + result.stderr

        right = write_config(tmp_path / "right.toml", db.dsn, "", "tr", ["public.t"],
                             topic={**sasl, "sasl_password": password})
        daemon = start_streaming(right, tmp_path / "daemon.log", db.dsn, slot_of("tr"))
        db.execute("INSERT INTO public.t VALUES (7)")
        wait_caught_up(db.dsn, slot_of("tr"), daemon)
        assert daemon.stop() == 0
        assert password not in daemon.output()
        config = TopicConfig(**sasl, sasl_password=password)
        records = list(read_topic(config, topic_name("tr", "public", "t")))
        assert [(r.key, payload_of(r.value)["after"]) for r in records] == [(b'{"id":7}', {"id": 7})]


def test_tls_streams_and_an_untrusted_certificate_says_so(db, tmp_path):
    """A broker with a TLS listener: trusting its certificate, cdc streams through it; trusting
    another one, the TLS handshake fails in one line naming the CA file to fix."""
    db.execute("CREATE TABLE public.t (id int PRIMARY KEY)")
    stranger = LocalKafka(tmp_path / "stranger", tls=True).certificate()  # never started
    with LocalKafka(tmp_path / "kafka", tls=True) as kafka:
        tls = {"bootstrap_servers": kafka.ssl_bootstrap_servers, "security_protocol": "SSL"}
        untrusted = write_config(tmp_path / "untrusted.toml", db.dsn, "", "tu", ["public.t"],
                                 topic={**tls, "ssl_cafile": str(stranger), "connect_timeout_s": 3})
        message = refused(run(untrusted, timeout=90))
        assert message == (
            f"cannot use the Kafka broker at {kafka.ssl_bootstrap_servers}: the TLS handshake failed: the broker's "
            "certificate is not trusted (KafkaTimeoutError): point [topic] ssl_cafile at the CA that signed it"
        ), message

        trusted = write_config(tmp_path / "trusted.toml", db.dsn, "", "tt", ["public.t"],
                               topic={**tls, "ssl_cafile": str(kafka.ca_file)})
        daemon = start_streaming(trusted, tmp_path / "daemon.log", db.dsn, slot_of("tt"))
        db.execute("INSERT INTO public.t VALUES (7)")
        wait_caught_up(db.dsn, slot_of("tt"), daemon)
        assert daemon.stop() == 0
        records = list(read_topic(TopicConfig(**tls, ssl_cafile=str(kafka.ca_file)), topic_name("tt", "public", "t")))
        assert [(r.key, payload_of(r.value)["after"]) for r in records] == [(b'{"id":7}', {"id": 7})]


def test_the_sinks_bench_names_the_extra_it_needs(tmp_path):
    """`pip install -e '.[sinks]'` has no confluent-kafka: the bench says which extra brings it."""
    blocked = (
        "import runpy, sys; sys.modules['confluent_kafka'] = None; sys.path.insert(0, 'bench'); "
        "sys.argv = ['bench/sinks.py']; runpy.run_path('bench/sinks.py', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: bench/sinks.py needs confluent-kafka (the daemon's producer and the bench's reader): "
        "pip install -e '.[sinks,confluent]'"
    )
