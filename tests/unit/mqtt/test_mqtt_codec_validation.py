"""Every validation rule of the codec raises MqttProtocolError with the right reason code."""

from __future__ import annotations

import pytest

from tbmq_mqtt import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    MqttDecoder,
    MqttProtocolError,
    PingReq,
    Properties,
    PubAck,
    Publish,
    Role,
    SubAck,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
    decode,
    encode,
)
from tbmq_mqtt._wire import encode_vbi

pytestmark = pytest.mark.unit

MALFORMED, PROTOCOL_ERROR, UNSUPPORTED, BAD_CLIENT_ID = 0x81, 0x82, 0x84, 0x85
TOPIC_NAME_INVALID, TOPIC_ALIAS_INVALID, TOO_LARGE = 0x90, 0x94, 0x95


def frame(b0: int, body: bytes) -> bytes:
    return bytes((b0,)) + encode_vbi(len(body)) + body


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return len(b).to_bytes(2, "big") + b


def rejects(code: int, data: bytes, level: int | None = 5, role=Role.ANY) -> MqttProtocolError:
    with pytest.raises(MqttProtocolError) as ei:
        MqttDecoder(level, role=role).feed(data)
    assert ei.value.reason_code == code, ei.value
    return ei.value


def connect_bytes(level=5, flags=0x02, rest=b"\x00\x01a", name=None, props=b"\x00") -> bytes:
    name = name or ("MQIsdp" if level == 3 else "MQTT")
    vh = s(name) + bytes((level, flags)) + b"\x00\x3c" + (props if level == 5 else b"")
    return frame(0x10, vh + rest)


# ---------------------------------------------------------------- fixed header

@pytest.mark.parametrize(
    "data",
    [
        b"\x60\x02\x00\x01",  # PUBREL must have flags 0b0010
        b"\x80\x06\x00\x01\x00\x01a\x00",  # SUBSCRIBE must have flags 0b0010
        b"\xa0\x05\x00\x01\x00\x01a",  # UNSUBSCRIBE must have flags 0b0010
        b"\x41\x02\x00\x01",  # PUBACK flags must be 0
        b"\x63\x02\x00\x01",
        b"\xc1\x00",  # PINGREQ
        b"\xe8\x00",  # DISCONNECT
        b"\x22\x02\x00\x00",  # CONNACK
    ],
)
def test_reserved_fixed_header_flags(data):  # [MQTT-2.1.3-1]
    for level in (3, 4, 5):
        rejects(MALFORMED, data, level)


def test_reserved_flags_on_connect():
    rejects(MALFORMED, b"\x11" + connect_bytes(4)[1:], None, Role.SERVER)


def test_reserved_packet_type_0():
    rejects(MALFORMED, b"\x00\x00", 4)


def test_remaining_length_longer_than_4_bytes_rejected_without_more_data():
    rejects(MALFORMED, b"\x30\xff\xff\xff\xff", 4)


def test_remaining_length_not_minimal():
    rejects(MALFORMED, b"\xc0\x80\x00", 4)


def test_trailing_bytes_are_malformed():
    rejects(MALFORMED, b"\x40\x03\x00\x01\x00", 4)  # 3.1.1 PUBACK is exactly 2 bytes
    rejects(MALFORMED, b"\xc0\x01\x00", 4)  # PINGREQ
    rejects(MALFORMED, b"\xe0\x01\x00", 4)  # 3.1.1 DISCONNECT
    rejects(MALFORMED, b"\x20\x03\x00\x00\x00", 4)  # 3.1.1 CONNACK
    rejects(MALFORMED, b"\x40\x05\x00\x01\x00\x00\x00", 5)  # properties end before packet


def test_body_shorter_than_declared_fields():
    rejects(MALFORMED, frame(0x30, b"\x00\x05ab"), 4)  # topic length beyond packet
    rejects(MALFORMED, frame(0x32, s("a") + b"\x00"), 4)  # truncated packet id
    rejects(MALFORMED, frame(0x40, b"\x00"), 4)


