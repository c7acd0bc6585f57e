"""The operator's face without servers: JSON log lines, the live view's rates and layout, the
report's series and page (tests/test_operator_face.py runs them against a deployment)."""

from __future__ import annotations

import io
import json
import logging
import re
from collections import deque

from rich.console import Console

from cdc import redact
from cdc.kafka.history import Sample
from cdc.report import (
    History,
    Timeline,
    TopicSize,
    _rate,
    chart,
    per_second,
    render_html,
    sink_series,
)
from cdc.top import DaemonPicture, Picture, SinkPicture, TablePicture, rate, render
from cdc.units import duration, size


def _json_line(message: str, *args: object, secrets: list[str], exc: BaseException | None = None, **extra: object) -> dict:
    redact.install(secrets)
    try:
        formatter = redact.JsonFormatter("sink-cache")
        record = logging.LogRecord("sinks.job", logging.WARNING, __file__, 1, message, args, None)
        if exc is not None:
            record.exc_info = (type(exc), exc, exc.__traceback__)
        record.__dict__.update(extra)
        return json.loads(formatter.format(record))
    finally:
        redact.install([])


def test_a_json_line_has_the_fields_an_operator_filters_by():
    line = _json_line("batch %d: %d records", 7, 120, secrets=[], batch=7, store="cache", table="public.t",
                      lsn="0/16B3748")
    assert set(line) == {"ts", "level", "component", "logger", "message", "batch", "store", "table", "lsn"}
    assert (line["level"], line["component"], line["logger"]) == ("WARNING", "sink-cache", "sinks.job")
    assert line["message"] == "batch 7: 120 records"
    assert (line["batch"], line["store"], line["table"], line["lsn"]) == (7, "cache", "public.t", "0/16B3748")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])


def test_secrets_are_masked_in_json_lines_and_the_line_stays_json():
    """A secret with a quote and a backslash: masked before encoding, so no escape is cut in half."""
    secret = 'pa"ss\\word-42'
    try:
        raise ValueError(f"cannot connect with password={secret}")
    except ValueError as exc:
        caught = exc
    line = _json_line("connecting to redis://u:%s@host:6379/0 (%s)", secret, secret, secrets=[secret],
                      exc=caught, table=f"t_{secret}")
    assert secret not in json.dumps(line) and "pa\\\"ss" not in json.dumps(line)
    assert line["message"] == "connecting to redis://u:***@host:6379/0 (***)"
    assert "password=***" in line["error"] and line["table"] == "t_***"


def test_setup_logging_in_json_writes_one_object_per_line(capsys):
    root = logging.getLogger()
    kept = root.handlers[:]
    root.handlers = []
    try:
        redact.setup_logging("INFO", ["s3cret-value"], "json", "daemon")
        logging.getLogger("cdc.daemon").info("streaming from %s", "0/1", extra={"lsn": "0/1"})
        logging.getLogger("cdc.daemon").info("a secret: s3cret-value")
        for handler in root.handlers:
            handler.flush()
    finally:
        root.handlers = kept
        redact.install([])
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(x["component"], x["message"], x.get("lsn")) for x in lines] == [
        ("daemon", "streaming from 0/1", "0/1"), ("daemon", "a secret: ***", None)]


