"""The sink jobs' waits on a server inside a wait, or a recovery, on the same server: a rebuild's
progress write, a retry inside a retry, a scroll's clean-up after it failed, a progress write
the query loop's look waited for, a scrape's poll of the heartbeats. Stand-ins for the job,
the store, the HTTP pool under the OpenSearch client, the progress topic and the heartbeats:
a real server cannot fail at exactly these moments on demand."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from kafka.errors import KafkaTimeoutError

import sinks.metrics as sink_metrics
import sinks.pipeline as pipeline
import sinks.runner as runner
from cdc.config import Config
from sinks.metrics import SinkMetrics
from sinks.pipeline import Progress, SinkJob, drained
from sinks.store import SinkStopped, StoreLost, StoreUnavailable
from sinks.stores.search.opensearch import Action, Bulk, Endpoint, SearchUnavailable, scroll
from tests.support import sleeps_of_this_thread


class _Job:
    """The sink job's stand-in: what the retry loop calls on it."""

    def __init__(self, events: list[str], forget_failures: list[Exception]) -> None:
        self.progress = Progress()
        self.events = events
        self.forget_failures = forget_failures

    def forget(self) -> None:
        if self.forget_failures:
            raise self.forget_failures.pop(0)
        self.events.append("progress: complete up to nothing")

    def close(self) -> None: ...


class _Store:
    name, transient = "cache", ()

    def __init__(self, events: list[str], clear_failures: list[Exception] | None = None) -> None:
        self.events = events
        self.clear_failures = clear_failures or []

    def clear(self) -> None:
        if self.clear_failures:
            raise self.clear_failures.pop(0)
        self.events.append("store cleared")


def _retry_loop(monkeypatch: pytest.MonkeyPatch, losses: int, forget_failures: list[Exception]) -> list[str]:
    """`keep_running` with `run` finding the store lost `losses` times, then draining."""
    events: list[str] = []
    runs = iter(range(1000))

    def run(*_args: object) -> Progress:
        if next(runs) < losses:
            raise StoreLost("Redis at redis://cache holds no trace of the batches this job committed")
        return Progress()

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(runner, "SinkJob", lambda *_args: _Job(events, forget_failures))
    monkeypatch.setattr(runner.checkpoints, "drop", lambda *_: events.append("checkpoint dropped"))
    sleeps_of_this_thread(monkeypatch)
    return events


def test_a_broker_that_times_out_the_rebuilds_progress_write_is_retried_and_the_store_waits_for_it(monkeypatch):
    """A store found lost: the job's progress goes to "complete up to nothing" (a write to the
    broker) before the store is cleared, and a broker that does not take that write is retried
    like a failed batch, not the end of the job with a client's traceback; until it is taken
    the store keeps its rows (`cdc status` never reads an old complete LSN over a cleared store)."""
    forget_failures: list[Exception] = [KafkaTimeoutError("Failed to flush buffered records within 30.0 secs")]
    events = _retry_loop(monkeypatch, losses=2, forget_failures=forget_failures)
    runner.keep_running(None, Config(), _Store(events), False, lambda: False)  # type: ignore[arg-type]
    assert not forget_failures
    assert events == ["progress: complete up to nothing", "store cleared", "checkpoint dropped"]


def test_a_store_that_stays_unclearable_ends_a_stopped_or_drained_job(monkeypatch):
    """Clearing a lost store that refuses for now is retried after a backoff, but a stop request
    (or `--once` after its attempts) ends the job there: the loop does not go round again at once."""
    events = _retry_loop(monkeypatch, losses=1000, forget_failures=[])
    refusals = [StoreUnavailable("Redis is loading the dataset in memory") for _ in range(100)]
    with pytest.raises(SinkStopped, match="starting its rebuild failed 1 times, last: Redis is loading"):
        runner.keep_running(None, Config(), _Store(events, refusals), False, lambda: True)  # type: ignore[arg-type]
    with pytest.raises(SinkStopped, match=f"starting its rebuild failed {runner.ONCE_ATTEMPTS} times"):
        runner.keep_running(None, Config(), _Store(events, refusals), True, lambda: False)  # type: ignore[arg-type]
    assert "store cleared" not in events


@dataclass
class _Answer:
    status: int
    data: bytes = b""
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})