# ---------------------------------------------------------------- strings

@pytest.mark.parametrize(
    "raw",
    [b"\xff", b"\xc0\xaf", b"a\xed\xa0\x80", b"\xe2\x82", b"a\x00b"],
    ids=["invalid-byte", "overlong", "surrogate", "truncated", "nul"],
)
def test_invalid_strings(raw):  # [MQTT-1.5.4-1] [MQTT-1.5.4-2]
    rejects(MALFORMED, frame(0x30, s(raw) + b"x"), 4)  # topic name
    rejects(MALFORMED, connect_bytes(4, rest=s(raw)), None, Role.SERVER)  # client id
    rejects(MALFORMED, frame(0x82, b"\x00\x01" + s(raw) + b"\x00"), 4)  # topic filter
    rejects(MALFORMED, frame(0x40, b"\x00\x01\x00" + encode_vbi(len(raw) + 3) + b"\x1f" + s(raw)), 5)
    up = b"\x26" + s("k") + s(raw)
    rejects(MALFORMED, frame(0x30, s("t") + encode_vbi(len(up)) + up), 5)


def test_encoder_rejects_invalid_strings():
    with pytest.raises(MqttProtocolError) as ei:
        encode(Publish("a\ud800", b""), 4)
    assert ei.value.reason_code == MALFORMED
    with pytest.raises(MqttProtocolError):
        encode(Connect(4, "a\x00"), 4)


# ---------------------------------------------------------------- PUBLISH

@pytest.mark.parametrize("topic", ["a/+", "#", "a/#", "+", "a+b"])
@pytest.mark.parametrize("level", [3, 4, 5])
def test_wildcard_in_publish_topic(topic, level):  # [MQTT-3.3.2-2]
    body = s(topic) + (b"\x00" if level == 5 else b"") + b"x"
    rejects(TOPIC_NAME_INVALID, frame(0x30, body), level)
    with pytest.raises(MqttProtocolError) as ei:
        encode(Publish(topic, b""), level)
    assert ei.value.reason_code == TOPIC_NAME_INVALID


@pytest.mark.parametrize("level", [3, 4, 5])
def test_publish_qos_3(level):  # [MQTT-3.3.1-4]
    rejects(MALFORMED, frame(0x36, s("a") + b"\x00\x01"), level)
    with pytest.raises(MqttProtocolError):
        encode(Publish("a", b"", 3, packet_id=1), level)


@pytest.mark.parametrize("level", [3, 4, 5])
def test_publish_qos0_with_dup(level):  # [MQTT-3.3.1-2]
    rejects(MALFORMED, frame(0x38, s("a") + (b"\x00" if level == 5 else b"")), level)


@pytest.mark.parametrize("level", [3, 4, 5])
def test_packet_id_zero(level):  # [MQTT-2.2.1-3]
    p = b"\x00" if level == 5 else b""
    rejects(PROTOCOL_ERROR, frame(0x32, s("a") + b"\x00\x00" + p), level)
    rejects(PROTOCOL_ERROR, frame(0x40, b"\x00\x00"), level)
    rejects(PROTOCOL_ERROR, frame(0x62, b"\x00\x00"), level)
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x00" + p + s("a") + b"\x00"), level)
    rejects(PROTOCOL_ERROR, frame(0xA2, b"\x00\x00" + p + s("a")), level)
    with pytest.raises(MqttProtocolError) as ei:
        encode(Publish("a", b"", 1), level)
    assert ei.value.reason_code == PROTOCOL_ERROR
    with pytest.raises(MqttProtocolError):
        encode(PubAck(0), level)


def test_empty_topic_name():
    rejects(TOPIC_NAME_INVALID, frame(0x30, s("") + b"x"), 4)  # [MQTT-4.7.3-1]
    rejects(PROTOCOL_ERROR, frame(0x30, s("") + b"\x00x"), 5)  # 3.3.2.1: needs a Topic Alias
    assert decode(frame(0x30, s("") + b"\x03\x23\x00\x01x"), 5) == Publish(
        "", b"x", properties=Properties(topic_alias=1)
    )


