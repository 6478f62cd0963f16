"""MQTT 5 property table (section 2.2.2.2) and the property codec.

The table is written once: identifier, ``Properties`` attribute, wire type and the packets (plus
the pseudo-packet ``WILL`` for will properties in CONNECT) that may carry the property.

Guarantee: ``decode_properties`` returns only properties the packet type may carry, each at most
once (User Property and a PUBLISH's Subscription Identifiers excepted), with values the spec allows:
0/1 bytes, non-zero Receive Maximum / Maximum Packet Size / Subscription Identifier / Topic Alias,
Authentication Data only with a Method, and a Response Topic that is a valid Topic Name
(``check_response_topic``); anything else raises ``MqttProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from enum import IntEnum

from . import _wire as w
from .errors import MqttProtocolError
from .packets import EMPTY_PROPERTIES, PacketType, Properties

__all__ = [
    "PropertyId",
    "PropertyType",
    "PropertySpec",
    "PROPERTY_SPECS",
    "PROPERTY_BY_ID",
    "PROPERTY_BY_NAME",
    "WILL",
    "allowed_properties",
    "check_response_topic",
    "decode_properties",
    "encode_properties",
]

WILL = 0  # pseudo packet type for will properties in the CONNECT payload


class PropertyId(IntEnum):
    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


class PropertyType(IntEnum):
    BYTE = 1
    TWO_BYTE_INT = 2
    FOUR_BYTE_INT = 3
    VARIABLE_BYTE_INT = 4
    UTF8_STRING = 5
    BINARY = 6
    UTF8_STRING_PAIR = 7
    BOOL_BYTE = 8  # a Byte whose only legal values are 0 and 1, exposed as bool


@dataclass(frozen=True, slots=True)
class PropertySpec:
    id: int
    name: str  # attribute of Properties
    type: PropertyType
    packets: frozenset[int]  # PacketType values (and WILL) allowed to carry it
    multiple: bool = False  # may appear more than once


P = PacketType
T = PropertyType
_ACKS = (P.PUBACK, P.PUBREC, P.PUBREL, P.PUBCOMP)
_ALL = (P.CONNECT, P.CONNACK, P.PUBLISH, *_ACKS, P.SUBSCRIBE, P.SUBACK, P.UNSUBSCRIBE,
        P.UNSUBACK, P.DISCONNECT, P.AUTH, WILL)

PROPERTY_SPECS: tuple[PropertySpec, ...] = tuple(
    PropertySpec(int(pid), name, typ, frozenset(int(p) for p in pkts), multiple)
    for pid, name, typ, pkts, multiple in [
        (0x01, "payload_format_indicator", T.BYTE, (P.PUBLISH, WILL), False),
        (0x02, "message_expiry_interval", T.FOUR_BYTE_INT, (P.PUBLISH, WILL), False),
        (0x03, "content_type", T.UTF8_STRING, (P.PUBLISH, WILL), False),
        (0x08, "response_topic", T.UTF8_STRING, (P.PUBLISH, WILL), False),
        (0x09, "correlation_data", T.BINARY, (P.PUBLISH, WILL), False),
        # several only in PUBLISH (server to client); once in SUBSCRIBE (checked in decode)
        (0x0B, "subscription_identifiers", T.VARIABLE_BYTE_INT, (P.PUBLISH, P.SUBSCRIBE), True),
        (0x11, "session_expiry_interval", T.FOUR_BYTE_INT, (P.CONNECT, P.CONNACK, P.DISCONNECT), False),
        (0x12, "assigned_client_identifier", T.UTF8_STRING, (P.CONNACK,), False),
        (0x13, "server_keep_alive", T.TWO_BYTE_INT, (P.CONNACK,), False),
        (0x15, "authentication_method", T.UTF8_STRING, (P.CONNECT, P.CONNACK, P.AUTH), False),
        (0x16, "authentication_data", T.BINARY, (P.CONNECT, P.CONNACK, P.AUTH), False),
        (0x17, "request_problem_information", T.BOOL_BYTE, (P.CONNECT,), False),
        (0x18, "will_delay_interval", T.FOUR_BYTE_INT, (WILL,), False),
        (0x19, "request_response_information", T.BOOL_BYTE, (P.CONNECT,), False),
        (0x1A, "response_information", T.UTF8_STRING, (P.CONNACK,), False),
        (0x1C, "server_reference", T.UTF8_STRING, (P.CONNACK, P.DISCONNECT), False),
        (0x1F, "reason_string", T.UTF8_STRING,
         (P.CONNACK, *_ACKS, P.SUBACK, P.UNSUBACK, P.DISCONNECT, P.AUTH), False),
        (0x21, "receive_maximum", T.TWO_BYTE_INT, (P.CONNECT, P.CONNACK), False),
        (0x22, "topic_alias_maximum", T.TWO_BYTE_INT, (P.CONNECT, P.CONNACK), False),
        (0x23, "topic_alias", T.TWO_BYTE_INT, (P.PUBLISH,), False),
        (0x24, "maximum_qos", T.BYTE, (P.CONNACK,), False),
        (0x25, "retain_available", T.BOOL_BYTE, (P.CONNACK,), False),
        (0x26, "user_properties", T.UTF8_STRING_PAIR, _ALL, True),
        (0x27, "maximum_packet_size", T.FOUR_BYTE_INT, (P.CONNECT, P.CONNACK), False),
        (0x28, "wildcard_subscription_available", T.BOOL_BYTE, (P.CONNACK,), False),
        (0x29, "subscription_identifier_available", T.BOOL_BYTE, (P.CONNACK,), False),
        (0x2A, "shared_subscription_available", T.BOOL_BYTE, (P.CONNACK,), False),
    ]
)
PROPERTY_BY_ID: dict[int, PropertySpec] = {s.id: s for s in PROPERTY_SPECS}
PROPERTY_BY_NAME: dict[str, PropertySpec] = {s.name: s for s in PROPERTY_SPECS}

# per context: id -> spec, only the properties that context allows
_ALLOWED: dict[int, dict[int, PropertySpec]] = {
    ctx: {s.id: s for s in PROPERTY_SPECS if ctx in s.packets} for ctx in (WILL, *range(1, 16))
}
# the same as plain (name, int type) tuples for the decoder's loop
_ALLOWED_FAST: dict[int, dict[int, tuple[str, int]]] = {
    ctx: {pid: (s.name, int(s.type)) for pid, s in specs.items()} for ctx, specs in _ALLOWED.items()
}
_BYTE, _BOOL, _U16, _U32, _VBI, _STR, _BIN, _PAIR = (
    int(T.BYTE), int(T.BOOL_BYTE), int(T.TWO_BYTE_INT), int(T.FOUR_BYTE_INT),
    int(T.VARIABLE_BYTE_INT), int(T.UTF8_STRING), int(T.BINARY), int(T.UTF8_STRING_PAIR),
)


def allowed_properties(packet_type: int) -> frozenset[str]:
    """Names of the Properties attributes a packet type (or WILL) may carry."""
    return frozenset(s.name for s in _ALLOWED[packet_type].values())


def _err(code: int, msg: str) -> MqttProtocolError:
    return MqttProtocolError(code, msg)


_RESPONSE_TOPIC = int(PropertyId.RESPONSE_TOPIC)


def check_response_topic(topic: str) -> None:
    """Raise ``MqttProtocolError`` (0x82 Protocol Error) unless ``topic`` may be a Response Topic.

    A Response Topic is the Topic Name of the response message (3.3.2.3.5): it MUST NOT contain
    wildcard characters [MQTT-3.3.2-14] and, as every Topic Name, is at least one character long
    [MQTT-4.7.3-1]; its UTF-8 rules (no U+0000, no surrogates) [MQTT-3.3.2-13] are checked when the
    string is read. Applies to a PUBLISH and to the Will properties of a CONNECT: a server answers
    the first with DISCONNECT 0x82, the second with CONNACK 0x82 (``server_error_response``).
    """
    if not topic:
        raise _err(w.PROTOCOL_ERROR, "empty Response Topic")  # [MQTT-4.7.3-1]
    if "+" in topic or "#" in topic:
        raise _err(w.PROTOCOL_ERROR, f"wildcard in Response Topic {topic!r}")  # [MQTT-3.3.2-14]


def decode_properties(data: bytes, pos: int, end: int, ctx: int) -> tuple[Properties, int]:
    """Decode a property length + properties starting at ``pos`` for packet type ``ctx``."""
    if pos >= end:
        raise w.malformed("missing property length")
    n = data[pos]
    if n == 0:  # fast path: no properties
        return EMPTY_PROPERTIES, pos + 1
    if n & 0x80:
        n, pos = w.read_vbi(data, pos, end)
    else:
        pos += 1
    stop = pos + n
    if stop > end:
        raise w.malformed("property length exceeds packet")
    allowed = _ALLOWED_FAST[ctx]
    values: dict[str, object] = {}
    user: list[tuple[str, str]] | None = None
    sub_ids: list[int] | None = None
    while pos < stop:
        pid = data[pos]
        if pid & 0x80:  # identifiers are VBIs; every defined one fits in a byte
            pid, pos = w.read_vbi(data, pos, stop)
        else:
            pos += 1
        spec = allowed.get(pid)
        if spec is None:
            if pid in PROPERTY_BY_ID:
                # 2.2.2.2: an identifier not valid for the packet type is a Malformed Packet
                raise w.malformed(f"property 0x{pid:02X} not allowed in packet type {ctx}")
            raise w.malformed(f"unknown property identifier 0x{pid:02X}")
        name, typ = spec
        if typ == _STR:
            value, pos = w.read_utf8(data, pos, stop)
        elif typ == _U32:
            if pos + 4 > stop:
                raise w.malformed("truncated four byte integer")
            value = w.unpack_u32(data, pos)[0]
            pos += 4
        elif typ == _U16:
            if pos + 2 > stop:
                raise w.malformed("truncated two byte integer")
            value = (data[pos] << 8) | data[pos + 1]
            pos += 2
        elif typ == _BYTE or typ == _BOOL:
            if pos >= stop:
                raise w.malformed("truncated byte")
            value = data[pos]
            pos += 1
        elif typ == _BIN:
            value, pos = w.read_binary(data, pos, stop)
        elif typ == _VBI:
            value, pos = w.read_vbi(data, pos, stop)
        else:  # UTF8_STRING_PAIR
            k, pos = w.read_utf8(data, pos, stop)
            v, pos = w.read_utf8(data, pos, stop)
            if user is None:
                user = []
            user.append((k, v))
            continue
        if pid == 0x0B:
            if value == 0:
                raise _err(w.PROTOCOL_ERROR, "Subscription Identifier 0")  # 3.3.2.3.8
            if sub_ids is None:
                sub_ids = []
            elif ctx != P.PUBLISH:
                raise _err(w.PROTOCOL_ERROR, "Subscription Identifier more than once")  # 3.8.2.1.2
            sub_ids.append(value)
            continue
        if name in values:
            # "It is a Protocol Error to include <property> more than once" (2.2.2.2 / 3.x.2.x)
            raise _err(w.PROTOCOL_ERROR, f"duplicate property {name}")
        if typ == _BOOL or typ == _BYTE:  # every Byte property is 0 or 1 (payload format, max QoS)
            if value > 1:
                raise _err(w.PROTOCOL_ERROR, f"{name} must be 0 or 1, got {value}")
            if typ == _BOOL:
                value = bool(value)
        elif pid == 0x21 or pid == 0x27:
            if value == 0:
                # 3.1.2.11.3 / 3.1.2.11.4 / 3.2.2.3.3 / 3.2.2.3.6
                raise _err(w.PROTOCOL_ERROR, f"{name} must not be 0")
        elif pid == 0x23 and value == 0:
            raise _err(0x94, "Topic Alias 0")  # [MQTT-3.3.2-8]
        elif pid == _RESPONSE_TOPIC:
            check_response_topic(value)
        values[name] = value
    if pos != stop:
        raise w.malformed("property overruns property length")
    if user is not None:
        values["user_properties"] = tuple(user)
    if sub_ids is not None:
        values["subscription_identifiers"] = tuple(sub_ids)
    if "authentication_data" in values and "authentication_method" not in values:
        # 3.1.2.11.10 / 3.2.2.3.18 / 3.15.2.2.3
        raise _err(w.PROTOCOL_ERROR, "Authentication Data without Authentication Method")
    return Properties(**values), stop


_ENCODE_ORDER = tuple((s.id, s.name, int(s.type)) for s in PROPERTY_SPECS)
_GET_ALL = attrgetter(*(s.name for s in PROPERTY_SPECS))  # all 27 values in one C call


def encode_properties(props: Properties, ctx: int) -> bytes:
    """Property length + properties for packet type ``ctx``. Raises MqttProtocolError 0x81 if
    ``props`` holds a property that packet type may not carry."""
    if props is EMPTY_PROPERTIES:
        return b"\x00"
    allowed = _ALLOWED[ctx]
    parts: list[bytes] = []
    for (pid, name, typ), value in zip(_ENCODE_ORDER, _GET_ALL(props)):
        if value is None:
            continue
        if pid not in allowed:
            if pid == 0x0B and not value:
                continue  # empty subscription_identifiers
            raise w.malformed(f"property {name} not allowed in packet type {ctx}")
        if typ == _PAIR:
            for k, v in value:
                parts.append(b"\x26" + w.encode_utf8(k) + w.encode_utf8(v))
        elif typ == _VBI:
            if ctx != 3 and len(value) > 1:
                raise _err(w.PROTOCOL_ERROR, "several subscription identifiers")
            for v in value:
                if not 1 <= v <= w.MAX_VBI:
                    raise w.malformed(f"subscription identifier {v} out of range")
                parts.append(b"\x0b" + w.encode_vbi(v))
        elif typ == _STR:
            parts.append(bytes((pid,)) + w.encode_utf8(value))
        elif typ == _BIN:
            parts.append(bytes((pid,)) + w.encode_binary(value))
        elif typ == _U32:
            if not 0 <= value <= 0xFFFFFFFF:
                raise w.malformed(f"{name} out of range")
            parts.append(bytes((pid,)) + w.pack_u32(value))
        elif typ == _U16:
            if not 0 <= value <= 0xFFFF:
                raise w.malformed(f"{name} out of range")
            parts.append(bytes((pid,)) + w.pack_u16(value))
        else:  # BYTE / BOOL_BYTE
            if not 0 <= value <= 255:
                raise w.malformed(f"{name} out of range")
            parts.append(bytes((pid, int(value))))
    body = b"".join(parts)
    return w.encode_vbi(len(body)) + body
