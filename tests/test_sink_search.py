"""`cdc sink search` end to end: PostgreSQL -> `cdc run` -> topics -> OpenSearch.

Real PostgreSQL, Kafka, Spark and OpenSearch. What a search user relies on: one index per
table behind an alias named after the topic, `_id` the key's JSON, `_source` the row,
typed fields, and a replay (also after `index.gc_deletes`) that changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
import urllib3
from kafka import KafkaProducer

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic
from cdc.local.opensearch import LocalOpenSearch
from cdc.local.process import free_port
from sinks.latest import canonical_key
from sinks.progress import read_progress
from sinks.stores.search.shapes import alias_name, index_name, markers_name
from tests.support import (
    SINK_TIMEOUT_S,
    Sink,
    acct_changes_captured,
    acct_on_a_cluster,
    acct_rows,
    cdc,
    cdc_here,
    wait_caught_up,
    wait_for,
    write_config,
)
from tests.test_sink_cache import BIG, _from_topics
from tests.test_sink_delta import CHANGES, SEED

HTTP = urllib3.PoolManager()


def _config(tmp_path: Path, db: Any, servers: str, prefix: str, url: str, **extra: dict) -> Path:
    spark = {"checkpoint_dir": str(tmp_path / "checkpoints"), **extra.pop("spark", {})}
    search = {"url": url, "replicas": 0, **extra.pop("search", {})}
    return write_config(tmp_path / "sink.toml", db.dsn, servers, prefix, ["public.*"], search=search,
                        spark=spark, **extra)


def _ok(base: str, method: str, path: str, body: Any = None) -> Any:
    resp = HTTP.request(method, base + path, body=None if body is None else json.dumps(body),
                        headers={"Content-Type": "application/json"})
    assert resp.status < 300, (resp.status, resp.data[:500])
    return orjson.loads(resp.data)


def _documents(base: str, index: str, source: bool = True) -> dict[str, Any]:
    """Every document of an index: _id -> (version, _source) (or version alone)."""
    _ok(base, "POST", f"/{index}/_refresh?expand_wildcards=all")
    answer = _ok(base, "POST", f"/{index}/_search?expand_wildcards=all", {
        "query": {"match_all": {}}, "size": 10000, "version": True, "_source": source,
    })
    return {h["_id"]: (h["_version"], h["_source"]) if source else h["_version"] for h in answer["hits"]["hits"]}


def _rows(base: str, topic: str) -> dict[str, Any]:
    return {key: source for key, (_, source) in _documents(base, alias_name(topic)).items()}


def _ids(base: str, alias: str, query: dict) -> list[str]:
    answer = _ok(base, "POST", f"/{alias}/_search", {"query": query, "size": 100, "_source": False})
    return sorted(h["_id"] for h in answer["hits"]["hits"])


# What a user checks of the converted columns: dates and timestamps as ISO text from PostgreSQL
PG_DATES = """
SELECT id, d::text, to_char(ts, 'YYYY-MM-DD"T"HH24:MI:SS.US'), to_char(ts3, 'YYYY-MM-DD"T"HH24:MI:SS.US'), j::text
FROM public.wide WHERE d IS NULL OR isfinite(d) ORDER BY id
"""


def test_the_index_follows_the_source_and_replays_change_nothing(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch
) -> None:
    base = opensearch.url
    for sql in SEED:
        db.execute(sql)
    db.execute("CREATE TABLE public.doc (id int PRIMARY KEY, body text, n int)")  # REPLICA IDENTITY DEFAULT
    db.execute(f"INSERT INTO public.doc VALUES (1, {BIG}, 0), (2, {BIG}, 0)")
    daemon, slot = run_daemon(["public.*"])
    config = _config(tmp_path, db, broker_servers, topic_prefix, base)
    sink = Sink(config, tmp_path / "sink.log", store="search")
    wide, odd, doc = (f"{topic_prefix}.public.{t}" for t in ("wide", "Odd-20Name", "doc"))

    def expected_wide() -> dict[str, Any]:
        rows = {key.split(":", 1)[1]: row for key, row in _from_topics(broker_servers, topic_prefix, ["wide"]).items()}
        finite = set()
        for id_, d, ts, ts3, j in db.fetchall(PG_DATES):
            row = rows[canonical_key(json.dumps({"id": id_}))]
            row.update(d=d, ts=ts, ts3=ts3, j=None if j is None else json.loads(j))
            finite.add(canonical_key(json.dumps({"id": id_})))
        for key, row in rows.items():  # beyond years 1-9999 (the infinities): epoch ms
            if key not in finite:
                row.update(d=row["d"] * 86_400_000, ts=row["ts"] // 1000)
        return rows

    def check() -> None:
        assert _rows(base, wide) == expected_wide()
        assert _rows(base, odd) == {
            canonical_key(json.dumps({"Key": k})): {"Key": k, "a b": a, "ü": u}
            for k, a, u in db.fetchall('SELECT "Key", "a b", "ü" FROM public."Odd Name"')
        }
        assert _rows(base, doc) == {  # the topic has TOAST placeholders: the index has the bodies
            f'{{"id":{i}}}': {"id": i, "body": body, "n": n} for i, body, n in db.fetchall("SELECT * FROM public.doc")
        }

    wait_caught_up(db.dsn, slot, daemon)
    assert "0 dead letters" in sink.once()
    check()
    # the infinite row: -infinity days and infinity µs as epoch ms, timestamptz as the event has it
    row2 = _rows(base, wide)['{"id":2}']
    assert (row2["d"] < -10**17, row2["ts"] > 10**15, row2["tsz"], row2["f8"]) == (True, True, "infinity", "NaN")

    # one index per table behind an alias named after the topic; a lowercase-safe one for capitals
    assert alias_name(odd) == f"{topic_prefix}.public.-uodd-20-uname"
    assert _ok(base, "GET", f"/_alias/{alias_name(odd)}") == {index_name(alias_name(odd)): {
        "aliases": {alias_name(odd): {}}}}
    fields = _ok(base, "GET", f"/{wide}/_mapping")[index_name(wide)]["mappings"]["properties"]
    assert {name: spec.get("type") for name, spec in fields.items()} == {
        "id": "integer", "b": "boolean", "i2": "short", "i8": "long", "f4": "float", "f8": "double",
        "n": "double", "nu": "double", "m": "double", "t": "text", "vc": "text", "bp": "text", "u": "keyword",
        "j": "flat_object", "d": "date", "tm": "long", "ts": "date", "ts3": "date", "tsz": "date", "iv": "long",
        "by": "binary", "bits": "binary", "bit1": "boolean", "ia": "integer", "ta": "text", "pt": None,
        "ip": "keyword", "e": "keyword", "_cdc_pos": "keyword",  # the position a truncate compares
    }
    # typed search: a date range, full text and its keyword, a flat_object path, a number
    assert _ids(base, wide, {"range": {"ts": {"gte": "2024-01-01", "lt": "2024-02-01"}}}) == ['{"id":1}']
    assert _ids(base, wide, {"match": {"t": "TEXT"}}) == ['{"id":1}']
    assert _ids(base, wide, {"term": {"t.keyword": "two"}}) == ['{"id":2}']
    assert _ids(base, wide, {"term": {"j.k": "2"}}) == ['{"id":1}']
    assert _ids(base, wide, {"range": {"n": {"gt": 1000}}}) == ['{"id":1}']

    # streaming: updates, a delete, a key change, ADD COLUMN, a truncate; unchanged TOASTed
    # values from the index (doc 1) and from the batch (doc 2)
    for sql in CHANGES:
        db.execute(sql)
    db.execute("UPDATE public.doc SET n = 1 WHERE id = 1")
    db.execute(f"UPDATE public.doc SET body = {BIG} WHERE id = 2")
    db.execute("UPDATE public.doc SET n = 2 WHERE id = 2")
    wait_caught_up(db.dsn, slot, daemon)
    assert "0 dead letters" in sink.once()
    check()
    assert sorted(_rows(base, wide)) == ['{"id":1}', '{"id":3}', '{"id":40}', '{"id":5}']
    assert _ok(base, "GET", f"/{wide}/_mapping")[index_name(wide)]["mappings"]["properties"]["extra"] == {
        "type": "double", "ignore_malformed": True}
    # deletes left markers at their positions, which GET readers never see
    assert set(_documents(base, markers_name(alias_name(wide)), source=False)) == {'{"id":2}', '{"id":4}'}
    assert set(_documents(base, markers_name(alias_name(odd)), source=False)) == {'{"Key":"k1"}', '{"Key":"k2"}'}

    def everything() -> dict[str, Any]:
        names = [alias_name(t) for t in (wide, odd, doc)]
        return {name: (_documents(base, name), _documents(base, markers_name(name), source=False)) for name in names}

    # replay from the earliest offsets onto the same index, a few records per batch (an old
    # insert comes before its delete): nothing changes
    before = everything()
    shutil.rmtree(tmp_path / "checkpoints")
    sink.once(env={"CDC_SPARK_MAX_OFFSETS_PER_TRIGGER": "4"})
    assert everything() == before

    # OpenSearch forgets a delete's version after index.gc_deletes (and on a restart); then an
    # older upsert arrives again (a duplicate, a replay interrupted before its delete): the
    # markers still refuse it
    for topic in (wide, odd):
        _ok(base, "PUT", f"/{alias_name(topic)}/_settings", {"index": {"gc_deletes": "0ms"}})
    time.sleep(1)
    _ok(base, "POST", "/_refresh")
    stale = [r for r in read_topic(TopicConfig(bootstrap_servers=broker_servers), wide)
             if r.key == b'{"id":2}' and r.value is not None][0]
    producer = KafkaProducer(bootstrap_servers=broker_servers, acks="all")
    producer.send(wide, key=stale.key, value=stale.value, partition=stale.partition)
    producer.flush()
    producer.close()
    assert "0 dead letters" in sink.once()
    assert everything() == before

    # an index deleted under the job (an operator, a restored cluster): it rebuilds them all
    _ok(base, "DELETE", f"/{index_name(alias_name(wide))}")
    sink.once()
    assert f"OpenSearch at {base} lost the index behind {alias_name(wide)}, which this job filled; rebuilding it" in (
        tmp_path / "sink.log").read_text()
    assert everything() == before
    assert daemon.stop() == 0


def _acct(base: str, prefix: str) -> dict[int, tuple[int, str]]:
    rows = _rows(base, f"{prefix}.public.acct")
    return {row["id"]: (row["version"], row["note"]) for row in rows.values()}


def test_the_search_job_on_a_standalone_cluster(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch,
    spark_cluster: Any,
) -> None:
    config = _config(tmp_path, db, broker_servers, topic_prefix, opensearch.url,
                     spark={"master": spark_cluster.master_url})
    acct_on_a_cluster(db, run_daemon, Sink(config, tmp_path / "sink.log", store="search"), spark_cluster,
                      lambda: _acct(opensearch.url, topic_prefix))
    # the rebuild runs there too
    acct = alias_name(f"{topic_prefix}.public.acct")
    done = cdc("search", "rebuild", "--config", str(config), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{acct}: {acct}-v1 -> {acct}-v2 ({len(acct_rows(db))} documents)" in done.stdout.splitlines()
    assert _acct(opensearch.url, topic_prefix) == acct_rows(db)
    assert "Registering app cdc-search-rebuild" in (spark_cluster.work_dir / "master.log").read_text()


def test_a_rebuild_swaps_every_index_while_readers_and_the_job_go_on(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch
) -> None:
    from tests.support import ACCT, rebuild_while_streaming

    base = opensearch.url
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'seed' FROM generate_series(1, 400) g")
    db.execute("CREATE TABLE public.item (id int PRIMARY KEY, code int)")
    db.execute("INSERT INTO public.item VALUES (1, 10), (2, 20)")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix, base)
    sink = Sink(config, tmp_path / "sink.log", store="search")
    assert "0 dead letters" in sink.once()
    # a column changes type: its field cannot (an integer), so the new value is a dead letter
    db.execute("ALTER TABLE public.item ALTER code TYPE text")
    db.execute("UPDATE public.item SET code = 'A-1' WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    assert "1 dead letters" in sink.once()
    item, acct = alias_name(f"{topic_prefix}.public.item"), alias_name(f"{topic_prefix}.public.acct")

    # the rebuild, while writers change acct, the job streams them into the index and readers
    # count it, through its alias and through a wildcard over the prefix (item's 2 documents too)
    def count(path: str) -> Any:
        resp = HTTP.request("GET", f"{base}/{path}/_count")
        return orjson.loads(resp.data)["count"] if resp.status == 200 else (resp.status, resp.data[:200])

    done, answers = rebuild_while_streaming(
        db.dsn, sink, ("search", "rebuild", "--config", str(config)), every_s=0.05, pause_s=0.02,
        read=lambda: (count(acct), count(f"{topic_prefix}.public.*")))
    lines = done.stdout.splitlines()
    assert re.fullmatch(rf"{re.escape(acct)}: {re.escape(acct)}-v1 -> {re.escape(acct)}-v2 \(\d+ documents\)",
                        lines[0]), lines
    assert lines[1:] == [f"{item}: {item}-v1 -> {item}-v2 (2 documents)", "search rebuild: 2 indexes swapped"]
    # readers never met a missing or half-full index, nor a table twice (about 300 more): every
    # answer is a count near the table's, and the wildcard's is the alias's and item's, give or
    # take the changes of the seconds around the swap
    wrong = [(one, every) for one, every in answers
             if not isinstance(one, int) or not isinstance(every, int) or one <= 200 or abs(every - one - 2) > 60]
    assert answers and not wrong, wrong[:5]
    wait_caught_up(db.dsn, slot, daemon)
    assert sink.stop() == 0
    sink.once()  # what the writers committed after the job's last streamed batch
    # the index equals the source: the rebuild took what the job wrote into v1 before the swap
    assert _acct(base, topic_prefix) == acct_rows(db)
    # the rebuild adopted the new type: the value that was a dead letter is indexed and searchable
    fields = _ok(base, "GET", f"/{item}/_mapping")[f"{item}-v2"]["mappings"]["properties"]
    assert (fields["code"]["type"], _ids(base, item, {"match": {"code": "A-1"}})) == ("text", ['{"id":1}'])
    assert _rows(base, f"{topic_prefix}.public.item") == {
        '{"id":1}': {"id": 1, "code": "A-1"}, '{"id":2}': {"id": 2, "code": 20},  # as its event (before ALTER)
    }
    # nothing of the rebuild is left: its aliases, the old indexes, its checkpoint, its progress
    for alias in (acct, item):
        assert _ok(base, "GET", f"/_alias/{alias}*?expand_wildcards=all") == {f"{alias}-v2": {"aliases": {alias: {}}}}
        assert HTTP.request("HEAD", f"{base}/{alias}-v1").status == 404
        assert _ok(base, "GET", f"/{alias}-v2/_settings")[f"{alias}-v2"]["settings"]["index"].get("hidden") == "false"
    assert not (tmp_path / "checkpoints" / "search-rebuild").exists()
    assert set(read_progress(TopicConfig(bootstrap_servers=broker_servers, prefix=topic_prefix))) == {"search"}
    assert daemon.stop() == 0


def test_a_rebuild_stopped_before_its_swap_leaves_the_index_and_goes_on_when_run_again(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch
) -> None:
    base = opensearch.url
    daemon = acct_changes_captured(db, run_daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix, base)
    assert "0 dead letters" in Sink(config, tmp_path / "sink.log", store="search").once()
    acct = alias_name(f"{topic_prefix}.public.acct")
    env = {**os.environ, "CDC_SPARK_MAX_OFFSETS_PER_TRIGGER": "40"}  # many batches
    log = tmp_path / "rebuild.log"
    with log.open("w") as out:
        rebuild = subprocess.Popen([sys.executable, "-m", "cdc", "search", "rebuild", "--config", str(config)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: "sinks.pipeline: batch 1:" in log.read_text(), SINK_TIMEOUT_S, "a rebuild batch")
        rebuild.send_signal(signal.SIGTERM)
        assert rebuild.wait(300) == 1
    assert [line for line in log.read_text().splitlines() if line.startswith("error:")] == [
        "error: the rebuild stopped before its switch; the current indexes are untouched: run `cdc search rebuild` "
        "again to go on from where it stopped"]
    assert _ok(base, "GET", f"/_alias/{acct}") == {f"{acct}-v1": {"aliases": {acct: {}}}}
    assert _acct(base, topic_prefix) == acct_rows(db)

    # run again at the default batch size: what is left in a few batches, from its offsets
    done = cdc_here("search", "rebuild", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == f"{acct}: {acct}-v1 -> {acct}-v2 ({len(acct_rows(db))} documents)"
    assert "sinks.pipeline: batch 0:" not in done.stderr  # it went on from its offsets
    assert _acct(base, topic_prefix) == acct_rows(db)
    assert daemon.stop() == 0


def test_a_document_opensearch_rejects_reaches_the_dead_letter_topic(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch
) -> None:
    db.execute("CREATE TABLE public.cfg (id int PRIMARY KEY, attrs jsonb)")
    db.execute("""INSERT INTO public.cfg VALUES (1, '{"a": 1}'), (2, '[1, 2]'), (3, '{"b": {"c": "x"}}')""")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix, opensearch.url)
    out = Sink(config, tmp_path / "sink.log", store="search").once()
    assert "1 dead letters" in out
    topic = f"{topic_prefix}.public.cfg"
    assert sorted(_rows(opensearch.url, topic)) == ['{"id":1}', '{"id":3}']  # the job went on
    (letter,) = [
        (r.key, orjson.loads(r.value))
        for r in read_topic(TopicConfig(bootstrap_servers=broker_servers), f"{topic_prefix}.__cdc_dlq")
    ]
    key, value = letter
    assert key == b'{"id":2}' and value["topic"] == topic and orjson.loads(value["value"])["after"]["id"] == 2
    assert value["reason"].startswith(
        "OpenSearch rejected the document: mapper_parsing_exception: failed to parse field [attrs] of type "
        "[flat_object]"
    ), value["reason"]
    assert daemon.stop() == 0


def test_an_unreachable_index_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://app:s3cret@127.0.0.1:{port}"
    config = tmp_path / "cdc.toml"
    config.write_text(f'[topic]\nbootstrap_servers = "127.0.0.1:1"\n[search]\nurl = "{url}"\n')
    for command in (["sink", "search", "--once"], ["search", "rebuild"]):
        done = cdc(*command, "--config", str(config))
        assert done.returncode == 1
        line = done.stderr.strip()
        assert line.startswith(f"error: cannot reach OpenSearch at http://app:***@127.0.0.1:{port} ("), line
        assert line.endswith("): start it, or fix [search] url")
        assert len(line.splitlines()) == 1 and "s3cret" not in done.stdout + done.stderr


def test_delete_markers_expire_when_the_job_starts(opensearch: LocalOpenSearch, topic_prefix: str) -> None:
    from sinks.stores.search import SearchConfig
    from sinks.stores.search.store import SearchStore

    base, alias = opensearch.url, alias_name(f"{topic_prefix}.public.t")
    _ok(base, "PUT", f"/{markers_name(alias)}", {"settings": {"index": {"hidden": True, "number_of_replicas": 0}}})
    now_ms = int(time.time() * 1000)
    for key, at in (('{"id":1}', now_ms - 3_600_000), ('{"id":2}', now_ms)):
        _ok(base, "PUT", f"/{markers_name(alias)}/_doc/{quote(key, safe='')}?version=5&version_type=external_gte"
            "&refresh=true", {"at": at})
    SearchStore(SearchConfig(url=base, replicas=0, marker_ttl_s=60), topic_prefix).open(resumed=False)
    assert _documents(base, markers_name(alias), source=False) == {'{"id":2}': 5}


def test_markers_that_cannot_expire_are_reported_not_counted(
    opensearch: LocalOpenSearch, topic_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The expiry judges its `_bulk` answer: a markers index that refuses writes keeps its markers
    and the log says so, instead of counting them expired."""
    from sinks.stores.search import SearchConfig
    from sinks.stores.search.store import SearchStore

    base, alias = opensearch.url, alias_name(f"{topic_prefix}.public.t")
    _ok(base, "PUT", f"/{markers_name(alias)}", {"settings": {"index": {"hidden": True, "number_of_replicas": 0}}})
    old = int(time.time() * 1000) - 3_600_000
    _ok(base, "PUT", f"/{markers_name(alias)}/_doc/1?version=5&version_type=external_gte&refresh=true", {"at": old})
    _ok(base, "PUT", f"/{markers_name(alias)}/_settings", {"index": {"blocks": {"write": True}}})
    try:
        with caplog.at_level(logging.INFO, logger="sinks.stores.search.store"):
            SearchStore(SearchConfig(url=base, replicas=0, marker_ttl_s=60), topic_prefix).open(resumed=False)
    finally:
        _ok(base, "PUT", f"/{markers_name(alias)}/_settings", {"index": {"blocks": {"write": False}}})
    assert _documents(base, markers_name(alias), source=False) == {"1": 5}
    lines = [r.getMessage() for r in caplog.records if "markers" in r.getMessage()]
    assert len(lines) == 1 and "1 delete markers could not expire" in lines[0] and "cluster_block_exception" in lines[0]


