"""Kafka-safe names derived from client ids and filters, shared by several services.

The platform topic catalogue imports these; they live in ``rules.py`` with the routing rules.
"""

from .rules import (
    APP_TOPIC_PREFIX,
    KAFKA_TOPIC_MAX_LEN,
    SHARED_APP_TOPIC_PREFIX,
    SHARED_STORE_PREFIX,
    app_topic_name,
    shared_app_topic_name,
    shared_store_id,
)

__all__ = [
    "APP_TOPIC_PREFIX",
    "SHARED_APP_TOPIC_PREFIX",
    "SHARED_STORE_PREFIX",
    "KAFKA_TOPIC_MAX_LEN",
    "app_topic_name",
    "shared_app_topic_name",
    "shared_store_id",
]
