"""`cdc report --html FILE`: the pipeline over time, as one self-contained HTML page.

Where the history comes from (all of it in Kafka, none of it kept by the report):
- the daemon's samples in `<prefix>.__cdc_metrics` (cdc.kafka.history): the slot's lag in
  bytes and seconds, and the records it produced;
- the daemon's heartbeats (`<prefix>.__cdc_heartbeat`): when the topics passed each LSN;
- the sink jobs' progress records (`<prefix>.__cdc_sinks`), one per micro-batch: the LSN a
  store is complete up to, its records applied and dead letters. That topic is compacted:
  its history reaches back to the last time the log cleaner compacted it;
- the topics themselves: what each table topic holds now against what compaction leaves
  (the latest record per key), and the bytes each log takes on disk.

The page is inline SVG and CSS: no script, no font, no request leaves it.
"""

from __future__ import annotations

import bisect
import html
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc.config import Config
from cdc.kafka.heartbeat import heartbeat_topic
from cdc.kafka.history import Sample, metrics_topic
from cdc.kafka.policy import DLQ_SUFFIX
from cdc.kafka.reader import read_topic
from cdc.kafka.topics import TopicAdmin
from cdc.naming import is_table_topic
from cdc.source.replication import format_lsn
from cdc.status import sink_state
from cdc.units import duration, rate, size
from sinks.progress import sinks_topic

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
MAX_POINTS = 1500  # per series: more than the plot's pixels, fewer than a week of samples


@dataclass
class TopicSize:
    topic: str
    written: int  # records ever written (the end offsets)
    on_disk: int | None = None  # bytes of its log on the brokers
    records: int | None = None  # records in the log now (read: None when not read)
    bytes: int | None = None  # their keys' and values' bytes
    kept: int | None = None  # what compaction leaves: the latest record of each key, tombstones gone
    kept_bytes: int | None = None


@dataclass
class History:
    prefix: str
    slot: str
    since_ms: int
    until_ms: int
    samples: list[Sample] = field(default_factory=list)
    beats: list[tuple[int, int]] = field(default_factory=list)  # (ts_ms, lsn)
    progress: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # job -> records in time order
    dead_letters: int = 0  # records in the dead-letter topic
    topics: list[TopicSize] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------ collecting


def collect(config: Config, hours: float, scan_topics: bool = True) -> History:
    """Everything the page shows, from `hours` ago to now."""
    prefix, slot = config.topic.prefix, config.source.slot
    until = int(time.time() * 1000)
    history = History(prefix, slot, until - int(hours * 3600 * 1000), until)
    for record in _read(config, metrics_topic(prefix), history.since_ms, history.notes):
        if record.value is not None and record.key == slot.encode():
            history.samples.append(Sample.parse(record.value))
    for record in _read(config, heartbeat_topic(prefix), history.since_ms, history.notes):
        if record.value is not None and record.key == slot.encode():
            beat = orjson.loads(record.value)
            history.beats.append((int(beat["ts_ms"]), int(beat["lsn"])))
    for record in _read(config, sinks_topic(prefix), history.since_ms, history.notes):
        if record.key is not None and record.value is not None:
            history.progress.setdefault(record.key.decode(), []).append(orjson.loads(record.value))
    history.samples.sort(key=lambda s: s.ts_ms)
    history.beats.sort()
    for records in history.progress.values():
        records.sort(key=lambda r: r["ts_ms"])
    admin = TopicAdmin(config.topic)
    try:
        names = admin.topics_with_prefix(prefix)
        ends = admin.end_offsets(names)
        disk = admin.log_sizes()
    finally:
        admin.close()
    history.dead_letters = sum(ends.get(f"{prefix}.{DLQ_SUFFIX}", {}).values())
    for name in names:
        measured = TopicSize(name, sum(ends.get(name, {}).values()), disk.get(name))
        if scan_topics and is_table_topic(prefix, name):
            _measure(config, measured)
        history.topics.append(measured)
    return history


