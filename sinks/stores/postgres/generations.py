"""`cdc postgres rebuild`'s schema generations: the live schemas (`cdc_public`) and the ones a
rebuild fills beside them (`cdc_public__next`), and the switch between them.

The rebuild is the read model's job under the name `postgres-rebuild`, writing the `__next`
schemas with its own checkpoint and bookkeeping record. The switch is one transaction: each
live schema renamed to `__old`, each `__next` one renamed live, the old ones dropped, and the
rebuild's record marked switched. A reader's query sees the old tables or the rebuilt ones,
never neither (it waits for the switch's locks, a moment); the live job goes on writing the
live names, its bookkeeping untouched, and its position guards keep what the rebuild wrote.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import orjson

from cdc.config import Config
from cdc.naming import quote_ident
from sinks.stores.postgres import PostgresConfig
from sinks.stores.postgres.store import (
    META_SCHEMA,
    OWNED,
    PostgresStore,
    connect,
    ensure_meta,
    owned_schemas,
    rows_of,
    stage_of,
)

if TYPE_CHECKING:
    from sinks.query import StopSignal

log = logging.getLogger(__name__)

NAME = "postgres-rebuild"
NEXT, OLD = "__next", "__old"


class Generations:
    """The live schemas and the rebuild's, in one database."""

    name = NAME
    last_pass = True  # the live job goes on through the switch

    def __init__(self, config: PostgresConfig) -> None:
        self.config = config
        self.prefix = config.schema_prefix

    def _record(self) -> dict | None:
        conn = connect(self.config.dsn, autocommit=True)
        try:
            ensure_meta(conn)
            found = conn.execute(f"SELECT record::text FROM {META_SCHEMA}.bookkeeping WHERE name = %s",
                                 (NAME,)).fetchone()
            return None if found is None else orjson.loads(found[0])
        finally:
            conn.close()

    def swapped(self) -> bool:
        """Whether an earlier run of this rebuild switched already."""
        return bool((self._record() or {}).get("switched"))

    def store(self, swapped: bool) -> PostgresStore:
        """The rebuild's store: the `__next` schemas, or, once switched, the live ones."""
        return PostgresStore(self.config, NAME, "" if swapped else NEXT)

    def prepare(self, resumed: bool) -> None:
        """Before the first pass: an unfinished rebuild's schemas gone on with (`resumed`) or dropped."""
        if resumed:
            return
        conn = connect(self.config.dsn, autocommit=True)
        try:
            for schema in owned_schemas(conn, self.prefix, NEXT):
                conn.execute(f"DROP SCHEMA {quote_ident(schema)} CASCADE")
                log.info("dropped schema %s, left by an unfinished rebuild", schema)
            conn.execute(f"DELETE FROM {META_SCHEMA}.bookkeeping WHERE name = %s", (NAME,))
        finally:
            conn.close()

    def swap(self) -> dict[str, int]:
        """The switch, in one transaction; the rows of each rebuilt table."""
        conn = connect(self.config.dsn)
        try:
            topics = [topic for (topic,) in conn.execute(f"SELECT topic FROM {META_SCHEMA}.tables").fetchall()]
            rows = {topic: n for topic in topics if (n := rows_of(conn, topic, NEXT)) is not None}
            for rebuilt in owned_schemas(conn, self.prefix, NEXT):
                live = rebuilt.removesuffix(NEXT)
                if conn.execute("SELECT to_regnamespace(%s)", (quote_ident(live),)).fetchone() != (None,):
                    conn.execute(f"ALTER SCHEMA {quote_ident(live)} RENAME TO {quote_ident(live + OLD)}")
                conn.execute(f"ALTER SCHEMA {quote_ident(rebuilt)} RENAME TO {quote_ident(live)}")
            for old in owned_schemas(conn, self.prefix, OLD):
                conn.execute(f"DROP SCHEMA {quote_ident(old)} CASCADE")
            conn.execute(f"UPDATE {META_SCHEMA}.bookkeeping SET record = record || '{{\"switched\": true}}'::jsonb "
                         "WHERE name = %s", (NAME,))
            conn.commit()
        finally:
            conn.close()
        log.info("switched %d rebuilt tables in, comment %r", len(rows), OWNED)
        return rows

    def finish(self) -> None:
        """After the last pass: the rebuild's bookkeeping and staging tables go."""
        conn = connect(self.config.dsn, autocommit=True)
        try:
            conn.execute(f"DELETE FROM {META_SCHEMA}.bookkeeping WHERE name = %s", (NAME,))
            conn.execute(f"DROP TABLE IF EXISTS {stage_of(NAME + NEXT)}, {stage_of(NAME)}")
        finally:
            conn.close()


def rebuild_here(config: Config, stop: StopSignal) -> dict[str, int]:
    """`cdc postgres rebuild`: every table again from the topics into the `__next` schemas,
    then switched in; rows per table (an earlier run that had switched: none counted)."""
    from sinks.rebuild import rebuild

    _, rows = rebuild(config, "postgres", lambda spark: Generations(config.postgres), stop,
                      "the live tables are untouched")
    return rows or {}
