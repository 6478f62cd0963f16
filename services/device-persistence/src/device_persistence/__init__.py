"""device-persistence: the Redis store of persistent DEVICE sessions (see docs/device-persistence.md)."""
