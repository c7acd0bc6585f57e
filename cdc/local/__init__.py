"""Throwaway local services for the tests, the demo and the benchmarks: one module each.

`postgres` (initdb'd, wal_level=logical), `kafka` (Apache Kafka in KRaft mode),
`spark` (a standalone Master and Worker from pip's pyspark), `jars` (every JVM
artifact, pinned, fetched once by Maven; the jars Spark gets), `process` (what they share).
"""