def _read(config: Config, topic: str, since_ms: int, notes: list[str]) -> Iterable[Any]:
    try:
        yield from read_topic(config.topic, topic, from_ms=since_ms, idle_timeout_s=30)
    except LookupError:
        notes.append(f"{topic} does not exist (yet)")


def _measure(config: Config, topic: TopicSize) -> None:
    """The topic's records now, and what compaction leaves of them: the latest record of each
    key, tombstones gone (they are, `delete.retention.ms` after the cleaner reached them)."""
    latest: dict[bytes | None, int] = {}  # key -> bytes of its latest record (0: a tombstone)
    records = total = 0
    for record in read_topic(config.topic, topic.topic, idle_timeout_s=30):
        n = len(record.key or b"") + len(record.value or b"")
        records += 1
        total += n
        latest[record.key] = n if record.value is not None else 0
    topic.records, topic.bytes = records, total
    topic.kept = sum(1 for n in latest.values() if n)
    topic.kept_bytes = sum(latest.values())


# ------------------------------------------------------------------------------ the series


Series = dict[str, list[tuple[int, float]]]  # name -> (ts_ms, value) in time order


def slot_lag(history: History) -> tuple[Series, Series]:
    """The slot's lag over time: bytes (server WAL end minus confirmed) and seconds."""
    return (
        {"slot lag": [(s.ts_ms, float(s.lag_bytes)) for s in history.samples]},
        {"slot lag": [(s.ts_ms, s.lag_seconds) for s in history.samples]},
    )


def per_second(points: list[tuple[int, int]]) -> list[tuple[int, float]]:
    """Rates between consecutive (ts_ms, running total) points; a total that went down (a
    restart counts from 0 again) counts from 0."""
    out = []
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t1 > t0:
            out.append((t1, (v1 - v0 if v1 >= v0 else v1) * 1000 / (t1 - t0)))
    return out


def daemon_rate(history: History) -> Series:
    return {"events/s": per_second([(s.ts_ms, s.events) for s in history.samples])}


class Timeline:
    """When the topics passed each LSN: the daemon's confirmed LSN over time (its samples and
    heartbeats together; it only grows)."""

    def __init__(self, history: History) -> None:
        points = sorted({*history.beats, *((s.ts_ms, s.confirmed_lsn) for s in history.samples)})
        self.times, self.lsns = [], []
        highest = -1
        for ts, lsn in points:
            if lsn > highest:
                self.times.append(ts)
                self.lsns.append(lsn)
                highest = lsn

    def at(self, ts_ms: int) -> int | None:
        """The confirmed LSN at `ts_ms` (None: before the first point)."""
        i = bisect.bisect_right(self.times, ts_ms)
        return self.lsns[i - 1] if i else None

    def passed(self, lsn: int) -> int | None:
        """When the topics first held something past `lsn` (None: not within the history)."""
        i = bisect.bisect_right(self.lsns, lsn)
        return self.times[i] if i < len(self.times) else None


def sink_series(history: History) -> tuple[Series, Series, Series, Series]:
    """Per sink job over time: bytes behind the slot, lag in seconds, records/s, dead letters."""
    timeline = Timeline(history)
    behind: Series = {}
    lag: Series = {}
    throughput: Series = {}
    letters: Series = {}
    for job, records in sorted(history.progress.items()):
        for r in records:
            ts, complete = int(r["ts_ms"]), int(r["complete_lsn"])
            letters.setdefault(job, []).append((ts, float(r.get("dead_letters", 0))))
            if not complete:
                continue  # before its first heartbeat a job knows no LSN it is complete up to
            confirmed = timeline.at(ts)
            if confirmed is not None:
                behind.setdefault(job, []).append((ts, float(max(0, confirmed - complete))))
            since = timeline.passed(complete)
            if timeline.times:
                lag.setdefault(job, []).append((ts, max(0.0, (ts - since) / 1000) if since is not None else 0.0))
        counted = [(int(r["ts_ms"]), int(r["records"])) for r in records if r.get("records") is not None]
        if len(counted) > 1:
            throughput[job] = per_second(counted)
    return behind, lag, throughput, letters


