"""Change data capture: PostgreSQL logical decoding into compacted Kafka topics."""

__version__ = "0.1.0"
