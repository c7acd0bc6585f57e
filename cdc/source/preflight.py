"""Checks before streaming, and the source-side setup (publication, slot, replica identity).

Every failure is one line that names the fix: a daemon that starts and then silently
captures nothing (or the wrong thing) is worse than one that refuses to start.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc.config import Config
from cdc.naming import (
    TablePattern,
    find_topic_collisions,
    parse_table_pattern,
    qualified,
    quote_ident,
    topic_name,
)
from cdc.redact import redact_dsn
from cdc.source.catalog import CapturedTable, Catalog

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10
"""connect_timeout for the catalog connection when the DSN sets none."""


class PreflightError(Exception):
    """The daemon cannot start; the message is one line naming the fix."""


def connect_catalog(config: Config) -> Catalog:
    try:
        params = conninfo_to_dict(config.source.dsn)
    except psycopg.Error as exc:  # libpq quotes the malformed part, which may be the password: cli masks it
        raise PreflightError(
            f"cannot connect to PostgreSQL ({str(exc).strip() or type(exc).__name__}): check [source] dsn / "
            "CDC_SOURCE_DSN, now a DSN libpq cannot parse (not shown: it may hold the password)"
        ) from None
    try:
        # libpq waits for an unanswered connect without limit: a firewalled host must fail, not hang
        params.setdefault("connect_timeout", str(CONNECT_TIMEOUT_S))
        return Catalog(make_conninfo("", **params))
    except psycopg.Error as exc:
        reason = redact_dsn(str(exc).strip().splitlines()[0]) if str(exc).strip() else type(exc).__name__
        # The DSN goes last: cli redacts the whole line again, and a masked password followed by
        # other characters would swallow them.
        raise PreflightError(
            f"cannot connect to PostgreSQL ({reason}): check [source] dsn / CDC_SOURCE_DSN, now "
            f"{redact_dsn(config.source.dsn)}"
        ) from None


def check_server(catalog: Catalog) -> None:
    """wal_level and the role's REPLICATION attribute."""
    wal_level = catalog.conn.execute("SHOW wal_level").fetchone()[0]  # type: ignore[index]
    if wal_level != "logical":
        raise PreflightError(
            f"wal_level is '{wal_level}', logical decoding needs 'logical': run ALTER SYSTEM SET wal_level = logical "
            "(or set it in postgresql.conf) and restart PostgreSQL"
        )
    role, can_replicate = catalog.conn.execute(
        "SELECT rolname, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user"
    ).fetchone()  # type: ignore[misc]
    if not can_replicate:
        raise PreflightError(
            f"role {role} lacks the REPLICATION attribute: run ALTER ROLE {quote_ident(role)} REPLICATION as a superuser"
        )


def resolve_tables(catalog: Catalog, config: Config) -> list[CapturedTable]:
    """The captured tables, each readable and keyed; warns about TOAST placeholders."""
    tables, unmatched = catalog.resolve(config.source.tables)
    if unmatched:
        raise PreflightError(_not_found(catalog, unmatched[0]))
    role = catalog.conn.execute("SELECT current_user").fetchone()[0]  # type: ignore[index]
    facts = {
        oid: rest for oid, *rest in catalog.conn.execute(
            "SELECT oid, has_schema_privilege(relnamespace, 'USAGE'), has_table_privilege(oid, 'SELECT'), "
            "relpersistence::text FROM pg_class WHERE oid = ANY(%s)",
            ([t.oid for t in tables],),
        ).fetchall()
    }
    for table in tables:
        name = qualified(table.schema, table.table)
        usage, allowed, persistence = facts[table.oid]
        if not usage:
            raise PreflightError(
                f"role {role} lacks USAGE on schema {quote_ident(table.schema)}, so it cannot read {table.display}: "
                f"run GRANT USAGE ON SCHEMA {quote_ident(table.schema)} TO {quote_ident(role)}"
            )
        if not allowed:
            raise PreflightError(f"role {role} lacks SELECT on {table.display}: run GRANT SELECT ON {name} TO {quote_ident(role)}")
        if persistence != "p":
            kind = "UNLOGGED" if persistence == "u" else "TEMPORARY"
            raise PreflightError(
                f"table {table.display} is {kind}, so its changes never reach the WAL and logical decoding cannot "
                f"see them: run ALTER TABLE {name} SET LOGGED, or leave it out of [source] tables"
            )
        if not table.key_columns:
            raise PreflightError(
                f"table {table.display} has no primary key and no replica identity index, so its rows have no key "
                f"in a compacted topic: add a primary key, or ALTER TABLE {name} REPLICA IDENTITY USING INDEX <unique index>"
            )
        if table.replica_identity == "n":
            raise PreflightError(
                f"table {table.display} has REPLICA IDENTITY NOTHING, so deletes carry no key: "
                f"run ALTER TABLE {name} REPLICA IDENTITY DEFAULT (or FULL)"
            )
    _check_topic_names(config, tables)
    resolved = [_apply_toast_policy(catalog, config, t) for t in tables]
    _warn_toast_placeholders([t for t in resolved if _sends_toast_placeholders(t)])
    return resolved