def test_spark_lines_are_json_lines_with_the_same_keys_and_no_secret():
    """The JVM's lines outside log4j are wrapped; its JSON lines (compact, as log4j writes them)
    redacted string by string: a DSN's `password=...` shape never eats the rest of the line."""
    from sinks.spark_log import as_json_line

    formatter = redact.JsonFormatter("sink-cache")
    redact.install(["s3cret-value"])
    try:
        wrapped = json.loads(as_json_line("WARNING: Using incubator modules: jdk.incubator.vector", formatter))
        log4j = ('{"ts":"2026-11-26T15:55:03.515Z","level":"ERROR","component":"sink-cache","logger":"org.apache.x",'
                 '"message":"no route with password=s3cret-value","error":"java.io.IOException: s3cret-value\\n\\tat x"}')
        jvm = json.loads(as_json_line(log4j, formatter))
        assert as_json_line("  ", formatter) == ""
        assert json.loads(as_json_line('{"broken": ', formatter))["message"] == '{"broken": '  # not JSON: wrapped
    finally:
        redact.install([])
    assert set(wrapped) == {"ts", "level", "component", "logger", "message"}
    assert (wrapped["level"], wrapped["component"], wrapped["logger"]) == ("WARNING", "sink-cache", "spark.stderr")
    assert wrapped["message"] == "WARNING: Using incubator modules: jdk.incubator.vector"
    assert jvm == {"ts": "2026-11-26T15:55:03.515Z", "level": "ERROR", "component": "sink-cache",
                   "logger": "org.apache.x", "message": "no route with password=***",
                   "error": "java.io.IOException: ***\n\tat x"}


def test_spark_driver_config_logs_the_python_keys_and_drops_the_local_checkpoint_warning():
    from sinks.spark_log import CHECKPOINT_WARNING, config_file, properties

    text = properties("json")
    template = next(line for line in text.splitlines() if line.startswith("appender.console.layout.eventTemplate"))
    assert set(json.loads(template.split(" = ", 1)[1])) == {"ts", "level", "component", "logger", "message", "error"}
    for log_format in ("text", "json"):
        assert f"appender.console.filter.checkpointed.text = {CHECKPOINT_WARNING}" in properties(log_format)
        assert config_file(log_format).read_text() == properties(log_format)


def test_a_child_writing_to_stderr_writes_json_lines(capfd):
    """What a JVM started inside `stderr_as_json` prints, as cdc's JSON lines, also after it ends."""
    import subprocess
    import sys
    import time

    from sinks.spark_log import stderr_as_json

    child = "import sys; sys.stderr.write('WARNING: raw\\n\\n{\"level\":\"WARNING\",\"message\":\"m\"}\\n')"
    with stderr_as_json("sink-cache"):
        done = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(0.5); {child}"])
    assert done.wait(30) == 0
    err, deadline = "", time.monotonic() + 30
    while err.count("\n") < 2 and time.monotonic() < deadline:
        err += capfd.readouterr().err
        time.sleep(0.05)
    lines = [json.loads(line) for line in err.splitlines()]
    assert [(line.get("logger"), line["message"]) for line in lines] == [("spark.stderr", "WARNING: raw"), (None, "m")]
    assert lines[0]["component"] == "sink-cache" and lines[1] == {"level": "WARNING", "message": "m"}


def test_rate_averages_the_recent_window_and_survives_a_restart():
    points = deque([(0.0, 0), (5.0, 500), (10.0, 1000), (15.0, 1500)])
    assert rate(points, 15.0) == 100.0  # from the point at the window's start (t=5) to now
    assert rate(deque([(0.0, 0), (5.0, 500)]), 60.0) == 0.0  # nothing within the window: idle
    assert rate(deque([(0.0, 900), (5.0, 1000), (10.0, 20)]), 10.0) == 20 / 5  # counting began again after 5 s
    assert rate(deque([(0.0, 5)]), 1.0) is None


def _picture() -> Picture:
    daemon = DaemonPicture("cdc", True, True, 4242, "reserved", 0x16B3748, 0x16B3800, 184, 0.25, 90_000, 1234.0,
                           56_789, "metrics", 3)
    sinks = [
        SinkPicture("cache", 0x16B3748, 12, 0, 1_000_000, 5_000, 850.0, 0, 0.0, False, True),
        SinkPicture("delta", 0x1600000, 4, 2, 999_000, 4_000, 120.0, 0xB3748, 42.0, True, False),
    ]
    tables = [TablePicture("cdc.public.orders", "public.orders", 1000, False, {"cache": 1000, "delta": 990})]
    return Picture("cdc", 1_002_000, daemon, sinks, tables, 1_001_000)


