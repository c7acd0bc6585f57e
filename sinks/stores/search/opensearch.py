"""OpenSearch's REST API as the search store uses it: JSON over HTTP with retries, `_bulk`
with per-item judgement, scrolling, index creation. Knows nothing of tables or events.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import orjson

from cdc.config import ConfigError
from cdc.redact import display_url
from sinks.store import StoreUnavailable
from sinks.stores.search import SearchConfig

log = logging.getLogger(__name__)

RETRIES = 6
RETRIABLE = (429, 502, 503, 504)


class SearchUnavailable(StoreUnavailable):
    """OpenSearch did not answer (or kept answering 429/5xx) through every retry: the batch fails."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem or message


class NotOpenSearch(Exception):
    """An answer that is not OpenSearch's JSON (a proxy's or a load balancer's page)."""


@dataclass(frozen=True)
class Endpoint:
    """Where OpenSearch is and how to log in (picklable: executors open their own clients)."""

    url: str
    username: str = ""
    password: str = ""
    tls_cafile: str = ""

    @classmethod
    def of(cls, config: SearchConfig) -> Endpoint:
        return cls(config.url, config.username, config.password, config.tls_cafile)

    @property
    def where(self) -> str:
        return f"OpenSearch at {display_url(self.url)}"

    def client(self, retries: int = RETRIES) -> Client:
        return Client(self, retries)