# ------------------------------------------------------------------------------ the page


def _rate(r: float) -> str:
    return rate(r) + "/s"


_BASE_UNIT = {_rate: "/s", duration: " s", size: " B"}  # what an axis writes when rounding would repeat a label


def _count(n: float) -> str:
    return f"{n:,.0f}" if n == int(n) else f"{n:,.2f}"


def _nice(top: float) -> float:
    """A round axis maximum at or above `top`."""
    if top <= 0:
        return 1.0
    magnitude = 10 ** len(str(int(top))) / 10 if top >= 1 else 1.0
    while magnitude > top:
        magnitude /= 10
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= top:
            return step * magnitude
    return 10 * magnitude


def _round(step: float) -> bool:
    """1, 2, 2.5 or 5 times a power of ten."""
    if step <= 0:
        return False
    while step >= 10:
        step /= 10
    while step < 1:
        step *= 10
    return any(abs(step - r) < 1e-9 for r in (1, 2, 2.5, 5))


def _decimals(step: float) -> int:
    """Digits after the point that write `step`, and so each multiple of it, exactly."""
    for digits in range(12):
        if abs(round(step, digits) - step) <= abs(step) * 1e-9:
            return digits
    return 12


def _axis_labels(values: list[float], step: float, unit: Callable[[float], str]) -> list[str]:
    """A label per tick, each different: `unit` rounds for reading (a rate to one decimal,
    so 0.15 and 0.2 would both read "0.2/s"); then every tick says its value exactly, in the
    unit's base (per second, seconds, bytes)."""
    labels = [unit(v) for v in values]
    if len(set(labels)) == len(labels):
        return labels
    digits = _decimals(step)
    return [f"{v:,.{digits}f}{_BASE_UNIT.get(unit, '')}" for v in values]


def series_colors(*charts: Series) -> dict[str, str]:
    """One colour per series name across the page, in order of first appearance: a job keeps
    its colour in every chart, whichever other jobs a chart lacks."""
    colors: dict[str, str] = {}
    for series in charts:
        for name in series:
            colors.setdefault(name, PALETTE[len(colors) % len(PALETTE)])
    return colors


