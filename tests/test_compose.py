"""The compose files (docker/compose.yaml, docker/compose.prod.yaml), validated without an engine.

No image registry is reachable here, so the stack itself cannot start (the official
PostgreSQL, Kafka, OpenSearch and Redis images cannot be pulled; the project's own image is
run by tests/test_containers.py). Debian's docker-compose parses, merges, interpolates and
validates the files (`docker-compose config`); these tests read its result and check it
against the deployment page (docs/deployment.md), cdc's settings table and docker/.env.example.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from cdc.config import SETTINGS, load, store_sections
from cdc.local.process import require_command

pytestmark = pytest.mark.containers

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
BASE = (DOCKER / "compose.yaml",)
PROD = (*BASE, DOCKER / "compose.prod.yaml")
ENV_FILE = DOCKER / ".env.example"
SECRETS = {"POSTGRES_PASSWORD": "pg-secret", "REDIS_PASSWORD": "redis-secret", "READ_MODEL_PASSWORD": "rm-secret"}  # .env.example leaves them empty
store_sections()  # SETTINGS holds every store's settings from here on (the registry loads them on first use)
CAPTURE_IMAGE, SINKS_IMAGE = "pg-cdc-capture:latest", "pg-cdc-sinks:latest"
SPARK_SERVICES = ("spark-master", "spark-worker", "sink-delta", "sink-search", "sink-cache", "sink-postgres")


def compose_config(files: tuple[Path, ...], secrets: dict[str, str] = SECRETS) -> subprocess.CompletedProcess[str]:
    compose = require_command("docker-compose", "`apt-get install docker-compose` (it validates without an engine)")
    argv = [compose, "--env-file", str(ENV_FILE), "--project-directory", str(DOCKER)]
    for file in files:
        argv += ["-f", str(file)]
    env = {"PATH": "/usr/bin:/bin", **secrets}  # only .env.example and these: nothing from this shell
    return subprocess.run([*argv, "config"], capture_output=True, text=True, env=env, timeout=60, check=False)


def merged(files: tuple[Path, ...]) -> dict[str, Any]:
    done = compose_config(files)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return merged(BASE)


@pytest.fixture(scope="module")
def prod() -> dict[str, Any]:
    return merged(PROD)


def deployment_page() -> str:
    """The docs page the compose files are checked against."""
    return (ROOT / "docs" / "deployment.md").read_text()


def page_table(marker: str) -> list[list[str]]:
    """The rows of the table after `<!-- marker ... -->` on the deployment page."""
    after = deployment_page().split(f"<!-- {marker}", 1)[1].split("-->", 1)[1].strip()
    rows = []
    for line in after.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def named_volumes(service: dict[str, Any]) -> dict[str, str]:
    """volume name -> mount path of the service's named volumes (not its bind mounts)."""
    out = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if not source.startswith("/"):
            out[source] = target
    return out


def is_cdc(service: dict[str, Any]) -> bool:
    return service["image"] in (CAPTURE_IMAGE, SINKS_IMAGE) and service["command"][0] == "cdc"


def test_the_compose_files_validate_and_refuse_to_start_without_their_secrets() -> None:
    for files in (BASE, PROD):
        done = compose_config(files)
        assert done.returncode == 0, done.stderr
        done = compose_config(files, secrets={})
        assert done.returncode != 0
        assert "set POSTGRES_PASSWORD in docker/.env" in done.stderr


@pytest.mark.parametrize("shape", ["base", "prod"])
def test_the_daemon_runs_the_capture_image_and_the_spark_services_the_sinks_image(
    shape: str, request: pytest.FixtureRequest
) -> None:
    """The daemon needs no Spark and no JVM: its service builds the Dockerfile's `capture`
    target; the sink jobs, the master and the worker share the `sinks` one (executors run
    the driver's interpreter and packages)."""
    services = request.getfixturevalue(shape)["services"]
    built = {name: (s["image"], s["build"].get("target"), s["build"]["dockerfile"])
             for name, s in services.items() if "build" in s}
    assert built == {"cdc": (CAPTURE_IMAGE, "capture", "docker/Dockerfile"),
                     **{name: (SINKS_IMAGE, "sinks", "docker/Dockerfile") for name in SPARK_SERVICES}}


