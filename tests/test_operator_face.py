"""The operator's face on a running deployment, as a person meets it.

One deployment for the module: the daemon captures as a least-privilege role (REPLICATION and
SELECT; the publication made by the tables' owner), with its metrics endpoint, metric history
and JSON logs; `cdc sink cache` streams into a Redis of its own, with its metrics endpoint and
JSON logs. Then `cdc top` runs in a real terminal (tmux) while rows change, the sink job's
/metrics is scraped, `cdc report --html` is opened in headless Chromium, and the logs are read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from cdc.config import TopicConfig
from cdc.local.postgres import LocalPostgres
from cdc.local.process import free_port
from cdc.local.redis import LocalRedis
from cdc.naming import topic_name
from cdc.top import scrape
from sinks.progress import read_progress
from tests.support import (
    DaemonProcess,
    current_lsn,
    png_pixels,
    slot_of,
    start_streaming,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.integration

TABLES = ["public.items", "public.notes"]


@dataclass
class Deployment:
    base: Path
    config: Path
    dsn: str  # the owner's
    prefix: str
    slot: str
    password: str  # the capture role's: no output line may show it
    servers: str
    daemon_metrics: int
    sink_metrics: int
    daemon_log: Path
    sink_log: Path

    def rows(self, table: str) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]

    def execute(self, *statements: str) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def sink_progress(self) -> dict:
        return read_progress(TopicConfig(bootstrap_servers=self.servers, prefix=self.prefix)).get("cache", {})

    def wait_sink_complete(self, timeout: float = 300) -> None:
        """Until the cache job's store is complete up to everything written so far."""
        target = current_lsn(self.dsn)
        wait_for(lambda: int(self.sink_progress().get("complete_lsn", 0)) >= target, timeout,
                 f"the cache sink to be complete up to {target}\n{self.sink_log.read_text()[-3000:]}", poll=1)


@pytest.fixture(scope="module")
def deployment(pg: LocalPostgres, broker_servers: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("face")
    tag = uuid.uuid4().hex[:10]
    name, role, password, prefix = f"t_face_{tag}", f"cdc_capture_{tag}", f"pw-{tag}-secret", f"face{tag}"
    dsn = pg.create_database(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE public.items (id int PRIMARY KEY, name text NOT NULL, qty int)")
        conn.execute("CREATE TABLE public.notes (id bigint PRIMARY KEY, body text)")
        conn.execute("INSERT INTO public.items SELECT g, 'item ' || g, g % 7 FROM generate_series(1, 200) g")
        conn.execute("INSERT INTO public.notes SELECT g, 'note ' || g FROM generate_series(1, 50) g")
        # least privilege: REPLICATION and SELECT; the publication is the tables' owner's
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
        conn.execute(sql.SQL("GRANT SELECT ON public.items, public.notes TO {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE public.items, public.notes "
                             "WITH (publish_via_partition_root = true)").format(sql.Identifier(f"p_{prefix}")))
    redis = LocalRedis(base / "redis").start()
    daemon_metrics, sink_metrics = free_port(), free_port()
    config = write_config(
        base / "cdc.toml", f"{dsn} user={role} password={password}", broker_servers, prefix, TABLES,
        daemon={"metrics_port": daemon_metrics, "metrics_interval_s": 1, "log_format": "json"},
        spark={"checkpoint_dir": str(base / "checkpoints"), "metrics_port": sink_metrics, "log_format": "json"},
        cache={"url": redis.url},
    )
    d = Deployment(base, config, dsn, prefix, slot_of(prefix), password, broker_servers, daemon_metrics,
                   sink_metrics, base / "daemon.log", base / "sink.log")
    daemon = start_streaming(config, d.daemon_log, dsn, d.slot)
    DaemonProcess.started.remove(daemon)  # it outlives each test: this fixture stops it
    sink = None
    try:
        with open(d.sink_log, "w", encoding="utf-8") as log:
            sink = subprocess.Popen([sys.executable, "-m", "cdc", "sink", "cache", "--config", str(config)],
                                    stdout=log, stderr=subprocess.STDOUT)
        d.wait_sink_complete()
        yield d
    finally:
        if sink is not None and sink.poll() is None:
            sink.send_signal(signal.SIGTERM)
            sink.wait(180)
        if daemon.alive():
            daemon.stop()
        redis.stop()
        pg.drop_database(name)
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


class Tmux:
    """A terminal of its own (its own tmux server): what a person would see, as text."""

    def __init__(self, base: Path, width: int = 160, height: int = 50) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is missing: apt-get install tmux")
        self.socket = str(base / "tmux.sock")
        self.width, self.height = width, height

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start(self, command: list[str]) -> None:
        # without a terminal of its own the tmux server puts COLUMNS=80 in its environment,
        # which programs prefer to the pane's real width
        argv = ["env", "-u", "COLUMNS", "-u", "LINES", *command]
        self._tmux("new-session", "-d", "-s", "face", "-x", str(self.width), "-y", str(self.height),
                   " ".join(subprocess.list2cmdline([part]) for part in argv))

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "face")

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=30)


