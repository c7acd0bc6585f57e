"""Throwaway local services for the tests, the demo and the benchmarks: one module each.

`postgres` (initdb'd, wal_level=logical), `kafka` (Apache Kafka in KRaft mode),
`jars` (every JVM artifact, pinned, fetched once by Maven), `process` (what they share).
"""