def test_every_service_restarts_checks_its_health_and_waits_for_what_it_needs(prod: dict[str, Any]) -> None:
    services = prod["services"]
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        for needed, how in service.get("depends_on", {}).items():
            assert how == {"condition": "service_healthy"}, (name, needed)
            assert needed in services, (name, needed)
    assert set(services["cdc"]["depends_on"]) == {"postgres", "kafka", "kafka-2", "kafka-3"}
    assert "redis" in services["sink-cache"]["depends_on"] and "opensearch" in services["sink-search"]["depends_on"]
    assert "read-model" in services["sink-postgres"]["depends_on"]
    postgres = " ".join(services["postgres"]["command"])
    assert "wal_level=logical" in postgres


def test_services_images_ports_and_volumes_are_the_docs(base: dict[str, Any], prod: dict[str, Any]) -> None:
    rows = page_table("compose services")
    documented = {ticked(row[0])[0]: row for row in rows}
    assert set(documented) == set(prod["services"])
    assert {name for name, row in documented.items() if ticked(row[1]) == ["compose.yaml"]} == set(base["services"])
    for name, service in prod["services"].items():
        _, _, image, _, port, volumes = documented[name]
        assert ticked(image) == [service["image"]], name
        published = [p.split(":")[1] for p in service.get("ports", [])]
        assert ([port] if port else []) == published, name
        assert sorted(ticked(volumes)) == sorted(named_volumes(service)), name


def test_volumes_mount_points_and_users_are_the_docs(base: dict[str, Any], prod: dict[str, Any]) -> None:
    users: dict[str, tuple[str, set[str]]] = {}
    for name, service in prod["services"].items():
        for volume, target in named_volumes(service).items():
            path, names = users.setdefault(volume, (target, set()))
            assert path == target, (volume, name)  # one mount point per volume
            names.add(name)
    rows = page_table("compose volumes")
    assert {ticked(row[0])[0]: (ticked(row[1])[0], set(ticked(row[2]))) for row in rows} == users
    assert set(prod["volumes"]) == set(users)
    shared = {name for name, volume in prod["volumes"].items() if volume.get("driver_opts")}
    assert shared == {"checkpoints", "warehouse"}
    assert {ticked(row[0])[0] for row in rows if "shared storage" in row[3]} == shared
    assert not any(volume and volume.get("driver_opts") for volume in base["volumes"].values())


#: the port an official image serves on (the others say theirs in their command or environment)
IMAGE_PORTS = {"postgres": 5432, "redis": 6379, "opensearchproject/opensearch": 9200}


def listens_on(service: dict[str, Any], port: int | None) -> bool:
    image = service["image"].rsplit(":", 1)[0]
    if image in IMAGE_PORTS:
        return port == IMAGE_PORTS[image]
    listeners = service.get("environment", {}).get("KAFKA_LISTENERS")
    if listeners:
        return f"PLAINTEXT://:{port}" in listeners.split(",")
    command = service.get("command", [])
    return "--port" in command and command[command.index("--port") + 1] == str(port)