def _line(screen: str, first_word: str) -> list[str]:
    found = [line.split() for line in screen.splitlines() if line.split()[:1] == [first_word]]
    return found[-1] if found else []


def test_top_shows_every_stage_live_in_a_terminal(deployment: Deployment):
    d = deployment
    tmux = Tmux(d.base)
    tmux.start([sys.executable, "-m", "cdc", "top", "--config", str(d.config), "--interval", "0.5",
                "--counts-every", "1"])
    try:
        wait_for(lambda: "public.items" in tmux.screen(), 60, "cdc top's first picture")
        # rows change while it watches, and a record the sink cannot decode lands in a table topic
        d.execute(
            "INSERT INTO public.items SELECT g, 'item ' || g, 1 FROM generate_series(201, 500) g",
            "UPDATE public.items SET qty = qty + 1 WHERE id <= 100",
            "DELETE FROM public.items WHERE id BETWEEN 401 AND 450",
            "INSERT INTO public.notes SELECT g, 'more' FROM generate_series(51, 70) g",
        )
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=d.servers)
        producer.send(topic_name(d.prefix, "public", "items"), key=b'{"id":999999}', value=b"not json at all")
        producer.flush()
        producer.close()
        items, notes = d.rows("public.items"), d.rows("public.notes")
        assert (items, notes) == (450, 70)

        last = [""]

        def settled() -> str | None:
            screen = last[0] = tmux.screen()
            cache = _line(screen, "cache")
            done = (_line(screen, "public.items")[1:] == ["450", "450", "="]
                    and _line(screen, "public.notes")[1:] == ["70", "70", "="]
                    and cache[-2:] == ["caught", "up"] and cache[8:9] == ["1"])  # one dead letter
            return screen if done else None

        try:
            screen = wait_for(settled, 300, "cdc top to show the cache equal to PostgreSQL", poll=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n{last[0]}") from None
    finally:
        tmux.close()
    with psycopg.connect(d.dsn, autocommit=True) as conn:
        pid = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (d.slot,)).fetchone()[0]
    daemon = _line(screen, "active")
    assert daemon[:2] == ["pid", str(pid)] or daemon[1:3] == ["pid", str(pid)], screen
    # events/s, then the events the daemon produced since it started: the snapshot's 200 + 50
    # rows, 300 inserts, 100 updates, 50 deletes each with its tombstone, 20 inserts
    assert "(topics)" not in daemon, screen  # the rate is the daemon's own, from its /metrics
    assert "events/s" in screen and f"{200 + 50 + 300 + 100 + 100 + 20:,}" in daemon, screen
    # sink, records/s, records, complete up to, behind slot (2), lag (2), dead letters, ...
    cache = _line(screen, "cache")
    assert cache[2] == f"{700 + 70:,}", screen  # records applied: both snapshots and every change since
    assert cache[4:6] == ["0", "B"] and cache[8] == "1" and cache[-2:] == ["caught", "up"], screen
    assert "slot lag" in screen and "complete up to" in screen and "dead letters" in screen


