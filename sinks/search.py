"""The search index: OpenSearch, one index per table, read through an alias named after its topic.

Written from the executors, one `_bulk` stream per Spark partition. Every document is
versioned by its commit LSN (`version_type=external_gte`), so a replayed or duplicated
batch changes nothing (OpenSearch answers 409, a skipped stale write). OpenSearch forgets
a deleted document's version after `index.gc_deletes` (60 s) and on a restart, so each
delete also writes a marker, the key at the delete's version, in the table's
`<alias>-markers` index; an upsert is sent only when no marker holds a higher position.
Markers live `[search] marker_ttl_s`. A truncate walks the table's documents (the
distribution may lack `_delete_by_query`) and deletes those below its position.
"""

from __future__ import annotations

import base64
import itertools
import logging
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import orjson
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F

from cdc.config import ConfigError, SearchConfig
from cdc.redact import display_url
from sinks.batch import ChangeBatch
from sinks.latest import COLUMNS, Change, last_changes
from sinks.search_shapes import (
    REBUILD_SUFFIX,
    Documents,
    alias_name,
    generation,
    index_name,
    mapping,
    markers_name,
    rebuild_alias,
)
from sinks.shapes import Registry, Version

log = logging.getLogger(__name__)

CHUNK_KEYS = 1000  # keys per marker look-up and per bulk round
RETRIES = 6
RETRIABLE = (429, 502, 503, 504)
MARKER_MAPPING = {"dynamic": "strict", "properties": {"at": {"type": "date", "format": "epoch_millis"}}}
META_INDEX_SUFFIX = "-msink"  # `-m`: never in an alias


class SearchUnavailable(Exception):
    """OpenSearch did not answer (or kept answering 429/5xx) through every retry: the batch fails."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem or message


@dataclass(frozen=True)
class Settings:
    """What an executor needs to write (picklable: it travels with the partition function)."""

    url: str
    username: str
    password: str
    tls_cafile: str
    refresh: str
    bulk_bytes: int
    marker_ttl_ms: int
    rebuild: bool = False  # write through the rebuild's aliases, not the readers'

    @classmethod
    def of(cls, config: SearchConfig, rebuild: bool = False) -> Settings:
        return cls(config.url, config.username, config.password, config.tls_cafile, config.refresh,
                   config.bulk_bytes, config.marker_ttl_s * 1000, rebuild)

    def target(self, alias: str) -> str:
        """Where the writes for the readers' `alias` go."""
        return rebuild_alias(alias) if self.rebuild else alias

    def client(self, retries: int = RETRIES) -> Client:
        return Client(self, retries)


