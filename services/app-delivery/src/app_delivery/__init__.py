"""app-delivery: per-client Kafka consumers of APPLICATION clients, streamed to connectors over gRPC."""
