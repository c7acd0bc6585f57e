"""Records into Kafka: the producer, Kafka's partitioner, the compacted topics and the acknowledgement bookkeeping."""