class Client:
    """JSON over HTTP with keep-alive; connection errors, 429 and 502-504 are retried with
    backoff (0.5 s doubling to 10 s), then SearchUnavailable."""

    def __init__(self, settings: Settings, retries: int) -> None:
        import urllib3

        parts = urlsplit(settings.url)
        netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
        self.base: str = urlunsplit(parts._replace(netloc=netloc))
        self.where = f"OpenSearch at {display_url(settings.url)}"
        user = settings.username or (parts.username or "")
        password = settings.password or (parts.password or "")
        self.headers = {"Content-Type": "application/json"}
        if user or password:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
        self.retries = retries
        options: dict[str, Any] = {"timeout": urllib3.Timeout(connect=10, read=120), "retries": False, "maxsize": 2}
        if settings.tls_cafile:
            options["ca_certs"] = settings.tls_cafile
        self.pool = urllib3.PoolManager(**options)

    def request(self, method: str, path: str, body: Any = None, ndjson: bytes | None = None) -> tuple[int, Any]:
        """(status, decoded answer) of one request; statuses other than the retriable ones
        are the caller's to judge."""
        import urllib3

        headers = dict(self.headers)
        data = None
        if ndjson is not None:
            data, headers["Content-Type"] = ndjson, "application/x-ndjson"
        elif body is not None:
            data = orjson.dumps(body)
        delay = 0.5
        for attempt in itertools.count():
            try:
                resp = self.pool.request(method, self.base + path, body=data, headers=headers)
                if resp.status not in RETRIABLE:
                    return resp.status, orjson.loads(resp.data) if resp.data else None
                problem = f"HTTP {resp.status}"
            except urllib3.exceptions.HTTPError as exc:
                problem = str(exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc)
                problem = re.sub(r"^HTTPS?Connection\([^)]*\): (Failed to establish a new connection: )?", "", problem)
            if attempt >= self.retries:
                raise SearchUnavailable(f"{self.where}: {method} {path.split('?')[0]} failed: {problem}", problem)
            log.warning("%s: %s %s: %s; again in %.1f s", self.where, method, path.split("?")[0], problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def ok(self, method: str, path: str, body: Any = None, missing_ok: bool = False) -> Any:
        """The answer of a request that must succeed; None for a 404 when `missing_ok`."""
        status, answer = self.request(method, path, body)
        if status == 404 and missing_ok:
            return None
        if status >= 300:
            raise RuntimeError(f"{self.where}: {method} {path.split('?')[0]}: HTTP {status} {_reason(answer)}")
        return answer

    def close(self) -> None:
        self.pool.clear()


def _reason(answer: Any) -> str:
    """OpenSearch's own words for an error answer (or item)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        return f"{error.get('type')}: {error.get('reason')}"
    return str(error if error is not None else answer)[:300]


def _path(name: str) -> str:
    return quote(name, safe="")


def check_reachable(config: SearchConfig) -> None:
    """GET / of the cluster; a one-line error naming the fix when it does not answer."""
    client = Settings.of(config).client(retries=0)
    where = client.where
    try:
        status, answer = client.request("GET", "/")
    except SearchUnavailable as exc:
        first = exc.problem.splitlines()[0]
        raise ConfigError(f"cannot reach {where} ({first}): start it, or fix [search] url") from None
    finally:
        client.close()
    if status in (401, 403):
        raise ConfigError(f"{where} refused the credentials (HTTP {status}): fix [search] username and password")
    if status >= 300 or not isinstance(answer, dict) or "version" not in answer:
        raise ConfigError(f"{where} is not an OpenSearch REST endpoint (HTTP {status}): fix [search] url")


# --------------------------------------------------------------------------- bulk


@dataclass
class Action:
    """One `_bulk` action and its source, with where it came from (for dead letters)."""

    meta: dict[str, Any]
    source: dict[str, Any] | None
    origin: tuple[str, int, int] | None  # topic, partition, offset; None for a marker

    def lines(self) -> bytes:
        out = orjson.dumps(self.meta) + b"\n"
        return out + orjson.dumps(self.source) + b"\n" if self.source is not None else out


def versioned(op: str, index: str, key: str, version: int, alias: bool = True) -> dict[str, Any]:
    """An action at a version; to an alias only (`require_alias`): a write to a missing alias
    must fail, not create an index with a guessed mapping."""
    meta = {"_index": index, "_id": key, "version": version, "version_type": "external_gte"}
    return {op: {**meta, "require_alias": True} if alias else meta}


class Bulk:
    """Sends actions in `_bulk` requests of at most `bulk_bytes`, judging each item: 2xx done,
    409 a stale write skipped, 404 of a delete nothing to delete, 429/5xx sent again after
    a backoff, 400 (OpenSearch rejects the document: a mapping conflict) a dead letter,
    anything else fails the batch."""

    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.rejected: list[tuple[str, int, int, str]] = []  # topic, partition, offset, reason
        self.applied = 0

    def send(self, actions: list[Action]) -> None:
        delay = 0.5
        for attempt in itertools.count():
            retry: list[Action] = []
            for request in self._requests(actions):
                retry += self._judge(request)
            if not retry:
                return
            if attempt >= self.client.retries:
                raise SearchUnavailable(f"{self.client.where} kept refusing {len(retry)} writes with 429/5xx")
            time.sleep(delay)
            delay, actions = min(delay * 2, 10.0), retry

    def _requests(self, actions: list[Action]) -> Iterator[list[tuple[Action, bytes]]]:
        request: list[tuple[Action, bytes]] = []
        size = 0
        for action in actions:
            lines = action.lines()
            if request and size + len(lines) > self.settings.bulk_bytes:
                yield request
                request, size = [], 0
            request.append((action, lines))
            size += len(lines)
        if request:
            yield request

    def _judge(self, request: list[tuple[Action, bytes]]) -> list[Action]:
        query = f"?refresh={self.settings.refresh}" if self.settings.refresh in ("true", "wait_for") else ""
        status, answer = self.client.request("POST", f"/_bulk{query}", ndjson=b"".join(lines for _, lines in request))
        if status >= 300:
            raise RuntimeError(f"{self.client.where}: _bulk: HTTP {status} {_reason(answer)}")
        retry = []
        for (action, _), item in zip(request, answer["items"], strict=True):
            op, result = next(iter(item.items()))
            code = result["status"]
            if code < 300:
                self.applied += 1
            elif code == 409:  # a stale write, skipped
                continue
            elif code == 404 and op == "delete":
                continue
            elif code in RETRIABLE or code >= 500:
                retry.append(action)
            elif code == 400 and action.origin is not None:
                self.rejected.append((*action.origin, f"OpenSearch rejected the document: {_reason(result)}"))
            else:
                raise RuntimeError(
                    f"{self.client.where}: {op} of {result.get('_id')} in {result.get('_index')}: HTTP {code} "
                    f"{_reason(result)}"
                )
        return retry


def marker(alias: str, key: str, version: int, now_ms: int) -> Action:
    return Action(versioned("index", markers_name(alias), key, version, alias=False), {"at": now_ms}, None)


# --------------------------------------------------------------------------- executors


class PartitionWriter:
    """Writes one Spark partition's changes (runs on an executor); yields the records
    OpenSearch rejected: (topic, partition, offset, reason)."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry

    def __call__(self, rows: Iterable[Row]) -> Iterator[tuple[str, int, int, str]]:
        changes = last_changes(rows)
        first = next(changes, None)
        if first is None:  # most partitions of a batch hold other tables' records, or none
            return
        changes = itertools.chain([first], changes)
        documents = Documents(self.registry)
        client = self.settings.client()
        try:
            bulk = Bulk(client, self.settings)
            while chunk := list(itertools.islice(changes, CHUNK_KEYS)):
                bulk.send(self._actions(client, documents, chunk))
            yield from bulk.rejected
        finally:
            client.close()

    def _actions(self, client: Client, documents: Documents, chunk: list[tuple[str, Change]]) -> list[Action]:
        """The chunk's actions: one look-up of the markers (and of the documents the chunk
        needs: versions for tombstones without a position, unchanged TOASTed values)."""
        aliases = {topic: alias_name(topic) for topic in {t for t, _ in chunk}}
        targets = {topic: self.settings.target(alias) for topic, alias in aliases.items()}
        docs: list[dict[str, Any]] = []
        for topic, change in chunk:
            docs.append({"_index": markers_name(aliases[topic]), "_id": change.key, "_source": False})
            if change.missing or change.lsn is None:
                docs.append({"_index": targets[topic], "_id": change.key, "_source": list(change.missing) or False})
        found = iter(client.ok("POST", "/_mget", {"docs": docs})["docs"])
        now_ms = int(time.time() * 1000)
        actions = []
        for topic, change in chunk:
            held = next(found)
            doc = next(found) if change.missing or change.lsn is None else {}
            marked = held["_version"] if held.get("found") else None
            stored = doc["_version"] if doc.get("found") else None
            alias, target, origin = aliases[topic], targets[topic], (topic, change.partition, change.offset)
            if change.kind == "u":
                assert change.lsn is not None and change.row is not None
                if marked is not None and marked > change.lsn:
                    continue  # deleted at a later position: a replay must not bring it back
                source = documents.source(topic, change.lsn, change.row)
                for name in change.missing:  # unchanged TOASTed values: the indexed ones
                    source[name] = (doc.get("_source") or {}).get(name) if stored is not None else None
                actions.append(Action(versioned("index", target, change.key, change.lsn), source, origin))
                continue
            version = change.lsn
            if version is None:  # a tombstone whose d was compacted away: delete what is there
                if stored is None:
                    continue
                version = max(stored, marked or 0)
            actions.append(Action(versioned("delete", target, change.key, version), None, origin))
            actions.append(marker(alias, change.key, version, now_ms))
        return actions


# --------------------------------------------------------------------------- the store


class SearchStore:
    """Keeps one OpenSearch index per table equal to the source, every table of a micro-batch in one pass.

    The job keeps a document in `<prefix>-msink`: its batch count (written after each
    batch's writes, checked before the next one commits) and the aliases it filled. A
    count that is gone or behind (the indexes deleted, a cluster restored from an old
    snapshot), or an alias of the list that is gone, means lost writes: the job rebuilds
    the indexes from the topics.

    A rebuild (`rebuild`, `cdc search rebuild`) is the same job under its own name,
    checkpoint and document, filling the next generation of every table's index (hidden,
    behind the hidden `<alias>-rebuild`) while readers, and a running job, keep the
    current one; `swap` then moves the readers' aliases in one `_aliases` call."""

    def __init__(self, spark: SparkSession, config: SearchConfig, prefix: str, rebuild: bool = False) -> None:
        self.name = "search-rebuild" if rebuild else "search"
        self.spark = spark
        self.settings = Settings.of(config, rebuild)
        self.config = config
        self.prefix = prefix
        self.meta = alias_name(prefix) + META_INDEX_SUFFIX
        self.doc = "rebuild" if rebuild else "job"
        self.batches = 0
        self.filled: set[str] = set()  # the aliases this job has written to (kept in the meta document)
        self.mapped: dict[str, set[str]] = {}  # alias -> the fields its index maps
        self.flat = "flat_object"

    def _client(self) -> Client:
        return self.settings.client()

    def _held(self, client: Client) -> dict[str, Any] | None:
        status, answer = client.request("GET", f"/{_path(self.meta)}/_doc/{self.doc}")
        return answer["_source"] if status == 200 else None

    def _hold(self, client: Client) -> None:
        doc = {"count": self.batches, "indexes": sorted(self.filled)}
        client.ok("PUT", f"/{_path(self.meta)}/_doc/{self.doc}?refresh=false", doc)

    def start(self, resumed: bool) -> None:
        from sinks.job import StoreLost

        client = self._client()
        try:
            distribution = client.ok("GET", "/")["version"].get("distribution", "elasticsearch")
            self.flat = "flat_object" if distribution == "opensearch" else "flattened"
            self.mapped = {}  # read again: a failed batch may have met a changed cluster
            held = self._held(client)
            if held is None and resumed:
                raise StoreLost(f"{client.where} holds no trace of the batches this job committed")
            if held is None or not resumed:  # a new checkpoint: the indexes are filled from the earliest offsets
                self.batches, self.filled = 0, set()
                self._ensure_meta(client)
                if self.settings.rebuild:
                    self._drop_unfinished(client)
                self._hold(client)
            else:
                self.batches, self.filled = int(held["count"]), set(held["indexes"])
                behind = self._behind(client)
                gone = sorted(a for a in self.filled if self.settings.target(a) not in behind)
                if gone:
                    raise StoreLost(f"{client.where} lost the index behind {gone[0]}, which this job filled")
            self._expire_markers(client)
        finally:
            client.close()

    def done(self) -> None:
        from sinks.job import StoreLost

        client = self._client()
        try:
            held = self._held(client)
            if held is None or int(held["count"]) != self.batches:
                count = "no count" if held is None else f"a count of {int(held['count'])}"
                raise StoreLost(
                    f"{client.where} lost writes: it holds {count} of this job's batches, which wrote {self.batches}"
                )
            self.batches += 1
            self._hold(client)
        finally:
            client.close()

    def _behind(self, client: Client) -> dict[str, list[str]]:
        """The prefix's aliases (the rebuild's hidden ones too) -> the indexes behind each."""
        path = f"/_alias/{_path(alias_name(self.prefix))}.*?expand_wildcards=all"
        behind: dict[str, list[str]] = {}
        for index, entry in sorted((client.ok("GET", path, missing_ok=True) or {}).items()):
            for alias in entry.get("aliases", {}):
                behind.setdefault(alias, []).append(index)
        return behind

    def _drop_unfinished(self, client: Client) -> None:
        """A new rebuild: the indexes an earlier one left unswapped go (an index it swapped
        only loses the rebuild's alias)."""
        behind = self._behind(client)
        actions: list[dict[str, Any]] = []
        for alias, indexes in behind.items():
            readers = alias.removesuffix(REBUILD_SUFFIX)
            if readers == alias:
                continue
            for index in indexes:
                if index in behind.get(readers, []):
                    actions.append({"remove": {"index": index, "alias": alias}})
                else:
                    actions.append({"remove_index": {"index": index}})
                    log.info("%s: dropped %s, left by an unfinished rebuild", client.where, index)
        if actions:
            client.ok("POST", "/_aliases", {"actions": actions})

    def swap(self) -> list[tuple[str, list[str], str]]:
        """Point every alias this rebuild filled at its new index instead of the old ones, in
        one `_aliases` call: readers of the aliases see the old indexes or the new ones,
        never neither. The old ones are hidden first and dropped in `finish`, once the
        searches that started on them are over, so a wildcard search of the prefix meets
        each table once. (alias, old indexes, new index) of each alias moved."""
        client = self._client()
        try:
            behind = self._behind(client)
            actions: list[dict[str, Any]] = []
            moved = []
            for alias in sorted(self.filled):
                target = self.settings.target(alias)
                if len(behind.get(target, [])) != 1:  # deleted under it: a new rebuild starts over
                    from sinks.job import SinkStopped

                    raise SinkStopped(f"{client.where} lost {target}, the rebuild's index for {alias}; the current "
                                      "indexes are untouched: run `cdc search rebuild` again")
                (new,) = behind[target]
                old = [index for index in behind.get(alias, []) if index != new]
                if new in behind.get(alias, []) and not old:
                    continue  # swapped before (a resumed rebuild)
                actions.append({"add": {"index": new, "alias": alias}})
                actions += [{"remove": {"index": index, "alias": alias}} for index in old]
                moved.append((alias, old, new))
            for _, old, new in moved:
                client.ok("POST", f"/{_path(new)}/_refresh")  # searchable as it is at the swap
                for index in old:
                    client.ok("PUT", f"/{_path(index)}/_settings", {"index": {"hidden": True}})
            if actions:
                client.ok("POST", "/_aliases", {"actions": actions})
            for _, _, new in moved:
                self._show(client, new)
            return moved
        finally:
            client.close()

    @staticmethod
    def _show(client: Client, index: str) -> None:
        """A rebuilt index as the job's are: visible to wildcards, refreshed every second."""
        client.ok("PUT", f"/{_path(index)}/_settings", {"index": {"hidden": False, "refresh_interval": None}})

    def finish(self) -> None:
        """After the last pass: the rebuild's aliases, the tables' earlier generations and
        the rebuild's document go."""
        client = self._client()
        try:
            behind = self._behind(client)
            rebuilt = [(target, index) for target in map(self.settings.target, sorted(self.filled))
                       for index in behind.get(target, [])]
            for _, index in rebuilt:  # again: a rebuild may have stopped right after its swap
                self._show(client, index)
            actions: list[dict[str, Any]] = [{"remove": {"index": index, "alias": target}} for target, index in rebuilt]
            for alias in sorted(self.filled):
                there = client.ok("GET", f"/{_path(alias)}-v*?expand_wildcards=all", missing_ok=True) or {}
                actions += [{"remove_index": {"index": index}} for index in sorted(there)
                            if generation(alias, index) and index not in behind.get(alias, [])]
            if actions:
                client.ok("POST", "/_aliases", {"actions": actions})
            if self.filled:  # what the last pass wrote
                client.ok("POST", "/" + ",".join(_path(a) for a in sorted(self.filled)) + "/_refresh")
            client.request("DELETE", f"/{_path(self.meta)}/_doc/{self.doc}")
        finally:
            client.close()

    def documents(self, aliases: list[str]) -> dict[str, int]:
        """How many documents the index behind each alias holds (as of its last refresh)."""
        client = self._client()
        try:
            return {alias: int(client.ok("GET", f"/{_path(alias)}/_count")["count"]) for alias in aliases}
        finally:
            client.close()

    def _ensure_meta(self, client: Client) -> None:
        body = {"settings": {"index": {"number_of_shards": 1, "number_of_replicas": self.config.replicas,
                                       "hidden": True}},
                "mappings": {"dynamic": "strict", "properties": {
                    "count": {"type": "long"}, "indexes": {"type": "keyword"}}}}
        _create(client, self.meta, body)

    def _expire_markers(self, client: Client) -> None:
        """Delete the prefix's markers older than marker_ttl_s (at start: they age in days)."""
        pattern = _path(alias_name(self.prefix) + ".*-markers")
        cutoff = int(time.time() * 1000) - self.settings.marker_ttl_ms
        query = {"query": {"range": {"at": {"lt": cutoff}}}, "_source": False, "size": CHUNK_KEYS}
        expired = 0
        for hits in _scroll(client, f"/{pattern}/_search?expand_wildcards=all", query):
            lines = b"".join(orjson.dumps({"delete": {"_index": h["_index"], "_id": h["_id"]}}) + b"\n" for h in hits)
            client.request("POST", "/_bulk", ndjson=lines)
            expired += len(hits)
        if expired:
            log.info("%s: %d delete markers older than %d s expired", client.where, expired,
                     self.settings.marker_ttl_ms // 1000)

    def ensure_index(self, client: Client, topic: str, version: Version) -> None:
        """The table's index behind the alias the job writes through, and its markers;
        fields of new columns added."""
        from sinks.job import StoreLost

        alias = alias_name(topic)
        target = self.settings.target(alias)
        fields = mapping(version, self.flat)["properties"]
        if alias not in self.mapped:
            answer = client.ok("GET", f"/{_path(target)}/_mapping", missing_ok=True)
            if answer is None and alias in self.filled:
                raise StoreLost(f"{client.where} lost the index behind {target}, which this job filled")
            self.filled.add(alias)
            if answer is None:
                self._create_index(client, alias, version)
                self.mapped[alias] = set(fields)
                return
            (concrete,) = answer.values()
            self.mapped[alias] = set(concrete["mappings"].get("properties", {}))
        new = {name: spec for name, spec in fields.items() if name not in self.mapped[alias]}
        if new:  # ADD COLUMN; a column whose type changed keeps its mapping (a rebuild adopts it)
            client.ok("PUT", f"/{_path(target)}/_mapping", {"properties": new})
            self.mapped[alias] |= set(new)
            log.info("%s: %s maps the new columns %s", client.where, target, ", ".join(new))

    def _create_index(self, client: Client, alias: str, version: Version) -> None:
        """The job's first index of a table, `<alias>-v1`; a rebuild's, the generation after
        every one there is, hidden with its alias until the swap."""
        settings: dict[str, Any] = {"number_of_shards": self.config.shards, "number_of_replicas": self.config.replicas}
        _create(client, markers_name(alias), {"settings": {"index": {**settings, "hidden": True}},
                                              "mappings": MARKER_MAPPING})
        if self.settings.rebuild:
            there = client.ok("GET", f"/{_path(alias)}-v*?expand_wildcards=all", missing_ok=True) or {}
            index = index_name(alias, max([1, *(generation(alias, name) for name in there)]) + 1)
            # nobody searches it before the swap: no refreshes while it fills (fewer, larger segments)
            body = {"settings": {"index": {**settings, "hidden": True, "refresh_interval": "-1"}},
                    "aliases": {rebuild_alias(alias): {"is_hidden": True}}}
        else:
            index = index_name(alias)
            body = {"settings": {"index": settings}, "aliases": {alias: {}}}
        _create(client, index, {**body, "mappings": mapping(version, self.flat)})
        log.info("%s: created index %s behind alias %s", client.where, index, self.settings.target(alias))

    def apply_changes(self, batch: ChangeBatch) -> DataFrame | None:
        registry, topics = batch.registry, batch.topics
        client = self._client()
        try:
            for topic in topics:
                self.ensure_index(client, topic, registry.versions(topic)[-1])
            for topic, truncates in batch.truncates.items():
                if truncates:
                    self._truncate(client, topic, truncates[-1][0])
        finally:
            client.close()
        # a key's changes meet in one Spark partition, in offset order (sinks.latest)
        rejected = batch.changes().select(*COLUMNS).rdd.mapPartitions(PartitionWriter(self.settings, registry)).collect()
        if self.settings.refresh == "batch" and topics and not self.settings.rebuild:  # searchable at the commit
            client = self._client()
            try:
                self.refresh(client, topics)
            finally:
                client.close()
        if not rejected:
            return None
        reasons = self.spark.createDataFrame(
            rejected, "_cdc_topic string, _cdc_partition int, _cdc_offset long, _reason string"
        )
        return (batch.rows.join(reasons, ["_cdc_topic", "_cdc_partition", "_cdc_offset"])
                .withColumn("_cdc_error", F.col("_reason")).drop("_reason"))

    @staticmethod
    def refresh(client: Client, topics: list[str]) -> None:
        """Make what was written to the tables' indexes searchable."""
        client.ok("POST", "/" + ",".join(_path(alias_name(t)) for t in topics) + "/_refresh")

    def _truncate(self, client: Client, topic: str, lsn: int) -> None:
        """Delete every document of the table below the truncate's commit LSN, with markers
        (walking the index: no `_delete_by_query` needed)."""
        alias = alias_name(topic)
        target = self.settings.target(alias)
        bulk = Bulk(client, self.settings)
        query = {"query": {"match_all": {}}, "_source": False, "version": True, "size": CHUNK_KEYS, "sort": ["_doc"]}
        now_ms = int(time.time() * 1000)
        for hits in _scroll(client, f"/{_path(target)}/_search", query):
            actions = []
            for hit in hits:
                if hit["_version"] < lsn:
                    actions += [Action(versioned("delete", target, hit["_id"], lsn), None, None),
                                marker(alias, hit["_id"], lsn, now_ms)]
            bulk.send(actions)
        log.info("%s: truncate of %s deleted %d documents", client.where, target, bulk.applied // 2)


def _create(client: Client, name: str, body: dict[str, Any]) -> None:
    status, answer = client.request("PUT", f"/{_path(name)}", body)
    if status >= 300 and "resource_already_exists" not in _reason(answer):
        raise RuntimeError(f"{client.where}: cannot create index {name}: HTTP {status} {_reason(answer)}")


def _scroll(client: Client, path: str, query: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """The hits of a search, a page at a time (the scroll API: every distribution has it)."""
    joiner = "&" if "?" in path else "?"
    answer = client.ok("POST", f"{path}{joiner}scroll=1m", query, missing_ok=True)
    if answer is None:
        return
    scroll_id = answer.get("_scroll_id")
    try:
        while hits := answer["hits"]["hits"]:
            yield hits
            answer = client.ok("POST", "/_search/scroll", {"scroll": "1m", "scroll_id": scroll_id})
            scroll_id = answer.get("_scroll_id", scroll_id)
    finally:
        if scroll_id:
            client.request("DELETE", "/_search/scroll", {"scroll_id": scroll_id})
