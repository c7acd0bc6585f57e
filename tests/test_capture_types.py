"""End to end through the real walsender: each type's value, schema changes, partitions, limits."""

from __future__ import annotations

import base64
import struct

import orjson

from cdc.config import TopicConfig
from cdc.kafka.reader import read_topic
from cdc.naming import topic_name
from tests.support import (
    DaemonProcess,
    cdc,
    confirmed_lsn,
    current_lsn,
    slot_of,
    start_streaming,
    topic_records,
    wait_caught_up,
    wait_for,
    write_config,
)

TYPES_DDL = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN positive_int AS int CHECK (VALUE > 0);
CREATE TABLE public.all_types (
  id int PRIMARY KEY,
  b bool, i2 int2, i8 int8, f4 float4, f8 float8, f8nan float8, n numeric(10,3), m money,
  t text, vc varchar(10), c char(3), by bytea, d date, d_bc date, tm time, tm3 time(3),
  ts timestamp, ts3 timestamp(3), tz timestamptz, ttz timetz, iv interval,
  u uuid, j json, jb jsonb, x xml, ip inet, ci cidr, mac macaddr,
  bt bit(10), b1 bit(1), pt point, r int4range, e mood, dom positive_int,
  arr int[], tarr text[], arr2 int[][], earr mood[],
  g int GENERATED ALWAYS AS (i2 * 2) STORED
)
"""

INSERT = """
INSERT INTO public.all_types (id, b, i2, i8, f4, f8, f8nan, n, m, t, vc, c, by, d, d_bc, tm, tm3, ts, ts3, tz, ttz, iv,
  u, j, jb, x, ip, ci, mac, bt, b1, pt, r, e, dom, arr, tarr, arr2, earr) VALUES (
  1, true, -7, 9007199254740993, 1.5, 0.1, 'NaN', 12.5, -1234.56, 'héllo "q"', 'v', 'ab', '\\x0102ff',
  '2024-01-02', '0044-03-15 BC', '03:04:05.123456', '03:04:05.123', '2024-01-02 03:04:05.123456',
  '2024-01-02 03:04:05.123', '2024-01-02 08:34:05.5+05:30', '03:04:05+01', '1 year 2 mons 3 days 04:05:06.5',
  'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2]}', '{"b": 1, "a": 2}', '<x>1</x>', '10.1.2.3/16', '10.1.0.0/16',
  '08:00:2b:01:02:03', B'1000000001', B'1', '(1.5,2)', '[1,5)', 'happy', 5, '{1,NULL,3}', '{"a b","c\\"d",NULL}',
  '{{1,2},{3,4}}', '{sad,ok}')
