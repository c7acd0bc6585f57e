"""The search index and the cache the sinks write: real OpenSearch and Redis servers.

The OpenSearch tests also pin down what the sink can rely on in the integ-test
distribution (external versions, gc_deletes, flat_object, aliases) and what it lacks
(painless, _delete_by_query, `flattened`), so that a sink never depends on those.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from cdc.local.opensearch import LocalOpenSearch
from cdc.local.process import LOCALHOST, ServiceUnavailable
from cdc.local.redis import LocalRedis

# --------------------------------------------------------------------------- OpenSearch


def http(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request; returns (status, decoded JSON). A list body is sent as _bulk's NDJSON."""
    if isinstance(body, list):
        data, ctype = "".join(json.dumps(line) + "\n" for line in body).encode(), "application/x-ndjson"
    else:
        data, ctype = (None if body is None else json.dumps(body).encode()), "application/json"
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def ok(base: str, method: str, path: str, body: Any = None) -> Any:
    status, answer = http(base, method, path, body)
    assert status < 300, (status, answer)
    return answer


MAPPING = {
    "dynamic": "strict",
    "properties": {
        "name": {"type": "text", "fields": {"raw": {"type": "keyword"}}},
        "updated_at": {"type": "date"},
        "attrs": {"type": "flat_object"},
    },
}


def create_index(base: str, alias: str) -> str:
    """A concrete index with the sink's mapping and gc_deletes, reached through `alias`."""
    index = f"{alias}_v1"
    settings = {"number_of_shards": 1, "number_of_replicas": 0, "index.gc_deletes": "1h"}
    ok(base, "PUT", f"/{index}", {"settings": settings, "mappings": MAPPING})
    ok(base, "POST", "/_aliases", {"actions": [{"add": {"index": index, "alias": alias}}]})
    return index


def bulk_upserts(base: str, alias: str, rows: list[tuple[str, int, dict]]) -> list[dict]:
    """_bulk index actions versioned by position (external_gte); returns the per-item results."""
    lines: list[dict] = []
    for doc_id, version, source in rows:
        lines += [{"index": {"_id": doc_id, "version": version, "version_type": "external_gte"}}, source]
    answer = ok(base, "POST", f"/{alias}/_bulk?refresh=true", lines)
    return [item["index"] for item in answer["items"]]


def row(name: str, color: str) -> dict:
    return {"name": name, "updated_at": "2026-01-02T03:04:05Z", "attrs": {"color": color, "size": {"cm": "3"}}}


def test_versioned_bulk_through_an_alias(opensearch: LocalOpenSearch) -> None:
    base, alias = opensearch.url, "t" + uuid.uuid4().hex[:12]
    index = create_index(base, alias)
    settings = ok(base, "GET", f"/{index}/_settings")[index]["settings"]["index"]
    assert settings["gc_deletes"] == "1h"
    assert ok(base, "GET", f"/_alias/{alias}") == {index: {"aliases": {alias: {}}}}

    first = bulk_upserts(base, alias, [("1", 10, row("alpha one", "red")), ("2", 10, row("beta", "blue"))])
    assert [(r["status"], r["_version"]) for r in first] == [(201, 10), (201, 10)]

    # A stale position is refused per item (the batch goes on); a replay of the same one is not.
    later = bulk_upserts(
        base, alias, [("1", 5, row("stale", "green")), ("2", 20, row("beta two", "blue")), ("1", 10, row("alpha one", "red"))]
    )
    assert [r["status"] for r in later] == [409, 200, 200]
    assert later[0]["error"]["type"] == "version_conflict_engine_exception"
    doc = ok(base, "GET", f"/{alias}/_doc/1")
    assert (doc["_version"], doc["_source"]["name"]) == (10, "alpha one")

    # A versioned delete leaves a tombstone: within gc_deletes an older upsert cannot resurrect the row.
    deleted = ok(base, "DELETE", f"/{alias}/_doc/2?version=30&version_type=external_gte&refresh=true")
    assert (deleted["result"], deleted["_version"]) == ("deleted", 30)
    (resurrect,) = bulk_upserts(base, alias, [("2", 25, row("beta old", "blue"))])
    assert resurrect["status"] == 409
    assert http(base, "GET", f"/{alias}/_doc/2")[0] == 404

    def hits(query: dict) -> list[str]:
        answer = ok(base, "POST", f"/{alias}/_search", {"query": query})
        return sorted(hit["_id"] for hit in answer["hits"]["hits"])

    assert hits({"match": {"name": "alpha"}}) == ["1"]
    assert hits({"term": {"name.raw": "alpha one"}}) == ["1"]
    assert hits({"term": {"attrs.color": "red"}}) == ["1"]
    assert hits({"term": {"attrs.size.cm": "3"}}) == ["1"]
    assert hits({"range": {"updated_at": {"gte": "2026-01-01"}}}) == ["1"]


