"""Files through Hadoop's FileSystem, from the driver: a local folder or any URI Spark can
write (the checkpoints, the warehouse's bookkeeping)."""

from __future__ import annotations

import time
from typing import Any

from pyspark.sql import SparkSession


def under(root: str, part: str) -> str:
    """`part` inside the folder `root` (which may end in a slash)."""
    return f"{root.rstrip('/')}/{part}"


def filesystem(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's FileSystem for `path`, and the path."""
    jvm, jsc = spark._jvm, spark._jsc
    assert jvm is not None and jsc is not None
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    return hadoop_path.getFileSystem(jsc.hadoopConfiguration()), hadoop_path


def exists(spark: SparkSession, path: str) -> bool:
    fs, where = filesystem(spark, path)
    return bool(fs.exists(where))


def names(spark: SparkSession, folder: str) -> list[str]:
    """The names in a folder ([] when there is none)."""
    fs, where = filesystem(spark, folder)
    if not fs.exists(where):
        return []
    return [status.getPath().getName() for status in fs.listStatus(where)]


def folders(spark: SparkSession, folder: str) -> list[str]:
    """The paths of the folders in a folder ([] when there is none)."""
    fs, where = filesystem(spark, folder)
    if not fs.exists(where):
        return []
    return [status.getPath().toString() for status in fs.listStatus(where) if status.isDirectory()]


def rename(spark: SparkSession, path: str, to: str) -> None:
    """Move a file or folder (one step on a local or HDFS file system; a copy on object stores)."""
    fs, where = filesystem(spark, path)
    jvm = spark._jvm
    assert jvm is not None
    target = jvm.org.apache.hadoop.fs.Path(to)
    fs.mkdirs(target.getParent())
    if not fs.rename(where, target):
        raise OSError(f"could not move {path} to {to}")


def delete(spark: SparkSession, path: str) -> None:
    """A file, or a folder with everything in it (nothing when it is not there)."""
    fs, where = filesystem(spark, path)
    fs.delete(where, True)


def age_s(spark: SparkSession, path: str) -> float | None:
    """Seconds since the file at `path` was last written (None: no file)."""
    fs, where = filesystem(spark, path)
    if not fs.exists(where):
        return None
    try:
        written = fs.getFileStatus(where).getModificationTime()
    except Exception as exc:  # py4j's error for Java's FileNotFoundException: deleted meanwhile
        if "FileNotFoundException" in str(exc):
            return None
        raise
    return max(0.0, time.time() - written / 1000)


def read_bytes(spark: SparkSession, path: str) -> bytes | None:
    fs, where = filesystem(spark, path)
    if not fs.exists(where):
        return None
    stream = fs.open(where)
    try:
        jvm = spark._jvm
        assert jvm is not None
        return bytes(jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def write_bytes(spark: SparkSession, path: str, data: bytes) -> None:
    """Replace the file at `path` in one step: written beside it, then renamed over it (a
    reader finds the old content or the new one, on file systems whose rename is atomic)."""
    jvm, jsc = spark._jvm, spark._jsc
    assert jvm is not None and jsc is not None
    fs, where = filesystem(spark, path)
    written = jvm.org.apache.hadoop.fs.Path(path + ".writing")
    out = fs.create(written, True)
    try:
        out.write(bytearray(data))
    finally:
        out.close()
    context = jvm.org.apache.hadoop.fs.FileContext.getFileContext(where.toUri(), jsc.hadoopConfiguration())
    rename = jvm.org.apache.hadoop.fs.Options.Rename
    overwrite = spark.sparkContext._gateway.new_array(rename, 1)  # type: ignore[union-attr]
    overwrite[0] = rename.OVERWRITE
    context.rename(written, where, overwrite)
