"""connector: MQTT 3.1 / 3.1.1 / 5.0 termination bridged to Kafka and gRPC (see docs/connector.md)."""
