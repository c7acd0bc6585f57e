"""Changes into events: PostgreSQL values to Debezium's JSON, the change rules, the records each change becomes."""
