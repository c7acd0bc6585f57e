"""`cdc status`: how far the slot, the topics and the sinks are, answerable without the daemon;
and whether a sink is near the tombstone horizon (compaction.horizon)."""

from __future__ import annotations

from typing import Any

from cdc.config import Config
from cdc.kafka.policy import duration, kind_of
from cdc.kafka.topics import TopicAdmin, TopicInfo
from cdc.source.preflight import connect_catalog
from cdc.source.replication import format_lsn, parse_lsn

_SLOT_SQL = """
SELECT s.slot_name, s.active, s.active_pid, s.confirmed_flush_lsn::text, s.restart_lsn::text, s.wal_status,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS lag_bytes,
       pg_current_wal_lsn()::text,
       EXTRACT(EPOCH FROM r.flush_lag)::float8 AS lag_seconds,
       EXTRACT(EPOCH FROM now() - r.reply_time)::float8 AS last_reply_age_s
FROM pg_replication_slots s
LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
WHERE s.slot_name = %s
"""


def slot_status(conn: Any, name: str) -> dict[str, Any] | None:
    """The slot as PostgreSQL sees it, with its lag in bytes and seconds (None: no such slot)."""
    row = conn.execute(_SLOT_SQL, (name,)).fetchone()
    if row is None:
        return None
    keys = [
        "name", "active", "active_pid", "confirmed_flush_lsn", "restart_lsn", "wal_status",
        "retained_wal_bytes", "lag_bytes", "server_lsn", "lag_seconds", "last_reply_age_s",
    ]
    slot = dict(zip(keys, row, strict=True))
    if slot["active"] and slot["lag_seconds"] is None:
        slot["lag_seconds"] = 0.0  # an active walsender with no measured lag is caught up
    return slot


def sink_state(complete: int, caught_up: bool) -> str:
    """A sink job's state in a word or three (`cdc top`, `cdc status`, `cdc report`;
    docs/monitoring.md): `no LSN yet` (its progress names no LSN its store is complete up
    to), `caught up` (complete up to the daemon's newest heartbeat: everything the topics
    are known to hold), else `catching up`."""
    return "no LSN yet" if not complete else "caught up" if caught_up else "catching up"


def collect(config: Config) -> dict[str, Any]:
    """Slot state, lag in bytes and seconds, and per-topic end offsets."""
    catalog = connect_catalog(config)
    try:
        slot = slot_status(catalog.conn, config.source.slot)
    finally:
        catalog.close()
    admin = TopicAdmin(config.topic)
    try:
        topics = admin.topics_with_prefix(config.topic.prefix)
        offsets = admin.end_offsets(topics)
        tables = admin.describe([t for t in topics if kind_of(config.topic.prefix, t) == "table"])
    finally:
        admin.close()
    return {
        "slot": slot,
        "snapshot": _snapshot(config),
        "sinks": _sinks(config, slot, tables),
        "topics": {t: {str(p): o for p, o in sorted(parts.items())} for t, parts in offsets.items()},
    }


def _snapshot(config: Config) -> dict[str, Any] | None:
    """The slot's durable snapshot state (None before the first `cdc run`)."""
    from snapshot.state import load_state

    state = load_state(config)
    if state is None:
        return None
    inc = state.incremental
    return {
        "initial": state.initial,
        "consistent_point": None if state.consistent_point is None else format_lsn(state.consistent_point),
        "complete_tables": state.done,
        "incremental": None if inc is None else {
            "current": inc.tables[0] if inc.tables else None, "queued": inc.tables[1:],
            "chunks_done": inc.chunks, "rows_done": inc.rows,
        },
    }


