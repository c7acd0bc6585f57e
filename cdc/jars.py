"""Every JVM artifact the project runs, pinned in one table, fetched once by Maven.

The broker, Spark's Kafka source, Delta's jars and the search server all come from
Maven Central. `mvn dependency:copy-dependencies` resolves each bundle with its
transitive dependencies into a cache outside the clone (``$CDC_JAR_CACHE``, else
``~/.cache/cdc/jvm``), one folder per bundle and pinned version set, so a second
run costs nothing and a version bump never mixes with old jars. Spark never
resolves anything itself (no Ivy): it gets these jars as local files, minus the
ones pip's pyspark already ships (`spark_jars`).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from xml.sax.saxutils import escape

from cdc.machine import ServiceUnavailable, require_command

#: bundle -> Maven coordinates (group:artifact:version), resolved with their runtime deps
BUNDLES: dict[str, tuple[str, ...]] = {
    # Apache Kafka, KRaft broker; Kafka 4.1 brings slf4j-api 1.7, hence the 1.x binding.
    "kafka": (
        "org.apache.kafka:kafka_2.13:4.1.1",
        "org.apache.logging.log4j:log4j-core:2.24.3",
        "org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",
    ),
    # Spark 4.2's Kafka source and Delta Lake 4.4.0 (the first built for Spark 4.2;
    # delta-spark 4.4.1 on PyPI has no jars on Maven Central).
    "spark": (
        "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0",
        "io.delta:delta-spark_4.2_2.13:4.4.0",
    ),
    # Kafka Connect standalone (the worker that runs the Debezium connector, the tests'
    # oracle), the same Kafka version as the broker, with the broker's log4j2 binding.
    "connect": (
        "org.apache.kafka:connect-runtime:4.1.1",
        "org.apache.kafka:connect-json:4.1.1",
        "org.apache.logging.log4j:log4j-core:2.24.3",
        "org.apache.logging.log4j:log4j-slf4j-impl:2.24.3",
    ),
}

#: distribution -> the zip's coordinates (group:artifact:version:zip), unpacked once
DISTRIBUTIONS: dict[str, str] = {
    # The integration-test distribution: one module (transport-netty4), no plugins.
    "opensearch": "org.opensearch.distribution.integ-test-zip:opensearch:2.19.3:zip",
    # Debezium's PostgreSQL connector as a Connect plugin folder: the plain jar's transitive
    # resolution fails on a dependency that is not on Maven Central; the tarball has all.
    "debezium-postgres": "io.debezium:debezium-connector-postgres:3.3.1.Final:tar.gz:plugin",
}

JDK_MAJOR = 17  # OpenSearch 2.x refuses newer JDKs' ergonomics; Kafka 4 and Spark 4 run on it


def cache_root() -> Path:
    return Path(os.environ.get("CDC_JAR_CACHE") or Path.home() / ".cache" / "cdc" / "jvm")


def java_home() -> Path:
    """A JDK 17 home: ``$CDC_JAVA_HOME``, else the system's under /usr/lib/jvm."""
    env = os.environ.get("CDC_JAVA_HOME")
    if env:
        if not (Path(env) / "bin" / "java").is_file():
            raise ServiceUnavailable(f"CDC_JAVA_HOME={env} has no bin/java")
        return Path(env)
    for cand in sorted(glob.glob(f"/usr/lib/jvm/*{JDK_MAJOR}*")):
        if (Path(cand) / "bin" / "java").is_file():
            return Path(cand)
    raise ServiceUnavailable(
        f"no Java {JDK_MAJOR} under /usr/lib/jvm: `apt-get install openjdk-{JDK_MAJOR}-jdk-headless` "
        f"(or set CDC_JAVA_HOME to a JDK {JDK_MAJOR})"
    )


def java() -> str:
    return str(java_home() / "bin" / "java")


