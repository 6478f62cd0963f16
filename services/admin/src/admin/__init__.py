"""admin: the suite's REST API (/api/v1) and web UI, read from the compacted topics, writing only through the
suite's own topics (docs/operations.md)."""