def _thin(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most MAX_POINTS, keeping each stretch's highest value (a peak stays visible)."""
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / MAX_POINTS
    return [max(points[int(i * step):int((i + 1) * step)] or [points[-1]], key=lambda p: p[1])
            for i in range(MAX_POINTS)]


def chart(title: str, series: Series, unit: Callable[[float], str], since_ms: int, until_ms: int,
          step: bool = False, colors: dict[str, str] | None = None) -> str:
    """One SVG line chart: time across, `unit`-formatted values up; hover a point for its value.
    `colors` (series_colors) keeps a series' colour the same in every chart of a page."""
    width, height, left, right, top, bottom = 920, 250, 84, 40, 34, 38
    plot_w, plot_h = width - left - right, height - top - bottom
    drawn = {name: _thin(points) for name, points in series.items() if points}
    out = [f'<svg class="chart" role="img" aria-label="{html.escape(title)}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{left}" y="20" class="title">{html.escape(title)}</text>']
    if not drawn:
        out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" class="empty" text-anchor="middle">'
                   "no data in this period</text></svg>")
        return "".join(out)
    t0 = min(since_ms, *(pts[0][0] for pts in drawn.values()))
    t1 = max(until_ms, *(pts[-1][0] for pts in drawn.values()))
    t1 = t1 if t1 > t0 else t0 + 1000
    vmax = _nice(max(max(p[1] for p in pts) for pts in drawn.values()) * 1.05)
    if unit in (_count, size):
        vmax = max(vmax, 4.0)  # whole numbers on every tick

    def x(t: int) -> float:
        return left + (t - t0) / (t1 - t0) * plot_w

    def y(v: float) -> float:
        return top + plot_h - v / vmax * plot_h

    steps = 5 if _round(vmax / 5) else 4  # 250 in fifties, 2.0 in halves
    ticks = [vmax * i / steps for i in range(steps + 1)]
    for v, label in zip(ticks, _axis_labels(ticks, vmax / steps, unit), strict=True):
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" class="tick" text-anchor="end">{html.escape(label)}</text>')
    for i in range(6):
        t = t0 + (t1 - t0) * i / 5
        label = time.strftime("%H:%M:%S" if t1 - t0 < 86400000 else "%d %b %H:%M", time.localtime(t / 1000))
        out.append(f'<text x="{x(int(t)):.1f}" y="{height - 14}" class="tick" text-anchor="middle">{label}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    palette = series_colors(drawn) if colors is None else colors
    for n, (name, points) in enumerate(drawn.items()):
        color = palette[name]
        coords = []
        for i, (t, v) in enumerate(points):
            if step and i:
                coords.append(f"{x(t):.1f},{y(points[i - 1][1]):.1f}")
            coords.append(f"{x(t):.1f},{y(v):.1f}")
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{" ".join(coords)}"/>')
        for t, v in points if len(points) <= 200 else points[:: len(points) // 200]:
            when = time.strftime("%H:%M:%S", time.localtime(t / 1000))
            out.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2.5" fill="{color}">'
                       f"<title>{html.escape(name)} {when}: {html.escape(unit(v))}</title></circle>")
        lx = left + 8 + 150 * n
        out.append(f'<rect x="{lx}" y="{top + 6}" width="12" height="4" fill="{color}"/>'
                   f'<text x="{lx + 16}" y="{top + 12}" class="legend">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 960px;
       color: #1b1f24; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.sub { color: #57606a; margin: 0 0 16px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { border: 1px solid #d0d7de; border-radius: 6px; padding: 10px 14px; min-width: 160px; }
.card b { display: block; font-size: 20px; } .card span { color: #57606a; font-size: 12px; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid #eaeef2; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; } th { background: #f6f8fa; }
svg.chart { display: block; margin: 8px 0 18px; }
svg .title { font-weight: 600; font-size: 14px; } svg .tick { font-size: 11px; fill: #57606a; }
svg .legend { font-size: 12px; } svg .grid { stroke: #eaeef2; } svg .frame { fill: none; stroke: #d0d7de; }
svg .empty { fill: #8c959f; font-size: 13px; }
.note { color: #9a6700; }
"""


def render_html(history: History) -> str:
    """The page."""
    until = history.until_ms
    firsts = [s.ts_ms for s in history.samples[:1]] + [r[0]["ts_ms"] for r in history.progress.values() if r]
    since = max(history.since_ms, min(firsts, default=history.since_ms))  # the plots begin with the data
    lag_bytes, lag_seconds = slot_lag(history)
    behind, lag, throughput, letters = sink_series(history)
    produced = daemon_rate(history)
    colors = series_colors(lag_bytes, lag_seconds, produced, behind, lag, throughput, letters)
    e = html.escape
    latest = history.samples[-1] if history.samples else None
    stamp = "%Y-%m-%d %H:%M:%S"
    period = (f"{time.strftime(stamp, time.localtime(since / 1000))} to "
              f"{time.strftime(stamp + ' %Z', time.localtime(until / 1000))}")
    cards = [
        ("slot lag now", "-" if latest is None else size(latest.lag_bytes)),
        ("slot lag now (time)", "-" if latest is None else duration(latest.lag_seconds)),
        ("confirmed LSN", "-" if latest is None else format_lsn(latest.confirmed_lsn)),
        ("dead letters", _count(history.dead_letters)),
    ]
    for job, points in sorted(behind.items()):
        cards.append((f"{job}: behind the slot", size(points[-1][1])))
        if lag.get(job):
            cards.append((f"{job}: lag", duration(lag[job][-1][1])))
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>cdc report: {e(history.prefix)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>cdc report: prefix {e(history.prefix)}, slot {e(history.slot)}</h1>",
        f'<p class="sub">{e(period)}; {len(history.samples)} daemon samples, {len(history.beats)} heartbeats, '
        f"{sum(len(r) for r in history.progress.values())} sink progress records</p>",
        '<div class="cards">' + "".join(f'<div class="card"><b>{e(v)}</b><span>{e(k)}</span></div>' for k, v in cards)
        + "</div>",
        "<h2>The slot</h2>",
        chart("slot lag (bytes): the server's WAL end minus the confirmed LSN", lag_bytes, size, since, until,
              colors=colors),
        chart("slot lag (seconds): age of the oldest unacknowledged commit", lag_seconds, duration, since, until,
              colors=colors),
        chart("daemon: records produced per second", produced, _rate, since, until, colors=colors),
        "<h2>The sinks</h2>",
        chart("sinks: bytes behind the slot (its confirmed LSN minus the LSN the store is complete up to)", behind,
              size, since, until, colors=colors),
        chart("sinks: lag (seconds since the topics first held a change the store lacks)", lag, duration, since, until,
              colors=colors),
        chart("sinks: records applied per second", throughput, _rate, since, until, colors=colors),
        chart("sinks: dead letters (running total)", letters, _count, since, until, step=True, colors=colors),
        _sinks_table(history),
        "<h2>The topics: now and after compaction</h2>",
        _topics_table(history.topics),
    ]
    parts += [f'<p class="note">note: {e(n)}</p>' for n in history.notes]
    parts.append("</body></html>")
    return "\n".join(parts)


def _sinks_table(history: History) -> str:
    """Each job's last progress record, and its state against the newest heartbeat of the period."""
    newest = max((lsn for _, lsn in history.beats), default=0)
    rows = []
    for job, records in sorted(history.progress.items()):
        last = records[-1]
        complete = int(last["complete_lsn"])
        rows.append(
            f"<tr><td>{html.escape(job)}</td><td>{format_lsn(complete) if complete else '-'}</td>"
            f"<td>{sink_state(complete, 0 < newest <= complete)}</td>"
            f"<td>{last.get('batch', '-')}</td><td>{_count(last['records']) if 'records' in last else '-'}</td>"
            f"<td>{_count(last.get('dead_letters', 0))}</td>"
            f"<td>{time.strftime('%H:%M:%S', time.localtime(last['ts_ms'] / 1000))}</td></tr>"
        )
    if not rows:
        return "<p>No sink job recorded progress in this period.</p>"
    return ("<table><tr><th>sink</th><th>complete up to</th><th>state</th><th>last batch</th><th>records applied</th>"
            "<th>dead letters</th><th>last progress</th></tr>" + "".join(rows) + "</table>")


def _topics_table(topics: list[TopicSize]) -> str:
    def n(v: int | None, fmt: Callable[[float], str] = _count) -> str:
        return "-" if v is None else fmt(v)

    rows = "".join(
        f"<tr><td>{html.escape(t.topic)}</td><td>{n(t.written)}</td><td>{n(t.records)}</td><td>{n(t.bytes, size)}"
        f"</td><td>{n(t.kept)}</td><td>{n(t.kept_bytes, size)}</td><td>{n(t.on_disk, size)}</td></tr>"
        for t in topics
    )
    return ("<table><tr><th>topic</th><th>records written</th><th>records in the log</th><th>their bytes</th>"
            "<th>after compaction</th><th>their bytes</th><th>on disk</th></tr>" + rows + "</table>"
            "<p class=\"sub\">Records written: the end offsets. In the log: what a reader from offset 0 meets now "
            "(compaction already dropped the rest). After compaction: the latest record of each key, tombstones "
            "gone. On disk: the log's bytes on the brokers (its largest replica), indexes aside. Internal topics "
            "are not read.</p>")
