"""What to snapshot at start-up, from the snapshot mode, the slot and the durable state.

The rules (docs/snapshots.md): a new slot gets the aligned initial snapshot; an existing
slot streams, and every captured table without a complete snapshot in the state (the
initial one was interrupted, the table was added to `tables`, or there is no state at
all) is snapshotted incrementally while streaming. A slot that is gone or lost although
the topics hold a snapshot taken through it means changes were missed: only `when_needed`
re-snapshots then, cutting off everything older with a truncate event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cdc.naming import parse_table_pattern
from cdc.source.catalog import CapturedTable
from cdc.source.preflight import PreflightError
from snapshot.state import SnapshotState, state_topic


class SnapshotRefused(Exception):
    """The mode forbids what the slot's situation needs; the message names the fix."""


@dataclass
class Plan:
    state: SnapshotState
    create_slot: bool = False
    drop_lost_slot: bool = False
    initial: list[str] = field(default_factory=list)  # tables for the aligned snapshot (new slot only)
    truncate_first: bool = False  # a re-snapshot: older rows in the topics are cut off
    incremental: list[str] = field(default_factory=list)
    stop_when_done: bool = False  # initial_only: no streaming beyond finishing the snapshot


def plan(
    mode: str, slot: str, prefix: str, slot_exists: bool, slot_lost: bool, state: SnapshotState | None,
    tables: list[str], only: list[str] | None = None,
) -> Plan:
    # "running" without a consistent point: the slot creation itself failed, nothing was read
    had_snapshot = state is not None and (
        state.consistent_point is not None or state.initial == "done" or bool(state.done)
    )
    if slot_exists and slot_lost:
        if mode != "when_needed":
            raise SnapshotRefused(
                f"slot {slot} has lost WAL it needed (wal_status=lost), so changes are missing from it: set "
                f"[snapshot] mode = \"when_needed\" to drop it and take a new snapshot, or drop it yourself with "
                f"SELECT pg_drop_replication_slot('{slot}') and start again with a fresh snapshot of the tables"
            )
        return _new_slot(mode, slot, tables, only, truncate_first=had_snapshot, drop=True)
    if not slot_exists:
        if had_snapshot and mode in ("initial", "initial_only"):
            raise SnapshotRefused(
                f"slot {slot} is gone but the topics hold a snapshot taken through it ({state_topic(prefix)}), so "
                "changes made meanwhile were never captured: set [snapshot] mode = \"when_needed\" to take a new "
                "snapshot (older rows are cut off by a truncate event), or delete the topics to start over"
            )
        return _new_slot(mode, slot, tables, only, truncate_first=had_snapshot and mode == "when_needed")
    current = state or SnapshotState(slot, initial="skipped" if mode == "never" else "running")
    result = Plan(current, stop_when_done=mode == "initial_only")
    if mode != "never":
        queued = current.incremental.tables if current.incremental else []
        wanted = only if only is not None else tables
        result.incremental = [t for t in wanted if t not in current.done and t not in queued]
    return result


def _new_slot(mode: str, slot: str, tables: list[str], only: list[str] | None, truncate_first: bool, drop: bool = False) -> Plan:
    fresh = SnapshotState(slot, initial="skipped" if mode == "never" else "running")
    result = Plan(fresh, create_slot=True, drop_lost_slot=drop, stop_when_done=mode == "initial_only")
    if mode != "never":
        result.initial = list(only if only is not None else tables)
        result.truncate_first = truncate_first
    return result


def captured_names(tables: list[CapturedTable], patterns: list[str] | None) -> list[str] | None:
    """The display names of the captured tables the patterns name (None: all); ValueError
    naming the fix for a pattern that names no captured table."""
    if not patterns:
        return None
    chosen: list[str] = []
    for text in patterns:
        pattern = parse_table_pattern(text)
        hits = [t.display for t in tables if pattern.matches(t.schema, t.table)]
        if not hits:
            raise ValueError(
                f"table {text} is not one of the captured tables ({', '.join(t.display for t in tables)}): "
                "check the name, or add it to [source] tables"
            )
        chosen.extend(h for h in hits if h not in chosen)
    return chosen


def chosen_names(tables: list[CapturedTable], patterns: list[str] | None) -> list[str]:
    """What a command's `--tables` names (every captured table without it), or the
    PreflightError naming the fix: the one-line error of `cdc snapshot`, `cdc verify`, `cdc topics`."""
    try:
        return captured_names(tables, patterns) or [t.display for t in tables]
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
