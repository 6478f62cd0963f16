"""Kafka-safe names derived from client ids and filters (topics, consumer groups, store ids), shared by
several services: each is computed here only.

The platform topic catalogue imports these; they live in ``rules.py`` with the routing rules.
"""

from .rules import (
    APP_CLIENT_GROUP_PREFIX,
    APP_SHARED_GROUP_PREFIX,
    APP_TOPIC_PREFIX,
    HASHED_PREFIX,
    KAFKA_TOPIC_MAX_LEN,
    RESERVED_CLIENT_ID_PREFIXES,
    SHARED_APP_TOPIC_PREFIX,
    SHARED_STORE_PREFIX,
    app_client_group,
    app_shared_group,
    app_topic_name,
    is_reserved_client_id,
    shared_app_topic_name,
    shared_store_id,
)

__all__ = [
    "APP_CLIENT_GROUP_PREFIX",
    "APP_SHARED_GROUP_PREFIX",
    "app_client_group",
    "app_shared_group",
    "APP_TOPIC_PREFIX",
    "SHARED_APP_TOPIC_PREFIX",
    "SHARED_STORE_PREFIX",
    "KAFKA_TOPIC_MAX_LEN",
    "HASHED_PREFIX",
    "RESERVED_CLIENT_ID_PREFIXES",
    "is_reserved_client_id",
    "app_topic_name",
    "shared_app_topic_name",
    "shared_store_id",
]
