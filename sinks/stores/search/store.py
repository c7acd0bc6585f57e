"""The search index: OpenSearch, one index per table, read through an alias named after its topic.

Written from the executors (sinks.rows), one `_bulk` stream per chunk of last changes.
Every document is versioned by its commit LSN (`version_type=external_gte`), so a replayed
or duplicated batch changes nothing (OpenSearch answers 409, a skipped stale write), and
carries its full position in `_cdc_pos` (stored, out of `_source`), which a truncate
compares. OpenSearch forgets a deleted document's version after `index.gc_deletes` (60 s)
and on a restart, so each delete also writes a marker, the key at the delete's position, in
the table's `<alias>-markers` index; an upsert is sent only when no marker holds its
position or a later one. Markers live `[search] marker_ttl_s`. The job's bookkeeping is a
document in `<prefix>-msink`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from cdc.config import Config, ConfigError
from sinks.json_columns import compact_json, concatenated, json_strings
from sinks.rows import CHUNK_KEYS, Rejected, RowStore, RowWriter
from sinks.store import SinkStopped, StoreLost
from sinks.stores.search import SearchConfig
from sinks.stores.search.opensearch import (
    SHARD_LIMIT,
    Action,
    Bulk,
    Client,
    Endpoint,
    check_reachable,
    create_index,
    path_of,
    reason,
    refresh,
    scroll,
    shard_room,
    versioned,
)
from sinks.stores.search.shapes import (
    POSITION,
    REBUILD_SUFFIX,
    TABLE,
    Documents,
    alias_name,
    filtered,
    generation,
    index_name,
    mapping,
    markers_name,
    pack,
    rebuild_alias,
    shared_markers,
    shared_name,
    shared_place,
)
from sinks.versions import Registry, Version

if TYPE_CHECKING:
    from sinks.query import StopSignal

log = logging.getLogger(__name__)

MARKER_MAPPING = {"dynamic": "strict", "properties": {
    "at": {"type": "date", "format": "epoch_millis"}, "pos": {"type": "keyword"},
}}
META_INDEX_SUFFIX = "-msink"  # `-m`: never in an alias


@dataclass(frozen=True)
class Settings:
    """What an executor needs to write (picklable: it travels with the partition function)."""

    endpoint: Endpoint
    refresh: str
    bulk_bytes: int
    marker_ttl_ms: int
    base: str  # the prefix's alias: the shared indexes' and markers' names start with it
    shared: bool = False  # tables packed into shared indexes ([search] tables_per_index > 1)
    rebuild: bool = False  # write through the rebuild's aliases, not the readers'

    @classmethod
    def of(cls, config: SearchConfig, prefix: str, rebuild: bool = False) -> Settings:
        return cls(Endpoint.of(config), config.refresh, config.bulk_bytes, config.marker_ttl_s * 1000,
                   alias_name(prefix), config.tables_per_index > 1, rebuild)

    def target(self, alias: str) -> str:
        """Where the writes for the readers' `alias` go."""
        return rebuild_alias(alias) if self.rebuild else alias

    def doc_id(self, alias: str, key: str) -> str:
        """A row's `_id`: its key's JSON, after its table's alias in a shared index."""
        return f"{alias}:{key}" if self.shared else key

    def markers(self, alias: str) -> str:
        """Where the table's delete markers are."""
        return shared_markers(self.base) if self.shared else markers_name(alias)

    def client(self) -> Client:
        return self.endpoint.client()

    def bulk(self, client: Client) -> Bulk:
        return Bulk(client, self.bulk_bytes, self.refresh)


def key_of(alias: str, doc_id: str) -> str:
    """The key of a document of the table `alias`, whichever layout holds it (a key's JSON
    starts with `{`, an alias never does)."""
    return doc_id.removeprefix(f"{alias}:")


def marker(index: str, doc_id: str, version: int, pos: str, now_ms: int) -> Action:
    return Action(versioned("index", index, doc_id, version, alias=False)
                  + orjson.dumps({"at": now_ms, "pos": pos}) + b"\n", None)


def _stored_position(doc: dict[str, Any]) -> str:
    """A document's position as `_mget` or a search returns it (stored_fields)."""
    return (doc.get("fields") or {}).get(POSITION, [""])[0]


