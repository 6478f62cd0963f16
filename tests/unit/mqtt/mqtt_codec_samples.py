"""Shared sample packets and hypothesis strategies for the tbmq_mqtt codec tests."""

from __future__ import annotations

from hypothesis import strategies as st

from tbmq_mqtt import (
    EMPTY_PROPERTIES,
    REASON_CODES_BY_PACKET,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    PacketType,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    allowed_properties,
)
from tbmq_mqtt.properties import PROPERTY_BY_NAME, WILL, PropertyType

LEVELS = (3, 4, 5)

FULL_PROPS = {
    "publish": Properties(
        payload_format_indicator=1, message_expiry_interval=3600, content_type="text/plain",
        response_topic="reply/here", correlation_data=b"\x00\x01", subscription_identifiers=(1, 268435455),
        topic_alias=7, user_properties=(("a", "1"), ("a", "2"), ("ключ", "значение")),
    ),
    "connect": Properties(
        session_expiry_interval=0xFFFFFFFF, authentication_method="SCRAM", authentication_data=b"d",
        request_problem_information=False, request_response_information=True, receive_maximum=10,
        topic_alias_maximum=5, maximum_packet_size=1 << 20, user_properties=(("k", "v"),),
    ),
    "connack": Properties(
        session_expiry_interval=60, assigned_client_identifier="auto-1", server_keep_alive=30,
        authentication_method="m", authentication_data=b"", response_information="r/",
        server_reference="other:1883", reason_string="ok", receive_maximum=65535,
        topic_alias_maximum=0, maximum_qos=1, retain_available=True, maximum_packet_size=4096,
        wildcard_subscription_available=False, subscription_identifier_available=True,
        shared_subscription_available=True, user_properties=(("x", ""),),
    ),
    "will": Properties(
        payload_format_indicator=0, message_expiry_interval=10, content_type="c", response_topic="r",
        correlation_data=b"c", will_delay_interval=5, user_properties=(("w", "p"),),
    ),
}


def sample_packets(level: int) -> list:
    """At least one packet of every type valid at ``level`` (AUTH only at 5)."""
    v5 = level == 5
    P = FULL_PROPS if v5 else {k: EMPTY_PROPERTIES for k in FULL_PROPS}
    rs = Properties(reason_string="why", user_properties=(("u", "p"),)) if v5 else EMPTY_PROPERTIES
    pkts = [
        Connect(level, "client-1", True, 60),
        Connect(level, "c2", False, 0, "user", b"pass", Will("will/topic", b"bye", 2, True, P["will"]),
                P["connect"]),
        Connect(level, "c3", True, 65535, "user-only"),
        ConnAck(False, 0, P["connack"]),
        ConnAck(False, 0x87 if v5 else 5),
        Publish("a/b", b"", 0),
        Publish("a/b/c", b"payload" * 50, 1, True, False, 1, P["publish"]),
        Publish("x", bytes(range(256)) * 2, 2, False, True, 65535),
        Publish("large", b"z" * 20000, 1, packet_id=9),
        PubAck(1), PubRec(2), PubRel(3), PubComp(4),
        Subscribe(10, [Subscription("a/+/c", 1), Subscription("#", 2)]),
        SubAck(10, [0, 1, 2, 0x80]),
        Unsubscribe(11, ["a/+/c", "#"]),
        UnsubAck(11, [0, 0x11] if v5 else []),
        PingReq(), PingResp(), Disconnect(),
    ]
    if level != 3:
        pkts.append(ConnAck(True, 0))
    if v5:
        pkts += [
            Connect(5, "", False, 10, None, b"pw-without-user"),
            Publish("", b"aliased", 0, properties=Properties(topic_alias=3)),
            PubAck(5, 0x10, rs), PubRec(6, 0x80), PubRel(7, 0x92, rs), PubComp(8, 0, rs),
            Subscribe(12, [Subscription("a/#", 1, True, True, 2), Subscription("$share/g/t", 0, False, False, 1)],
                      Properties(subscription_identifiers=(42,), user_properties=(("s", "1"),))),
            SubAck(12, [0x00, 0x97, 0xA2], rs),
            Unsubscribe(13, ["a"], Properties(user_properties=(("k", "v"),))),
            UnsubAck(13, [0x8F], rs),
            Disconnect(0x04), Disconnect(0x8E, Properties(reason_string="taken", session_expiry_interval=0)),
            Disconnect(0x9C, Properties(server_reference="b:1883")),
            Auth(), Auth(0x18, Properties(authentication_method="SCRAM", authentication_data=b"\x01")),
            Auth(0x19),
        ]
    return pkts


# ------------------------------------------------------------------ hypothesis strategies

mqtt_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
topic_names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"),
    min_size=1, max_size=12,
)
filters = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1, max_size=12,
)
small_bytes = st.binary(max_size=16)
packet_ids = st.integers(1, 65535)

_VALUE = {
    PropertyType.BYTE: st.integers(0, 1),
    PropertyType.BOOL_BYTE: st.booleans(),
    PropertyType.TWO_BYTE_INT: st.integers(1, 65535),
    PropertyType.FOUR_BYTE_INT: st.integers(1, 0xFFFFFFFF),
    PropertyType.UTF8_STRING: mqtt_text,
    PropertyType.BINARY: small_bytes,
}