def test_the_live_view_shows_every_stage():
    console = Console(file=io.StringIO(), width=140, color_system=None)
    console.print(render(_picture()))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "active pid 4242" in text and "1,234" in text and "56,789" in text and "0/16B3748" in text
    cache = next(line for line in text.splitlines() if line.startswith("cache"))
    assert cache.split() == ["cache", "850", "5,000", "0/16B3748", "0", "B", "0", "s", "0", "12", "2", "s", "ago",
                             "caught", "up"]
    delta = next(line for line in text.splitlines() if line.startswith("delta"))
    assert "735.0 kB" in delta and "≥ 42.0 s" in delta and "catching up" in delta
    orders = next(line for line in text.splitlines() if line.startswith("public.orders"))
    assert orders.split() == ["public.orders", "1,000", "1,000", "990", "≠"]


def test_each_sink_says_its_state_and_one_that_knows_no_lsn_shows_no_distance():
    """The history query caught up like the job it follows; a job whose progress names no LSN
    yet shows neither `0/0` nor the slot's whole LSN as bytes behind."""
    picture = _picture()
    picture.sinks += [
        SinkPicture("delta-history", 0x16B3748, 3, 0, 1_000_000, 4_000, 0.0, 0, 0.0, False, True),
        SinkPicture("search", 0, 0, 0, 1_000_000, 0, 0.0),
    ]
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render(picture))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    history = next(line for line in lines if line.startswith("delta-history")).split()
    assert history[3:6] == ["0/16B3748", "0", "B"] and history[-2:] == ["caught", "up"]
    search = next(line for line in lines if line.startswith("search")).split()
    # sink, records/s, records, complete up to, behind slot, lag, dead letters, batch, updated (3), state
    assert search[3:6] == ["-", "-", "-"] and search[-3:] == ["no", "LSN", "yet"], search
    delta = next(line for line in lines if line.startswith("delta ")).split()
    assert delta[-2:] == ["catching", "up"]


def test_status_says_each_sinks_state():
    from cdc.status import render as render_status

    sinks = {
        "delta": {"state": "caught up", "complete_lsn": "0/16B3748", "tables": {}, "dead_letters": 0,
                  "lag_bytes": 184},
        "delta-history": {"state": "catching up", "complete_lsn": "0/1600000", "tables": {}, "dead_letters": 0,
                          "lag_bytes": 734_024},
        "search": {"state": "no LSN yet", "complete_lsn": "0/0", "tables": {}, "dead_letters": 0},
    }
    text = render_status({"slot": None, "snapshot": None, "sinks": sinks, "topics": {}})
    assert "sink delta: caught up, complete up to 0/16B3748, 184 bytes behind the server; 0 dead letters" in text
    assert "sink delta-history: catching up, complete up to 0/1600000, 734,024 bytes behind" in text
    assert "sink search: no LSN yet; 0 dead letters" in text


def test_the_reports_sink_table_says_each_sinks_state():
    history = _history()  # the newest heartbeat: LSN 1590
    history.progress["delta"] = [{"ts_ms": 30_000, "complete_lsn": "1590", "records": 9, "dead_letters": 0, "batch": 7}]
    history.progress["search"] = [{"ts_ms": 30_000, "complete_lsn": "0", "records": 0, "dead_letters": 0, "batch": 0}]
    page = render_html(history)
    assert "<td>cache</td><td>0/50A</td><td>catching up</td>" in page
    assert "<td>delta</td><td>0/636</td><td>caught up</td>" in page
    assert "<td>search</td><td>-</td><td>no LSN yet</td>" in page


def test_caught_up_needs_every_job_past_the_lsn_and_the_newest_heartbeat_and_equal_counts():
    picture = _picture()
    assert not picture.caught_up(["cache"], 0x16B3748)  # delta's 990 rows: the counts differ
    picture.tables[0].stores["delta"] = 1000
    assert picture.caught_up(["cache"], 0x16B3748)
    assert not picture.caught_up(["cache", "delta"], 0x1600000)  # delta is behind the newest heartbeat
    picture.sinks[1].caught_up = True
    assert picture.caught_up(["cache", "delta"], 0x1600000)
    assert not picture.caught_up(["cache", "delta"], 0x16B3748)  # delta is not complete up to it


