"""The topic as a table: latest value per key, tombstones delete, truncates by position."""