def test_metrics_of_the_daemon_and_the_sink_job_are_scraped(deployment: Deployment):
    """After the snapshot (200 items, 50 notes) and the top test's changes: 300 inserts, 100
    updates, 50 deletes with their tombstones (items), 20 inserts (notes), and the undecodable
    record (not the daemon's)."""
    d = deployment
    daemon = scrape(f"http://127.0.0.1:{d.daemon_metrics}/metrics")
    assert daemon[("cdc_events_total", (("table", "public.items"),))] == 200 + 500
    assert daemon[("cdc_events_total", (("table", "public.notes"),))] == 50 + 20

    def settled() -> dict | None:
        sink = scrape(f"http://127.0.0.1:{d.sink_metrics}/metrics")
        return sink if sink.get(("cdc_sink_records_total", (("store", "cache"), ("table", "public.items")))) == 700 \
            else None

    sink = wait_for(settled, 120, "the sink's metrics to count every record")
    cache = (("store", "cache"),)
    assert sink[("cdc_sink_records_total", (*cache, ("table", "public.notes")))] == 50 + 20
    assert sink[("cdc_sink_dead_letters_total", cache)] == 1
    assert sink[("cdc_sink_retries_total", (("reason", "failed"), *cache))] == 0
    assert sink[("cdc_sink_retries_total", (("reason", "store_lost"), *cache))] == 0
    assert sink[("cdc_sink_batch_duration_seconds_count", cache)] >= 2
    assert sink[("cdc_sink_batch_duration_seconds_sum", cache)] > 0
    progress = d.sink_progress()
    assert sink[("cdc_sink_complete_lsn", cache)] <= int(progress["complete_lsn"])  # it may have moved since
    assert 0 <= sink[("cdc_sink_lag_bytes", cache)] < 1_000_000 and 0 <= sink[("cdc_sink_lag_seconds", cache)] < 60
    assert progress["records"] == 700 + 70 and progress["dead_letters"] == 1


def test_report_renders_in_headless_chromium(deployment: Deployment, tmp_path: Path):
    d = deployment
    page = tmp_path / "report.html"
    made = subprocess.run([sys.executable, "-m", "cdc", "report", "--config", str(d.config), "--html", str(page),
                           "--hours", "1"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"report: {page} (")
    chromium = shutil.which("chromium") or pytest.fail("chromium is missing: apt-get install chromium")
    headless = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1000,2600"]
    dom = subprocess.run([*headless, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count('<svg class="chart"') == 7
    assert html.count("<polyline") >= 5  # the slot's lag twice, the daemon's rate, the sink's lag twice ...
    assert "<b>1</b><span>dead letters</span>" in html
    items = topic_name(d.prefix, "public", "items")
    row = html.split(f"<td>{items}</td>", 1)[1].split("</tr>", 1)[0]
    cells = [c.split("</td>")[0] for c in row.split("<td>")[1:]]
    assert cells[3] == f"{d.rows('public.items') + 1:,}"  # after compaction: every row, and the undecodable record
    shot = tmp_path / "report.png"
    taken = subprocess.run([*headless, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                           timeout=120)
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    width, height, pixels = png_pixels(shot)
    assert (width, height) == (1000, 2600)
    assert len(set(pixels)) > 100  # lines, text and colours: not a blank page


def test_logs_are_json_lines_without_secrets(deployment: Deployment):
    d = deployment
    daemon = [json.loads(line) for line in d.daemon_log.read_text().splitlines() if line.strip()]
    assert {line["component"] for line in daemon} == {"daemon"}
    streaming = next(line for line in daemon if line["message"].startswith("streaming from "))
    assert streaming["lsn"] == streaming["message"].removeprefix("streaming from ")
    assert {line["table"] for line in daemon if "table" in line} >= {"public.items", "public.notes"}
    # every line of the job's output (the sink is still running: its closing line is not yet
    # written) is one JSON object with the daemon's keys, Spark's and the JVM's lines included
    sink = [json.loads(line) for line in d.sink_log.read_text().splitlines()]
    assert all(isinstance(line, dict) for line in sink)
    assert {"ts", "level", "component", "logger", "message"} <= set().union(*sink) <= {
        "ts", "level", "component", "logger", "message", "error", "table", "lsn", "batch", "store"}
    assert all({"ts", "level", "component", "logger", "message"} <= set(line) for line in sink)
    assert {line["component"] for line in sink} == {"sink-cache"}
    assert {line["level"] for line in sink} <= {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
    assert [line for line in sink if line["logger"].startswith("org.apache.")], "no line of Spark's own"
    # Spark warns at each release of a localCheckpoint (every batch): expected, so not logged
    assert not [line for line in sink if "locally checkpointed" in line["message"]]
    batches = [line for line in sink if line["message"].startswith("batch ")]
    assert batches and all(line["message"].startswith(f"batch {line['batch']}: ") and line["store"] == "cache"
                           for line in batches)
    letter = next(line for line in sink if "records to " in line["message"])
    assert (letter["table"], letter["level"]) == ("public.items", "WARNING")
    for text in (d.daemon_log.read_text(), d.sink_log.read_text()):
        assert d.password not in text
    assert os.path.getsize(d.daemon_log) > 0