class SearchWriter(RowWriter):
    """Writes last changes as versioned `_bulk` actions (runs on the executors, and on the
    driver for a truncate)."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.documents = Documents(registry)
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        assert self._client is not None, "open() the writer first"
        return self._client

    def open(self) -> None:
        self._client = self.settings.client()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def held(self, topic: str, keys: list[str], columns: set[str]) -> list[dict[str, Any] | None]:
        alias = alias_name(topic)
        target = self.settings.target(alias)
        docs = [{"_index": target, "_id": self.settings.doc_id(alias, key), "_source": sorted(columns)} for key in keys]
        found = self.client.ok("POST", "/_mget", {"docs": docs})["docs"]
        return [doc.get("_source") if doc.get("found") else None for doc in found]

    def write(self, changes: pa.Table) -> list[Rejected]:
        bulk = self.settings.bulk(self.client)
        for actions in self._actions(changes):
            bulk.send(actions)
        return bulk.rejected

    #: what `_actions` reads of each `_mget` answer (the rest is not sent, nor parsed)
    LOOKUP = "/_mget?filter_path=docs.found,docs._version,docs._source,docs.fields,docs.error"

    def _actions(self, changes: pa.Table) -> Iterator[list[Action]]:
        """The actions of `changes` (sinks.latest.LAST), CHUNK_KEYS changes at a time, each
        chunk after one look-up of its markers (and, after them, of the documents that
        tombstones without a position delete). The look-ups, and the upserts of tables whose
        rows need no converting, are packed column by column for all of `changes` first."""
        topics, keys, kinds, lsns, positions, partitions, offsets = (
            changes[name].to_pylist() for name in ("topic", "key", "kind", "lsn", "pos", "partition", "offset")
        )
        names = sorted(set(topics))
        aliases = {topic: alias_name(topic) for topic in names}
        targets = {topic: self.settings.target(alias) for topic, alias in aliases.items()}
        which = pc.index_in(changes["topic"], value_set=pa.array(names, pa.string()))

        def per_topic(value: dict[str, bytes]) -> pa.ChunkedArray:
            """Each change's topic's bytes in `value`."""
            return pc.take(pa.array([value[topic] for topic in names], pa.binary()), which)

        def per_topic_json(value: dict[str, str]) -> pa.ChunkedArray:
            return per_topic({topic: orjson.dumps(text) for topic, text in value.items()})

        shared = self.settings.shared
        doc_ids = pc.binary_join_element_wise(
            per_topic({t: a.encode() for t, a in aliases.items()}), changes["key"].cast(pa.binary()), b":",
        ) if shared else changes["key"]
        ids = json_strings(doc_ids)
        lookups = pc.binary_join_element_wise(
            b',{"_index":', per_topic_json({t: self.settings.markers(a) for t, a in aliases.items()}), b',"_id":', ids,
            b',"_source":["pos"]}', b"",
        )
        rows = compact_json(changes["row"])
        plain = pc.and_(
            pc.is_in(changes["topic"], value_set=pa.array([t for t in names if self.documents.plain(t)], pa.string())),
            pc.fill_null(pc.greater(pc.binary_length(rows), 2), False),
        )
        upserts = pc.if_else(plain, pc.binary_join_element_wise(
            b'{"index":{"_index":', per_topic_json(targets), b',"_id":', ids, b',"version":',
            pc.cast(pc.cast(changes["lsn"], pa.string()), pa.binary()),
            b',"version_type":"external_gte","require_alias":true}}\n', pc.binary_slice(rows, 0, -1),
            b',"%b":"' % POSITION.encode(), changes["pos"].cast(pa.binary()), b'"',
            per_topic({t: b',"%b":%b' % (TABLE.encode(), orjson.dumps(a)) for t, a in aliases.items()})
            if shared else b"", b"}\n", b"",
        ), pa.scalar(None, pa.binary())).to_pylist()
        row_texts = rows.to_pylist() if None in upserts else []
        for start in range(0, len(topics), CHUNK_KEYS):
            stop = min(len(topics), start + CHUNK_KEYS)
            lone = [i for i in range(start, stop) if lsns[i] is None]  # tombstones without a position
            docs = b"".join(
                b',{"_index":%b,"_id":%b,"_source":false,"stored_fields":["%b"]}'
                % (orjson.dumps(targets[topics[i]]), orjson.dumps(self.settings.doc_id(aliases[topics[i]], keys[i])),
                   POSITION.encode()) for i in lone
            )
            body = b'{"docs":[' + (concatenated(lookups.slice(start, stop - start)) + docs)[1:] + b"]}"
            found = self.client.ok("POST", self.LOOKUP, body)["docs"]
            held = dict(zip(lone, found[stop - start:], strict=True))
            now_ms = int(time.time() * 1000)
            actions = []
            for i, marker_doc in zip(range(start, stop), found, strict=False):
                topic, key, kind, lsn, pos = topics[i], keys[i], kinds[i], lsns[i], positions[i]
                marked = (marker_doc["_version"], marker_doc["_source"]["pos"]) if marker_doc.get("found") else None
                target, origin = targets[topic], (topic, partitions[i], offsets[i])
                doc_id = self.settings.doc_id(aliases[topic], key)
                if kind == "u":
                    if marked is not None and marked[1] >= pos:
                        continue  # deleted at this position or a later one: a replay must not bring it back
                    lines = upserts[i]
                    if lines is None:  # a row with columns to convert
                        source = self.documents.source(topic, lsn, orjson.loads(row_texts[i]), pos)
                        if shared:
                            source[TABLE] = aliases[topic]
                        lines = versioned("index", target, doc_id, lsn) + orjson.dumps(source) + b"\n"
                    actions.append(Action(lines, origin))
                    continue
                version = lsn
                if version is None:  # a tombstone whose d was compacted away: delete what is there
                    doc = held[i]
                    if not doc.get("found"):
                        continue
                    version, pos = max((doc["_version"], _stored_position(doc)), marked or (0, ""))
                actions.append(Action(versioned("delete", target, doc_id, version), origin))
                actions.append(marker(self.settings.markers(aliases[topic]), doc_id, version, pos, now_ms))
            yield actions

    def positions(self, topic: str) -> Iterator[list[tuple[str, str]]]:
        alias = alias_name(topic)
        query = {"query": {"match_all": {}}, "_source": False, "stored_fields": [POSITION], "size": CHUNK_KEYS,
                 "sort": ["_doc"]}
        for hits in scroll(self.client, f"/{path_of(self.settings.target(alias))}/_search", query):
            yield [(key_of(alias, hit["_id"]), _stored_position(hit)) for hit in hits]


class SearchStore(RowStore):
    """Keeps one OpenSearch index per table equal to the source, every table of a micro-batch in one pass.

    The job's bookkeeping (sinks.store) is a document in `<prefix>-msink`, with the aliases
    it filled: one of them gone means lost writes, and the job rebuilds the indexes from
    the topics.

    A rebuild (`rebuild`, `cdc search rebuild`) is the same job under its own name,
    checkpoint and document, filling the next generation of every table's index (hidden,
    behind the hidden `<alias>-rebuild`) while readers, and a running job, keep the
    current one; `swap` then moves the readers' aliases in one `_aliases` call."""

    transient = ("sinks.stores.search.opensearch.SearchUnavailable",)

    def __init__(self, config: SearchConfig, prefix: str, rebuild: bool = False) -> None:
        self.name = "search-rebuild" if rebuild else "search"
        self.settings = Settings.of(config, prefix, rebuild)
        self.where = self.settings.endpoint.where
        self.config = config
        self.prefix = prefix
        self.meta = alias_name(prefix) + META_INDEX_SUFFIX
        self.doc = "rebuild" if rebuild else "job"
        self.filled: set[str] = set()  # the aliases this job has written to (kept in its bookkeeping)
        self.mapped: dict[str, set[str]] = {}  # alias -> the fields its index maps
        self.shared: dict[str, set[str]] = {}  # a shared index -> its fields (each of its aliases' `mapped`)
        self.placed: dict[str, str] = {}  # a new table's alias -> the shared index it joins
        self.flat = "flat_object"

    def _client(self) -> Client:
        return self.settings.client()

    def open(self, resumed: bool) -> None:
        client = self._client()
        try:
            distribution = client.ok("GET", "/")["version"].get("distribution", "elasticsearch")
            self.flat = "flat_object" if distribution == "opensearch" else "flattened"
            self.mapped, self.shared = {}, {}  # read again: a failed batch may have met a changed cluster
            self._ensure_meta(client)
            record = self._record(client)
            if record is None or not resumed:  # a new checkpoint: the indexes are filled from the earliest offsets
                self.filled = set()
                if self.settings.rebuild:
                    behind = self._drop_unfinished(client)  # the readers' aliases stay as they were
                    readers = sorted(a for a in behind if not a.endswith(REBUILD_SUFFIX))
                    per_index = self.config.tables_per_index
                    self._room_for(client, readers, -(-len(readers) // per_index), "a rebuild's new generation of")
            else:
                self.filled = set(record.get("indexes", []))
                behind = self._behind(client)
                gone = sorted(a for a in self.filled if self.settings.target(a) not in behind)
                if gone:
                    raise StoreLost(f"{client.where} lost the index behind {gone[0]}, which this job filled")
                for alias in sorted(self.filled):
                    for index in behind[self.settings.target(alias)]:
                        self._same_layout(client, index, alias, bool(shared_place(self.settings.base, index)))
            self._expire_markers(client)
        finally:
            client.close()

    def _record(self, client: Client) -> dict[str, Any] | None:
        status, answer = client.request("GET", f"/{path_of(self.meta)}/_doc/{self.doc}")
        return answer["_source"].get("record") if status == 200 else None

    def load(self) -> dict[str, Any] | None:
        client = self._client()
        try:
            return self._record(client)
        finally:
            client.close()

    def save(self, record: dict[str, Any]) -> None:
        client = self._client()
        try:
            doc = {"record": {**record, "indexes": sorted(self.filled)}}
            client.ok("PUT", f"/{path_of(self.meta)}/_doc/{self.doc}?refresh=false", doc)
        finally:
            client.close()

    def clear(self) -> None:
        """Every index the job writes through (the readers' ones, or a rebuild's) and the
        bookkeeping: the topics fill them again. The delete markers stay: they hold positions
        the log proved, which no older upsert of the replay may pass."""
        client = self._client()
        try:
            behind = self._behind(client)
            doomed = sorted({index for alias, indexes in behind.items()
                             if alias.endswith(REBUILD_SUFFIX) == self.settings.rebuild for index in indexes})
            for index in doomed:
                client.request("DELETE", f"/{path_of(index)}?expand_wildcards=all")
            client.request("DELETE", f"/{path_of(self.meta)}/_doc/{self.doc}")
            self.filled, self.mapped = set(), {}
            log.info("%s: cleared %d indexes of %s", client.where, len(doomed), self.prefix)
        finally:
            client.close()

    def writer(self, registry: Registry) -> SearchWriter:
        return SearchWriter(self.settings, registry)

    def prepare(self, topics: list[str], registry: Registry) -> None:
        """The batch's tables' indexes: those not seen yet are looked up in two requests (the
        prefix's aliases and its indexes' mappings, not three requests per table), the room
        for those to create is checked, then each is created or maps its new columns."""
        client = self._client()
        try:
            unseen = [alias_name(t) for t in topics if alias_name(t) not in self.mapped]
            found = self._mappings(client) if unseen else {}
            behind = self._behind(client) if unseen else {}
            # per alias, what `GET /<target>/_mapping` answers: the mappings of the indexes behind
            # it (or of an index of that very name), or None
            answers = {a: {i: found[i] for i in [*behind.get(self.settings.target(a), []), self.settings.target(a)]
                           if i in found} or None for a in unseen}
            new = [a for a in unseen if answers[a] is None]
            if self.settings.shared:
                versions = {alias_name(t): registry.versions(t)[-1] for t in topics}
                made = self._pack(found, behind, [(a, versions[a]) for a in sorted(new)])
                markers = [name for name in [shared_markers(self.settings.base)] if new and name not in found]
                self._room_for(client, new, len(made) + len(markers), "the indexes of")
                for name in markers:
                    self._create_markers(client, name)
            else:
                markers = [] if self.settings.rebuild else [a for a in new if markers_name(a) not in found]
                self._room_for(client, new, len(new) + len(markers), "the indexes of")
            joining: list[dict[str, Any]] = []  # the new tables' aliases on shared indexes, added in one call
            for topic in topics:
                self.ensure_index(client, topic, registry.versions(topic)[-1], answers.get(alias_name(topic)), joining)
            if joining:
                client.ok("POST", "/_aliases", {"actions": joining})
                log.info("%s: %d tables joined shared indexes", client.where, len(joining))
        finally:
            client.close()

    def _mappings(self, client: Client) -> dict[str, Any]:
        """Every index of the prefix (hidden ones too) -> its mapping entry."""
        base = path_of(self.settings.base)
        path = f"/{base}.*,{base}-shared*,{base}-markers/_mapping?expand_wildcards=all&ignore_unavailable=true"
        return client.ok("GET", path, missing_ok=True) or {}

    def _pack(self, found: dict[str, Any], behind: dict[str, list[str]], tables: list[tuple[str, Version]]) -> list[str]:
        """Place each new table in a shared index of the generation this job writes (`placed`):
        one that holds fewer than `[search] tables_per_index` tables, with fields that agree
        with the table's (sinks.stores.search.shapes.pack), or a new one. The new indexes' names."""
        base = self.settings.base
        places = {index: place for index in [*found, *(i for indexes in behind.values() for i in indexes)]
                  if (place := shared_place(base, index))}
        mine: dict[str, int] = {}  # the shared indexes behind the aliases this job writes, and their tables
        for alias, indexes in behind.items():
            if alias.endswith(REBUILD_SUFFIX) == self.settings.rebuild:
                for index in indexes:
                    if index in places:
                        mine[index] = mine.get(index, 0) + 1
        newest = max((g for _, g in places.values()), default=0)
        if mine:  # the generation its tables are in
            now = max(places[index][1] for index in mine)
        elif self.settings.rebuild:  # a rebuild's first table: the generation after every one there is
            now = newest + 1
        else:  # the job's first: generation 1, or the newest a rebuild switched in
            now = max(newest, 1)
        numbers = [n for n, g in places.values() if g == now]
        fresh = iter(shared_name(base, n, now) for n in range(max(numbers, default=0) + 1, 1 << 30))
        fields = {index: found.get(index, {}).get("mappings", {}).get("properties", {}) for index in mine}
        for index in mine:
            self.shared.setdefault(index, set(fields[index]))
        ordered = sorted(mine, key=lambda index: places[index][0])
        placed = pack([(alias, mapping(version, self.flat, shared=True)["properties"]) for alias, version in tables],
                      {index: (mine[index], fields[index]) for index in ordered}, self.config.tables_per_index,
                      lambda: next(fresh))
        self.placed.update(placed)
        return sorted(set(placed.values()) - set(mine))

    def _room_for(self, client: Client, aliases: list[str], indexes: int, what: str) -> None:
        """Refuse, in one line and before creating any, indexes the cluster's shard limit
        would refuse part of the way through (a table has an index and a delete markers'
        index; a rebuild adds an index per table until its switch)."""
        if not indexes:
            return
        per_index = self.config.shards * (1 + self.config.replicas)
        need, room = per_index * indexes, shard_room(client)
        if need <= room.free:
            return
        enough = -(-(room.open + need) // max(1, room.nodes))
        raise SinkStopped(
            f"{client.where} has room for {room.free} more shards ({SHARD_LIMIT} = {room.per_node} on each of "
            f"{room.nodes} data node{'' if room.nodes == 1 else 's'}, {room.open} shards open) and {what} "
            f"{len(aliases)} tables need {need} "
            f"({indexes} indexes of {per_index}: [search] shards = {self.config.shards}, replicas = "
            f"{self.config.replicas}): raise {SHARD_LIMIT} to at least {enough} (PUT _cluster/settings), add data "
            "nodes, share indexes between tables ([search] tables_per_index), or capture fewer tables into this cluster"
        )

    def after_batch(self, topics: list[str]) -> None:
        if self.settings.refresh == "batch" and topics and not self.settings.rebuild:  # searchable at the commit
            client = self._client()
            try:
                refresh(client, [alias_name(t) for t in topics])
            finally:
                client.close()

    def _behind(self, client: Client) -> dict[str, list[str]]:
        """The prefix's aliases (the rebuild's hidden ones too) -> the indexes behind each."""
        path = f"/_alias/{path_of(alias_name(self.prefix))}.*?expand_wildcards=all"
        behind: dict[str, list[str]] = {}
        for index, entry in sorted((client.ok("GET", path, missing_ok=True) or {}).items()):
            for alias in entry.get("aliases", {}):
                behind.setdefault(alias, []).append(index)
        return behind

    def _drop_unfinished(self, client: Client) -> dict[str, list[str]]:
        """A new rebuild: the indexes an earlier one left unswapped go (an index it swapped
        only loses the rebuild's alias). The aliases as they were before (`_behind`)."""
        behind = self._behind(client)
        actions: list[dict[str, Any]] = []
        dropped: set[str] = set()  # a shared index is behind many of the rebuild's aliases
        for alias, indexes in behind.items():
            readers = alias.removesuffix(REBUILD_SUFFIX)
            if readers == alias:
                continue
            for index in indexes:
                if index in behind.get(readers, []):
                    actions.append({"remove": {"index": index, "alias": alias}})
                elif index not in dropped:
                    dropped.add(index)
                    actions.append({"remove_index": {"index": index}})
                    log.info("%s: dropped %s, left by an unfinished rebuild", client.where, index)
        if actions:
            client.ok("POST", "/_aliases", {"actions": actions})
        return behind

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
                    raise SinkStopped(f"{client.where} lost {target}, the rebuild's index for {alias}; the current "
                                      "indexes are untouched: run `cdc search rebuild` again")
                (new,) = behind[target]
                old = [index for index in behind.get(alias, []) if index != new]
                if new in behind.get(alias, []) and not old:
                    continue  # swapped before (a resumed rebuild)
                shared = filtered(alias) if shared_place(self.settings.base, new) else {}
                actions.append({"add": {"index": new, "alias": alias, **shared}})
                actions += [{"remove": {"index": index, "alias": alias}} for index in old]
                moved.append((alias, old, new))
            news = list(dict.fromkeys(new for _, _, new in moved))  # a shared index holds many tables
            for new in news:
                client.ok("POST", f"/{path_of(new)}/_refresh")  # searchable as it is at the swap
            for index in dict.fromkeys(index for _, old, _ in moved for index in old):
                client.ok("PUT", f"/{path_of(index)}/_settings", {"index": {"hidden": True}})
            if actions:
                client.ok("POST", "/_aliases", {"actions": actions})
            for new in news:
                self._show(client, new)
            return moved
        finally:
            client.close()

    @staticmethod
    def _show(client: Client, index: str) -> None:
        """A rebuilt index as the job's are: visible to wildcards, refreshed every second."""
        client.ok("PUT", f"/{path_of(index)}/_settings", {"index": {"hidden": False, "refresh_interval": None}})

    def finish(self) -> None:
        """After the last pass: the rebuild's aliases, the tables' earlier generations and
        the rebuild's document go."""
        client = self._client()
        try:
            behind = self._behind(client)
            rebuilt = [(target, index) for target in map(self.settings.target, sorted(self.filled))
                       for index in behind.get(target, [])]
            for index in dict.fromkeys(index for _, index in rebuilt):  # again: it may have stopped after its swap
                self._show(client, index)
            actions: list[dict[str, Any]] = [{"remove": {"index": index, "alias": target}} for target, index in rebuilt]
            for alias in sorted(self.filled):
                there = client.ok("GET", f"/{path_of(alias)}-v*?expand_wildcards=all", missing_ok=True) or {}
                actions += [{"remove_index": {"index": index}} for index in sorted(there)
                            if generation(alias, index) and index not in behind.get(alias, [])]
            actions += [{"remove_index": {"index": index}} for index in self._left_behind(client, behind)]
            if actions:
                client.ok("POST", "/_aliases", {"actions": actions})
            if self.filled:  # what the last pass wrote
                refresh(client, sorted(self.filled))
            client.request("DELETE", f"/{path_of(self.meta)}/_doc/{self.doc}")
        finally:
            client.close()

    def _left_behind(self, client: Client, behind: dict[str, list[str]]) -> list[str]:
        """After a rebuild's swap: the shared indexes no alias points at any more, and the
        delete markers of the layout it left (`[search] tables_per_index` changed)."""
        base = path_of(self.settings.base)
        live = {index for indexes in behind.values() for index in indexes}
        pattern = f"{base}.*-markers" if self.settings.shared else f"{base}-markers"
        there = client.ok("GET", f"/{base}-shared*,{pattern}?expand_wildcards=all&ignore_unavailable=true",
                          missing_ok=True) or {}
        return sorted(index for index in there
                      if index not in live and (shared_place(self.settings.base, index) or index.endswith("-markers")))

    def documents(self, aliases: list[str]) -> dict[str, int]:
        """How many documents the index behind each alias holds (as of its last refresh)."""
        client = self._client()
        try:
            return {alias: int(client.ok("GET", f"/{path_of(alias)}/_count")["count"]) for alias in aliases}
        finally:
            client.close()

    def _ensure_meta(self, client: Client) -> None:
        body = {"settings": {"index": {"number_of_shards": 1, "number_of_replicas": self.config.replicas,
                                       "hidden": True}},
                "mappings": {"dynamic": "strict", "properties": {"record": {"type": "object", "enabled": False}}}}
        create_index(client, self.meta, body)

    def _expire_markers(self, client: Client) -> None:
        """Delete the prefix's markers older than marker_ttl_s (at start: they age in days)."""
        pattern = f"{path_of(self.settings.base)}.*-markers,{path_of(shared_markers(self.settings.base))}"
        cutoff = int(time.time() * 1000) - self.settings.marker_ttl_ms
        query = {"query": {"range": {"at": {"lt": cutoff}}}, "_source": False, "size": CHUNK_KEYS}
        expired, failed = 0, []
        for hits in scroll(client, f"/{pattern}/_search?expand_wildcards=all&ignore_unavailable=true", query):
            lines = b"".join(orjson.dumps({"delete": {"_index": h["_index"], "_id": h["_id"]}}) + b"\n" for h in hits)
            status, answer = client.request("POST", "/_bulk", ndjson=lines)
            if status >= 300:
                failed.append(f"HTTP {status} {reason(answer)}")
                continue
            for item in answer["items"]:
                result = item["delete"]
                if result["status"] < 300 or result["status"] == 404:
                    expired += 1
                else:
                    failed.append(f"{result['_index']}: {reason(result)}")
        if expired:
            log.info("%s: %d delete markers older than %d s expired", client.where, expired,
                     self.settings.marker_ttl_ms // 1000)
        if failed:
            log.warning("%s: %d delete markers could not expire (they stay, and expiry is tried again at the next "
                        "start), the first: %s", client.where, len(failed), failed[0])

    def ensure_index(self, client: Client, topic: str, version: Version, answer: dict[str, Any] | None,
                     joining: list[dict[str, Any]]) -> None:
        """The table's index behind the alias the job writes through, and its markers;
        fields of new columns added. `answer`: the mappings of the indexes behind that alias,
        None when it has none (read by `prepare` for a table not mapped yet). A new table
        of shared indexes adds its alias's action to `joining`."""
        alias = alias_name(topic)
        target = self.settings.target(alias)
        fields = mapping(version, self.flat)["properties"]
        if alias not in self.mapped:
            if answer is None and alias in self.filled:
                raise StoreLost(f"{client.where} lost the index behind {target}, which this job filled")
            self.filled.add(alias)
            if answer is None:
                if self.settings.shared:
                    joining.append(self._join_shared(client, alias, version))
                else:
                    self._create_index(client, alias, version)
                    self.mapped[alias] = set(fields)
                return
            ((index, concrete),) = answer.items()
            held = set(concrete["mappings"].get("properties", {}))
            if POSITION not in held:
                raise StoreLost(f"{client.where}: the index behind {target} holds no positions ({POSITION}), which "
                                "this version of the job compares")
            self._same_layout(client, index, alias, TABLE in held)
            self.mapped[alias] = self.shared.setdefault(index, held) if self.settings.shared else held
        new = {name: spec for name, spec in fields.items() if name not in self.mapped[alias]}
        if new:  # ADD COLUMN; a column whose type changed keeps its mapping (a rebuild adopts it)
            client.ok("PUT", f"/{path_of(target)}/_mapping", {"properties": new})
            self.mapped[alias] |= set(new)
            log.info("%s: %s maps the new columns %s", client.where, target, ", ".join(new))

    def _same_layout(self, client: Client, index: str, alias: str, shared: bool) -> None:
        """Stop in one line where the table's index is not laid out as `[search] tables_per_index` says."""
        if shared != self.settings.shared:
            layout = "shares indexes between tables" if shared else "has an index per table"
            raise SinkStopped(
                f"{client.where}: {index} behind {self.settings.target(alias)} {layout}, and [search] "
                f"tables_per_index = {self.config.tables_per_index} asks for the other layout: run `cdc search "
                "rebuild` with it (readers keep the current indexes until its switch), or set it back"
            )

    def _join_shared(self, client: Client, alias: str, version: Version) -> dict[str, Any]:
        """Put a new table in the shared index `_pack` chose: made with its mapping, or given
        its new fields. The action that adds the table's alias (a filter on its documents)."""
        index = self.placed.pop(alias)
        body = mapping(version, self.flat, shared=True)
        held = self.shared.get(index)
        if held is None:
            create_index(client, index, {"settings": {"index": self._index_settings(self.settings.rebuild)},
                                         "mappings": body})
            held = self.shared[index] = set(body["properties"])
            log.info("%s: created shared index %s", client.where, index)
        else:
            new = {name: spec for name, spec in body["properties"].items() if name not in held}
            if new:
                client.ok("PUT", f"/{path_of(index)}/_mapping", {"properties": new})
                held |= set(new)
        alias_spec: dict[str, Any] = {"index": index, "alias": self.settings.target(alias), **filtered(alias)}
        if self.settings.rebuild:
            alias_spec["is_hidden"] = True
        self.mapped[alias] = held
        return {"add": alias_spec}

    def _index_settings(self, rebuild: bool = False) -> dict[str, Any]:
        """A new index's settings; a rebuild's is hidden until its swap, and nobody searches
        it before then: no refreshes while it fills (fewer, larger segments)."""
        settings: dict[str, Any] = {"number_of_shards": self.config.shards, "number_of_replicas": self.config.replicas}
        if rebuild:
            settings.update(hidden=True, refresh_interval="-1")
        return settings

    def _create_markers(self, client: Client, name: str) -> None:
        """A delete markers' index: hidden, read by the job alone."""
        create_index(client, name, {"settings": {"index": {**self._index_settings(), "hidden": True}},
                                    "mappings": MARKER_MAPPING})

    def _create_index(self, client: Client, alias: str, version: Version) -> None:
        """The job's first index of a table, `<alias>-v1`; a rebuild's, the generation after
        every one there is, hidden with its alias until the swap."""
        self._create_markers(client, markers_name(alias))
        if self.settings.rebuild:
            there = client.ok("GET", f"/{path_of(alias)}-v*?expand_wildcards=all", missing_ok=True) or {}
            index = index_name(alias, max([1, *(generation(alias, name) for name in there)]) + 1)
            body = {"settings": {"index": self._index_settings(rebuild=True)},
                    "aliases": {rebuild_alias(alias): {"is_hidden": True}}}
        else:
            index = index_name(alias)
            body = {"settings": {"index": self._index_settings()}, "aliases": {alias: {}}}
        create_index(client, index, {**body, "mappings": mapping(version, self.flat)})
        log.info("%s: created index %s behind alias %s", client.where, index, self.settings.target(alias))



def check(config: Config) -> None:
    try:
        alias_name(config.topic.prefix)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_reachable(config.search)


def build(spark: SparkSession, config: Config) -> SearchStore:
    return SearchStore(config.search, config.topic.prefix)


def rebuild(config: Config, stop: StopSignal) -> list[str]:
    from sinks.stores.search.generations import rebuild_here

    moved = rebuild_here(config, stop)
    return [*(f"{alias}: {', '.join(old) or 'no index'} -> {new} ({documents} documents)"
              for alias, old, new, documents in moved), f"search rebuild: {len(moved)} indexes swapped"]


def local(workdir: Path) -> tuple[Any, dict[str, str]]:
    """A throwaway OpenSearch node (the demo's), and the settings that point the job at it."""
    from cdc.local.opensearch import LocalOpenSearch

    node = LocalOpenSearch(workdir / "opensearch").start()
    return node, {"CDC_SEARCH_URL": node.url, "CDC_SEARCH_REPLICAS": "0"}


def show(config: Config, topics: list[str]) -> list[str]:
    """The documents searches find behind each table's alias, a line each."""
    client = Endpoint.of(config.search).client()
    try:
        client.ok("POST", "/_refresh")
        lines = []
        for topic in topics:
            alias = alias_name(topic)
            hits = client.ok("POST", f"/{path_of(alias)}/_search", {"query": {"match_all": {}}, "size": 100})
            for hit in sorted(hits["hits"]["hits"], key=lambda h: h["_id"]):
                lines.append(f"{alias}/_doc/{hit['_id']} -> {orjson.dumps(hit['_source']).decode()}")
        return lines
    finally:
        client.close()


def find(config: Config, topic: str, field: str, text: str) -> list[str]:
    """The keys of the table's rows whose `field` matches `text`, by a full-text query: what a
    search user asks the index that a GET by key cannot."""
    client = Endpoint.of(config.search).client()
    try:
        query = {"query": {"match": {field: text}}, "size": 100}
        hits = client.ok("POST", f"/{path_of(alias_name(topic))}/_search", query)["hits"]["hits"]
        return sorted(key_of(alias_name(topic), hit["_id"]) for hit in hits)
    finally:
        client.close()


class _Rows:
    """The documents behind each table's alias (`_count`)."""

    def __init__(self, config: Config) -> None:
        self.client = Endpoint.of(config.search).client(retries=0)

    def count(self, topics: list[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for topic in topics:
            status, answer = self.client.request("GET", f"/{path_of(alias_name(topic))}/_count")
            out[topic] = int(answer["count"]) if status == 200 else None
        return out

    def close(self) -> None:
        self.client.close()


def counter(config: Config) -> _Rows:
    return _Rows(config)