def test_what_the_integ_test_distribution_lacks(opensearch: LocalOpenSearch) -> None:
    """Facts of the distribution: a sink must not use these (see docs/development.md, Local services)."""
    base, alias = opensearch.url, "t" + uuid.uuid4().hex[:12]
    status, answer = http(base, "PUT", f"/{alias}_flat", {"mappings": {"properties": {"a": {"type": "flattened"}}}})
    assert status == 400 and "No handler for type [flattened]" in json.dumps(answer)

    create_index(base, alias)
    bulk_upserts(base, alias, [("1", 1, row("alpha", "red"))])
    status, answer = http(base, "POST", f"/{alias}/_update/1", {"script": {"source": "ctx._source.name = 'x'"}})
    assert status == 400 and "script_lang not supported [painless]" in json.dumps(answer)
    for action in ("_delete_by_query", "_update_by_query"):
        status, answer = http(base, "POST", f"/{alias}/{action}", {"query": {"match_all": {}}})
        assert status == 400 and "no handler found for uri" in json.dumps(answer)


def test_opensearch_keeps_documents_across_restart_and_kill9(tmp_path: Path) -> None:
    with LocalOpenSearch(tmp_path / "os") as node:
        base, port, alias = node.url, node.port, "restart"
        create_index(base, alias)
        bulk_upserts(base, alias, [("a", 1, row("kept over a restart", "red"))])
        node.restart()
        assert node.port == port and node.running
        assert ok(base, "GET", f"/{alias}/_doc/a")["_version"] == 1

        # Without a refresh: an acknowledged write is in the translog (fsynced per request).
        ok(base, "PUT", f"/{alias}/_doc/b?version=7&version_type=external_gte", row("kept over a crash", "red"))
        node.kill9()
        assert not node.running
        node.start()
        assert node.port == port
        assert ok(base, "GET", f"/{alias}/_doc/b")["_version"] == 7
        assert ok(base, "GET", f"/{alias}/_count")["count"] == 2


# --------------------------------------------------------------------------- Redis

# Set KEYS[1] to ARGV[2] unless KEYS[2] holds a newer position than ARGV[1].
GUARDED_SET = """
local stored = redis.call('GET', KEYS[2])
if stored and tonumber(stored) > tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""


def test_redis_round_trip_and_lua(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    key = "t" + uuid.uuid4().hex[:12]
    assert client.set(f"{key}:plain", b'{"id":1}') and client.get(f"{key}:plain") == b'{"id":1}'

    sha = client.script_load(GUARDED_SET)
    keys = [f"{key}:row", f"{key}:pos"]
    assert client.evalsha(sha, 2, *keys, 20, "new") == 1
    assert client.evalsha(sha, 2, *keys, 10, "stale") == 0
    assert client.get(keys[0]) == b"new" and client.get(keys[1]) == b"20"
    client.close()


def test_redis_answers_again_after_kill9_on_the_same_port(tmp_path: Path) -> None:
    with LocalRedis(tmp_path / "redis") as server:
        port = server.port
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        server.kill9()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()
        assert server.port == port and client.ping()
        assert client.get("k") is None  # no persistence: the sink rebuilds the cache
        client.close()


# --------------------------------------------------------------------------- both


@pytest.mark.parametrize("service", [LocalOpenSearch, LocalRedis])
def test_a_taken_explicit_port_is_a_one_line_error(tmp_path: Path, service: type) -> None:
    with socket.socket() as taken:
        taken.bind((LOCALHOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServiceUnavailable) as err:
            service(tmp_path / "svc", port=port).start()
    message = str(err.value)
    assert f"port {port}" in message and "already in use" in message and "\n" not in message
