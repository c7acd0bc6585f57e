"""The Spark stack the sink jobs stand on, with real parts: Kafka, Spark, Delta, delta-rs, DuckDB.

One `local[2]` session for the module (a session start costs 10-50 s here) and one
standalone cluster; the cluster's drivers are separate processes, as a Python
process holds one SparkContext.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer

from cdc import jars
from cdc.config import TopicConfig
from cdc.kafka.topics import TopicAdmin
from cdc.local.spark import LocalSparkCluster

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 600  # a driver start plus a few Delta commits, on a busy 2-core machine

# (id, name, pos, op): position-ordered per key, as the capture side writes them.
FIRST = [(1, "a", 10, "c"), (2, "b", 11, "c"), (3, "c", 12, "c"), (1, "a2", 13, "u"), (4, "d", 14, "c")]
FIRST_ROWS = [[1, "a2", 13], [2, "b", 11], [3, "c", 12], [4, "d", 14]]
# A replayed older change of id 1 must not win over the stored position 13.
SECOND = [(2, "b2", 20, "u"), (3, None, 21, "d"), (1, "stale", 9, "u"), (5, "e", 22, "c"), (4, "d2", 23, "u")]
FINAL_ROWS = [[1, "a2", 13], [2, "b2", 20], [4, "d2", 23], [5, "e", 22]]

_DELTA_RS_READ = """
import json, os, sys
import duckdb
from deltalake import DeltaTable
t = DeltaTable(sys.argv[1]).to_pyarrow_table()
rows = sorted([r["id"], r["name"], r["pos"]] for r in t.to_pylist())
via_duckdb = duckdb.sql("SELECT id, name, pos FROM t ORDER BY id").fetchall()
sys.stdout.write(json.dumps({"deltalake": rows, "duckdb": [list(r) for r in via_duckdb]}))
sys.stdout.flush()
os._exit(0)  # delta-rs can abort at interpreter exit after a read (status 134)
"""


def _record(change: tuple[int, str | None, int, str]) -> tuple[str, str]:
    ident, name, pos, op = change
    key = json.dumps({"id": ident}, separators=(",", ":"))
    value = json.dumps({"id": ident, "name": name, "pos": pos, "op": op}, separators=(",", ":"))
    return key, value


def _create_topic(servers: str, topic: str) -> None:
    admin = TopicAdmin(TopicConfig(bootstrap_servers=servers, partitions=2))
    try:
        admin.ensure([topic])
    finally:
        admin.close()


def _produce(servers: str, topic: str, changes: list[tuple[int, str | None, int, str]]) -> None:
    producer = KafkaProducer(bootstrap_servers=servers, acks="all")
    try:
        for key, value in map(_record, changes):
            producer.send(topic, key=key.encode(), value=value.encode())
        producer.flush()
    finally:
        producer.close()


def _as_lists(rows: list[Any]) -> list[list[Any]]:
    return [list(row) for row in rows]


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a child to completion in `cwd` (Spark drops a spark-warehouse/ there); its stdout."""
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert result.returncode == 0, f"{argv[:3]} exited {result.returncode}: {result.stderr[-3000:]}"
    return result.stdout


def _child_env() -> dict[str, str]:
    """This worktree's packages first, whatever is installed (editable) elsewhere."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_spark_gets_only_the_jars_pyspark_lacks() -> None:
    """The bundle's older Hadoop, Jackson, Parquet, Scala, slf4j, ... stay out of spark.jars."""
    kept = jars.spark_jars()
    assert all(jar.is_file() for jar in kept)
    assert {jar.name.rsplit("-", 1)[0] for jar in kept} == {
        "commons-pool2", "delta-kernel-api", "delta-kernel-defaults", "delta-kernel-unitycatalog",
        "delta-spark_4.2_2.13", "delta-storage", "jackson-datatype-jdk8", "javax.annotation-api",
        "kafka-clients", "shims", "spark-sql-kafka-0-10_2.13", "spark-token-provider-kafka-0-10_2.13",
        "unitycatalog-client", "unitycatalog-hadoop",
    }


