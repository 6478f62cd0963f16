"""Known byte vectors: hand-written from the specification and produced by paho-mqtt."""

from __future__ import annotations

import pytest
from paho.mqtt import client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from tbmq_mqtt import (
    PROPERTY_SPECS,
    REASON_CODES_BY_PACKET,
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
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    allowed_properties,
    decode,
    encode,
)
from tbmq_mqtt._wire import encode_vbi, read_vbi
from tbmq_mqtt.properties import decode_properties, encode_properties

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- variable byte integers (1.5.5)

@pytest.mark.parametrize(
    "value,wire",
    [
        (0, b"\x00"), (127, b"\x7f"), (128, b"\x80\x01"), (16383, b"\xff\x7f"),
        (16384, b"\x80\x80\x01"), (2097151, b"\xff\xff\x7f"), (2097152, b"\x80\x80\x80\x01"),
        (268435455, b"\xff\xff\xff\x7f"),
    ],
)
def test_variable_byte_integer_table(value, wire):
    assert encode_vbi(value) == wire
    assert read_vbi(wire, 0, len(wire)) == (value, len(wire))


def test_remaining_length_boundaries():
    for size in (0, 1, 120, 121, 122, 123, 16375, 16376, 16377, 2097149, 2097150):
        pub = Publish("a", b"x" * size, 0)
        data = encode(pub, 4)
        assert decode(data, 4) == pub


# ---------------------------------------------------------------- hand-written vectors