def test_topic_alias_zero():  # [MQTT-3.3.2-8]
    rejects(TOPIC_ALIAS_INVALID, frame(0x30, s("a") + b"\x03\x23\x00\x00x"), 5)


def test_subscription_identifier_in_client_publish():  # [MQTT-3.3.4-6]
    conn = encode(Connect(5, "c"), 5)
    pub = frame(0x30, s("a") + b"\x02\x0b\x01x")
    with pytest.raises(MqttProtocolError) as ei:
        MqttDecoder().feed(conn + pub)
    assert ei.value.reason_code == PROTOCOL_ERROR
    # a client receives them (several are allowed in PUBLISH)
    two = frame(0x30, s("a") + b"\x04\x0b\x01\x0b\x02x")
    assert MqttDecoder(5, role=Role.CLIENT).feed(two)[0].properties.subscription_identifiers == (1, 2)


# ---------------------------------------------------------------- SUBSCRIBE / UNSUBSCRIBE

@pytest.mark.parametrize("level", [3, 4, 5])
def test_subscribe_without_filters(level):  # [MQTT-3.8.3-2]; 3.1.1 [MQTT-3.8.3-3]
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x01" + (b"\x00" if level == 5 else b"")), level)
    with pytest.raises(MqttProtocolError):
        encode(Subscribe(1, []), level)


@pytest.mark.parametrize("level", [3, 4, 5])
def test_unsubscribe_without_filters(level):  # [MQTT-3.10.3-2]
    rejects(PROTOCOL_ERROR, frame(0xA2, b"\x00\x01" + (b"\x00" if level == 5 else b"")), level)
    with pytest.raises(MqttProtocolError):
        encode(Unsubscribe(1, []), level)


def test_subscription_options_reserved_bits():
    rejects(MALFORMED, frame(0x82, b"\x00\x01" + s("a") + b"\x04"), 4)  # 3.1.1 [MQTT-3-8.3-4]
    rejects(MALFORMED, frame(0x82, b"\x00\x01" + s("a") + b"\x03"), 4)  # QoS 3
    rejects(MALFORMED, frame(0x82, b"\x00\x01\x00" + s("a") + b"\x40"), 5)  # [MQTT-3.8.3-5]
    rejects(MALFORMED, frame(0x82, b"\x00\x01\x00" + s("a") + b"\x80"), 5)
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x01\x00" + s("a") + b"\x30"), 5)  # Retain Handling 3
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x01\x00" + s("a") + b"\x03"), 5)  # QoS 3
    rejects(MALFORMED, frame(0x82, b"\x00\x01\x00" + s("a")), 5)  # options byte missing


def test_no_local_on_shared_subscription():  # [MQTT-3.8.3-4]
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x01\x00" + s("$share/g/a") + b"\x04"), 5)
    assert decode(frame(0x82, b"\x00\x01\x00" + s("$share/g/a") + b"\x00"), 5) == Subscribe(
        1, [Subscription("$share/g/a")]
    )


def test_subscription_identifier_rules():
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x01\x04\x0b\x01\x0b\x02" + s("a") + b"\x00"), 5)
    rejects(PROTOCOL_ERROR, frame(0x82, b"\x00\x01\x02\x0b\x00" + s("a") + b"\x00"), 5)  # value 0


# ---------------------------------------------------------------- CONNECT

def server_rejects(code, data) -> MqttProtocolError:
    err = rejects(code, data, None, Role.SERVER)
    assert err.packet_type == 1
    return err


@pytest.mark.parametrize("level", [3, 4, 5])
def test_connect_reserved_flag(level):  # [MQTT-3.1.2-3]
    server_rejects(MALFORMED, connect_bytes(level, flags=0x03))


