"""Round trips of every packet type at every protocol level, and the decoder's buffering."""

from __future__ import annotations

import pytest
from mqtt_codec_samples import LEVELS, sample_packets

from tbmq_mqtt import (
    EMPTY_PROPERTIES,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    MqttDecoder,
    PacketType,
    PingReq,
    Properties,
    PubAck,
    Publish,
    Role,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    decode,
    encode,
)

pytestmark = pytest.mark.unit

ALL_TYPES = {t.value for t in PacketType}


@pytest.mark.parametrize("level", LEVELS)
def test_every_packet_type_round_trips(level):
    samples = sample_packets(level)
    seen = {p.packet_type for p in samples}
    assert seen == (ALL_TYPES if level == 5 else ALL_TYPES - {15})
    for pkt in samples:
        data = encode(pkt, level)
        back = decode(data, level)
        assert back == pkt, (pkt, data)
        assert encode(back, level) == data


@pytest.mark.parametrize("level", LEVELS)
def test_stream_of_all_samples_byte_by_byte(level):
    samples = sample_packets(level)
    stream = b"".join(encode(p, level) for p in samples)
    dec = MqttDecoder(level, role=Role.ANY)
    got = []
    for i in range(len(stream)):
        got += dec.feed(stream[i : i + 1])
    assert got == samples
    assert dec.buffered == 0
    # and all in one go
    assert MqttDecoder(level, role=Role.ANY).feed(stream) == samples


@pytest.mark.parametrize("level", LEVELS)
def test_server_role_session(level):
    """A client's packets through a server-side decoder: CONNECT sets the level."""
    client_packets = [
        Connect(level, "dev", True, 30),
        Subscribe(1, [Subscription("t/#", 1)]),
        Publish("t/1", b"x", 1, packet_id=2),
        PubAck(5),
        PingReq(),
        Disconnect(),
    ]
    dec = MqttDecoder()
    assert dec.protocol_level is None
    out = dec.feed(b"".join(encode(p, level) for p in client_packets))
    assert out == client_packets
    assert dec.protocol_level == level


@pytest.mark.parametrize("level", LEVELS)
def test_client_role_session(level):
    server_packets = [ConnAck(False, 0), SubAck(1, [1]), Publish("t/1", b"x", 1, packet_id=2), PubAck(3)]
    if level == 5:
        server_packets.append(Auth(0x18))
        server_packets.append(Publish("t", b"", 0, properties=Properties(subscription_identifiers=(1, 2))))
    dec = MqttDecoder(level, role="client")
    assert dec.feed(b"".join(encode(p, level) for p in server_packets)) == server_packets


def test_v5_only_fields_are_dropped_below_level_5():
    props = Properties(message_expiry_interval=5, user_properties=(("a", "b"),))
    pub = Publish("a", b"p", 1, packet_id=1, properties=props)
    assert decode(encode(pub, 4), 4) == Publish("a", b"p", 1, packet_id=1)
    assert encode(PubAck(1, 0x10, Properties(reason_string="x")), 4) == b"\x40\x02\x00\x01"
    assert encode(Disconnect(0x8E), 4) == b"\xe0\x00"
    assert encode(UnsubAck(3, [0x11]), 4) == b"\xb0\x02\x00\x03"
    sub = Subscribe(1, [Subscription("a", 1, True, True, 2)])
    assert decode(encode(sub, 4), 4) == Subscribe(1, [Subscription("a", 1)])


def test_v5_codes_mapped_for_3x():
    assert encode(ConnAck(False, 0x86), 4) == b"\x20\x02\x00\x04"  # bad user name or password
    assert encode(ConnAck(False, 0x84), 4) == b"\x20\x02\x00\x01"
    assert encode(ConnAck(False, 0x85), 3) == b"\x20\x02\x00\x02"
    assert encode(ConnAck(True, 0x87), 4) == b"\x20\x02\x00\x05"  # session present forced to 0
    assert encode(ConnAck(True, 0), 3) == b"\x20\x02\x00\x00"  # 3.1 has no session present
    assert encode(SubAck(1, [0, 0x87, 2]), 4) == b"\x90\x05\x00\x01\x00\x80\x02"


def test_v5_short_forms():
    assert encode(PubAck(1), 5) == b"\x40\x02\x00\x01"
    assert encode(PubAck(1, 0x10), 5) == b"\x40\x03\x00\x01\x10"
    assert encode(PubAck(1, 0, Properties()), 5) == b"\x40\x02\x00\x01"
    assert encode(Disconnect(), 5) == b"\xe0\x00"
    assert encode(Disconnect(0x8B), 5) == b"\xe0\x01\x8b"
    assert encode(Auth(), 5) == b"\xf0\x00"
    # long forms decode to the same packets
    assert decode(b"\x40\x04\x00\x01\x00\x00", 5) == PubAck(1)
    assert decode(b"\x40\x03\x00\x01\x00", 5) == PubAck(1)
    assert decode(b"\xe0\x02\x00\x00", 5) == Disconnect()
    assert decode(b"\xf0\x02\x00\x00", 5) == Auth()


def test_empty_properties_is_shared_and_read_only():
    pub = decode(encode(Publish("a", b"", 0), 5), 5)
    assert pub.properties is EMPTY_PROPERTIES
    with pytest.raises(AttributeError):
        EMPTY_PROPERTIES.topic_alias = 1  # type: ignore[misc]
    assert Properties() == EMPTY_PROPERTIES and EMPTY_PROPERTIES == Properties()
    assert not EMPTY_PROPERTIES and Properties(topic_alias=1)


def test_large_packet_fed_in_small_chunks_is_linear():
    pub = Publish("big", b"q" * 3_000_000, 1, packet_id=1)
    data = encode(pub, 4)
    dec = MqttDecoder(4, role=Role.ANY)
    out = []
    for i in range(0, len(data), 1000):
        out += dec.feed(data[i : i + 1000])
    assert out == [pub]


def test_feed_accepts_bytearray_and_memoryview():
    data = encode(Publish("a", b"b", 0), 4) * 2
    assert len(MqttDecoder(4, role=Role.ANY).feed(bytearray(data))) == 2
    assert len(MqttDecoder(4, role=Role.ANY).feed(memoryview(data))) == 2