def _check_topic_names(config: Config, tables: list[CapturedTable]) -> None:
    """Every table gets a topic Kafka accepts, and no two of them clash in Kafka's eyes."""
    by_topic = {}
    for table in tables:
        try:
            by_topic[topic_name(config.topic.prefix, table.schema, table.table)] = table
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
    for first, second in find_topic_collisions(by_topic):
        raise PreflightError(
            f"tables {by_topic[first].display} and {by_topic[second].display} would get topics {first} and {second}, "
            "which Kafka cannot hold side by side ('.' and '_' are the same in its metric names): leave one out "
            "of [source] tables, or capture it with a second cdc run under another [topic] prefix"
        )


_RELKINDS = {
    "v": "view", "m": "materialized view", "f": "foreign table", "S": "sequence", "i": "index",
    "I": "partitioned index", "c": "composite type", "t": "TOAST table",
}


def _not_found(catalog: Catalog, text: str) -> str:
    """Why a pattern matched nothing, with the spelling it probably meant (case is the usual slip)."""
    pattern = parse_table_pattern(text)
    database = catalog.database()
    if pattern.table is None:
        return (
            f"no tables match {text} in database {database}: create them first or remove the pattern "
            "from [source] tables"
        )
    row = catalog.conn.execute(
        "SELECT c.relkind::text, rn.nspname, r.relname FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_class r ON c.relispartition AND r.oid = pg_partition_root(c.oid) "
        "LEFT JOIN pg_namespace rn ON rn.oid = r.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        (pattern.schema, pattern.table),
    ).fetchone()
    if row is not None and row[2] is not None:
        parent = str(TablePattern(row[1], row[2]))
        return (
            f"table {text} is a partition of {parent}: partitions publish through their root table, "
            f"so list {parent} in [source] tables instead"
        )
    if row is not None:
        kind = _RELKINDS.get(row[0], f"relation of kind {row[0]!r}")
        return f"{text} is a {kind}, not a table: logical decoding captures tables only; remove it from [source] tables"
    wanted = (pattern.schema.casefold(), pattern.table.casefold())
    similar = [str(TablePattern(s, t)) for _, s, t, _ in catalog.all_tables() if (s.casefold(), t.casefold()) == wanted]
    hint = f"; did you mean {similar[0]}?" if similar else ""
    return (
        f"table {text} not found in database {database}: check [source] tables "
        f"(identifiers are case-folded unless double-quoted{hint})"
    )


def _sends_toast_placeholders(table: CapturedTable) -> bool:
    return table.replica_identity == "d" and bool(table.toastable_columns)


def _apply_toast_policy(catalog: Catalog, config: Config, table: CapturedTable) -> CapturedTable:
    if not _sends_toast_placeholders(table) or not config.source.set_replica_identity_full:
        return table
    name = qualified(table.schema, table.table)
    try:
        catalog.conn.execute(f"ALTER TABLE {name} REPLICA IDENTITY FULL")
    except psycopg.Error as exc:
        raise PreflightError(
            f"cannot set REPLICA IDENTITY FULL on {table.display} ({exc.diag.message_primary}): run it as the "
            "table's owner, or set [source] set_replica_identity_full = false"
        ) from None
    log.info("set REPLICA IDENTITY FULL on %s (set_replica_identity_full = true)", table.display)
    return catalog.describe(table.oid, table.schema, table.table, "f")


#: up to this many tables get a warning line each; a wider schema gets one line for them all
TOAST_WARNINGS_EACH = 5


def _warn_toast_placeholders(tables: list[CapturedTable]) -> None:
    """One line per table whose UPDATEs may send TOAST placeholders, or one line for all of
    them in a wide schema (a thousand identical warnings hide the start-up's other lines)."""
    consequence = (
        "an UPDATE that leaves a large value unchanged sends the placeholder __debezium_unavailable_value, and "
        "compaction then keeps the placeholder; set [source] set_replica_identity_full = true"
    )
    if len(tables) <= TOAST_WARNINGS_EACH:
        for table in tables:
            log.warning(
                "table %s has TOASTable columns (%s) under REPLICA IDENTITY DEFAULT: %s (ALTER TABLE %s REPLICA "
                "IDENTITY FULL) to send real values",
                table.display, ", ".join(table.toastable_columns), consequence, qualified(table.schema, table.table),
            )
        return
    shown = ", ".join(t.display for t in tables[:TOAST_WARNINGS_EACH])
    log.warning(
        "%d tables have TOASTable columns under REPLICA IDENTITY DEFAULT (%s and %d more): %s (ALTER TABLE ... "
        "REPLICA IDENTITY FULL on each) to send real values",
        len(tables), shown, len(tables) - TOAST_WARNINGS_EACH, consequence,
    )


def start_failure(config: Config, exc: BaseException) -> PreflightError:
    """A PostgreSQL error during start-up (after the checks above), as one line naming the fix."""
    text = redact_dsn(str(exc).strip()).replace("FATAL:  ", "").replace("ERROR:  ", "")
    first = text.splitlines()[0] if text else type(exc).__name__
    slot = config.source.slot
    if "replication slots are in use" in text:
        return PreflightError(
            f"cannot create slot {slot}: {first}: drop a slot nobody uses (see SELECT slot_name, active FROM "
            "pg_replication_slots) or raise max_replication_slots and restart PostgreSQL"
        )
    if "max_wal_senders" in text:
        return PreflightError(
            f"cannot open a replication connection: {first}: stop a replication client nobody needs "
            "(see pg_stat_replication) or raise max_wal_senders and restart PostgreSQL"
        )
    return PreflightError(
        f"PostgreSQL failed while setting up slot {slot} ({first}): fix the cause named here (the server log "
        "has the details) and run again; nothing was streamed"
    )
