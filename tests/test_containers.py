"""The project's two images (docker/Dockerfile) built here and run as the compose stack runs them.

podman with runc, the images built FROM a Debian base made by debootstrap (no registry is
reachable here), containers on the host's network (cdc.local.containers). The stack's cdc
parts run in containers against the test services: `cdc run` from the capture image
captures into the test Kafka, a Spark master and worker from the sinks image take `cdc
sink cache` submitted from a third container, and Redis then equals PostgreSQL. One build
of each image for the session.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from cdc import __version__, jars
from cdc.local import containers
from cdc.local.containers import Container
from cdc.local.process import LOCALHOST, free_port
from cdc.local.redis import LocalRedis
from tests.support import (
    ACCT,
    acct_rows,
    slot_active,
    slot_of,
    wait_caught_up,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.containers

CONFIG = "/etc/cdc/cdc.toml"
HEALTHCHECK = ["python", "/opt/cdc/healthcheck.py"]


#: The capture image's size bound. Measured: 245 MB (the Debian base 121 MB, Debian's Python
#: 3.11 and CA certificates 51 MB, the venv 73 MB), so about 20% to grow; pyspark (485 MB),
#: a JRE (184 MB) or apt's caches left in a layer (90 MB) alone break it.
CAPTURE_IMAGE_MAX_BYTES = 300_000_000


@pytest.fixture(scope="session")
def capture_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The daemon's image, built once per session (from cached layers when nothing changed)."""
    return containers.build_image("capture", log=tmp_path_factory.mktemp("image") / "build-capture.log")


@pytest.fixture(scope="session")
def sinks_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The sink jobs' and Spark's image, built once per session."""
    return containers.build_image("sinks", log=tmp_path_factory.mktemp("image") / "build-sinks.log")


def _in_image(image: str, *argv: str, network: str = "none") -> str:
    done = containers.podman("run", "--rm", *containers.ULIMITS, "--network", network, image, *argv)
    return done.stdout


def test_the_sinks_image_runs_as_a_user_with_the_c_accelerator_and_spark_jars_baked_in(sinks_image: str) -> None:
    assert _in_image(sinks_image, "cdc", "--version").strip() == f"cdc {__version__} (C accelerator)"
    assert _in_image(sinks_image, "id", "-un").strip() == "cdc"
    # no network at all: the jars Spark gets are in the image, the very ones it gets here
    probe = "from cdc import jars; print('\\n'.join(sorted(p.name for p in jars.spark_jars())))"
    assert _in_image(sinks_image, "python", "-c", probe).split() == sorted(p.name for p in jars.spark_jars())
    assert _in_image(sinks_image, "sh", "-c", "command -v mvn javac gcc || echo none").split() == ["none"]


def test_the_capture_image_is_small_and_holds_no_spark_no_java_no_jars(capture_image: str) -> None:
    assert _in_image(capture_image, "cdc", "--version").strip() == f"cdc {__version__} (C accelerator)"
    assert _in_image(capture_image, "id", "-un").strip() == "cdc"
    size = int(containers.podman("image", "inspect", "--format", "{{.Size}}", capture_image).stdout)
    assert size < CAPTURE_IMAGE_MAX_BYTES, f"{size / 1e6:.0f} MB"
    for module in ("pyspark", "delta", "deltalake", "pyarrow"):
        done = containers.podman("run", "--rm", *containers.ULIMITS, "--network", "none", capture_image,
                                 "python", "-c", f"import {module}", check=False)
        assert done.returncode != 0 and f"No module named '{module}'" in done.stderr, module
    probe = "command -v java mvn javac gcc spark-submit; find / -xdev -name '*.jar' 2>/dev/null; true"
    assert _in_image(capture_image, "sh", "-c", probe).split() == []


@pytest.mark.parametrize("target", ["capture", "sinks"])
def test_the_build_secret_stays_out_of_the_image(target: str, request: pytest.FixtureRequest) -> None:
    """The machine's own CAs (the bundle pip and Maven trusted during the build) are in no file."""
    image = request.getfixturevalue(f"{target}_image")
    local_cas = sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt"))
    assert local_cas, "this check needs a local CA on the host (/usr/local/share/ca-certificates)"
    marks = [ca.read_text().split("-----BEGIN CERTIFICATE-----")[1].split()[0] for ca in local_cas]
    grep = " ".join(f"-e {mark}" for mark in marks)
    found = _in_image(image, "sh", "-c", f"grep -rlF {grep} /etc /opt /usr/local /var /tmp 2>/dev/null || true")
    assert found.split() == []


def cached_acct(client: redis.Redis, prefix: str) -> dict[int, tuple[int, str]]:
    """`public.acct` as GET readers see it in Redis now (a key deleted between SCAN and GET
    is not there), id -> (version, note)."""
    rows = {}
    for key in client.scan_iter(match=f"{prefix}.public.acct:*", count=1000):
        value = client.get(key)
        if value is not None:
            row = orjson.loads(value)
            rows[row["id"]] = (row["version"], row["note"])
    return rows


@dataclass
class SparkInContainers:
    url: str  # spark://...
    ui: str  # the master's web UI, what the compose health checks ask
    master: Container