"""


def wkb_point(x: float, y: float) -> str:
    return base64.b64encode(struct.pack("<BIdd", 1, 1, x, y)).decode()


EXPECTED = {
    "id": 1, "b": True, "i2": -7, "i8": 9007199254740993, "f4": 1.5, "f8": 0.1, "f8nan": "NaN", "n": "12.500",
    "m": "-1234.56", "t": 'héllo "q"', "vc": "v", "c": "ab ", "by": "AQL/", "d": 19724, "d_bc": -735160,
    "tm": 11045123456, "tm3": 11045123, "ts": 1704164645123456, "ts3": 1704164645123,
    "tz": "2024-01-02T03:04:05.5Z", "ttz": "02:04:05Z", "iv": (14 * 2629800 + 3 * 86400 + 14706) * 1_000_000 + 500000,
    "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "j": '{"a": [1, 2]}', "jb": '{"a": 2, "b": 1}', "x": "<x>1</x>",
    "ip": "10.1.2.3/16", "ci": "10.1.0.0/16", "mac": "08:00:2b:01:02:03",
    "bt": base64.b64encode((0b1000000001).to_bytes(2, "little")).decode(), "b1": True,
    "pt": {"x": 1.5, "y": 2.0, "wkb": wkb_point(1.5, 2.0), "srid": None}, "r": "[1,5)", "e": "happy", "dom": 5,
    "arr": [1, None, 3], "tarr": ["a b", 'c"d', None], "arr2": [[1, 2], [3, 4]], "earr": ["sad", "ok"],
}


def test_every_type_of_the_table(db, broker_servers, topic_prefix, run_daemon):
    db.execute(TYPES_DDL)
    daemon, slot = run_daemon(["public.all_types"])
    db.execute(INSERT)
    db.execute("INSERT INTO public.all_types (id) VALUES (2)")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    events = {k: v for k, v in topic_records(broker_servers, topic_prefix, "public", "all_types")}
    full = events[b'{"id":1}']["after"]
    assert "g" not in full  # PostgreSQL 15 does not publish generated columns
    assert full == EXPECTED
    empty = events[b'{"id":2}']["after"]
    assert empty == {name: (2 if name == "id" else None) for name in EXPECTED}


def test_alter_table_shows_in_the_next_event(db, broker_servers, topic_prefix, run_daemon):
    db.execute("CREATE TABLE public.evolving (id int PRIMARY KEY, a text, b int)")
    daemon, slot = run_daemon(["public.evolving"], events={"schemas": True})
    db.execute("INSERT INTO public.evolving VALUES (1, 'x', 1)")
    db.execute("ALTER TABLE public.evolving ADD COLUMN c timestamptz DEFAULT '2024-01-01 00:00:00+00'")
    db.execute("INSERT INTO public.evolving VALUES (2, 'y', 2)")
    db.execute("ALTER TABLE public.evolving DROP COLUMN b")
    db.execute("UPDATE public.evolving SET a = 'z' WHERE id = 1")
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    raw = read_topic(TopicConfig(bootstrap_servers=broker_servers), topic_name(topic_prefix, "public", "evolving"))
    values = sorted((orjson.loads(r.value) for r in raw), key=lambda v: v["payload"]["source"]["lsn"])
    afters = [v["payload"]["after"] for v in values]
    assert afters == [
        {"id": 1, "a": "x", "b": 1},
        {"id": 2, "a": "y", "b": 2, "c": "2024-01-01T00:00:00Z"},
        {"id": 1, "a": "z", "c": "2024-01-01T00:00:00Z"},
    ]
    fields = [[f["field"] for f in v["schema"]["fields"][1]["fields"]] for v in values]
    assert fields == [["id", "a", "b"], ["id", "a", "b", "c"], ["id", "a", "c"]]
    schema = values[1]["schema"]
    assert schema["name"] == f"{topic_prefix}.public.evolving.Envelope"
    c_field = schema["fields"][1]["fields"][3]
    assert (c_field["type"], c_field["name"]) == ("string", "io.debezium.time.ZonedTimestamp")
    assert schema["fields"][1]["fields"][0] == {"type": "int32", "optional": False, "field": "id"}


def test_partitioned_table_publishes_through_its_root(db, broker_servers, topic_prefix, run_daemon):
    db.execute("CREATE TABLE public.measures (id int, at date, v int, PRIMARY KEY (id, at)) PARTITION BY RANGE (at)")
    db.execute("CREATE TABLE public.measures_2023 PARTITION OF public.measures FOR VALUES FROM ('2023-01-01') TO ('2024-01-01')")
    db.execute("CREATE TABLE public.measures_2024 PARTITION OF public.measures FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')")
    daemon, slot = run_daemon(["public.*"])
    db.execute("INSERT INTO public.measures VALUES (1, '2023-05-01', 1), (2, '2024-05-01', 2)")
    db.execute("UPDATE public.measures SET at = '2024-06-01' WHERE id = 1")  # moves rows between partitions
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    records = topic_records(broker_servers, topic_prefix, "public", "measures")
    ops = [(k, v and v["op"]) for k, v in records]
    assert (b'{"id":2,"at":19844}', "c") in ops
    assert [op for k, op in ops if k == b'{"id":1,"at":19478}'] == ["c", "d", None]
    assert [op for k, op in ops if k == b'{"id":1,"at":19875}'] == ["c"]
    assert all(v is None or v["source"]["table"] == "measures" for _, v in records)


def test_idle_captured_table_lets_the_slot_advance(db, broker_servers, topic_prefix, run_daemon):
    db.execute("CREATE TABLE public.idle (id int PRIMARY KEY)")
    db.execute("CREATE TABLE public.busy (id int PRIMARY KEY)")
    daemon, slot = run_daemon(["public.idle"])
    before = confirmed_lsn(db.dsn, slot)
    db.execute("INSERT INTO public.busy SELECT generate_series(1, 5000)")  # WAL the slot does not capture
    target = current_lsn(db.dsn)
    wait_for(lambda: confirmed_lsn(db.dsn, slot) >= target, 30, "the slot to move past uncaptured WAL")
    assert confirmed_lsn(db.dsn, slot) > before
    assert daemon.stop() == 0


def test_record_too_large_stops_without_confirming(tmp_path, db, broker_servers, topic_prefix):
    db.execute("CREATE TABLE public.blobs (id int PRIMARY KEY, body text)")
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.blobs"],
        topic={"max_message_bytes": 20000},
    )
    slot = slot_of(topic_prefix)
    daemon = start_streaming(config, tmp_path / "daemon.log", db.dsn, slot)
    db.execute("INSERT INTO public.blobs VALUES (1, 'small')")
    wait_caught_up(db.dsn, slot, daemon)
    confirmed = confirmed_lsn(db.dsn, slot)
    db.execute("INSERT INTO public.blobs SELECT 2, string_agg(md5(g::text), '') FROM generate_series(1, 1000) g")
    committed = current_lsn(db.dsn)  # the end of the big transaction's commit record
    assert daemon.wait(60) == 1
    out = daemon.output()
    assert "record for table public.blobs key {\"id\":2} is" in out
    assert "raise [topic] max_message_bytes" in out
    # not confirmed past the record: nothing lost. The daemon may confirm WAL without changes
    # (a checkpoint's running-transactions record, a keepalive's position) up to the commit
    assert confirmed <= confirmed_lsn(db.dsn, slot) < committed
    # after raising the limit (topic and config), a restart delivers it
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=broker_servers)
    admin.alter_configs([ConfigResource(
        ConfigResourceType.TOPIC, topic_name(topic_prefix, "public", "blobs"), configs={"max.message.bytes": "200000"})])
    admin.close()
    result = cdc("config", "--config", str(config), env={"CDC_TOPIC_MAX_MESSAGE_BYTES": "200000"})
    assert '"max_message_bytes": 200000' in result.stdout
    daemon = DaemonProcess(config, tmp_path / "daemon.log", env={"CDC_TOPIC_MAX_MESSAGE_BYTES": "200000"}).start()
    wait_caught_up(db.dsn, slot, daemon)
    assert daemon.stop() == 0
    keys = [k for k, _ in topic_records(broker_servers, topic_prefix, "public", "blobs")]
    assert keys.count(b'{"id":2}') == 1