@pytest.mark.parametrize("level", [3, 4, 5])
def test_will_flags_consistency(level):
    server_rejects(MALFORMED, connect_bytes(level, flags=0x02 | 0x08))  # QoS w/o will [MQTT-3.1.2-11]
    server_rejects(MALFORMED, connect_bytes(level, flags=0x02 | 0x20))  # retain w/o will [MQTT-3.1.2-13]
    will = (b"\x00" if level == 5 else b"") + s("w") + s("m")
    server_rejects(MALFORMED, connect_bytes(level, flags=0x02 | 0x04 | 0x18, rest=s("a") + will))  # QoS 3
    ok = connect_bytes(level, flags=0x02 | 0x04 | 0x10 | 0x20, rest=s("a") + will)
    assert MqttDecoder().feed(ok)[0].will == Will("w", b"m", 2, True)
    err = server_rejects(TOPIC_NAME_INVALID, connect_bytes(
        level, flags=0x06, rest=s("a") + (b"\x00" if level == 5 else b"") + s("w/#") + s("m")))
    assert err.protocol_level == level


@pytest.mark.parametrize("level", [3, 4])
def test_password_without_username_3x(level):  # 3.1.1 [MQTT-3.1.2-22]
    server_rejects(MALFORMED, connect_bytes(level, flags=0x42, rest=s("a") + s("pw")))
    with pytest.raises(MqttProtocolError):
        encode(Connect(level, "a", password=b"pw"), level)


def test_password_without_username_allowed_in_v5():
    pkt = MqttDecoder().feed(connect_bytes(5, flags=0x42, rest=s("a") + s("pw")))[0]
    assert pkt.password == b"pw" and pkt.username is None


@pytest.mark.parametrize("name,level", [("MQTT", 6), ("MQTT", 3), ("MQIsdp", 4), ("MQTT", 0x84), ("MQTT", 2)])
def test_unsupported_protocol_level(name, level):  # [MQTT-3.1.2-2]
    err = server_rejects(UNSUPPORTED, connect_bytes(level, name=name))
    assert err.protocol_level == level


def test_unknown_protocol_name():  # [MQTT-3.1.2-1]
    server_rejects(PROTOCOL_ERROR, connect_bytes(4, name="HTTP"))


def test_client_identifier_rules():
    server_rejects(BAD_CLIENT_ID, connect_bytes(3, flags=0x02, rest=s("")))  # 3.1: 1..23 chars
    server_rejects(BAD_CLIENT_ID, connect_bytes(4, flags=0x00, rest=s("")))  # 3.1.1 [MQTT-3.1.3-8]
    assert MqttDecoder().feed(connect_bytes(4, flags=0x02, rest=s("")))[0].client_id == ""
    assert MqttDecoder().feed(connect_bytes(5, flags=0x00, rest=s("")))[0].client_id == ""


def test_connect_errors_carry_the_level():
    err = server_rejects(PROTOCOL_ERROR, connect_bytes(5, props=b"\x05\x21\x00\x00\x00\x00"))
    assert err.protocol_level == 5  # receive maximum 0 -> answer with a v5 CONNACK 0x82


# ---------------------------------------------------------------- properties

def test_duplicate_property():
    props = b"\x0a\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02"
    rejects(PROTOCOL_ERROR, frame(0x30, s("a") + props), 5)
    server_rejects(PROTOCOL_ERROR, connect_bytes(5, props=b"\x06\x21\x00\x01\x21\x00\x02"))


def test_user_property_may_repeat():
    props = b"\x0e" + (b"\x26" + s("k") + s("v")) * 2
    assert decode(frame(0x30, s("a") + props), 5).properties.user_properties == (("k", "v"),) * 2


def test_property_not_allowed_in_packet():
    rejects(MALFORMED, frame(0x30, s("a") + b"\x05\x11\x00\x00\x00\x01"), 5)  # session expiry in PUBLISH
    rejects(MALFORMED, frame(0x40, b"\x00\x01\x00\x03\x23\x00\x01"), 5)  # topic alias in PUBACK
    will = b"\x05\x11\x00\x00\x00\x01" + s("w") + s("m")  # session expiry is not a will property
    server_rejects(MALFORMED, connect_bytes(5, flags=0x06, rest=s("a") + will))
    with pytest.raises(MqttProtocolError) as ei:
        encode(PubAck(1, 0x10, Properties(topic_alias=1)), 5)
    assert ei.value.reason_code == MALFORMED


