"""session-registry: the authority on MQTT sessions (docs/session-registry.md)."""