class _Pool:
    """The HTTP pool's stand-in under sinks.stores.search.opensearch.Client: `answer(method, path)` says what
    OpenSearch answers; `asked` keeps every request made."""

    def __init__(self, answer: Callable[[str, str], _Answer]) -> None:
        self.answer = answer
        self.asked: list[tuple[str, str]] = []

    def request(self, method: str, url: str, body: Any = None, headers: Any = None) -> _Answer:
        path = url.split("9200", 1)[1].split("?")[0]
        self.asked.append((method, path))
        return self.answer(method, path)

    def clear(self) -> None: ...


def _client(monkeypatch: pytest.MonkeyPatch, answer: Callable[[str, str], _Answer]) -> tuple[Any, _Pool, list[float]]:
    slept = sleeps_of_this_thread(monkeypatch)
    client = Endpoint("http://search.invalid:9200").client()
    client.pool = _Pool(answer)
    return client, client.pool, slept


def test_a_test_that_records_its_sleeps_leaves_every_other_threads_pause_real(monkeypatch):
    """A background thread of the test process (a client's, a leftover job's) still pauses while
    a test records its own sleeps: patched for every thread, each pause was a busy loop appending
    to the test's list, and a worker's memory filled to the OOM killer within minutes."""
    slept = sleeps_of_this_thread(monkeypatch)
    started = time.monotonic()
    pauses = threading.Thread(target=lambda: [time.sleep(0.05) for _ in range(4)])
    pauses.start()
    time.sleep(30)
    pauses.join()
    assert slept == [30]
    assert time.monotonic() - started >= 0.2


def test_an_overloaded_opensearch_gets_the_bulk_writes_again_within_one_retry_budget(monkeypatch):
    """OpenSearch refusing a whole `_bulk` (429) or only its items (429 each) is retried in the
    same rounds: the client's retries and backoff once, not a request's retries inside each
    round of item retries (7 x 7 requests and minutes of backoff for one batch)."""
    answers = iter(range(1000))

    def overloaded(_method: str, _path: str) -> _Answer:  # six refusals whole, then one item by item, again
        if next(answers) % 7 < 6:
            return _Answer(429, b'{"error":{"type":"rejected_execution_exception"}}')
        return _Answer(200, orjson.dumps({"errors": True, "items": [{"index": {"status": 429, "_id": "1"}}]}))

    client, pool, slept = _client(monkeypatch, overloaded)
    with pytest.raises(SearchUnavailable, match="kept refusing 1 writes with 429/5xx"):
        Bulk(client, 1 << 20).send([Action(b'{"index":{"_index":"t","_id":"1"}}\n{}\n', ("p.public.t", 0, 5))])
    assert len(pool.asked) == client.retries + 1
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


def test_a_scroll_that_lost_opensearch_fails_with_its_own_error_after_one_try_to_let_go(monkeypatch):
    """A scroll whose next page finds OpenSearch gone raises that, once the client's retries are
    spent; letting go of the scroll is one try (it expires by itself), not a second round of
    retries that would also replace the error with its own."""

    def gone_after_the_first_page(method: str, path: str) -> _Answer:
        if path == "/t/_search":
            return _Answer(200, orjson.dumps({"_scroll_id": "s1", "hits": {"hits": [{"_id": "1"}]}}))
        return _Answer(503)

    client, pool, slept = _client(monkeypatch, gone_after_the_first_page)
    pages = []
    with pytest.raises(SearchUnavailable, match=r"POST /_search/scroll failed: HTTP 503"):
        for page in scroll(client, "/t/_search", {"query": {"match_all": {}}}):
            pages.append(page)
    assert pages == [[{"_id": "1"}]]
    assert pool.asked.count(("POST", "/_search/scroll")) == client.retries + 1
    assert pool.asked.count(("DELETE", "/_search/scroll")) == 1


def test_a_scroll_opensearch_lost_fails_the_batch_for_a_retry_not_the_job(monkeypatch):
    """OpenSearch forgets a scroll on a restart, or when its reader spent over a minute on a page
    (a truncate's deletes waiting on OpenSearch's retries): reading again cures that, so the
    error is one the job retries, not one that stops it for good."""
    def restarted_after_the_first_page(method: str, path: str) -> _Answer:
        if path == "/t/_search":
            return _Answer(200, orjson.dumps({"_scroll_id": "s1", "hits": {"hits": [{"_id": "1"}]}}))
        return _Answer(404, orjson.dumps({"error": {"type": "search_context_missing_exception",
                                                    "reason": "No search context found for id [1]"}}))

    client, _, _ = _client(monkeypatch, restarted_after_the_first_page)
    with pytest.raises(SearchUnavailable, match="the scroll over /t/_search is gone .HTTP 404 search_context_missing") as lost:
        for _ in scroll(client, "/t/_search", {"query": {"match_all": {}}}):
            pass
    assert runner.transient(lost.value, _Store([]))  # type: ignore[arg-type]