def test_unknown_property_identifier():
    rejects(MALFORMED, frame(0x30, s("a") + b"\x02\x07\x00"), 5)
    rejects(MALFORMED, frame(0x30, s("a") + b"\x03\x80\x01\x00"), 5)


@pytest.mark.parametrize(
    "prop",
    [b"\x01\x02", b"\x17\x02", b"\x19\x05", b"\x21\x00\x00", b"\x27\x00\x00\x00\x00"],
    ids=["payload-format", "request-problem", "request-response", "receive-max-0", "max-packet-0"],
)
def test_invalid_property_values(prop):
    pkt = frame(0x30, s("a") + bytes((len(prop),)) + prop) if prop[0] == 1 else connect_bytes(
        5, props=bytes((len(prop),)) + prop)
    if prop[0] == 1:
        rejects(PROTOCOL_ERROR, pkt, 5)
    else:
        server_rejects(PROTOCOL_ERROR, pkt)


def test_connack_boolean_properties():
    rejects(PROTOCOL_ERROR, frame(0x20, b"\x00\x00\x02\x25\x02"), 5)  # retain available 2
    rejects(PROTOCOL_ERROR, frame(0x20, b"\x00\x00\x02\x24\x02"), 5)  # maximum QoS 2


def test_authentication_data_without_method():
    server_rejects(PROTOCOL_ERROR, connect_bytes(5, props=b"\x04\x16\x00\x01x"))
    rejects(PROTOCOL_ERROR, frame(0xF0, b"\x18\x04\x16\x00\x01x"), 5)


def _response_topic(topic: str) -> bytes:
    """A property block holding one Response Topic."""
    prop = b"\x08" + s(topic)
    return bytes((len(prop),)) + prop


@pytest.mark.parametrize("topic", ["r/+", "r/#", "#", "+", "a+b", "r/#/x", ""])
def test_response_topic_must_be_a_topic_name(topic):  # [MQTT-3.3.2-14] [MQTT-4.7.3-1]
    from tbmq_mqtt import check_response_topic

    with pytest.raises(MqttProtocolError) as ei:
        check_response_topic(topic)
    assert ei.value.reason_code == PROTOCOL_ERROR
    # in a PUBLISH, from a client (server role) and from a server (client role)
    conn = encode(Connect(5, "c"), 5)
    pub = frame(0x32, s("a") + b"\x00\x07" + _response_topic(topic) + b"x")
    with pytest.raises(MqttProtocolError) as ei:
        MqttDecoder().feed(conn + pub)
    assert ei.value.reason_code == PROTOCOL_ERROR and ei.value.packet_type == 3
    rejects(PROTOCOL_ERROR, pub, 5, Role.CLIENT)
    # in the Will properties of a CONNECT: the CONNECT is refused, at its level
    will = _response_topic(topic) + s("w") + s("m")
    err = server_rejects(PROTOCOL_ERROR, connect_bytes(5, flags=0x06, rest=s("a") + will))
    assert err.protocol_level == 5


@pytest.mark.parametrize("topic", ["reply/here", "r", "$r/x", "a//b", "/", "r/ü"])
def test_response_topic_valid(topic):
    from tbmq_mqtt import check_response_topic

    check_response_topic(topic)
    pub = frame(0x30, s("a") + _response_topic(topic) + b"x")
    assert MqttDecoder(5, role=Role.SERVER).feed(encode(Connect(5, "c"), 5) + pub)[1].properties == Properties(
        response_topic=topic)
    will = _response_topic(topic) + s("w") + s("m")
    assert MqttDecoder().feed(connect_bytes(5, flags=0x06, rest=s("a") + will))[0].will == Will(
        "w", b"m", properties=Properties(response_topic=topic))