def _history() -> History:
    history = History("cdc", "cdc", 0, 100_000)
    history.samples = [Sample("cdc", t * 1000, 1000 + 10 * t, 1000 + 12 * t, 0.1, 100 * t, 0, 0) for t in range(60)]
    history.beats = [(t * 1000 + 500, 1000 + 10 * t) for t in range(60)]
    history.progress = {"cache": [
        {"ts_ms": 10_000, "complete_lsn": "0", "records": 0, "dead_letters": 0, "batch": 0},
        {"ts_ms": 20_000, "complete_lsn": "1100", "records": 500, "dead_letters": 0, "batch": 1},
        {"ts_ms": 30_000, "complete_lsn": "1290", "records": 1500, "dead_letters": 1, "batch": 2},
    ]}
    history.dead_letters = 1
    history.topics = [TopicSize("cdc.public.t", 1500, 90_000, 1200, 80_000, 700, 50_000), TopicSize("cdc.__cdc_dlq", 1)]
    return history


def test_the_timeline_says_when_the_topics_passed_an_lsn():
    timeline = Timeline(_history())
    assert timeline.at(20_000) == 1200 and timeline.at(-1) is None
    assert timeline.passed(1100) == timeline.passed(1105) == 11_000  # LSN 1110, the sample at 11 s
    assert timeline.passed(10**9) is None


def test_sink_series_from_progress_records():
    behind, lag, throughput, letters = sink_series(_history())
    assert behind["cache"] == [(20_000, 100.0), (30_000, 10.0)]  # the first record knew no LSN yet: left out
    assert lag["cache"] == [(20_000, 9.0), (30_000, 0.0)]  # LSN 1100 was passed at 11 s; 1290 just now
    assert throughput["cache"] == [(20_000, 50.0), (30_000, 100.0)]
    assert letters["cache"] == [(10_000, 0.0), (20_000, 0.0), (30_000, 1.0)]
    assert per_second([(0, 100), (1000, 50)]) == [(1000, 50.0)]  # a restart counts from 0


def test_the_report_is_one_page_that_asks_for_nothing():
    page = render_html(_history())
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"<script|<link|<img|src=|url\(|@import", page)  # nothing to fetch, nothing to run
    for title in ("slot lag (bytes)", "slot lag (seconds)", "records produced per second", "bytes behind the slot",
                  "sinks: lag", "records applied per second", "dead letters (running total)", "after compaction"):
        assert title in page, title
    assert page.count("<polyline") == 7 and page.count("no data in this period") == 0
    assert "<td>cdc.public.t</td><td>1,500</td><td>1,200</td><td>80.0 kB</td><td>700</td><td>50.0 kB</td>" in page


def test_a_series_keeps_its_colour_in_every_chart_of_the_report():
    """delta-history knows no LSN yet: it is missing from the charts of LSNs, in the others
    the jobs after it must not take another colour."""
    history = _history()
    cache = history.progress["cache"]
    history.progress = {
        "cache": cache,
        "delta-history": [{**r, "complete_lsn": "0"} for r in cache],
        "search": [{**r, "records": 2 * r["records"]} for r in cache],
    }
    page = render_html(history)
    legends = re.findall(r'height="4" fill="([^"]+)"/><text [^>]*class="legend">([^<]+)</text>', page)
    colours: dict[str, set[str]] = {}
    for colour, name in legends:
        colours.setdefault(name, set()).add(colour)
    assert {name for _, name in legends} == {"slot lag", "events/s", "cache", "delta-history", "search"}
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({c for cs in colours.values() for c in cs}) == len(colours), colours  # different series differ
    assert sum(1 for _, name in legends if name == "search") == 4  # behind, lag, records/s, dead letters


