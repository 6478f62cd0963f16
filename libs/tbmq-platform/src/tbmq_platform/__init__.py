"""Platform library shared by every tbmq-py service: settings, logging, telemetry, Kafka, tracing,
health endpoint, lifecycle, and the Kafka topic catalogue."""