def test_property_length_beyond_packet():
    rejects(MALFORMED, frame(0x30, s("a") + b"\x09\x01\x01"), 5)
    rejects(MALFORMED, frame(0x30, s("a") + b"\x02\x02\x00"), 5)  # four-byte int cut by prop length


# ---------------------------------------------------------------- reason codes

def test_reason_code_not_valid_for_packet():
    rejects(MALFORMED, b"\x40\x03\x00\x01\x05", 5)
    rejects(MALFORMED, b"\x62\x03\x00\x01\x10", 5)
    rejects(MALFORMED, b"\xe0\x01\x11", 5)
    rejects(MALFORMED, b"\xf0\x01\x00\xff"[:2] + b"\x01", 5)
    rejects(MALFORMED, b"\x20\x03\x00\x04\x00", 5)  # 0x04 not a CONNACK code
    rejects(MALFORMED, b"\x20\x02\x00\x06", 4)  # 3.1.1 return codes 0..5
    rejects(MALFORMED, b"\x20\x02\x02\x00", 4)  # CONNACK reserved flag bits
    rejects(MALFORMED, b"\x90\x03\x00\x01\x03", 4)  # SUBACK 3.1.1 code
    rejects(MALFORMED, b"\x90\x04\x00\x01\x00\x03", 5)
    rejects(MALFORMED, b"\xb0\x04\x00\x01\x00\x10", 5)
    with pytest.raises(MqttProtocolError):
        encode(PubAck(1, 0x8F), 5)
    with pytest.raises(MqttProtocolError):
        encode(SubAck(1, [0x11]), 5)


def test_auth_only_in_v5():
    rejects(MALFORMED, b"\xf0\x00", 4)
    with pytest.raises(MqttProtocolError):
        encode(Auth(), 4)


# ---------------------------------------------------------------- connection state / roles

def test_first_packet_must_be_connect():  # [MQTT-3.1.0-1]
    err = rejects(PROTOCOL_ERROR, b"\xc0\x00", None, Role.SERVER)
    assert err.packet_type == 12
    rejects(PROTOCOL_ERROR, b"\x30", None, Role.SERVER)  # detected from the first byte


def test_second_connect_is_a_protocol_error():  # [MQTT-3.1.0-2]
    c = encode(Connect(4, "a"), 4)
    dec = MqttDecoder()
    assert len(dec.feed(c)) == 1
    with pytest.raises(MqttProtocolError) as ei:
        dec.feed(c)
    assert ei.value.reason_code == PROTOCOL_ERROR and ei.value.protocol_level == 4


@pytest.mark.parametrize("data", [b"\x20\x02\x00\x00", b"\x90\x03\x00\x01\x00", b"\xb0\x02\x00\x01", b"\xd0\x00"],
                         ids=["connack", "suback", "unsuback", "pingresp"])
def test_server_rejects_server_packets(data):
    dec = MqttDecoder()
    dec.feed(encode(Connect(4, "a"), 4))
    with pytest.raises(MqttProtocolError) as ei:
        dec.feed(data)
    assert ei.value.reason_code == PROTOCOL_ERROR


def test_client_rejects_client_packets():
    for pkt in (Connect(4, "a"), Subscribe(1, [Subscription("a")]), PingReq()):
        with pytest.raises(MqttProtocolError) as ei:
            MqttDecoder(4, role=Role.CLIENT).feed(encode(pkt, 4))
        assert ei.value.reason_code == PROTOCOL_ERROR


def test_client_decoder_needs_level():
    with pytest.raises(ValueError):
        MqttDecoder(role=Role.CLIENT)
    with pytest.raises(ValueError):
        MqttDecoder(6)


def test_decoder_stays_failed():
    dec = MqttDecoder(4, role=Role.ANY)
    with pytest.raises(MqttProtocolError) as first:
        dec.feed(b"\x36\x00")
    with pytest.raises(MqttProtocolError) as second:
        dec.feed(encode(PingReq(), 4))
    assert second.value is first.value


