"""tbmq_routing: topic validation, subscription trie, retained store and routing rules.

Pure Python, no I/O, no dependencies. Modules:

* ``tbmq_routing.topics``  -- topic name / filter validation, ``$share/`` parsing
* ``tbmq_routing.trie``    -- ``SubscriptionTrie``, ``Subscription``, ``RetainedStore``
* ``tbmq_routing.rules``   -- ``plan_routing`` -> ``RoutingPlan``, ``RoundRobin``, ``SessionView``
* ``tbmq_routing.naming``  -- ``app_topic_name``, ``shared_app_topic_name``, ``shared_store_id``,
  ``app_client_group``, ``app_shared_group``
* ``tbmq_routing.expiry``  -- the message expiry rule (``expired``, ``forwarded_interval``, ``store_ttl_ms``)
* ``tbmq_routing.origins`` -- ``OriginMarks``: one copy per tbmq.msg.all record (a router's replay dropped)
* ``python -m tbmq_routing.bench`` -- trie benchmark
"""

from . import expiry
from .naming import (app_client_group, app_shared_group, app_topic_name, is_reserved_client_id, shared_app_topic_name,
                     shared_store_id)
from .rules import (
    APPLICATION,
    DEVICE,
    AppDelivery,
    Delivery,
    PublishInfo,
    RoundRobin,
    RoutingPlan,
    SessionView,
    SharedAppCopy,
    SharedDeviceChoice,
    plan_routing,
)
from .topics import (
    InvalidSharedSubscription,
    InvalidTopicFilter,
    InvalidTopicName,
    ParsedFilter,
    TopicError,
    filter_covers,
    parse_subscription_filter,
    subscribed_to,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)
from .trie import RetainedStore, Subscription, SubscriptionTrie

__all__ = [
    "APPLICATION", "DEVICE", "AppDelivery", "Delivery", "PublishInfo", "RoundRobin", "RoutingPlan",
    "SessionView", "SharedAppCopy", "SharedDeviceChoice", "plan_routing",
    "InvalidSharedSubscription", "InvalidTopicFilter", "InvalidTopicName", "ParsedFilter", "TopicError",
    "filter_covers", "parse_subscription_filter", "subscribed_to", "topic_matches", "validate_topic_filter", "validate_topic_name",
    "RetainedStore", "Subscription", "SubscriptionTrie",
    "app_topic_name", "shared_app_topic_name", "shared_store_id", "app_client_group", "app_shared_group", "is_reserved_client_id",
    "expiry",
]
