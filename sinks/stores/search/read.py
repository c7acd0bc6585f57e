"""The search index's read side for `cdc verify` (compaction.verify.Side): its documents, hashed here.

OpenSearch has no compute that could hash a document's source, so every document of the
table's alias is read in bulk (a scroll) and hashed as it arrives. `_source` is the event's
row as sinks.stores.search.shapes converted it (dates and timestamps as ISO text, JSON columns
parsed): `event_form` turns it back, and compaction.canonical compares JSON by meaning.
Positions are the documents' stored `_cdc_pos` and the delete markers' `pos`. To be folded
into the store (sinks.store) as its read side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import date, datetime
from typing import Any

from cdc.config import Config
from compaction.canonical import row_values
from compaction.verify import Digest, Found, TableSpec, digest_of, hashes_of
from sinks.latest import parse_position
from sinks.stores.search import SearchConfig
from sinks.stores.search.opensearch import path_of, scroll
from sinks.stores.search.shapes import POSITION, alias_name
from sinks.stores.search.store import Settings, key_of

_TIMESTAMPS = {"io.debezium.time.Timestamp": 1000, "io.debezium.time.MicroTimestamp": 1}  # event unit in µs
_EPOCH = datetime(1970, 1, 1)
_EPOCH_DAY = date(1970, 1, 1).toordinal()
PAGE = 5000


def _back(value: Any, connect: dict[str, Any], in_array: bool = False) -> Any:
    """One `_source` value as the event had it (sinks.stores.search.shapes' conversions undone)."""
    if value is None:
        return None
    kind, name = connect.get("type"), connect.get("name")
    if kind == "array" and isinstance(value, list):
        return [_back(x, connect.get("items", {}), True) for x in value]
    if name == "io.debezium.time.Date":
        if isinstance(value, str):
            return date.fromisoformat(value).toordinal() - _EPOCH_DAY
        return value // 86_400_000 if isinstance(value, int) else value
    if name in _TIMESTAMPS:
        unit = _TIMESTAMPS[name]
        if isinstance(value, str):
            delta = datetime.fromisoformat(value) - _EPOCH
            return (delta.days * 86_400_000_000 + delta.seconds * 1_000_000 + delta.microseconds) // unit
        return value * 1000 // unit if isinstance(value, int) else value
    return value


def event_form(source: dict[str, Any], table: TableSpec) -> dict[str, Any]:
    return {c.name: _back(source.get(c.name), c.connect) for c in table.columns if c.name in source}


class SearchSide:
    name = "search"

    def __init__(self, config: SearchConfig, prefix: str) -> None:
        self.settings = Settings.of(config, prefix)
        self.client = self.settings.client()

    def _pairs(self, table: TableSpec) -> Iterator[tuple[bytes, dict[str, Any]]]:
        """(`_id`, `_source`) of every document behind the table's alias."""
        alias = alias_name(table.topic)
        query = {"size": PAGE, "sort": ["_doc"], "query": {"match_all": {}}}
        for hits in scroll(self.client, f"/{path_of(alias)}/_search", query):
            for hit in hits:
                yield key_of(alias, hit["_id"]).encode(), hit["_source"]

    def digest(self, table: TableSpec) -> Digest:
        return digest_of(self._pairs(table), lambda s: row_values(event_form(s, table), table.columns), table.bits)

    def hashes(self, table: TableSpec, segments: set[int]) -> dict[bytes, int]:
        values = lambda s: row_values(event_form(s, table), table.columns)  # noqa: E731
        return hashes_of(self._pairs(table), values, table.bits, segments)

    def fetch(self, table: TableSpec, keys: list[bytes]) -> dict[bytes, Found]:
        alias = alias_name(table.topic)
        ids = {self.settings.doc_id(alias, k.decode()): k.decode() for k in keys}  # _id -> key
        out: dict[bytes, Found] = {}
        for start in range(0, len(ids), PAGE):
            chunk = list(ids)[start:start + PAGE]
            docs = self._mget(alias, chunk, f"_source=true&stored_fields={POSITION}")
            markers = self._mget(self.settings.markers(alias), chunk, "_source=true")
            for doc_id in chunk:
                key, doc, marker = ids[doc_id], docs.get(doc_id), markers.get(doc_id)
                if doc is not None:
                    values = row_values(event_form(doc.get("_source") or {}, table), table.columns)
                    stored = (doc.get("fields") or {}).get(POSITION, [""])[0]
                    out[key.encode()] = Found(values, parse_position(stored))
                elif marker is not None:
                    out[key.encode()] = Found(None, parse_position((marker.get("_source") or {}).get("pos", "")))
        return out

    def _mget(self, index: str, ids: list[str], params: str) -> dict[str, dict[str, Any]]:
        answer = self.client.ok("POST", f"/{path_of(index)}/_mget?{params}", {"ids": ids}, missing_ok=True)
        return {d["_id"]: d for d in (answer or {}).get("docs", ()) if d.get("found")}

    def close(self) -> None:
        self.client.close()


def side(config: Config, spark: Callable[[], Any]) -> SearchSide:
    return SearchSide(config.search, config.topic.prefix)