def test_axis_labels_differ_for_small_ranges():
    """A rate of 0 to 0.22 records/s once read "0.2/s" on three ticks."""
    for top in (0.22, 0.25, 0.021, 0.003, 1.1, 7.3, 12.5, 2345.0):
        for unit in (_rate, duration, size, str):
            svg = chart("t", {"x": [(0, 0.0), (1000, top)]}, unit, 0, 1000)
            labels = re.findall(r'class="tick" text-anchor="end">([^<]+)</text>', svg)
            assert len(labels) >= 5 and len(set(labels)) == len(labels), (top, unit, labels)
    svg = chart("t", {"x": [(0, 0.0), (1000, 0.22)]}, _rate, 0, 1000)
    labels = re.findall(r'class="tick" text-anchor="end">([^<]+)</text>', svg)
    assert labels == ["0.00/s", "0.05/s", "0.10/s", "0.15/s", "0.20/s", "0.25/s"]


def test_a_chart_without_data_says_so():
    svg = chart("empty", {"x": []}, str, 0, 1000)
    assert "no data in this period" in svg and "<polyline" not in svg


def test_the_sink_metrics_read_how_complete_the_store_is_from_the_job_at_each_scrape():
    """A job started again with nothing new to read runs no batch: a scrape finds the LSN its
    progress says (read back, or moved by a look between batches), not 0 with a lag from it."""
    from cdc.config import Config
    from sinks.metrics import SinkMetrics
    from sinks.pipeline import Progress

    metrics = SinkMetrics("cache", Config())
    complete = lambda: metrics.registry.get_sample_value("cdc_sink_complete_lsn", {"store": "cache"})  # noqa: E731
    assert complete() is None  # no job yet
    progress = Progress(complete_lsn=0x16B3748)
    metrics.follow(lambda: progress.complete_lsn)
    assert complete() == 0x16B3748
    progress.complete_lsn = 0x16B4000
    assert complete() == 0x16B4000


def test_sink_metrics_count_batches_per_table_and_retries_by_reason(monkeypatch):
    """The retry loop reports each batch read again: a failure a retry may cure, then a store
    that lost writes (the job and the store stand-ins hold no Spark and no server)."""
    import sinks.runner as runner
    from cdc.config import Config
    from sinks.metrics import SinkMetrics
    from sinks.pipeline import Progress
    from sinks.store import StoreLost
    from tests.support import sleeps_of_this_thread

    metrics = SinkMetrics("cache", Config())
    metrics.follow(lambda: 0x16B3748)
    metrics.batch(1.5, {"cdc.public.orders": 10, "cdc.public.Odd-20Name": 3, "cdc.public.empty": 0}, 2)
    failures = [ConnectionError("Redis went away"), StoreLost("the batch count is gone")]

    def run(*_args: object) -> Progress:
        if failures:
            raise failures.pop(0)
        return Progress()

    class Job:
        def __init__(self, *_args: object) -> None:
            self.progress = Progress()

        def forget(self) -> None: ...

        def close(self) -> None: ...

    class Store:
        name, transient = "cache", ()

        def clear(self) -> None: ...

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(runner, "SinkJob", Job)
    monkeypatch.setattr(runner.checkpoints, "drop", lambda *_: None)
    sleeps_of_this_thread(monkeypatch)
    runner.keep_running(None, Config(), Store(), True, lambda: False, metrics)  # type: ignore[arg-type]
    value = metrics.registry.get_sample_value
    assert value("cdc_sink_retries_total", {"store": "cache", "reason": "failed"}) == 1
    assert value("cdc_sink_retries_total", {"store": "cache", "reason": "store_lost"}) == 1
    assert value("cdc_sink_records_total", {"store": "cache", "table": "public.orders"}) == 10
    assert value("cdc_sink_records_total", {"store": "cache", "table": 'public."Odd Name"'}) == 3
    assert value("cdc_sink_records_total", {"store": "cache", "table": "public.empty"}) is None
    assert value("cdc_sink_dead_letters_total", {"store": "cache"}) == 2
    assert value("cdc_sink_batch_duration_seconds_count", {"store": "cache"}) == 1
    assert value("cdc_sink_complete_lsn", {"store": "cache"}) == 0x16B3748