@pytest.mark.parametrize("shape", ["base", "prod"])
def test_each_cdc_service_loads_the_mounted_config_and_reaches_the_stack(shape: str, request: pytest.FixtureRequest) -> None:
    """docker/cdc.toml with each cdc service's environment is a valid configuration whose
    endpoints are the stack's services and whose paths are the service's volumes."""
    stack = request.getfixturevalue(shape)
    services = stack["services"]
    cdc_services = {name: s for name, s in services.items() if is_cdc(s)}
    assert set(cdc_services) == {"cdc", "sink-delta", "sink-search", "sink-cache", "sink-postgres"}
    for name, service in cdc_services.items():
        mounts = dict(entry.split(":")[:2] for entry in service["volumes"])
        config_file = next(src for src, target in mounts.items() if target == "/etc/cdc/cdc.toml")
        assert Path(config_file) == DOCKER / "cdc.toml"
        environ = {key: str(value) for key, value in service["environment"].items()}
        known = {s.env for s in SETTINGS}
        assert set(environ) <= known, name
        config = load(config_file, environ=environ)  # every value checked, as the container does
        dsn = dict(part.split("=", 1) for part in config.source.dsn.split())
        assert listens_on(services[dsn["host"]], int(dsn["port"])) and dsn["password"] == SECRETS["POSTGRES_PASSWORD"]
        brokers = [server.split(":") for server in config.topic.bootstrap_servers.split(",")]
        assert {host for host, _ in brokers} == {n for n, s in services.items() if s["image"].startswith("apache/kafka")}
        assert all(listens_on(services[host], int(port)) for host, port in brokers)
        master = urlsplit(config.spark.master.replace("spark://", "http://"))
        assert listens_on(services[master.hostname], master.port)
        for url in (config.search.url, config.cache.url):
            assert listens_on(services[urlsplit(url).hostname], urlsplit(url).port)
        assert config.cache.password == SECRETS["REDIS_PASSWORD"]
        read_model = dict(part.split("=", 1) for part in config.postgres.dsn.split())
        assert listens_on(services[read_model["host"]], int(read_model["port"]))
        assert read_model["password"] == SECRETS["READ_MODEL_PASSWORD"]
        volumes = set(named_volumes(service).values())
        if name == "cdc":
            assert config.daemon.spill_dir in volumes
            assert service["ports"] == [f"127.0.0.1:{config.daemon.metrics_port}:{config.daemon.metrics_port}/tcp"]
            assert f":{config.daemon.metrics_port}/metrics" in service["healthcheck"]["test"][-1]
        else:
            assert config.spark.checkpoint_dir in volumes
            # each driver serves its metrics in its own container, for a scraper in the stack's network
            assert (config.spark.metrics_host, config.spark.metrics_port) == ("0.0.0.0", 9188)
            assert service["command"][1:3] == ["sink", name.removeprefix("sink-")]
            assert name.removeprefix("sink-") in service["healthcheck"]["test"][-1]
    # the executors write the Delta files the driver commits: the worker mounts the same warehouse
    warehouse = load(DOCKER / "cdc.toml", environ={"CDC_SOURCE_DSN": "host=x"}).delta.path
    assert warehouse in named_volumes(services["sink-delta"]).values()
    assert warehouse in named_volumes(services["spark-worker"]).values()
    if shape == "prod":
        config = load(DOCKER / "cdc.toml", environ={k: str(v) for k, v in services["cdc"]["environment"].items()})
        assert (config.topic.replication_factor, config.topic.min_insync_replicas) == (3, 2)


def test_the_production_shape_has_three_brokers_in_one_quorum(prod: dict[str, Any]) -> None:
    brokers = {n: s["environment"] for n, s in prod["services"].items() if s["image"].startswith("apache/kafka")}
    assert len(brokers) == 3
    assert sorted(env["KAFKA_NODE_ID"] for env in brokers.values()) == [1, 2, 3]
    voters = {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in brokers.values()}
    assert voters == {",".join(f"{env['KAFKA_NODE_ID']}@{n}:9093" for n, env in sorted(brokers.items()))}
    assert len({env["CLUSTER_ID"] for env in brokers.values()}) == 1
    for name, env in brokers.items():
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:9092"
        assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert (env["KAFKA_DEFAULT_REPLICATION_FACTOR"], env["KAFKA_MIN_INSYNC_REPLICAS"]) == (3, 2)
        assert (env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"], env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) == (3, 2)
    data = [named_volumes(prod["services"][name]) for name in brokers]
    assert all(list(volumes.values()) == ["/var/lib/kafka/data"] for volumes in data)
    assert len({name for volumes in data for name in volumes}) == 3  # a log directory each


def test_env_example_and_the_docs_name_every_variable_the_files_use() -> None:
    used = set()
    for file in PROD:
        used |= set(re.findall(r"\$\{([A-Z0-9_]+)", file.read_text()))
    example = {line.split("=", 1)[0] for line in ENV_FILE.read_text().splitlines() if re.match(r"[A-Z0-9_]+=", line)}
    assert example == used
    section = deployment_page()
    cdc_env = set()
    for file in PROD:
        cdc_env |= set(re.findall(r"^\s+(CDC_[A-Z0-9_]+):", file.read_text(), re.M))  # environment keys
    assert cdc_env and cdc_env <= {s.env for s in SETTINGS}
    assert {v for v in cdc_env if not re.search(f"`{v}[`=]", section)} == set()
