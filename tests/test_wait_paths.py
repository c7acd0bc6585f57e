"""The sink jobs' waits on a server inside a wait, or a recovery, on the same server: a rebuild's
progress write, a retry inside a retry, a scroll's clean-up after it failed. Stand-ins for the
job, the store and the HTTP pool under the OpenSearch client: a real server cannot fail at
exactly these moments on demand."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from kafka.errors import KafkaTimeoutError

import sinks.opensearch as opensearch
import sinks.runner as runner
from cdc.config import Config
from sinks.opensearch import Action, Bulk, Endpoint, SearchUnavailable, scroll
from sinks.pipeline import Progress
from sinks.store import SinkStopped, StoreLost, StoreUnavailable


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
    monkeypatch.setattr(runner.time, "sleep", lambda _: None)
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
    """The HTTP pool's stand-in under sinks.opensearch.Client: `answer(method, path)` says what
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
    slept: list[float] = []
    monkeypatch.setattr(opensearch.time, "sleep", slept.append)
    client = Endpoint("http://search.invalid:9200").client()
    client.pool = _Pool(answer)
    return client, client.pool, slept


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
