"""MQTT packets ⇄ Kafka payloads (tbmq.v1 protos). Pure functions."""

from __future__ import annotations

from tbmq.v1 import messages_pb2 as pb
from tbmq_mqtt import EMPTY_PROPERTIES, Properties, Publish, Will
from tbmq_routing.expiry import forwarded_interval

_RH = (pb.RETAIN_HANDLING_SEND, pb.RETAIN_HANDLING_SEND_IF_NOT_EXISTS, pb.RETAIN_HANDLING_DONT_SEND)


def publish_msg(pkt: Publish | Will, topic: str, *, publisher_id: str, service_id: str, mqtt_version: int,
                now_ms: int) -> pb.PublishMsg:
    """The publisher's copy of an inbound PUBLISH (or a Will) for tbmq.msg.all."""
    props = pkt.properties
    msg = pb.PublishMsg(publisher_id=publisher_id, topic=topic, payload=pkt.payload, qos=pkt.qos,
                        retain=pkt.retain, created_at_ms=now_ms, publisher_mqtt_version=mqtt_version,
                        publisher_service_id=service_id)
    if props is not EMPTY_PROPERTIES:
        if props.user_properties:
            msg.user_properties.extend(pb.UserProperty(key=k, value=v) for k, v in props.user_properties)
        if props.payload_format_indicator is not None:
            msg.payload_format_indicator = props.payload_format_indicator
        if props.content_type is not None:
            msg.content_type = props.content_type
        if props.response_topic is not None:
            msg.response_topic = props.response_topic
        if props.correlation_data is not None:
            msg.correlation_data = props.correlation_data
        if props.message_expiry_interval is not None:
            msg.message_expiry_interval = props.message_expiry_interval
    return msg


def outbound_publish(msg: pb.PublishMsg, qos: int, retain: bool, subscription_ids, now_ms: int,
                     *, v5: bool, dup: bool = False) -> Publish | None:
    """The PUBLISH a receiver gets, with the Message Expiry Interval that remains [MQTT-3.3.2-6]; None when
    the message expired [MQTT-3.3.2-5] (the one rule: tbmq_routing.expiry)."""
    expiry = None
    if msg.HasField("message_expiry_interval"):
        expiry = forwarded_interval(msg.created_at_ms, msg.message_expiry_interval, now_ms)
        if expiry is None:
            return None
    props = EMPTY_PROPERTIES
    if v5:
        has = (msg.user_properties or expiry is not None or subscription_ids
               or msg.HasField("payload_format_indicator") or msg.HasField("content_type")
               or msg.HasField("response_topic") or msg.HasField("correlation_data"))
        if has:
            props = Properties(
                payload_format_indicator=(msg.payload_format_indicator
                                          if msg.HasField("payload_format_indicator") else None),
                message_expiry_interval=expiry,
                content_type=msg.content_type if msg.HasField("content_type") else None,
                response_topic=msg.response_topic if msg.HasField("response_topic") else None,
                correlation_data=msg.correlation_data if msg.HasField("correlation_data") else None,
                subscription_identifiers=tuple(i for i in subscription_ids if i),
                user_properties=tuple((u.key, u.value) for u in msg.user_properties),
            )
    return Publish(topic=msg.topic, payload=msg.payload, qos=qos, retain=retain, dup=dup,
                   packet_id=None, properties=props)


def topic_subscription(share_name: str, topic_filter: str, qos: int, *, no_local: bool = False,
                       retain_as_published: bool = False, retain_handling: int = 0,
                       subscription_id: int = 0) -> pb.TopicSubscription:
    return pb.TopicSubscription(topic_filter=topic_filter, qos=qos, share_name=share_name,
                                no_local=no_local, retain_as_published=retain_as_published,
                                retain_handling=_RH[retain_handling], subscription_id=subscription_id)
