"""`cdc snapshot` with a slot in place: ask its daemon for an incremental snapshot.

Snapshot rows may enter a topic only before streaming starts or inline through the
streaming daemon (docs/design.md), so this never reads a table itself. With the daemon running
it writes a logical message into the WAL, which the daemon reads in order with the
changes and records durably before confirming past it. With the daemon stopped (this
process then holds the slot's lock) it queues the tables in the durable state directly.
"""

from __future__ import annotations

from cdc.config import Config
from cdc.kafka.producer import make_producer
from cdc.source.preflight import PreflightError, check_server, connect_catalog, resolve_tables
from cdc.source.slots import check_slot, slot_holder, slot_state, try_claim_slot
from snapshot.incremental import MESSAGE_PREFIX, signal_message
from snapshot.plan import chosen_names
from snapshot.state import Incremental, SnapshotState, deliver, load_state, send_state, state_topic


def request_incremental(config: Config, patterns: list[str], required: bool) -> str | None:
    """What was requested of the slot's daemon, for the user; None when there is no slot yet
    (the caller then takes the one-shot aligned snapshot)."""
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
            return None
        if found.wal_status == "lost":
            check_slot(catalog, config)  # fails with the recovery steps
        tables = resolve_tables(catalog, config)
        names = chosen_names(tables, patterns)
        # Holding the slot's lock means no daemon runs (and none starts meanwhile): then the
        # request goes straight into the durable state, where a second request can see it.
        daemon_stopped = try_claim_slot(catalog, slot)
        state = load_state(config)
        holder = None if daemon_stopped else slot_holder(catalog, slot)
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
        if daemon_stopped:
            _queue_in_state(config, state or SnapshotState(slot, initial="running"), names)
        else:
            catalog.conn.execute(
                "SELECT pg_logical_emit_message(true, %s, %s::text)",
                (MESSAGE_PREFIX, signal_message(slot, names).decode()),
            )
    finally:
        catalog.close()
    who = f"slot {slot}'s daemon, which is not running: it takes the snapshot when cdc run starts" if daemon_stopped else (
        f"the daemon streaming from slot {slot}"
    )
    return f"requested an incremental snapshot of {', '.join(names)} from {who}"



def _queue_in_state(config: Config, state: SnapshotState, names: list[str]) -> None:
    if state.incremental is None:
        state.incremental = Incremental([])
    state.incremental.tables.extend(names)
    producer = make_producer(config.topic, {state_topic(config.topic.prefix): 1})
    try:
        send_state(producer, config.topic.prefix, state)
        deliver(producer, config.topic.delivery_timeout_ms / 1000)
    finally:
        producer.close()