def _sinks(config: Config, slot: dict[str, Any] | None, tables: dict[str, TopicInfo]) -> dict[str, Any]:
    """Each sink job's progress in LSN terms, with its lag behind the server and the slot, and
    in time against the table topics' delete.retention.ms (the tombstone horizon)."""
    from cdc.kafka.heartbeat import newest_heartbeat
    from compaction.horizon import horizons, sink_lags
    from sinks.progress import read_progress

    progress = read_progress(config.topic)
    newest = newest_heartbeat(config.topic) if progress else 0
    lags = sink_lags(config.topic, progress, {name: info.partitions for name, info in tables.items()})
    retentions = {name: int(info.configs.get("delete.retention.ms", 86400000)) for name, info in tables.items()}
    against = horizons(lags, retentions)
    out = {}
    for job, record in sorted(progress.items()):
        complete = int(record["complete_lsn"])
        entry: dict[str, Any] = {
            "state": sink_state(complete, 0 < newest <= complete),
            "complete_lsn": format_lsn(complete),
            "tables": {t: format_lsn(int(lsn)) for t, lsn in sorted(record["tables"].items())},
            "dead_letters": record.get("dead_letters", 0),
            "batch": record["batch"],
            "updated_ms": record["ts_ms"],
        }
        if slot is not None and complete:  # no LSN known yet: nothing to measure a distance from
            entry["lag_bytes"] = max(0, parse_lsn(slot["server_lsn"]) - complete)
            entry["behind_slot_bytes"] = max(0, parse_lsn(slot["confirmed_flush_lsn"] or "0/0") - complete)
        horizon = against.get(job)
        if horizon is not None:
            entry["horizon"] = {
                "state": horizon.state, "behind_ms": horizon.lag.lag_ms,
                "behind_since_ms": horizon.lag.since_ms, "delete_retention_ms": horizon.retention_ms,
                "topic": horizon.topic, "message": horizon.message(),
            }
        out[job] = entry
    return out


def check_code(status: dict[str, Any]) -> int:
    """`cdc status --check`: 0 when every sink is within half of the tombstone horizon, 1 when
    one is past half (a warning), 2 when one is past it (deletes may be lost)."""
    states = {sink.get("horizon", {}).get("state", "ok") for sink in status["sinks"].values()}
    return 2 if "past" in states else 1 if "warning" in states else 0


def render(status: dict[str, Any]) -> str:
    """The human form."""
    lines = []
    slot = status["slot"]
    if slot is None:
        lines.append("slot: absent (cdc run creates it)")
    else:
        state = "active" if slot["active"] else "inactive"
        lines.append(f"slot {slot['name']}: {state}" + (f" (pid {slot['active_pid']})" if slot["active_pid"] else ""))
        lines.append(f"  confirmed_flush_lsn  {slot['confirmed_flush_lsn']}   server at {slot['server_lsn']}")
        lines.append(f"  wal_status           {slot['wal_status']}")
        lines.append(f"  WAL retained         {slot['retained_wal_bytes']:,} bytes")
        lag_s = "n/a (no walsender)" if slot["lag_seconds"] is None else f"{slot['lag_seconds']:.3f} s"
        lines.append(f"  lag                  {slot['lag_bytes']:,} bytes, {lag_s}")
    snap = status["snapshot"]
    if snap is None:
        lines.append("snapshot: none recorded yet (cdc run takes it)")
    else:
        at = f" at {snap['consistent_point']}" if snap["consistent_point"] else ""
        lines.append(f"snapshot: initial {snap['initial']}{at}; {len(snap['complete_tables'])} tables complete")
        inc = snap["incremental"]
        if inc is not None:
            queued = f", queued: {', '.join(inc['queued'])}" if inc["queued"] else ""
            lines.append(
                f"  incremental: {inc['current']} ({inc['chunks_done']} chunks, {inc['rows_done']:,} rows done){queued}"
            )
    for job, sink in status["sinks"].items():
        lag = f", {sink['lag_bytes']:,} bytes behind the server" if "lag_bytes" in sink else ""
        horizon = sink.get("horizon")
        if horizon is not None and horizon["behind_ms"]:
            lag += f" ({duration(horizon['behind_ms'])})"
        known = f", complete up to {sink['complete_lsn']}" if sink["state"] != "no LSN yet" else ""
        lines.append(f"sink {job}: {sink['state']}{known}{lag}; {sink['dead_letters']} dead letters")
        for table, lsn in sink["tables"].items():
            lines.append(f"  {table}  applied up to {lsn}")
        if horizon is not None and horizon["message"]:
            lines.append(f"  {'problem' if horizon['state'] == 'past' else 'warning'}: {horizon['message']}")
    lines.append("topics:" if status["topics"] else "topics: none yet")
    for topic, parts in status["topics"].items():
        total = sum(parts.values())
        detail = " ".join(f"{p}:{o}" for p, o in parts.items())
        lines.append(f"  {topic}  {total:,} records  (end offsets {detail})")
    return "\n".join(lines)