def test_a_proxy_page_instead_of_opensearch_is_one_line(tmp_path: Path) -> None:
    """A URL that answers with HTML (a proxy's or a login page) stops the job in one line."""
    import http.server

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = b"<html><body>Please log in</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        config = tmp_path / "cdc.toml"
        config.write_text(f'[topic]\nbootstrap_servers = "127.0.0.1:1"\n[search]\nurl = "{url}"\n')
        done = cdc("sink", "search", "--once", "--config", str(config))
    finally:
        server.shutdown()
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"error: OpenSearch at {url} answered GET / with HTTP 200 and text/html, not OpenSearch's JSON: point "
        "[search] url at OpenSearch's REST endpoint (not a proxy's or a login page)"
    )


def _open_shards(base: str) -> int:
    health = _ok(base, "GET", "/_cluster/health")
    return health["active_shards"] + health["initializing_shards"] + health["unassigned_shards"]


def test_a_layout_beyond_the_clusters_shard_limit_is_one_line_before_any_index_is_made(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch
) -> None:
    """Each table takes an index and a delete markers' index, and a rebuild a second
    generation of each table's index: where `cluster.max_shards_per_node` would refuse part
    of them, the job (and the rebuild) stops at once with one line naming the limit and the
    fix, having made none of them; with the limit raised, the same run goes on."""
    base = opensearch.url
    for table in ("a", "b", "c"):
        db.execute(f"CREATE TABLE public.{table} (id int PRIMARY KEY)")
        db.execute(f"INSERT INTO public.{table} VALUES (1)")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    config = _config(tmp_path, db, broker_servers, topic_prefix, base)
    sink = Sink(config, tmp_path / "sink.log", store="search")
    sink.once()  # the job's own index (its bookkeeping) first
    for table in ("a", "b", "c"):  # the job made them: start again without them
        _ok(base, "DELETE", f"/{index_name(alias_name(f'{topic_prefix}.public.{table}'))},"
                            f"{markers_name(alias_name(f'{topic_prefix}.public.{table}'))}?expand_wildcards=all")
    shutil.rmtree(tmp_path / "checkpoints")
    opened = _open_shards(base)
    limit = "cluster.max_shards_per_node"
    try:
        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: opened + 5}})  # 3 tables need 6
        failed = sink.once(exit_code=1)
        assert [line for line in failed.splitlines() if line.startswith("error: ")] == [
            f"error: OpenSearch at {base} has room for 5 more shards ({limit} = {opened + 5} on each of 1 data node, "
            f"{opened} "
            "shards open) and the indexes of 3 tables need 6 (6 indexes of 1: [search] shards = 1, replicas = 0): "
            f"raise {limit} to at least {opened + 6} (PUT _cluster/settings), add data nodes, share indexes between "
            "tables ([search] tables_per_index), or capture fewer tables into this cluster"
        ]
        assert _ok(base, "GET", f"/_alias/{alias_name(topic_prefix)}.*?expand_wildcards=all") == {}

        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: opened + 7}})
        assert "0 dead letters" in sink.once()
        assert {a: _rows(base, f"{topic_prefix}.public.{a}") for a in ("a", "b", "c")} == {
            a: {'{"id":1}': {"id": 1}} for a in ("a", "b", "c")}
        # a rebuild's new generation of the three indexes does not fit: refused before it makes any
        done = cdc_here("search", "rebuild", "--config", str(config))
        assert done.returncode == 1
        assert [line for line in done.stderr.splitlines() if line.startswith("error: ")][0].endswith(
            f"has room for 1 more shards ({limit} = {opened + 7} on each of 1 data node, {opened + 6} shards open) "
            "and a rebuild's new generation of 3 tables need 3 (3 indexes of 1: [search] shards = 1, replicas = 0): "
            f"raise {limit} to at least {opened + 9} (PUT _cluster/settings), add data nodes, share indexes "
            "between tables ([search] tables_per_index), or capture fewer tables into this cluster"
        )
        assert _open_shards(base) == opened + 6
    finally:
        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: None}})
    assert daemon.stop() == 0


