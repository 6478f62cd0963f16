"""Pure glue between the protobuf contracts and tbmq_routing (no I/O, no Faust).

* tbmq.client.subscriptions records -> (filter, Subscription) pairs for ``SubscriptionTrie.replace_client``;
* tbmq.client.session records -> ``rules.SessionView``;
* a ``RoutingPlan`` -> the Kafka records to produce (``OutRecord``), one per destination record:
  one BasicDownlink per connector (all its live recipients), one PersistedMsg per persistent DEVICE
  client (or shared group store id), one receiver copy per APPLICATION topic and per shared
  APPLICATION topic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.topics import TopicSpec
from tbmq_routing.rules import APPLICATION, DEVICE, RoutingPlan, SessionView
from tbmq_routing.topics import is_valid_topic_filter
from tbmq_routing.trie import Subscription

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ state
def subscriptions_from_record(key: bytes | None, value: bytes | None) -> tuple[str, list[tuple[str, Subscription]]]:
    """(client id, its WHOLE subscription set) of a tbmq.client.subscriptions record.

    A null value or an empty set means "no subscriptions" (the caller removes the client). Invalid
    filters are skipped with a warning (the connector validates them; the trie must never hold one).
    """
    cs = pb.ClientSubscriptions.FromString(value) if value else pb.ClientSubscriptions()
    client_id = key.decode("utf-8") if key else cs.client_id
    pairs: list[tuple[str, Subscription]] = []
    for ts in cs.subscriptions:
        if not is_valid_topic_filter(ts.topic_filter):
            log.warning("client %s: invalid filter %r skipped", client_id, ts.topic_filter)
            continue
        pairs.append((ts.topic_filter, Subscription(
            client_id=client_id,
            qos=min(int(ts.qos), 2),
            share_name=ts.share_name,
            no_local=ts.no_local,
            retain_as_published=ts.retain_as_published,
            retain_handling=int(ts.retain_handling),
            subscription_id=ts.subscription_id,
        )))
    return client_id, pairs


def session_from_record(value: bytes | None) -> SessionView | None:
    """SessionView of a tbmq.client.session record (None for a null value: session removed)."""
    if value is None:
        return None
    si = pb.SessionInfo.FromString(value)
    return session_view(si)


def session_view(si: pb.SessionInfo) -> SessionView:
    return SessionView(
        connected=si.connected,
        service_id=si.service_id if si.connected else "",
        client_type=APPLICATION if si.client_type == pb.CLIENT_TYPE_APPLICATION else DEVICE,
        persistent=si.persistent,
    )


# ------------------------------------------------------------------------------------------ expiry
def is_expired(msg: pb.PublishMsg, now_ms: int) -> bool:
    """True when the message carries a Message Expiry Interval that has passed at ``now_ms``."""
    if not msg.HasField("message_expiry_interval") or msg.created_at_ms <= 0:
        return False
    return now_ms > msg.created_at_ms + 1000 * msg.message_expiry_interval


# ------------------------------------------------------------------------------------------ output
@dataclass(slots=True)
class OutRecord:
    topic: str
    key: bytes
    value: bytes
    spec: TopicSpec | None = None  # catalogue spec for topics created on demand (APPLICATION)


_DOWNLINK = topics.spec(topics.DOWNLINK_BASIC_PREFIX + "<svc>")


def downlink_spec(service_id: str) -> TopicSpec:
    return replace(_DOWNLINK, name=topics.downlink_basic_topic(service_id))


def receiver_copy(msg: pb.PublishMsg, qos: int, retain: bool, subscription_ids) -> pb.PublishMsg:
    copy = pb.PublishMsg()
    copy.CopyFrom(msg)
    copy.qos = qos
    copy.retain = retain
    del copy.subscription_ids[:]
    copy.subscription_ids.extend(subscription_ids)
    return copy


def plan_records(msg: pb.PublishMsg, plan: RoutingPlan, topic_key: bytes | None = None) -> list[OutRecord]:
    """The records that carry out ``plan`` for ``msg`` (the publisher's copy)."""
    key = topic_key if topic_key is not None else msg.topic.encode("utf-8")
    out: list[OutRecord] = []
    for service_id, deliveries in plan.live.items():
        downlink = pb.BasicDownlink(msg=msg)
        for d in deliveries:
            downlink.recipients.add(client_id=d.client_id, qos=d.qos, retain=d.retain,
                                    subscription_ids=d.subscription_ids)
        out.append(OutRecord(topics.downlink_basic_topic(service_id), key, downlink.SerializeToString(),
                             downlink_spec(service_id)))
    for d in plan.persisted:
        pm = pb.PersistedMsg(client_id=d.client_id, msg=receiver_copy(msg, d.qos, d.retain, d.subscription_ids))
        out.append(OutRecord(topics.MSG_PERSISTED, d.client_id.encode("utf-8"), pm.SerializeToString()))
    for a in plan.app:
        out.append(OutRecord(a.topic, key, receiver_copy(msg, a.qos, a.retain, a.subscription_ids)
                             .SerializeToString(), topics.app_topic(a.client_id)))
    for s in plan.shared_app:
        out.append(OutRecord(s.topic, key, receiver_copy(msg, s.qos, s.retain, s.subscription_ids)
                             .SerializeToString(), topics.shared_app_topic(s.topic_filter)))
    return out
