"""The README's first command (docs/getting-started.md): `cdc demo` runs the pipeline on embedded defaults."""

from __future__ import annotations

import json
import re

import pytest

from sinks.stores import STORES
from tests.support import cdc

#: the sides of `cdc verify`'s report: the topic, then each store's (the read model's is named
#: apart from PostgreSQL, the source)
SIDES = ("topic", *("read-model" if name == "postgres" else name for name in STORES))


@pytest.mark.integration  # `cdc demo` starts its own PostgreSQL, Kafka, OpenSearch and Redis
def test_demo_shows_events_landing_in_compacted_topics(tmp_path):
    result = cdc("demo", "--workdir", str(tmp_path / "demo"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "topic demo.public.customers" in out and "topic demo.public.orders" in out
    assert 'key={"id":101}  tombstone' in out  # the delete
    assert 'key={"id":200}  op=c' in out and 'key={"id":102}  op=d' in out  # the key change
    assert 'key={"id":1}  op=r' in out and 'key={"id":2}  op=r' in out  # rows there before cdc: the snapshot
    assert "slot cdc: active" in out
    assert '"connector": "postgresql"' in out
    # the Delta warehouse caught up: the tables as PostgreSQL has them now
    assert "sink delta: " in out and "0 dead letters" in out
    customers = out.split("current/public/customers (read with delta-rs): ", 1)[1].splitlines()[0]
    assert [(r["id"], r["email"]) for r in json.loads(customers)] == [(1, "ada@example.com"), (2, "grace@example.com")]
    orders = out.split("current/public/orders (read with delta-rs): ", 1)[1].splitlines()[0]
    assert [(r["id"], r["total"]) for r in json.loads(orders)] == [(100, "12.50"), (200, "5.00")]
    assert _status_line("delta", out)
    # the cache caught up too: GET <topic>:<key JSON> is the row, the deleted order has none
    gets = dict(
        line.strip().removeprefix("GET '").split("' -> ", 1) for line in out.splitlines() if line.strip().startswith("GET '")
    )
    assert {k: json.loads(v) for k, v in gets.items() if ".customers:" in k} == {
        'demo.public.customers:{"id":1}': {"id": 1, "name": "Ada", "email": "ada@example.com"},
        'demo.public.customers:{"id":2}': {"id": 2, "name": "Grace", "email": "grace@example.com"},
    }
    assert sorted(k for k in gets if ".orders:" in k) == ['demo.public.orders:{"id":100}', 'demo.public.orders:{"id":200}']
    assert _status_line("cache", out)
    # and the search index: a document per row, searchable, the deleted order gone
    docs = dict(line.strip().split(" -> ", 1) for line in out.splitlines() if "/_doc/" in line)
    assert {k: json.loads(v) for k, v in docs.items() if ".customers/" in k} == {
        'demo.public.customers/_doc/{"id":1}': {"id": 1, "name": "Ada", "email": "ada@example.com"},
        'demo.public.customers/_doc/{"id":2}': {"id": 2, "name": "Grace", "email": "grace@example.com"},
    }
    assert sorted(k for k in docs if ".orders/" in k) == [
        'demo.public.orders/_doc/{"id":100}', 'demo.public.orders/_doc/{"id":200}']
    assert """search customers for email 'example.com': ['{"id":1}', '{"id":2}']""" in out
    assert _status_line("search", out)
    # and the read model: a table per captured table, the rows as PostgreSQL has them
    selected = dict(line.strip().removeprefix('SELECT FROM "cdc_public".').split(" -> ", 1)
                    for line in out.splitlines() if line.strip().startswith("SELECT FROM "))
    assert {k: json.loads(v) for k, v in selected.items() if k.startswith('"customers"')} == {
        '"customers" {"id":1}': {"id": 1, "name": "Ada", "email": "ada@example.com"},
        '"customers" {"id":2}': {"id": 2, "name": "Grace", "email": "grace@example.com"},
    }
    assert sorted(k for k in selected if k.startswith('"orders"')) == ['"orders" {"id":100}', '"orders" {"id":200}']
    assert _status_line("postgres", out)
    # the live view's last picture: every store holds PostgreSQL's rows, each sink caught up
    assert re.search(r"^every store caught up: \d+ s after the sink jobs started, \d+ s after cdc demo started$", out,
                     re.MULTILINE), out[-3000:]
    view = out.split("cdc demo   prefix demo   slot cdc", 1)[1].split("every store caught up", 1)[0]
    rows = {line.split()[0]: line.split()[1:] for line in view.splitlines() if line.startswith("public.")}
    assert rows == {"public.customers": ["2"] * (1 + len(STORES)) + ["="],
                    "public.orders": ["2"] * (1 + len(STORES)) + ["="]}, view
    sinks = {line.split()[0]: line.split() for line in view.splitlines() if line.split()[:1] in ([n] for n in STORES)}
    # sink, records/s, records, complete up to, behind slot (2), lag (2), dead letters, batch, updated (3), state
    assert sorted(sinks) == sorted(STORES) and all(
        cells[8] == "0" and cells[-2:] == ["caught", "up"] for cells in sinks.values()), view
    # and cdc verify, every store against the source row by row, ends it
    comparison = out.split("== every store against the source: cdc verify", 1)[1].split("==", 1)[0]
    lines = [line.strip() for line in comparison.splitlines() if line.strip()]
    assert lines[0].startswith("verify: PostgreSQL at LSN ") and lines[-1].startswith(
        "verify: every side agrees with PostgreSQL"), comparison
    for table in ("public.customers", "public.orders"):
        at = lines.index(f"{table}: postgres 2 rows")
        assert sorted(line.split() for line in lines[at + 1:at + 2 + len(STORES)]) == sorted(
            [side, "2", "rows", "ok"] for side in SIDES), comparison
    # each --once run read every record and a heartbeat after them: complete, not "up to 0/0"
    completes = dict(re.findall(r"sink (\w+): \d+ batches, .* complete up to LSN (\S+),", out))
    assert sorted(completes) == sorted(STORES) and "0/0" not in completes.values(), completes


def _status_line(store: str, out: str) -> bool:
    """`cdc status` names the sink's state and the LSN its store is complete up to."""
    return re.search(rf"^sink {store}: (caught up|catching up), complete up to 0/[0-9A-F]+", out, re.M) is not None
