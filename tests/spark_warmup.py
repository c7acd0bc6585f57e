"""One warm-up shared by every Spark driver the tests start: a class-data archive and C1 only.

A driver JVM spends most of its start loading and verifying Spark's and Delta's classes,
and a short test job most of its CPU in the JIT's optimising compiler. The suite starts
dozens of drivers (`cdc sink` processes, rebuilds, `cdc delta ...`, the in-process session)
on two cores: each gets the classes of one archive (`-XX:SharedArchiveFile`, made once per
machine by a small Delta job run with `-XX:ArchiveClassesAtExit`) and stops at C1
(`-XX:TieredStopAtLevel=1`), through the product's own `[spark] driver_java_options`. A
missing or stale archive is ignored by the JVM (silently: `-Xlog:cds...=off`), so a driver
without it is slower, never wrong.

    python -m tests.spark_warmup      # make the archive (the test session does it when missing)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from cdc import jars
from cdc.local.process import QUICK_JIT

ENV = "CDC_SPARK_DRIVER_JAVA_OPTIONS"
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
JIT = QUICK_JIT  # C1 only, with the tiered code cache


def archive_path() -> Path:
    """Where the archive for this JDK, pyspark and jar set lives (a new one for any change)."""
    parts = [str(jars.java_home()), str(jars.spark_home()), *(jar.name for jar in jars.spark_jars())]
    tag = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
    return jars.cache_root() / "cds" / f"spark-{tag}.jsa"


def driver_options(archive: Path) -> str:
    return f"{JIT} -XX:SharedArchiveFile={archive} {QUIET}"


def ensure_archive() -> Path:
    """The archive, made first if missing (about a minute, once per machine). It is written
    under another name and renamed: a JVM mapping a half-written archive crashes."""
    archive = archive_path()
    if archive.is_file():
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
    env = {**os.environ, ENV: f"{JIT} -XX:ArchiveClassesAtExit={partial} {QUIET}"}
    done = subprocess.run([sys.executable, "-m", "tests.spark_warmup", "--workload"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"the Spark class-data archive was not made:\n{done.stderr[-3000:]}")
    partial.rename(archive)
    return archive


def _workload() -> None:
    """What a sink job's driver loads: a session with cdc's settings, Delta writes, a MERGE, reads."""
    import tempfile

    from delta.tables import DeltaTable

    from cdc.config import SparkConfig
    from sinks.spark import build_session, job_conf

    spark = build_session("cdc-class-archive", conf=job_conf(SparkConfig(driver_java_options=os.environ[ENV])))
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/t"
        spark.range(0, 100).selectExpr("id", "cast(id as string) AS v").write.format("delta").save(path)
        changes = spark.range(50, 150).selectExpr("id", "'x' AS v")
        DeltaTable.forPath(spark, path).alias("t").merge(changes.alias("s"), "t.id = s.id") \
            .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
        DeltaTable.forPath(spark, path).delete("id < 10")
        assert spark.read.format("delta").load(path).count() == 140
    spark.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["--workload"]:
        _workload()
    else:
        print(ensure_archive())