@pytest.fixture
def spark_in_containers(sinks_image: str) -> Iterator[SparkInContainers]:
    """A Spark master and worker, each a container of the sinks image as in docker/compose.yaml,
    once the master's health check passes (a worker registered)."""
    port, ui, worker_ui = free_port(), free_port(), free_port()
    env = {"SPARK_LOCAL_IP": LOCALHOST}
    master = Container(sinks_image, [
        "spark-class", "org.apache.spark.deploy.master.Master", "--host", LOCALHOST, "--port", str(port),
        "--webui-port", str(ui)], env=env)
    worker = Container(sinks_image, [
        "spark-class", "org.apache.spark.deploy.worker.Worker", f"spark://{LOCALHOST}:{port}",
        "--cores", "2", "--memory", "2g", "--webui-port", str(worker_ui), "--work-dir", "/var/lib/cdc/spark"], env=env)
    with master, worker:
        cluster = SparkInContainers(f"spark://{LOCALHOST}:{port}", f"http://{LOCALHOST}:{ui}", master)
        healthy = [*HEALTHCHECK, "spark-master", cluster.ui]
        wait_for(lambda: master.exec(*healthy).returncode == 0 or not (master.running() and worker.running()),
                 240, "the Spark master with a live worker")
        assert master.exec(*healthy).returncode == 0, master.logs()[-3000:] + worker.logs()[-3000:]
        assert worker.exec(*HEALTHCHECK, "url", f"http://{LOCALHOST}:{worker_ui}/json/").returncode == 0
        yield cluster


def test_the_daemon_and_a_sink_job_in_containers_keep_redis_equal_to_postgres(
    capture_image: str, sinks_image: str, spark_in_containers: SparkInContainers, tmp_path: Path, db: Any, broker_servers: str, topic_prefix: str,
    redis_server: LocalRedis,
) -> None:
    db.execute(ACCT)
    db.execute("INSERT INTO public.acct SELECT g, 1, 'n' || g FROM generate_series(1, 300) g")
    cluster = spark_in_containers
    metrics = free_port()
    config = write_config(
        tmp_path / "cdc.toml", db.dsn, broker_servers, topic_prefix, ["public.*"],
        daemon={"spill_dir": "/var/lib/cdc/spill", "metrics_port": metrics},
        spark={"master": cluster.url, "checkpoint_dir": "/var/lib/cdc/checkpoints"},
        cache={"url": redis_server.url},
    )
    mounted = {config: f"{CONFIG}:ro"}
    checkpoints = containers.writable_by_image_user(tmp_path / "checkpoints", sinks_image)
    client = redis.Redis.from_url(redis_server.url)

    def sink(*args: str) -> Container:
        return Container(sinks_image, ["cdc", "sink", "cache", *args, "--config", CONFIG],
                         env={"SPARK_LOCAL_IP": LOCALHOST}, volumes={**mounted, checkpoints: "/var/lib/cdc/checkpoints"})

    # the daemon from the capture image (no Spark, no JVM), the sink job from the sinks image
    with Container(capture_image, ["cdc", "run", "--config", CONFIG], volumes=mounted) as daemon:
        slot = slot_of(topic_prefix)
        wait_for(lambda: slot_active(db.dsn, slot) or not daemon.running(), 120, "the daemon to stream")
        assert daemon.running(), daemon.logs()[-3000:]
        # the compose file's health check of the daemon: its metrics endpoint answers
        assert daemon.exec(*HEALTHCHECK, "url", f"http://{LOCALHOST}:{metrics}/metrics").returncode == 0
        db.execute("UPDATE public.acct SET version = 2, note = 'u' WHERE id % 5 = 0")
        db.execute("DELETE FROM public.acct WHERE id % 7 = 0")
        db.execute("UPDATE public.acct SET id = 1000 WHERE id = 1")  # a key change
        wait_caught_up(db.dsn, slot)

        done = sink("--once").run()
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        assert re.search(r"sink cache: \d+ batches, 1 tables, complete up to LSN \S+, 0 dead letters", done.stdout)
        assert cached_acct(client, topic_prefix) == acct_rows(db)
        assert "Registering app cdc-sink-cache" in cluster.master.logs()  # submitted to the cluster
        assert (checkpoints / "cache" / "commits").is_dir()

        # as the compose stack runs it: streaming, resumed from its checkpoint on the mounted
        # volume, healthy while it runs, stopped by SIGTERM
        with sink() as job:
            db.execute("INSERT INTO public.acct SELECT g, 1, 'late' FROM generate_series(301, 350) g")
            db.execute("DELETE FROM public.acct WHERE id BETWEEN 10 AND 19")
            wait_for(lambda: cached_acct(client, topic_prefix) == acct_rows(db) or not job.running(), 300,
                     "the streaming job to apply the new changes")
            assert job.running(), job.logs()[-4000:]
            healthy = job.exec(*HEALTHCHECK, "spark-app", cluster.ui, "cdc-sink-cache")
            assert healthy.returncode == 0, healthy.stderr
            assert job.stop(timeout_s=120) == 0, job.logs()[-4000:]

        assert daemon.stop() == 0  # SIGTERM: a clean stop