class Client:
    """JSON over HTTP with keep-alive; connection errors, 429 and 502-504 are retried with
    backoff (0.5 s doubling to 10 s), then SearchUnavailable."""

    def __init__(self, endpoint: Endpoint, retries: int) -> None:
        import urllib3

        parts = urlsplit(endpoint.url)
        netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        self.base: str = urlunsplit(parts._replace(netloc=netloc))
        self.where = endpoint.where
        user = endpoint.username or (parts.username or "")
        password = endpoint.password or (parts.password or "")
        self.headers = {"Content-Type": "application/json"}
        if user or password:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
        self.retries = retries
        options: dict[str, Any] = {"timeout": urllib3.Timeout(connect=10, read=120), "retries": False, "maxsize": 2}
        if endpoint.tls_cafile:
            options["ca_certs"] = endpoint.tls_cafile
        self.pool = urllib3.PoolManager(**options)

    def request(
        self, method: str, path: str, body: Any = None, ndjson: bytes | None = None, retries: int | None = None,
    ) -> tuple[int, Any]:
        """(status, decoded answer) of one request; statuses other than the retriable ones
        are the caller's to judge. An answer that is not JSON raises NotOpenSearch. `retries`:
        this request's (the client's by default; 0 for a caller that retries, or gives up, itself)."""
        import urllib3

        headers = dict(self.headers)
        data = None
        if ndjson is not None:
            data, headers["Content-Type"] = ndjson, "application/x-ndjson"
        elif body is not None:  # packed already (bytes), or to be
            data = body if isinstance(body, bytes) else orjson.dumps(body)
        delay = 0.5
        for attempt in itertools.count():
            try:
                resp = self.pool.request(method, self.base + path, body=data, headers=headers)
                if resp.status not in RETRIABLE:
                    return resp.status, self._decoded(resp, method, path)
                problem = f"HTTP {resp.status}"
            except urllib3.exceptions.HTTPError as exc:
                problem = str(exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc)
                problem = re.sub(r"^HTTPS?Connection\([^)]*\): (Failed to establish a new connection: )?", "", problem)
            if attempt >= (self.retries if retries is None else retries):
                raise SearchUnavailable(f"{self.where}: {method} {path.split('?')[0]} failed: {problem}", problem)
            log.warning("%s: %s %s: %s; again in %.1f s", self.where, method, path.split("?")[0], problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def _decoded(self, resp: Any, method: str, path: str) -> Any:
        if not resp.data:
            return None
        try:
            return orjson.loads(resp.data)
        except orjson.JSONDecodeError:
            kind = resp.headers.get("Content-Type", "no content type").split(";")[0]
            raise NotOpenSearch(
                f"{self.where} answered {method} {path.split('?')[0]} with HTTP {resp.status} and {kind}, not "
                "OpenSearch's JSON: point [search] url at OpenSearch's REST endpoint (not a proxy's or a login page)"
            ) from None

    def ok(self, method: str, path: str, body: Any = None, missing_ok: bool = False) -> Any:
        """The answer of a request that must succeed; None for a 404 when `missing_ok`."""
        status, answer = self.request(method, path, body)
        if status == 404 and missing_ok:
            return None
        if status >= 300:
            shown = path.split("?")[0]
            if len(shown) > 200:  # a request naming hundreds of indexes
                shown = f"{shown[:200]}... ({len(shown):,} bytes)"
            raise RuntimeError(f"{self.where}: {method} {shown}: HTTP {status} {reason(answer)}")
        return answer

    def close(self) -> None:
        self.pool.clear()


def reason(answer: Any) -> str:
    """OpenSearch's own words for an error answer (or item)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        return f"{error.get('type')}: {error.get('reason')}"
    return str(error if error is not None else answer)[:300]


def path_of(name: str) -> str:
    """An index or alias name as a URL path segment."""
    return quote(name, safe="")


#: OpenSearch refuses a request line over 4 KB (`http.max_initial_line_length`): a request that
#: names many indexes is split to stay below this many bytes of names
NAMES_BYTES = 3072


def refresh(client: Client, names: list[str]) -> None:
    """Make what was written to the indexes or aliases `names` searchable: one `_refresh` per
    run of names that fits a request line (a batch of hundreds of tables names them all)."""
    run: list[str] = []
    size = 0  # of ",".join(run)
    for name in [path_of(n) for n in names]:
        if run and size + 1 + len(name) > NAMES_BYTES:
            client.ok("POST", "/" + ",".join(run) + "/_refresh")
            run, size = [], -1
        run.append(name)
        size += 1 + len(name)
    if run:
        client.ok("POST", "/" + ",".join(run) + "/_refresh")


def check_reachable(config: SearchConfig) -> None:
    """GET / of the cluster; a one-line error naming the fix when it does not answer."""
    client = Endpoint.of(config).client(retries=0)
    where = client.where
    try:
        status, answer = client.request("GET", "/")
    except SearchUnavailable as exc:
        first = exc.problem.splitlines()[0]
        raise ConfigError(f"cannot reach {where} ({first}): start it, or fix [search] url") from None
    except NotOpenSearch as exc:
        raise ConfigError(str(exc)) from None
    finally:
        client.close()
    if status in (401, 403):
        raise ConfigError(f"{where} refused the credentials (HTTP {status}): fix [search] username and password")
    if status >= 300 or not isinstance(answer, dict) or "version" not in answer:
        raise ConfigError(f"{where} is not an OpenSearch REST endpoint (HTTP {status}): fix [search] url")


@dataclass(slots=True)
class Action:
    """One `_bulk` action as its lines (the action, then its source unless a delete), with
    where it came from (for dead letters)."""

    lines: bytes
    origin: tuple[str, int, int] | None  # topic, partition, offset; None for a marker


def versioned(op: str, index: str, key: str, version: int, alias: bool = True) -> bytes:
    """An action's line at a version; to an alias only (`require_alias`): a write to a missing
    alias must fail, not create an index with a guessed mapping."""
    return b'{"%b":{"_index":%b,"_id":%b,"version":%d,"version_type":"external_gte"%b}}\n' % (
        op.encode(), orjson.dumps(index), orjson.dumps(key), version, b',"require_alias":true' if alias else b"",
    )


class Bulk:
    """Sends actions in `_bulk` requests of at most `bulk_bytes`, judging each item: 2xx done,
    409 a stale write skipped, 404 of a delete nothing to delete, 429/5xx sent again after
    a backoff, 400 (OpenSearch rejects the document: a mapping conflict) a dead letter,
    anything else fails the batch. A request refused whole (no answer, 429/5xx) is sent again
    in the same rounds: one backoff and one count of the client's retries for both, not a
    request's retries inside each round (which multiplied them)."""

    #: what an item's judgement needs of OpenSearch's answer (the rest is not sent, nor parsed)
    ANSWER = "filter_path=errors,items.*.status,items.*.error,items.*._id,items.*._index"

    def __init__(self, client: Client, bulk_bytes: int, refresh: str = "false") -> None:
        self.client = client
        self.bulk_bytes = bulk_bytes
        self.refresh = refresh
        self.rejected: list[tuple[str, int, int, str]] = []  # topic, partition, offset, reason

    def send(self, actions: list[Action]) -> None:
        delay = 0.5
        for attempt in itertools.count():
            retry: list[Action] = []
            refused: SearchUnavailable | None = None
            for request in self._requests(actions):
                try:
                    retry += self._judge(request)
                except SearchUnavailable as exc:
                    refused = exc
                    retry += request
            if not retry:
                return
            if attempt >= self.client.retries:
                if refused is not None:
                    raise refused
                raise SearchUnavailable(f"{self.client.where} kept refusing {len(retry)} writes with 429/5xx")
            if refused is not None:
                log.warning("%s: POST /_bulk: %s; again in %.1f s", self.client.where, refused.problem, delay)
            time.sleep(delay)
            delay, actions = min(delay * 2, 10.0), retry

    def _requests(self, actions: list[Action]) -> Iterator[list[Action]]:
        request: list[Action] = []
        size = 0
        for action in actions:
            if request and size + len(action.lines) > self.bulk_bytes:
                yield request
                request, size = [], 0
            request.append(action)
            size += len(action.lines)
        if request:
            yield request

    def _judge(self, request: list[Action]) -> list[Action]:
        query = f"&refresh={self.refresh}" if self.refresh in ("true", "wait_for") else ""
        status, answer = self.client.request("POST", f"/_bulk?{self.ANSWER}{query}",
                                             ndjson=b"".join(action.lines for action in request), retries=0)
        if status >= 300:
            raise RuntimeError(f"{self.client.where}: _bulk: HTTP {status} {reason(answer)}")
        if answer.get("errors") is False:
            return []
        retry = []
        for action, item in zip(request, answer["items"], strict=True):
            op, result = next(iter(item.items()))
            code = result["status"]
            if code < 300 or code == 409 or (code == 404 and op == "delete"):
                continue  # done; a stale write skipped; nothing to delete
            if code in RETRIABLE or code >= 500:
                retry.append(action)
            elif code == 400 and action.origin is not None:
                self.rejected.append((*action.origin, f"OpenSearch rejected the document: {reason(result)}"))
            else:
                raise RuntimeError(
                    f"{self.client.where}: {op} of {result.get('_id')} in {result.get('_index')}: HTTP {code} "
                    f"{reason(result)}"
                )
        return retry


@dataclass(frozen=True)
class ShardRoom:
    """What the cluster's shard limit leaves: `cluster.max_shards_per_node` on each data
    node, against the shards of its open indexes (replicas included, assigned or not),
    which is what OpenSearch checks every index creation against."""

    per_node: int
    nodes: int
    open: int

    @property
    def free(self) -> int:
        return max(0, self.per_node * self.nodes - self.open)


SHARD_LIMIT = "cluster.max_shards_per_node"


def shard_room(client: Client) -> ShardRoom:
    settings = client.ok("GET", "/_cluster/settings?include_defaults=true&flat_settings=true")
    per_node = next(
        (int(settings[level][SHARD_LIMIT]) for level in ("transient", "persistent", "defaults")
         if SHARD_LIMIT in settings.get(level, {})),
        1000,
    )
    health = client.ok("GET", "/_cluster/health")
    opened = int(health["active_shards"]) + int(health["initializing_shards"]) + int(health["unassigned_shards"])
    return ShardRoom(per_node, int(health["number_of_data_nodes"]), opened)


def create_index(client: Client, name: str, body: dict[str, Any]) -> None:
    """Create an index (or nothing, when it is there)."""
    status, answer = client.request("PUT", f"/{path_of(name)}", body)
    if status >= 300 and "resource_already_exists" not in reason(answer):
        raise RuntimeError(f"{client.where}: cannot create index {name}: HTTP {status} {reason(answer)}")


def scroll(client: Client, path: str, query: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """The hits of a search, a page at a time (the scroll API: every distribution has it). A
    scroll OpenSearch no longer has (it restarted, or the reader spent over a minute on a page,
    waiting on OpenSearch itself) is SearchUnavailable: the caller's batch is read again."""
    joiner = "&" if "?" in path else "?"
    answer = client.ok("POST", f"{path}{joiner}scroll=1m", query, missing_ok=True)
    if answer is None:
        return
    scroll_id = answer.get("_scroll_id")
    try:
        while hits := answer["hits"]["hits"]:
            yield hits
            status, answer = client.request("POST", "/_search/scroll", {"scroll": "1m", "scroll_id": scroll_id})
            if status == 404:
                problem = f"HTTP 404 {reason(answer)}"
                raise SearchUnavailable(f"{client.where}: the scroll over {path.split('?')[0]} is gone ({problem})",
                                        problem)
            if status >= 300:
                raise RuntimeError(f"{client.where}: POST /_search/scroll: HTTP {status} {reason(answer)}")
            scroll_id = answer.get("_scroll_id", scroll_id)
    finally:
        if scroll_id:  # one try: the scroll expires by itself in a minute, and a scroll that failed for want
            # of an answer (or whose reader did) must not wait out the client's retries a second time here
            with contextlib.suppress(SearchUnavailable, NotOpenSearch):
                client.request("DELETE", "/_search/scroll", {"scroll_id": scroll_id}, retries=0)
