"""The compacted topic as a table, between the topics and the sinks.

- `table`: a table topic folded into what compaction converges to (every reader's one view);
- `truncates`: tombstones for the rows a truncate removed, written in the daemon's order;
- `horizon`: how far behind each sink is, in time, against `delete.retention.ms`;
- `canonical`, `verify`, `verify_topic`: `cdc verify`'s canonical row form, its comparison
  of digests and rounds, and the topics' side of it.

It imports only what is upstream of it (configuration, events, the Kafka side): no
PostgreSQL client, no Spark. The topic policy lives with the topics (cdc.kafka.policy).
"""