BROKER_S = 5.0  # how long the broker's stand-ins hold a write or a poll before they time out, like a real one


class _Broker:
    """The progress topic's stand-in (sinks.progress.ProgressLog): with `held` set, a send waits
    on the broker (`waiting`) until `free` is set, or times out after BROKER_S."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.held = False
        self.waiting = threading.Event()
        self.free = threading.Event()

    def last(self) -> dict[str, Any] | None:
        return None

    def send(self, progress: dict[str, Any]) -> None:
        if self.held:
            self.waiting.set()
            try:
                if not self.free.wait(BROKER_S):
                    raise KafkaTimeoutError("Failed to flush buffered records within 30.0 secs")
            finally:
                self.waiting.clear()
        self.sent.append(progress)


class _Vouches:
    newest = 0x100  # the daemon's newest heartbeat

    def poll(self) -> None: ...

    def close(self) -> None: ...


class _Feed:
    """The feed's stand-in: it vouches for LSN 0x100 with one table partition ending at 10; the
    job read to that end once `read_to` says so."""

    in_batches = True
    ends_at = {"p.public.t": {0: 10}}

    def __init__(self) -> None:
        self.read_to: dict[str, dict[int, int]] | None = None

    def vouches(self, _config: Config) -> _Vouches:
        return _Vouches()

    def ends(self, _job: SinkJob) -> dict[str, dict[int, int]]:
        return self.ends_at

    def read(self, _spark: object, _checkpoint: str, _batch: int | None) -> dict[str, dict[int, int]] | None:
        return self.read_to

    def within(self, ends: dict[str, dict[int, int]], read: dict[str, dict[int, int]]) -> bool:
        return drained(read, ends)


class _JobStore:
    name, handover = "cache", None

    def __init__(self, feed: _Feed) -> None:
        self.feed = feed


def _job(monkeypatch: pytest.MonkeyPatch) -> tuple[SinkJob, _Broker, _Feed]:
    """A sink job on the stand-ins of its feed, its store and the progress topic (no Spark)."""
    broker, feed = _Broker(), _Feed()
    monkeypatch.setattr(pipeline.topics, "SchemaFeed", lambda _config: None)
    monkeypatch.setattr(pipeline.topics, "ProgressLog", lambda _config, _name: broker)
    return SinkJob(None, Config(), _JobStore(feed)), broker, feed  # type: ignore[arg-type]


@pytest.mark.parametrize("write", ["forget", "batch"])
def test_a_progress_write_the_broker_holds_does_not_hold_up_the_query_loops_look(monkeypatch, write):
    """A progress record (a batch's, or the rebuild's "complete up to nothing") waits out the
    broker's timeouts, 90 s when it is away. The query loop, which is what notices SIGTERM,
    meanwhile looks how complete the store is under the job's lock: it gets on with it."""
    job, broker, _ = _job(monkeypatch)
    broker.held = True
    writes = {"forget": job.forget, "batch": lambda: job._record(7, {"p.public.t": 0x90}, None, 3)}
    writer = threading.Thread(target=writes[write])
    writer.start()
    try:
        assert broker.waiting.wait(BROKER_S)
        job.look()
        assert broker.waiting.is_set(), "the look waited for the progress write to time out"
        assert job.progress.heartbeat_lsn == 0x100
    finally:
        broker.free.set()
        writer.join()
    assert [(r["batch"], r["tables"]) for r in broker.sent] == [
        {"forget": (-1, {}), "batch": (7, {"p.public.t": str(0x90)})}[write]
    ]


class _Turn:
    """The job's lock, giving `then` its turn once, right after the release that follows the
    building of a progress record (`built`): between a record's building and its send."""

    def __init__(self, lock: Any, then: Callable[[], None]) -> None:
        self.lock, self.then, self.built = lock, then, False

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.lock.release()
        if self.built and self.then is not None:
            then, self.then = self.then, None
            then()


