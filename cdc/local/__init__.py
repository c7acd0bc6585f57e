"""Throwaway local services for the tests, the demo and the benchmarks: one module each.

`postgres` (initdb'd, wal_level=logical), `kafka` (Apache Kafka in KRaft mode),
`opensearch` (OpenSearch 2.19.3's integ-test distribution, single node),
`redis` (Debian's redis-server, no persistence), `spark` (a standalone Master and
Worker from pip's pyspark), `jars` (every JVM artifact, pinned, fetched once by Maven;
the jars Spark gets), `process` (what they share).
"""
