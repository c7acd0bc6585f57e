"""`cdc snapshot` with a slot in place: ask its daemon for an incremental snapshot.

Snapshot rows may enter a topic only before streaming starts or inline through the
streaming daemon (DESIGN.md), so this never reads a table itself: it writes a logical
message into the WAL. The daemon reads it in order with the changes, whether it is
streaming now or starts later, and records the request durably before confirming past it.
"""

from __future__ import annotations

import click

from cdc.config import Config
from cdc.preflight import (
    PreflightError,
    check_server,
    check_slot,
    connect_catalog,
    resolve_tables,
    slot_holder,
    slot_state,
)
from snapshot.incremental import MESSAGE_PREFIX, signal_message
from snapshot.plan import captured_names
from snapshot.state import load_state


def request_incremental(config: Config, patterns: list[str], required: bool) -> bool:
    """True when the request went to the slot's daemon; False when there is no slot yet (the
    caller then takes the one-shot aligned snapshot)."""
    slot = config.source.slot
    catalog = connect_catalog(config)
    try:
        check_server(catalog)
        found = slot_state(catalog, slot)
        if not found.exists:
            if required:
                raise PreflightError(
                    f"slot {slot} does not exist, so no daemon can take an incremental snapshot: run cdc snapshot "
                    "without --incremental for the aligned initial snapshot, or cdc run"
                )
            return False
        if found.wal_status == "lost":
            check_slot(catalog, config)  # fails with the recovery steps
        active_pid = found.active_pid
        tables = resolve_tables(catalog, config)
        try:
            names = captured_names(tables, patterns) or [t.display for t in tables]
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        state = load_state(config)
        holder = slot_holder(catalog, slot)
        if state is not None and state.initial == "running" and state.incremental is None and holder is not None:
            raise PreflightError(
                f"the initial snapshot on slot {slot} is still running (PostgreSQL backend PID {holder}): wait "
                "until it completes; cdc status shows its state"
            )
        queued = state.incremental.tables if state is not None and state.incremental else []
        busy = [n for n in names if n in queued]
        if busy:
            raise PreflightError(
                f"an incremental snapshot of {', '.join(busy)} is already running or queued on slot {slot}: wait "
                "until it completes (cdc status shows its progress)"
            )
        catalog.conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s::text)",
            (MESSAGE_PREFIX, signal_message(slot, names).decode()),
        )
    finally:
        catalog.close()
    who = f"the daemon streaming from slot {slot} (PID {active_pid})" if active_pid else (
        f"slot {slot}'s daemon, which is not running: it takes the snapshot when cdc run starts"
    )
    click.echo(f"requested an incremental snapshot of {', '.join(names)} from {who}")
    return True