def test_submit_command_carries_the_session_settings() -> None:
    from sinks.spark import session_conf, submit_command
    from sinks.spark_log import config_file

    argv = submit_command("job.py", ["--once"], app_name="job", master="spark://127.0.0.1:7077")
    assert argv[0] == str(jars.spark_home() / "bin" / "spark-submit")
    assert argv[1:5] == ["--master", "spark://127.0.0.1:7077", "--name", "job"]
    assert argv[-2:] == ["job.py", "--once"]
    confs = dict(arg.split("=", 1) for arg in argv[6:-2:2])
    expected = session_conf("job", "spark://127.0.0.1:7077")
    assert confs == {k: v for k, v in expected.items() if k not in ("spark.master", "spark.app.name")}
    assert confs["spark.driver.extraJavaOptions"] == f"-Xss16m -Dlog4j2.configurationFile={config_file('text')}"


@pytest.mark.slow
def test_kafka_to_delta_merge_on_local_session(spark: Any, broker_servers: str, topic_prefix: str, tmp_path: Path) -> None:
    from tests.spark_kafka_delta import apply_topic, read_batch, table_rows

    topic, table, checkpoint = f"{topic_prefix}.public.items", str(tmp_path / "items"), str(tmp_path / "ckpt")
    _create_topic(broker_servers, topic)
    _produce(broker_servers, topic, FIRST)
    jvm_args = str(spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert "-Xss16m" in jvm_args

    assert read_batch(spark, broker_servers, topic) == sorted(map(_record, FIRST))
    assert apply_topic(spark, broker_servers, topic, table, checkpoint) == [0]
    assert _as_lists(table_rows(spark, table)) == FIRST_ROWS

    _produce(broker_servers, topic, SECOND)
    assert apply_topic(spark, broker_servers, topic, table, checkpoint) == [1]  # resumed, not replayed
    assert _as_lists(table_rows(spark, table)) == FINAL_ROWS

    outside_spark = json.loads(_run([sys.executable, "-c", _DELTA_RS_READ, table], tmp_path))
    assert outside_spark == {"deltalake": FINAL_ROWS, "duckdb": FINAL_ROWS}


@pytest.mark.slow
def test_kafka_to_delta_merge_on_standalone_cluster(
    spark_cluster: LocalSparkCluster, broker_servers: str, topic_prefix: str, tmp_path: Path
) -> None:
    topic = f"{topic_prefix}.public.items"
    _create_topic(broker_servers, topic)
    _produce(broker_servers, topic, FIRST + SECOND)
    out = _run(
        [
            sys.executable, "-m", "tests.spark_kafka_delta",
            "--master", spark_cluster.master_url,
            "--servers", broker_servers,
            "--topic", topic,
            "--table", str(tmp_path / "items"),
            "--checkpoint", str(tmp_path / "ckpt"),
        ],
        tmp_path,
        _child_env(),
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["master"] == spark_cluster.master_url
    assert result["batch"] == _as_lists(sorted(map(_record, FIRST + SECOND)))
    assert result["batch_ids"] == [0]
    assert result["rows"] == FINAL_ROWS  # one batch, the same end state as two
    assert "Registering app test-kafka-delta-driver" in (spark_cluster.work_dir / "master.log").read_text()


@pytest.mark.slow
def test_spark_submit_to_standalone_cluster(spark_cluster: LocalSparkCluster, tmp_path: Path) -> None:
    from sinks.spark import spark_environment, submit_command

    argv = submit_command(ROOT / "tests" / "spark_submit_job.py", app_name="test-submit", master=spark_cluster.master_url)
    out = _run(argv, tmp_path, {**_child_env(), **spark_environment()})
    assert f"RESULT master={spark_cluster.master_url} sum=338350 executor_python={sys.executable}" in out
