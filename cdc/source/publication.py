"""The publication the slot decodes through: created, or completed with missing tables."""

from __future__ import annotations

import logging

import psycopg

from cdc.config import Config
from cdc.naming import qualified, quote_ident
from cdc.source.catalog import CapturedTable, Catalog
from cdc.source.preflight import PreflightError
from cdc.source.slots import slot_state

log = logging.getLogger(__name__)


def ensure_publication(catalog: Catalog, config: Config, tables: list[CapturedTable]) -> None:
    """Create the publication, or add the tables it lacks; partitions publish through their root."""
    pub = config.source.publication
    row = catalog.conn.execute(
        "SELECT puballtables, pubviaroot FROM pg_publication WHERE pubname = %s", (pub,)
    ).fetchone()
    names = ", ".join(qualified(t.schema, t.table) for t in tables)
    if row is None and slot_state(catalog, config.source.slot).exists:
        # pgoutput looks the publication up in the catalog as of each decoded change: a slot
        # older than its publication fails with "publication does not exist" at every start.
        slot = config.source.slot
        raise PreflightError(
            f"publication {pub} does not exist but slot {slot} does, and a slot cannot decode through a "
            "publication created after it: set [source] publication to the one the slot was streamed with, "
            f"or drop the slot (SELECT pg_drop_replication_slot('{slot}')) and start again with a fresh snapshot of the tables"
        )
    try:
        if row is None:
            catalog.conn.execute(f"CREATE PUBLICATION {quote_ident(pub)} FOR TABLE {names} WITH (publish_via_partition_root = true)")
            log.info("created publication %s for %d tables", pub, len(tables))
            return
        if row[0]:
            return
        present = {
            (r[0], r[1])
            for r in catalog.conn.execute(
                "SELECT n.nspname, c.relname FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid "
                "JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE p.pubname = %s",
                (pub,),
            ).fetchall()
        }
        missing = [t for t in tables if (t.schema, t.table) not in present]
        if missing:
            catalog.conn.execute(
                f"ALTER PUBLICATION {quote_ident(pub)} ADD TABLE "
                + ", ".join(qualified(t.schema, t.table) for t in missing)
            )
            log.info("added %d tables to publication %s", len(missing), pub)
        if not row[1]:
            catalog.conn.execute(f"ALTER PUBLICATION {quote_ident(pub)} SET (publish_via_partition_root = true)")
    except psycopg.Error as exc:
        raise PreflightError(
            f"cannot create or alter publication {pub} ({exc.diag.message_primary}): the role must own the tables "
            f"(or create it as a superuser: CREATE PUBLICATION {quote_ident(pub)} FOR TABLE {names} "
            "WITH (publish_via_partition_root = true))"
        ) from None


