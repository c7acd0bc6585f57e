"""The source side: PostgreSQL's replication stream, its decoder, the catalog, preflight checks and spilled transactions."""