VECTORS = [
    # (level, packet, bytes)
    (4, Connect(4, "a", True, 60), b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01a"),
    (3, Connect(3, "a", True, 60), b"\x10\x0f\x00\x06MQIsdp\x03\x02\x00\x3c\x00\x01a"),
    (5, Connect(5, "a", True, 60), b"\x10\x0e\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01a"),
    (4, Connect(4, "a", False, 10, "u", b"p", Will("w", b"m", 1, True)),
     b"\x10\x19\x00\x04MQTT\x04\xec\x00\x0a\x00\x01a\x00\x01w\x00\x01m\x00\x01u\x00\x01p"),
    (4, ConnAck(False, 0), b"\x20\x02\x00\x00"),
    (4, ConnAck(True, 0), b"\x20\x02\x01\x00"),
    (5, ConnAck(False, 0), b"\x20\x03\x00\x00\x00"),
    (5, ConnAck(False, 0x85, Properties(reason_string="x")), b"\x20\x07\x00\x85\x04\x1f\x00\x01x"),
    (4, Publish("a/b", b"hi", 0), b"\x30\x07\x00\x03a/bhi"),
    (4, Publish("a/b", b"hi", 1, True, True, 10), b"\x3b\x09\x00\x03a/b\x00\x0ahi"),
    (5, Publish("a/b", b"hi", 2, packet_id=1, properties=Properties(topic_alias=2)),
     b"\x34\x0d\x00\x03a/b\x00\x01\x03\x23\x00\x02hi"),
    (4, PubAck(1), b"\x40\x02\x00\x01"),
    (4, PubRec(2), b"\x50\x02\x00\x02"),
    (4, PubRel(3), b"\x62\x02\x00\x03"),
    (4, PubComp(4), b"\x70\x02\x00\x04"),
    (5, PubAck(1, 0x10), b"\x40\x03\x00\x01\x10"),
    (5, PubRel(1, 0x92), b"\x62\x03\x00\x01\x92"),
    (4, Subscribe(10, [Subscription("a/b", 1)]), b"\x82\x08\x00\x0a\x00\x03a/b\x01"),
    (5, Subscribe(10, [Subscription("a/b", 1, True, True, 2)]), b"\x82\x09\x00\x0a\x00\x00\x03a/b\x2d"),
    (4, SubAck(10, [1, 0x80]), b"\x90\x04\x00\x0a\x01\x80"),
    (5, SubAck(10, [0xA2]), b"\x90\x04\x00\x0a\x00\xa2"),
    (4, Unsubscribe(11, ["a/b"]), b"\xa2\x07\x00\x0b\x00\x03a/b"),
    (4, UnsubAck(11), b"\xb0\x02\x00\x0b"),
    (5, UnsubAck(11, [0x11]), b"\xb0\x04\x00\x0b\x00\x11"),
    (4, PingReq(), b"\xc0\x00"),
    (4, PingResp(), b"\xd0\x00"),
    (4, Disconnect(), b"\xe0\x00"),
    (5, Disconnect(0x04), b"\xe0\x01\x04"),
    (5, Disconnect(0x8B, Properties(session_expiry_interval=1)), b"\xe0\x07\x8b\x05\x11\x00\x00\x00\x01"),
]


@pytest.mark.parametrize("level,packet,wire", VECTORS)
def test_known_vectors(level, packet, wire):
    assert encode(packet, level) == wire
    assert decode(wire, level) == packet


# ---------------------------------------------------------------- paho-mqtt's encoder

class _DummySocket:
    def close(self):
        pass


class CapturingClient(paho.Client):
    """paho client whose outgoing packets are captured instead of written to a socket."""

    def __init__(self, protocol, client_id="paho"):
        super().__init__(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
        self.sent: list[bytes] = []
        self._sock = _DummySocket()  # _send_publish refuses to run without one

    def _packet_queue(self, command, packet, mid, qos, info=None):
        self.sent.append(bytes(packet))
        return paho.MQTTErrorCode.MQTT_ERR_SUCCESS


PAHO_LEVEL = {3: paho.MQTTv31, 4: paho.MQTTv311, 5: paho.MQTTv5}


@pytest.mark.parametrize("level", [3, 4, 5])
def test_paho_connect_matches(level):
    c = CapturingClient(PAHO_LEVEL[level], client_id="dev-1")
    c.username_pw_set("user", "secret")
    will_props = None
    if level == 5:
        will_props = PahoProperties(PacketTypes.WILLMESSAGE)
        will_props.WillDelayInterval = 7
    c.will_set("w/t", b"gone", qos=1, retain=True, properties=will_props)
    if level == 5:
        cp = PahoProperties(PacketTypes.CONNECT)
        cp.SessionExpiryInterval = 300
        c._connect_properties = cp
        c._clean_start = True
    else:
        c._clean_session = False
    c._send_connect(45)
    ours = Connect(
        level, "dev-1", level == 5, 45, "user", b"secret",
        Will("w/t", b"gone", 1, True, Properties(will_delay_interval=7) if level == 5 else Properties()),
        Properties(session_expiry_interval=300) if level == 5 else Properties(),
    )
    assert c.sent[-1] == encode(ours, level)
    assert decode(c.sent[-1]) == ours


@pytest.mark.parametrize("level", [3, 4, 5])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_paho_publish_matches(level, qos):
    c = CapturingClient(PAHO_LEVEL[level])
    props = None
    ours_props = Properties()
    if level == 5:
        props = PahoProperties(PacketTypes.PUBLISH)
        props.MessageExpiryInterval = 30
        ours_props = Properties(message_expiry_interval=30)
    pid = 77 if qos else 0
    c._send_publish(pid, b"sensors/1", b"\x00\xffdata", qos, True, bool(qos), None, props)
    ours = Publish("sensors/1", b"\x00\xffdata", qos, True, bool(qos), pid or None, ours_props)
    assert c.sent[-1] == encode(ours, level)
    assert decode(c.sent[-1], level) == ours


@pytest.mark.parametrize("level", [3, 4, 5])
def test_paho_subscribe_unsubscribe_acks_ping_disconnect_match(level):
    c = CapturingClient(PAHO_LEVEL[level])
    if level == 5:
        opts = SubscribeOptions(qos=2, noLocal=True, retainAsPublished=True,
                                retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB)
        c._send_subscribe(False, [(b"a/+", opts)])
        subs = [Subscription("a/+", 2, True, True, 1)]
    else:
        c._send_subscribe(False, [(b"a/+", 2)])
        subs = [Subscription("a/+", 2)]
    pkt = decode(c.sent[-1], level)
    assert pkt == Subscribe(pkt.packet_id, subs)
    assert encode(pkt, level) == c.sent[-1]

    c._send_unsubscribe(False, [b"a/+", b"b"])
    pkt = decode(c.sent[-1], level)
    assert pkt == Unsubscribe(pkt.packet_id, ["a/+", "b"])
    assert encode(pkt, level) == c.sent[-1]

    for send, ours in [
        (lambda: c._send_puback(5), PubAck(5)),
        (lambda: c._send_pubrec(6), PubRec(6)),
        (lambda: c._send_pubrel(7), PubRel(7)),
        (lambda: c._send_pubcomp(8), PubComp(8)),
        (c._send_pingreq, PingReq()),
        (c._send_pingresp, PingResp()),
        (c._send_disconnect, Disconnect()),
    ]:
        send()
        assert c.sent[-1] == encode(ours, level)
        assert decode(c.sent[-1], level) == ours


def test_paho_disconnect_with_reason_v5():
    c = CapturingClient(paho.MQTTv5)
    props = PahoProperties(PacketTypes.DISCONNECT)
    props.ReasonString = "bye"
    c._send_disconnect(PahoReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message"), props)
    ours = Disconnect(0x04, Properties(reason_string="bye"))
    assert c.sent[-1] == encode(ours, 5)
    assert decode(c.sent[-1], 5) == ours


# ---------------------------------------------------------------- tables against paho's

_PAHO_PACKET = {
    PacketType.CONNECT: PacketTypes.CONNECT, PacketType.CONNACK: PacketTypes.CONNACK,
    PacketType.PUBLISH: PacketTypes.PUBLISH, PacketType.PUBACK: PacketTypes.PUBACK,
    PacketType.PUBREC: PacketTypes.PUBREC, PacketType.PUBREL: PacketTypes.PUBREL,
    PacketType.PUBCOMP: PacketTypes.PUBCOMP, PacketType.SUBSCRIBE: PacketTypes.SUBSCRIBE,
    PacketType.SUBACK: PacketTypes.SUBACK, PacketType.UNSUBSCRIBE: PacketTypes.UNSUBSCRIBE,
    PacketType.UNSUBACK: PacketTypes.UNSUBACK, PacketType.DISCONNECT: PacketTypes.DISCONNECT,
    PacketType.AUTH: PacketTypes.AUTH, 0: PacketTypes.WILLMESSAGE,
}


def test_property_table_agrees_with_paho():
    paho_props = PahoProperties(PacketTypes.PUBLISH)
    assert len(paho_props.names) == len(PROPERTY_SPECS) == 27
    by_id = {v: k for k, v in paho_props.names.items()}
    for spec in PROPERTY_SPECS:
        paho_name = by_id[spec.id]
        paho_packets = set(paho_props.properties[spec.id][1])
        ours = {_PAHO_PACKET[p] for p in spec.packets}
        assert ours == paho_packets, paho_name


def test_reason_code_table_agrees_with_paho():
    # paho's table: {code: {name: [packet types]}}
    paho_table = PahoReasonCode(PacketTypes.CONNACK).names
    inverse = {v: k for k, v in _PAHO_PACKET.items() if k}
    ours_from_paho: dict[int, set[int]] = {}
    for code, names in paho_table.items():
        for pkts in names.values():
            for p in pkts:
                ours_from_paho.setdefault(inverse[p], set()).add(code)
    # MQTT 5.0 table 3.2.2.2 lists 0x99 (Payload format invalid: the Will Payload) for CONNACK;
    # paho's table omits it.
    ours_from_paho[PacketType.CONNACK].add(0x99)
    for ptype, codes in REASON_CODES_BY_PACKET.items():
        assert set(codes) == ours_from_paho[ptype], PacketType(ptype).name
    assert {int(r) for r in ReasonCode} == set(paho_table)


@pytest.mark.parametrize("ctx", [1, 2, 3, 14, 0])
def test_properties_interoperate_with_paho(ctx):
    """Every property allowed in a packet, one value each: our bytes parse with paho and back."""
    from mqtt_codec_samples import FULL_PROPS

    props = {1: FULL_PROPS["connect"], 2: FULL_PROPS["connack"], 3: FULL_PROPS["publish"],
             14: Properties(session_expiry_interval=3, server_reference="s", reason_string="r",
                            user_properties=(("a", "b"),)),
             0: FULL_PROPS["will"]}[ctx]
    assert {n for n in allowed_properties(ctx) if getattr(props, n) not in (None, ())} == set(
        allowed_properties(ctx)
    ) - ({"authentication_method", "authentication_data"} if ctx in (0, 3, 14) else set())
    wire = encode_properties(props, ctx)
    theirs = PahoProperties(_PAHO_PACKET[ctx])
    theirs.unpack(wire)
    assert theirs.pack() == wire or decode_properties(theirs.pack(), 0, len(theirs.pack()), ctx)[0] == props
    assert decode_properties(wire, 0, len(wire), ctx) == (props, len(wire))