def properties(ctx: int, server_publish: bool = False) -> st.SearchStrategy[Properties]:
    names = sorted(allowed_properties(ctx))
    if server_publish:
        names.remove("subscription_identifiers")

    @st.composite
    def build(draw):
        chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=4)) if names else []
        kw = {}
        for name in chosen:
            spec = PROPERTY_BY_NAME[name]
            if name == "user_properties":
                kw[name] = tuple(draw(st.lists(st.tuples(mqtt_text, mqtt_text), min_size=1, max_size=3)))
            elif name == "response_topic":  # a Topic Name [MQTT-3.3.2-14] [MQTT-4.7.3-1]
                kw[name] = draw(topic_names)
            elif name == "subscription_identifiers":
                kw[name] = tuple(draw(st.lists(st.integers(1, 268435455), min_size=1,
                                               max_size=3 if ctx == PacketType.PUBLISH else 1)))
            else:
                kw[name] = draw(_VALUE[spec.type])
        if "authentication_data" in kw and "authentication_method" not in kw:
            kw["authentication_method"] = draw(mqtt_text)
        return Properties(**kw)

    return build()


def _props(level, ctx):
    return properties(ctx) if level == 5 else st.just(EMPTY_PROPERTIES)


def packets(level: int) -> st.SearchStrategy:
    v5 = level == 5

    @st.composite
    def connect(draw):
        client_id = draw(mqtt_text)
        clean = draw(st.booleans())
        if level == 3 and not client_id:
            client_id = "c"
        if level == 4 and not client_id:
            clean = True
        will = None
        if draw(st.booleans()):
            will = Will(draw(topic_names), draw(small_bytes), draw(st.integers(0, 2)), draw(st.booleans()),
                        draw(_props(level, WILL)))
        username = draw(st.none() | mqtt_text)
        password = draw(st.none() | small_bytes)
        if not v5 and username is None:
            password = None
        return Connect(level, client_id, clean, draw(st.integers(0, 65535)), username, password, will,
                       draw(_props(level, 1)))

    @st.composite
    def connack(draw):
        if v5:
            rc = draw(st.sampled_from(sorted(REASON_CODES_BY_PACKET[2])))
            sp = draw(st.booleans())
        else:
            rc = draw(st.integers(0, 5))
            sp = level == 4 and rc == 0 and draw(st.booleans())
        return ConnAck(sp, rc, draw(_props(level, 2)))

    @st.composite
    def publish(draw):
        qos = draw(st.integers(0, 2))
        props = draw(_props(level, 3))
        topic = draw(topic_names)
        if v5 and props.topic_alias is not None and draw(st.booleans()):
            topic = ""
        return Publish(topic, draw(st.binary(max_size=300)), qos, draw(st.booleans()),
                       bool(qos) and draw(st.booleans()), draw(packet_ids) if qos else None, props)

    def ack(cls, ptype):
        @st.composite
        def build(draw):
            if not v5:
                return cls(draw(packet_ids))
            return cls(draw(packet_ids), draw(st.sampled_from(sorted(REASON_CODES_BY_PACKET[ptype]))),
                       draw(_props(level, ptype)))
        return build()

    subscription = (
        st.builds(Subscription, filters, st.integers(0, 2), st.booleans(), st.booleans(), st.integers(0, 2))
        .filter(lambda s: not (s.no_local and s.filter.startswith("$share/")))
        if v5 else st.builds(Subscription, filters, st.integers(0, 2))
    )
    suback_codes = sorted(REASON_CODES_BY_PACKET[9]) if v5 else [0, 1, 2, 0x80]
    strategies = [
        connect(), connack(), publish(),
        ack(PubAck, 4), ack(PubRec, 5), ack(PubRel, 6), ack(PubComp, 7),
        st.builds(Subscribe, packet_ids, st.lists(subscription, min_size=1, max_size=4), _props(level, 8)),
        st.builds(SubAck, packet_ids, st.lists(st.sampled_from(suback_codes), min_size=1, max_size=4),
                  _props(level, 9)),
        st.builds(Unsubscribe, packet_ids, st.lists(filters, min_size=1, max_size=4), _props(level, 10)),
        st.builds(UnsubAck, packet_ids,
                  st.lists(st.sampled_from(sorted(REASON_CODES_BY_PACKET[11])), min_size=1, max_size=4)
                  if v5 else st.just([]), _props(level, 11)),
        st.just(PingReq()), st.just(PingResp()),
        st.builds(Disconnect, st.sampled_from(sorted(REASON_CODES_BY_PACKET[14])), _props(level, 14))
        if v5 else st.just(Disconnect()),
    ]
    if v5:
        strategies.append(
            st.builds(Auth, st.sampled_from(sorted(REASON_CODES_BY_PACKET[15])), _props(level, 15))
        )
    return st.one_of(strategies)


PACKETS_BY_LEVEL = {lvl: packets(lvl) for lvl in LEVELS}
any_level_packet = st.one_of([st.tuples(st.just(lvl), PACKETS_BY_LEVEL[lvl]) for lvl in LEVELS])
