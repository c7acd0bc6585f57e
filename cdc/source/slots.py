"""The replication slot: its state, its health check, and the lock that makes one cdc
process per slot (a second one streaming the same slot would interleave two streams)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cdc.config import Config
from cdc.source.catalog import Catalog
from cdc.source.preflight import PreflightError
from cdc.source.replication import parse_lsn


@dataclass(frozen=True)
class SlotState:
    exists: bool
    confirmed_flush_lsn: int | None = None
    active_pid: int | None = None
    wal_status: str | None = None


def slot_state(catalog: Catalog, slot: str) -> SlotState:
    row = catalog.conn.execute(
        "SELECT plugin, database, confirmed_flush_lsn::text, active_pid, wal_status "
        "FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    if row is None:
        return SlotState(False)
    plugin, database, confirmed, pid, wal_status = row
    if plugin != "pgoutput" or database != catalog.database():
        raise PreflightError(
            f"slot {slot} belongs to database {database} with plugin {plugin}, not {catalog.database()} with pgoutput: "
            "set [source] slot to another name"
        )
    return SlotState(True, parse_lsn(confirmed) if confirmed else None, pid, wal_status)


def check_slot(catalog: Catalog, config: Config) -> SlotState:
    """An existing slot must be healthy and free; waits briefly for a dying previous walsender."""
    slot = config.source.slot
    deadline = time.monotonic() + config.source.slot_wait_s
    while True:
        state = slot_state(catalog, slot)
        if not state.exists:
            return state
        if state.wal_status == "lost":
            raise PreflightError(
                f"slot {slot} has lost WAL it needed (wal_status=lost), so changes are missing from it: drop it with "
                f"SELECT pg_drop_replication_slot('{slot}') and start again with a fresh snapshot of the tables"
            )
        if state.active_pid is None:
            return state
        if time.monotonic() >= deadline:
            raise PreflightError(
                f"slot {slot} is in use by PID {state.active_pid} (another cdc run?): stop that process, "
                "or set [source] slot to another name"
            )
        time.sleep(0.2)


_LOCK_CLASS = 0x6364  # "cd": advisory locks of cdc, one per slot name

_HOLDER_SQL = """
SELECT l.pid FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = hashtext(%s)::oid
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def claim_slot(catalog: Catalog, config: Config) -> None:
    """One cdc process per slot, also while it snapshots (when no walsender holds the slot yet):
    a session advisory lock that dies with the process's connection. Waits `slot_wait_s` for a
    dying previous process, like `check_slot`."""
    slot = config.source.slot
    deadline = time.monotonic() + config.source.slot_wait_s
    while True:
        if try_claim_slot(catalog, slot):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    walsender = slot_state(catalog, slot).active_pid
    if walsender is not None:
        raise PreflightError(
            f"slot {slot} is in use by PID {walsender} (another cdc run?): stop that process, "
            "or set [source] slot to another name"
        )
    raise PreflightError(
        f"slot {slot} is in use by another cdc process (PostgreSQL backend PID {slot_holder(catalog, slot)}) taking "
        "its snapshot: wait for it to finish or stop it, or set [source] slot to another name"
    )


def try_claim_slot(catalog: Catalog, slot: str) -> bool:
    row = catalog.conn.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))", (_LOCK_CLASS, slot)).fetchone()
    return bool(row and row[0])


def slot_holder(catalog: Catalog, slot: str) -> int | None:
    """The backend PID of the cdc process holding the slot's advisory lock, if any."""
    row = catalog.conn.execute(_HOLDER_SQL, (_LOCK_CLASS, slot)).fetchone()
    return None if row is None else row[0]




def drop_slot(catalog: Catalog, config: Config) -> int | None:
    """Drop the slot, holding its lock so that no cdc process starts on it meanwhile; the WAL
    bytes it held back (None: there was no slot). A slot in use is refused, like a second daemon."""
    claim_slot(catalog, config)
    slot = config.source.slot
    try:
        state = slot_state(catalog, slot)
        if not state.exists:
            return None
        if state.active_pid is not None:  # a walsender of another tool (cdc ones hold the lock)
            raise PreflightError(
                f"slot {slot} is in use by PID {state.active_pid}: stop that process first"
            )
        row = catalog.conn.execute(
            "SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint "
            "FROM pg_replication_slots WHERE slot_name = %s", (slot,),
        ).fetchone()
        catalog.conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        return int(row[0]) if row else 0
    finally:
        catalog.conn.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", (_LOCK_CLASS, slot))