def _version_tag(items: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One fetcher at a time per cache folder (tests, the demo and CI may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _mvn(args: list[str], workdir: Path, what: str) -> None:
    mvn = require_command("mvn", "`apt-get install maven` (it fetches the JVM parts from Maven Central)")
    env = {**os.environ, "JAVA_HOME": str(java_home())}
    result = subprocess.run(
        [mvn, "-q", "-B", *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        lines = [ln.strip() for ln in (result.stdout + result.stderr).splitlines() if "ERROR" in ln]
        raise ServiceUnavailable(f"mvn could not fetch {what}: {' | '.join(lines[-3:]) or 'exit ' + str(result.returncode)}")


def _pom(bundle: str, coords: tuple[str, ...]) -> str:
    deps = []
    for coord in coords:
        group, artifact, version = coord.split(":")
        deps.append(
            f"<dependency><groupId>{escape(group)}</groupId><artifactId>{escape(artifact)}</artifactId>"
            f"<version>{escape(version)}</version></dependency>"
        )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        f"<groupId>cdc.local</groupId><artifactId>{bundle}</artifactId><version>1</version>"
        f"<packaging>pom</packaging><dependencies>{''.join(deps)}</dependencies></project>\n"
    )


def bundle_dir(bundle: str) -> Path:
    """The folder holding every jar of `bundle` (fetched on first use)."""
    coords = BUNDLES[bundle]
    target = cache_root() / f"{bundle}-{_version_tag(coords)}"
    if (target / ".complete").exists():
        return target
    with _locked(target):
        if (target / ".complete").exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            work = Path(tmp)
            (work / "pom.xml").write_text(_pom(bundle, coords))
            out = work / "jars"
            _mvn(
                ["dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={out}"],
                work,
                f"the {bundle} jars ({', '.join(coords)})",
            )
            (out / ".complete").write_text("\n".join(coords) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            out.rename(target)
    return target


def bundle_jars(bundle: str) -> list[Path]:
    return sorted(bundle_dir(bundle).glob("*.jar"))


def spark_home() -> Path:
    """The installed pyspark folder: a complete SPARK_HOME (bin/, jars/) without a download."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise ServiceUnavailable("pyspark is not installed: `pip install -e '.[sinks]'`")
    return Path(spec.origin).parent


#: ``artifact-version[-classifier].jar`` as Maven names copied jars (and pyspark's jars/ is named)
_JAR_NAME = re.compile(r"^(?P<artifact>.+)-\d+\.[^-]*(?:-.+)?\.jar$")


def _artifact(jar: Path) -> str:
    match = _JAR_NAME.match(jar.name)
    return match["artifact"] if match else jar.stem


def spark_jars() -> list[Path]:
    """The `spark` bundle's jars that pyspark lacks, for ``spark.jars``.

    The bundle also brings older Hadoop, Jackson, Parquet, Scala, slf4j, ... that
    pyspark's jars/ already has in the versions Spark was built with: any artifact
    present there is dropped, whatever its version, so only the Kafka source,
    Delta and their own dependencies travel to the driver and the executors.
    """
    shipped = {_artifact(jar) for jar in (spark_home() / "jars").glob("*.jar")}
    return [jar for jar in bundle_jars("spark") if _artifact(jar) not in shipped]


def bake_spark_jars() -> list[Path]:
    """Fetch the `spark` bundle into the cache and delete the jars Spark never gets.

    For an image (docker/Dockerfile): the cache folder then holds only `spark_jars()`,
    still marked complete, so a container finds them with ``$CDC_JAR_CACHE`` and never
    runs Maven.
    """
    keep = set(spark_jars())
    for jar in bundle_jars("spark"):
        if jar not in keep:
            jar.unlink()
    return sorted(keep)


def distribution_home(name: str) -> Path:
    """The unpacked home folder of distribution `name` (a zip or a tar.gz, fetched and
    unpacked on first use)."""
    coord = DISTRIBUTIONS[name]
    target = cache_root() / f"{name}-{_version_tag((coord,))}"
    if (target / ".complete").exists():
        return _only_child(target)
    with _locked(target):
        if not (target / ".complete").exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                work = Path(tmp)
                _mvn(
                    ["dependency:copy", f"-Dartifact={coord}", f"-DoutputDirectory={work}"],
                    work,
                    f"the {name} distribution ({coord})",
                )
                (archive,) = [p for p in work.iterdir() if p.name.endswith((".zip", ".tar.gz"))]
                out = work / "home"
                if archive.name.endswith(".zip"):
                    _unzip(archive, out)
                else:
                    with tarfile.open(archive) as tf:
                        tf.extractall(out, filter="tar")
                (out / ".complete").write_text(coord + "\n")
                shutil.rmtree(target, ignore_errors=True)
                out.rename(target)
    return _only_child(target)


def _unzip(archive: Path, dest: Path) -> None:
    """Unzip keeping the executable bits (zipfile alone drops them)."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            path = Path(zf.extract(info, dest))
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                path.chmod(mode)


def _only_child(folder: Path) -> Path:
    (home,) = [p for p in folder.iterdir() if p.is_dir()]
    return home
