"""Snapshots aligned to the replication slot (initial and incremental); see docs/design.md."""