def test_a_progress_record_never_goes_out_after_a_newer_one(monkeypatch):
    """A batch's record is built; before it goes out, a look finds the store complete further
    and sends its own. The batch's, older, must not follow it: the compacted topic keeps the
    last record per job, and `cdc status` would read the older LSN back."""
    job, broker, feed = _job(monkeypatch)
    job.checkpoint, feed.read_to = "checkpoint", feed.ends_at  # the job read to where the feed ended at 0x100
    turn = _Turn(job._lock, job.look)
    job._lock = turn  # type: ignore[assignment]
    progress, as_record = job.progress, job.progress.as_record

    def building(*args: Any) -> dict[str, Any]:
        turn.built = True
        return as_record(*args)

    progress.as_record = building  # type: ignore[method-assign]
    job._record(7, {"p.public.t": 0x90}, None, 3)
    assert turn.then is None  # the look had its turn
    lsns = [int(r["complete_lsn"]) for r in broker.sent]
    assert lsns == sorted(lsns) and lsns[-1] == 0x100, broker.sent
    assert broker.sent[-1]["tables"] == {"p.public.t": str(0x90)}


class _Heartbeats:
    """The daemon's heartbeats' stand-in (cdc.kafka.follow.Heartbeats): the first poll reads one
    at LSN 0x100 from a minute ago; the next ones wait on the broker (`polling`) until `free` is
    set, or time out after BROKER_S. A close during a poll is noted: their client is not for two
    threads."""

    def __init__(self) -> None:
        self.polls = 0
        self.polling = threading.Event()
        self.free = threading.Event()
        self.closed = threading.Event()
        self.closed_while_polling = False
        self.beat = (0x100, time.time() - 60)

    def poll(self) -> None:
        self.polls += 1
        if self.polls == 1:
            return
        self.polling.set()
        try:
            if not self.free.wait(BROKER_S):
                raise KafkaTimeoutError("Timeout after waiting for 30.0 secs")
        finally:
            self.polling.clear()

    def lag(self, complete: int, now: float | None = None) -> tuple[int | None, float | None, bool]:
        if not self.polls:
            return None, None, False
        lsn, ts = self.beat
        now = time.time() if now is None else now
        return (lsn - complete, now - ts, False) if lsn > complete else (0, 0.0, False)

    def close(self) -> None:
        self.closed_while_polling = self.polling.is_set()
        self.closed.set()


def _scrape(metrics: SinkMetrics) -> dict[str, float]:
    """One scrape of the sink job's endpoint: the store's samples by name."""
    return {s.name: s.value for family in metrics.registry.collect() for s in family.samples
            if s.labels == {"store": "cache"}}


def _scraped_while_a_poll_waits(monkeypatch: pytest.MonkeyPatch) -> tuple[SinkMetrics, _Heartbeats, threading.Thread]:
    """A store complete up to 0xC0, its metrics measured against the heartbeats' stand-in, one
    scrape, then another in a thread of its own; until a poll of the heartbeats waits on the broker."""
    monkeypatch.setattr(sink_metrics, "POLL_S", 0.01)
    heartbeats, metrics = _Heartbeats(), SinkMetrics("cache", Config())
    metrics.follow(lambda: 0xC0)
    metrics.measure(heartbeats)  # type: ignore[arg-type]
    _scrape(metrics)
    other = threading.Thread(target=_scrape, args=(metrics,))
    other.start()
    assert heartbeats.polling.wait(BROKER_S)
    return metrics, heartbeats, other


def test_a_scrape_answers_from_the_last_poll_while_the_next_waits_on_the_broker(monkeypatch):
    """Prometheus scrapes, and a person with curl too: neither waits on the broker (a poll of the
    heartbeats waits out its timeouts when it is away), nor behind one another."""
    metrics, heartbeats, other = _scraped_while_a_poll_waits(monkeypatch)
    try:
        scraped = _scrape(metrics)
        assert heartbeats.polling.is_set(), "the scrape waited for the poll to time out"
        assert scraped["cdc_sink_complete_lsn"] == 0xC0 and scraped["cdc_sink_lag_bytes"] == 0x40
        assert scraped["cdc_sink_lag_seconds"] >= 60
    finally:
        heartbeats.free.set()
        other.join()


def test_closing_the_metrics_while_the_heartbeats_are_polled_leaves_them_to_the_poll(monkeypatch):
    """The job ends while a poll of the heartbeats waits on the broker: their client is closed
    once the poll is done with it, not under it; a scrape after that polls nothing."""
    metrics, heartbeats, other = _scraped_while_a_poll_waits(monkeypatch)
    try:
        metrics.close()
    finally:
        heartbeats.free.set()
        other.join()
    assert heartbeats.closed.wait(BROKER_S)
    assert not heartbeats.closed_while_polling
    polls = heartbeats.polls
    assert _scrape(metrics)["cdc_sink_lag_bytes"] == 0x40
    assert heartbeats.polls == polls