def test_any_role_needs_a_level_before_non_connect():
    rejects(PROTOCOL_ERROR, b"\xc0\x00", None, Role.ANY)


# ---------------------------------------------------------------- size limit

def test_packet_too_large_rejected_from_the_fixed_header():
    dec = MqttDecoder(4, max_packet_size=1000, role=Role.ANY)
    with pytest.raises(MqttProtocolError) as ei:
        dec.feed(b"\x30\xe6\x07")  # declares 998 bytes of body: 1001 bytes in all, no body sent
    assert ei.value.reason_code == TOO_LARGE
    assert dec.buffered == 0
    ok = encode(Publish("t", b"x" * 994), 4)
    assert len(ok) == 1000
    assert MqttDecoder(4, max_packet_size=1000, role=Role.ANY).feed(ok)


def test_packet_too_large_on_server_connect():
    dec = MqttDecoder(max_packet_size=64)
    with pytest.raises(MqttProtocolError) as ei:
        dec.feed(b"\x10\xff\xff\x03")
    assert ei.value.reason_code == TOO_LARGE and ei.value.packet_type == 1


def test_partial_fixed_header_is_buffered():
    dec = MqttDecoder(4, role=Role.ANY)
    assert dec.feed(b"\x30") == []
    assert dec.feed(b"\x80") == []
    assert dec.feed(b"\x01") == []
    assert dec.buffered == 3
    assert dec.feed(b"\x00\x01a" + b"p" * 125) == [Publish("a", b"p" * 125)]
    assert dec.buffered == 0


def test_disconnect_reason_codes_v5():
    assert decode(b"\xe0\x01\x04", 5) == Disconnect(0x04)


# ---------------------------------------------------------------- what the server answers

def _err(data: bytes) -> MqttProtocolError:
    with pytest.raises(MqttProtocolError) as ei:
        MqttDecoder().feed(data)
    return ei.value


def test_server_error_response():
    from tbmq_mqtt import server_error_response

    # unsupported level -> 3.1.1-format CONNACK return code 1 [MQTT-3.1.2-2]
    assert server_error_response(_err(connect_bytes(6))) == b"\x20\x02\x00\x01"
    # 3.1.1 empty client id without clean session -> return code 2
    assert server_error_response(_err(connect_bytes(4, flags=0, rest=s("")))) == b"\x20\x02\x00\x02"
    # malformed 3.1.1 CONNECT -> just close
    assert server_error_response(_err(connect_bytes(4, flags=0x03))) is None
    # v5 CONNECT errors -> v5 CONNACK with the reason code
    assert server_error_response(_err(connect_bytes(5, flags=0x03))) == b"\x20\x03\x00\x81\x00"
    assert server_error_response(_err(connect_bytes(5, props=b"\x03\x21\x00\x00"))) == b"\x20\x03\x00\x82\x00"
    # before CONNECT -> close
    assert server_error_response(_err(b"\xc0\x00")) is None
    # v5 after CONNECT -> DISCONNECT; topic alias 0 -> 0x94
    conn = encode(Connect(5, "c"), 5)
    assert server_error_response(_err(conn + frame(0x30, s("a") + b"\x03\x23\x00\x00"))) == b"\xe0\x01\x94"
    assert server_error_response(_err(conn + b"\x36\x00")) == b"\xe0\x01\x81"
    # a Response Topic with a wildcard: DISCONNECT 0x82 after a PUBLISH, CONNACK 0x82 for a Will [MQTT-3.3.2-14]
    assert server_error_response(_err(conn + frame(0x30, s("a") + _response_topic("r/+")))) == b"\xe0\x01\x82"
    will = _response_topic("r/#") + s("w") + s("m")
    assert server_error_response(_err(connect_bytes(5, flags=0x06, rest=s("a") + will))) == b"\x20\x03\x00\x82\x00"
    # 3.1.1 after CONNECT -> close
    assert server_error_response(_err(encode(Connect(4, "c"), 4) + b"\x36\x00")) is None