def test_the_indexes_of_many_new_tables_are_looked_up_in_two_requests_not_per_table(
    opensearch: LocalOpenSearch, topic_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wide schema's first batch: the job learns which of its tables have indexes from the
    prefix's aliases and mappings (two GETs), not from three GETs per table; then it makes an
    index and a markers index per table, and a second batch of the same tables asks nothing."""
    from sinks.stores.search import SearchConfig
    from sinks.stores.search.opensearch import Client
    from sinks.stores.search.store import SearchStore
    from sinks.versions import ColumnShape, Registry, Version

    base = opensearch.url
    topics = [f"{topic_prefix}.public.t{i}" for i in range(12)]
    registry = Registry(
        Version("public", t.rsplit(".", 1)[1], t, 0, (ColumnShape("id", "int4", -1, True, {"type": "int32"}),))
        for t in topics
    )
    # one of them has its index already, from an earlier run
    _ok(base, "PUT", f"/{index_name(alias_name(topics[0]))}",
        {"settings": {"index": {"number_of_replicas": 0}}, "aliases": {alias_name(topics[0]): {}},
         "mappings": {"properties": {"_cdc_pos": {"type": "long"}}}})
    store = SearchStore(SearchConfig(url=base, replicas=0, marker_ttl_s=60), topic_prefix)
    store.open(resumed=False)
    sent: list[str] = []
    real = Client.request

    def counted(self: Client, method: str, path: str, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        sent.append(f"{method} {path.split('?')[0]}")
        return real(self, method, path, *args, **kwargs)

    monkeypatch.setattr(Client, "request", counted)
    store.prepare(topics, registry)
    reads = [r for r in sent if r.startswith("GET ")]
    # what the indexes are, then the shard room for the 22 to make
    prefix = alias_name(topic_prefix)
    assert reads == [f"GET /{prefix}.*,{prefix}-shared*,{prefix}-markers/_mapping", f"GET /_alias/{prefix}.*",
                     "GET /_cluster/settings", "GET /_cluster/health"], sent
    made = sorted(r.split(" /")[1] for r in sent if r.startswith("PUT ") and "/_mapping" not in r)
    assert made == sorted([index_name(alias_name(t)) for t in topics[1:]] + [markers_name(alias_name(t)) for t in topics[1:]])
    assert [r for r in sent if "/_mapping" in r and r.startswith("PUT ")] == [
        f"PUT /{alias_name(topics[0])}/_mapping"]  # the earlier index gains the table's fields
    sent.clear()
    store.prepare(topics, registry)
    assert sent == []
    # the batch's refresh names every table it wrote: hundreds of names outgrow the 4 KB request
    # line OpenSearch takes (here the twelve tables, named 25 times over), so it goes in parts
    many = topics * 25
    assert len(",".join(alias_name(t) for t in many)) > 4096
    store.after_batch(many)
    refreshes = [r for r in sent if r.endswith("/_refresh")]
    assert len(refreshes) == 3 and all(len(r) < 3200 for r in refreshes), refreshes


def test_tables_share_indexes_within_a_shard_limit_an_index_per_table_would_pass(
    tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str, run_daemon: Any, opensearch: LocalOpenSearch
) -> None:
    """`[search] tables_per_index = 3`: five tables in three shared indexes (the fifth's `code`
    is text where the others' is an integer, so it cannot share their mapping) and one delete
    markers' index, under a shard limit that an index per table (ten) would pass. Each table
    reads as its own through its alias (`_id` = `<alias>:<key>`) and converges by position
    (deletes, a truncate, a replay from a deleted checkpoint); `cdc verify` finds it equal; a
    rebuild packs a new generation and drops the old; a job asking for the other layout stops
    in one line, and a rebuild with that setting lays the tables out again."""
    base = opensearch.url
    for table in "abcde":
        db.execute(f"CREATE TABLE public.{table} (id int PRIMARY KEY, code {'text' if table == 'e' else 'int'})")
        db.execute(f"INSERT INTO public.{table} SELECT g, g FROM generate_series(1, 40) g")
    daemon, slot = run_daemon(["public.*"])
    wait_caught_up(db.dsn, slot, daemon)
    prefix = alias_name(topic_prefix)
    aliases = {t: alias_name(f"{topic_prefix}.public.{t}") for t in "abcde"}
    config = _config(tmp_path, db, broker_servers, topic_prefix, base, search={"tables_per_index": 3})
    sink = Sink(config, tmp_path / "sink.log", store="search")

    def expected(shared: bool = True) -> dict[str, Any]:
        return {t: {f'{aliases[t]}:{{"id":{id_}}}' if shared else f'{{"id":{id_}}}': {"id": id_, "code": code}
                    for id_, code in db.fetchall(f"SELECT id, code FROM public.{t}")} for t in "abcde"}

    def held() -> dict[str, Any]:
        return {t: _rows(base, f"{topic_prefix}.public.{t}") for t in "abcde"}

    def layout() -> dict[str, str]:
        answer = _ok(base, "GET", f"/_alias/{prefix}.*")
        return {alias: index for index, entry in answer.items() for alias in entry["aliases"]}

    limit = "cluster.max_shards_per_node"
    opened = _open_shards(base)
    try:
        # the job's record, three shared indexes and the markers' fit the limit; ten indexes would not
        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: opened + 5}})
        assert "0 dead letters" in sink.once()
        first = [f"{prefix}-shared{n}-v1" for n in (1, 2, 3)]
        assert layout() == {aliases["a"]: first[0], aliases["b"]: first[0], aliases["c"]: first[0],
                            aliases["d"]: first[1], aliases["e"]: first[2]}
        assert held() == expected()
        assert _ids(base, aliases["e"], {"term": {"code.keyword": "7"}}) == [f'{aliases["e"]}:{{"id":7}}']
        db.execute("DELETE FROM public.a WHERE id <= 10")
        db.execute("UPDATE public.b SET code = -code WHERE id % 2 = 0")
        db.execute("TRUNCATE public.c")
        db.execute("INSERT INTO public.c VALUES (100, 1)")
        db.execute("UPDATE public.e SET code = 'x' || code WHERE id < 5")
        wait_caught_up(db.dsn, slot, daemon)
        assert "0 dead letters" in sink.once()
        assert held() == expected()
        shutil.rmtree(tmp_path / "checkpoints")  # a replay of every change: nothing deleted comes back
        sink.once()
        assert held() == expected()
        verified = cdc_here("verify", "--stores", "search", "--config", str(config))
        assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
        # a document deleted behind the job's back and one changed: `cdc verify` names each by its key
        doc = lambda t, i: quote(f'{aliases[t]}:{{"id":{i}}}', safe="")  # noqa: E731
        _ok(base, "DELETE", f"/{aliases['a']}/_doc/{doc('a', 11)}?refresh=true")
        _ok(base, "PUT", f"/{aliases['d']}/_doc/{doc('d', 3)}?refresh=true",
            {"id": 3, "code": -1, "_cdc_table": aliases["d"]})
        tampered = cdc_here("verify", "--stores", "search", "--config", str(config), "--json")
        assert tampered.returncode == 1, tampered.stdout[-3000:] + tampered.stderr[-3000:]
        found = {(side["table"], e["key"], e["kind"]) for table in orjson.loads(tampered.stdout)["tables"]
                 for side in table["sides"] for e in side["examples"]}
        assert found == {("public.a", '{"id":11}', "missing"), ("public.d", '{"id":3}', "different")}, found

        # a rebuild: the next generation, packed the same way, then the old one dropped
        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: opened + 8}})
        done = cdc_here("search", "rebuild", "--config", str(config))
        assert done.returncode == 0, done.stderr[-3000:]
        second = [f"{prefix}-shared{n}-v2" for n in (1, 2, 3)]
        assert done.stdout.splitlines()[-1] == "search rebuild: 5 indexes swapped"
        assert layout() == {aliases["a"]: second[0], aliases["b"]: second[0], aliases["c"]: second[0],
                            aliases["d"]: second[1], aliases["e"]: second[2]}
        assert all(HTTP.request("HEAD", f"{base}/{index}").status == 404 for index in first)
        assert held() == expected()

        # a job set for an index per table meets the shared layout: one line, nothing written
        config = _config(tmp_path, db, broker_servers, topic_prefix, base, search={"tables_per_index": 1})
        failed = [line for line in Sink(config, tmp_path / "one.log", store="search").once(exit_code=1).splitlines()
                  if line.startswith("error: ")]
        assert len(failed) == 1 and re.fullmatch(
            rf"error: OpenSearch at {re.escape(base)}: {re.escape(prefix)}-shared\d-v2 behind {re.escape(prefix)}"
            r"\.public\.[a-e] shares indexes between tables, and \[search\] tables_per_index = 1 asks for the other "
            r"layout: run `cdc search rebuild` with it \(readers keep the current indexes until its switch\), or set "
            r"it back", failed[0]), failed
        # its rebuild lays every table out in an index of its own, and the shared indexes and markers go
        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: opened + 5 + 5 + 5}})
        done = cdc_here("search", "rebuild", "--config", str(config))
        assert done.returncode == 0, done.stderr[-3000:]
        assert layout() == {alias: f"{alias}-v2" for alias in aliases.values()}
        assert _ok(base, "GET", f"/{prefix}-shared*,{prefix}-markers?expand_wildcards=all&ignore_unavailable=true") == {}
        assert "0 dead letters" in Sink(config, tmp_path / "one.log", store="search").once()
        assert held() == expected(shared=False)
    finally:
        _ok(base, "PUT", "/_cluster/settings", {"persistent": {limit: None}})
    assert daemon.stop() == 0
