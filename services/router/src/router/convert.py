"""Pure glue between the protobuf contracts and tbmq_routing (no I/O, no Faust).

* tbmq.client.subscriptions records -> (filter, Subscription) pairs for ``SubscriptionTrie.replace_client``;
* tbmq.client.session records -> ``rules.SessionView``;
* a ``RoutingPlan`` -> the Kafka records to produce (``OutRecord``), one per destination record:
  one BasicDownlink per connector (all its live recipients; several, each at most
  DOWNLINK_RECORD_MAX_BYTES, for a fan-out too large for one record), one PersistedMsg per persistent DEVICE
  client (or shared group store id), one receiver copy per APPLICATION topic and per shared
  APPLICATION topic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.topics import TopicSpec
from tbmq_platform.wire import varint
from tbmq_routing import expiry
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
    """True when the message carries a Message Expiry Interval that has passed at ``now_ms``
    (the one rule: tbmq_routing.expiry)."""
    return msg.HasField("message_expiry_interval") and expiry.expired(msg.created_at_ms,
                                                                       msg.message_expiry_interval, now_ms)


# ------------------------------------------------------------------------------------------ output
@dataclass(slots=True)
class OutRecord:
    topic: str
    key: bytes
    value: bytes
    spec: TopicSpec | None = None  # catalogue spec for topics created on demand (APPLICATION)


_DOWNLINK = topics.spec(topics.DOWNLINK_BASIC_PREFIX + "<svc>")
_MAX_CACHED = 100_000  # entries per cache below (cleared when reached: bounded memory)


def downlink_spec(service_id: str) -> TopicSpec:
    return replace(_DOWNLINK, name=topics.downlink_basic_topic(service_id))


# per connector: (downlink topic name, its spec): built once, not per message
_downlinks: dict[str, tuple[str, TopicSpec]] = {}
# per APPLICATION client / shared filter: the catalogue spec of its topic
_app_specs: dict[str, TopicSpec] = {}
_shared_specs: dict[str, TopicSpec] = {}
# serialized Recipient (field 2 of BasicDownlink, tag included) per (client, qos, retain, ids)
_recipients: dict[tuple, bytes] = {}


def _downlink(service_id: str) -> tuple[str, TopicSpec]:
    d = _downlinks.get(service_id)
    if d is None:
        if len(_downlinks) >= _MAX_CACHED:
            _downlinks.clear()
        spec = downlink_spec(service_id)
        d = _downlinks[service_id] = (spec.name, spec)
    return d


def _cached_spec(cache: dict[str, TopicSpec], key: str, make) -> TopicSpec:
    spec = cache.get(key)
    if spec is None:
        if len(cache) >= _MAX_CACHED:
            cache.clear()
        spec = cache[key] = make(key)
    return spec


_TAG_1_LEN = b"\x0a"  # field 1, wire type 2 (length-delimited)
_TAG_2_LEN = b"\x12"  # field 2, wire type 2
_TAG_3_VARINT = b"\x18"  # field 3, wire type 0 (varint)
_TAG_4_VARINT = b"\x20"  # field 4, wire type 0


def origin_fields(partition: int, offset: int) -> bytes:
    """The origin_partition and origin_offset (fields 3 and 4) of PersistedMsg and of BasicDownlink,
    appended to a spliced value."""
    return _TAG_3_VARINT + varint(partition) + _TAG_4_VARINT + varint(offset)


def _recipient_field(client_id: str, qos: int, retain: bool, subscription_ids) -> bytes:
    """``recipients`` entry of a BasicDownlink as wire bytes (tag, length, Recipient)."""
    k = (client_id, qos, retain, subscription_ids)
    b = _recipients.get(k)
    if b is None:
        if len(_recipients) >= _MAX_CACHED:
            _recipients.clear()
        r = pb.Recipient(client_id=client_id, qos=qos, retain=retain,
                         subscription_ids=subscription_ids).SerializeToString()
        b = _recipients[k] = _TAG_2_LEN + varint(len(r)) + r
    return b


# Most bytes of one BasicDownlink value. Kafka producers refuse a record over max.request.size (1 MB by
# default): a fan-out to tens of thousands of live recipients on one connector would otherwise be one record
# the router can never send. Recipients are split over as many records as needed, each under this bound
# (but always with at least one recipient, so a message near the size limit still goes out).
DOWNLINK_RECORD_MAX_BYTES = 256 * 1024


def downlink_values(msg_field: bytes, deliveries, max_bytes: int = DOWNLINK_RECORD_MAX_BYTES,
                    tail: bytes = b"") -> list[bytes]:
    """The BasicDownlink values carrying ``deliveries``: ``msg_field`` (field 1: tag, length, the publisher's
    PublishMsg bytes) followed by one ``recipients`` field per delivery, then ``tail`` (the origin fields).
    Protobuf messages are concatenations of their fields, so the publisher's copy is serialized once per
    message, not once per connector (same bytes as ``BasicDownlink(msg=..., recipients=...,
    origin_...).SerializeToString()``). One value when it fits in ``max_bytes``, else the recipients split
    in order over several, each at most ``max_bytes`` or the message plus one client's recipients: every
    recipient is in exactly one value, and the recipients of one client (its own subscriptions' copy and
    those of shared groups that picked it) are in the same one, because a connection takes one copy per
    origin and downlink record (tbmq_routing.origins.OriginMarks)."""
    if len(deliveries) == 1:
        d = deliveries[0]
        return [msg_field + _recipient_field(d.client_id, d.qos, d.retain, d.subscription_ids) + tail]
    fields = [_recipient_field(d.client_id, d.qos, d.retain, d.subscription_ids) for d in deliveries]
    if len(msg_field) + sum(map(len, fields)) + len(tail) <= max_bytes:
        return [msg_field + b"".join(fields) + tail]
    by_client: dict[str, list[bytes]] = {}  # first-seen order; a client's copies kept together
    for d, f in zip(deliveries, fields):
        by_client.setdefault(d.client_id, []).append(f)
    values: list[bytes] = []
    parts: list[bytes] = [msg_field]
    size = len(msg_field) + len(tail)
    for group in by_client.values():
        n = sum(map(len, group))
        if len(parts) > 1 and size + n > max_bytes:
            values.append(b"".join(parts) + tail)
            parts, size = [msg_field], len(msg_field) + len(tail)
        parts.extend(group)
        size += n
    values.append(b"".join(parts) + tail)
    return values


def receiver_copy(msg: pb.PublishMsg, qos: int, retain: bool, subscription_ids,
                  origin: tuple[int, int] | None = None) -> pb.PublishMsg:
    """The copy a receiver gets; `origin` (APPLICATION topics): the tbmq.msg.all (partition, offset)."""
    copy = pb.PublishMsg()
    copy.CopyFrom(msg)
    copy.qos = qos
    copy.retain = retain
    del copy.subscription_ids[:]
    copy.subscription_ids.extend(subscription_ids)
    if origin is not None:
        copy.origin_partition, copy.origin_offset = origin
    return copy


def plan_records(msg: pb.PublishMsg, plan: RoutingPlan, topic_key: bytes | None = None,
                 msg_bytes: bytes | None = None, origin: tuple[int, int] | None = None) -> list[OutRecord]:
    """The records that carry out ``plan`` for ``msg`` (the publisher's copy).

    ``msg_bytes``: ``msg`` as received (serialized PublishMsg), spliced into every BasicDownlink
    instead of serializing ``msg`` again; serialized here when not given.
    ``origin``: the tbmq.msg.all (partition, offset) the message was read from, written into every
    PersistedMsg, BasicDownlink and APPLICATION copy (``origin_partition``, ``origin_offset``):
    device-persistence stores a client's copy once per origin, and a connection and app-delivery deliver one
    copy per origin (tbmq_routing.origins), so routing the same record again after a crash neither stores
    nor delivers anything twice.
    """
    key = topic_key if topic_key is not None else msg.topic.encode("utf-8")
    out: list[OutRecord] = []
    tail = origin_fields(*origin) if origin is not None else b""
    if plan.live:
        if msg_bytes is None:
            msg_bytes = msg.SerializeToString()
        msg_field = _TAG_1_LEN + varint(len(msg_bytes)) + msg_bytes
        for service_id, deliveries in plan.live.items():
            name, spec = _downlink(service_id)
            for value in downlink_values(msg_field, deliveries, tail=tail):
                out.append(OutRecord(name, key, value, spec))
    if plan.persisted:
        copies: dict[tuple, bytes] = {}  # receiver copy (with its field tag) per (qos, retain, ids)
        for d in plan.persisted:
            ck = (d.qos, d.retain, d.subscription_ids)
            field = copies.get(ck)
            if field is None:
                c = receiver_copy(msg, d.qos, d.retain, d.subscription_ids).SerializeToString()
                field = copies[ck] = _TAG_2_LEN + varint(len(c)) + c
            cid = d.client_id.encode("utf-8")
            # PersistedMsg{client_id = 1, msg = 2, origin_partition = 3, origin_offset = 4}, fields in order
            value = (_TAG_1_LEN + varint(len(cid)) + cid if cid else b"") + field + tail
            out.append(OutRecord(topics.MSG_PERSISTED, cid, value))
    for a in plan.app:
        out.append(OutRecord(a.topic, key, receiver_copy(msg, a.qos, a.retain, a.subscription_ids, origin)
                             .SerializeToString(), _cached_spec(_app_specs, a.client_id, topics.app_topic)))
    for s in plan.shared_app:
        out.append(OutRecord(s.topic, key, receiver_copy(msg, s.qos, s.retain, s.subscription_ids, origin)
                             .SerializeToString(),
                             _cached_spec(_shared_specs, s.topic_filter, topics.shared_app_topic)))
    return out
