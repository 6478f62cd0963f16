"""Packet and property dataclasses.

Packets and :class:`Properties` are plain ``slots`` dataclasses (mutable so a connection can e.g.
assign ``packet_id`` or set ``dup`` on an outgoing :class:`Publish`). A packet without properties
refers to the shared read-only :data:`EMPTY_PROPERTIES` (what the decoder returns for a property
length of 0; assigning to its attributes raises ``AttributeError``): build a new
``Properties(...)`` or use :func:`dataclasses.replace` (which returns an ordinary ``Properties``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Union

__all__ = [
    "PacketType",
    "Properties",
    "EMPTY_PROPERTIES",
    "Will",
    "Subscription",
    "Connect",
    "ConnAck",
    "Publish",
    "PubAck",
    "PubRec",
    "PubRel",
    "PubComp",
    "Subscribe",
    "SubAck",
    "Unsubscribe",
    "UnsubAck",
    "PingReq",
    "PingResp",
    "Disconnect",
    "Auth",
    "Packet",
    "PROTOCOL_NAMES",
    "MQTT_3_1",
    "MQTT_3_1_1",
    "MQTT_5",
    "SUPPORTED_PROTOCOL_LEVELS",
]

MQTT_3_1 = 3
MQTT_3_1_1 = 4
MQTT_5 = 5
SUPPORTED_PROTOCOL_LEVELS = frozenset((MQTT_3_1, MQTT_3_1_1, MQTT_5))
# Protocol name carried by CONNECT for each level [MQTT-3.1.2-1].
PROTOCOL_NAMES = {MQTT_3_1: "MQIsdp", MQTT_3_1_1: "MQTT", MQTT_5: "MQTT"}


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


@dataclass(slots=True, repr=False)
class Properties:
    """MQTT 5 properties (section 2.2.2.2). ``None`` / empty tuple = absent.

    ``user_properties`` is a tuple of ``(name, value)`` pairs in wire order (a name may repeat);
    ``subscription_identifiers`` a tuple of ints (several only in server-to-client PUBLISH).
    """

    payload_format_indicator: int | None = None  # 0x01 byte: 0 bytes, 1 UTF-8
    message_expiry_interval: int | None = None  # 0x02 four-byte int, seconds
    content_type: str | None = None  # 0x03
    response_topic: str | None = None  # 0x08
    correlation_data: bytes | None = None  # 0x09
    subscription_identifiers: tuple[int, ...] = ()  # 0x0B variable byte int, 1..268435455
    session_expiry_interval: int | None = None  # 0x11 four-byte int
    assigned_client_identifier: str | None = None  # 0x12
    server_keep_alive: int | None = None  # 0x13 two-byte int
    authentication_method: str | None = None  # 0x15
    authentication_data: bytes | None = None  # 0x16
    request_problem_information: bool | None = None  # 0x17 byte 0/1
    will_delay_interval: int | None = None  # 0x18 four-byte int
    request_response_information: bool | None = None  # 0x19 byte 0/1
    response_information: str | None = None  # 0x1A
    server_reference: str | None = None  # 0x1C
    reason_string: str | None = None  # 0x1F
    receive_maximum: int | None = None  # 0x21 two-byte int, not 0
    topic_alias_maximum: int | None = None  # 0x22 two-byte int
    topic_alias: int | None = None  # 0x23 two-byte int, not 0
    maximum_qos: int | None = None  # 0x24 byte 0/1
    retain_available: bool | None = None  # 0x25 byte 0/1
    user_properties: tuple[tuple[str, str], ...] = ()  # 0x26 string pairs
    maximum_packet_size: int | None = None  # 0x27 four-byte int, not 0
    wildcard_subscription_available: bool | None = None  # 0x28 byte 0/1
    subscription_identifier_available: bool | None = None  # 0x29 byte 0/1
    shared_subscription_available: bool | None = None  # 0x2A byte 0/1

    def __repr__(self) -> str:  # only the properties that are present
        items = []
        for name in Properties.__slots__:
            v = getattr(self, name)
            if v is not None and v != ():
                items.append(f"{name}={v!r}")
        return f"Properties({', '.join(items)})"

    def __bool__(self) -> bool:
        """True when at least one property is present."""
        return self is not EMPTY_PROPERTIES and any(
            (v := getattr(self, n)) is not None and v != () for n in Properties.__slots__
        )


class _EmptyProperties(Properties):
    """Type of the read-only EMPTY_PROPERTIES singleton (Properties itself is not frozen because
    a frozen 27-field dataclass costs ~2.7 us to build versus ~0.5 us)."""

    __slots__ = ()

    def __new__(cls, *args, **kwargs):  # dataclasses.replace()/copy -> an ordinary Properties
        obj = object.__new__(Properties)
        obj.__init__(*args, **kwargs)
        return obj

    def __setattr__(self, name, value):
        raise AttributeError("EMPTY_PROPERTIES is read-only; create a new Properties")

    def __delattr__(self, name):
        raise AttributeError("EMPTY_PROPERTIES is read-only")

    def __eq__(self, other):
        if isinstance(other, Properties):
            return all(getattr(self, n) == getattr(other, n) for n in Properties.__slots__)
        return NotImplemented

    def __hash__(self) -> int:  # immutable, so hashable (also lets dataclasses use it as a default)
        return 0


def _make_empty() -> Properties:
    obj = object.__new__(_EmptyProperties)
    template = Properties()
    for name in Properties.__slots__:
        object.__setattr__(obj, name, getattr(template, name))
    return obj


EMPTY_PROPERTIES: Properties = _make_empty()


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties = EMPTY_PROPERTIES  # will properties (v5 only)


@dataclass(slots=True)
class Subscription:
    filter: str
    qos: int = 0
    no_local: bool = False  # v5 only
    retain_as_published: bool = False  # v5 only
    retain_handling: int = 0  # v5 only: 0 send retained, 1 only if new subscription, 2 never


@dataclass(slots=True)
class Connect:
    packet_type: ClassVar[int] = PacketType.CONNECT
    protocol_level: int = MQTT_3_1_1
    client_id: str = ""
    clean_start: bool = True  # "clean session" in 3.x
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class ConnAck:
    """``reason_code`` is the v5 reason code, or the 3.x return code (0..5) at levels 3/4.

    The encoder maps a v5 code to the 3.x return code when encoding for level 3/4.
    """

    packet_type: ClassVar[int] = PacketType.CONNACK
    session_present: bool = False
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class Publish:
    packet_type: ClassVar[int] = PacketType.PUBLISH
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # required (1..65535) when qos > 0, None when qos == 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class PubAck:
    packet_type: ClassVar[int] = PacketType.PUBACK
    packet_id: int
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class PubRec:
    packet_type: ClassVar[int] = PacketType.PUBREC
    packet_id: int
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class PubRel:
    packet_type: ClassVar[int] = PacketType.PUBREL
    packet_id: int
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class PubComp:
    packet_type: ClassVar[int] = PacketType.PUBCOMP
    packet_id: int
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class Subscribe:
    packet_type: ClassVar[int] = PacketType.SUBSCRIBE
    packet_id: int
    subscriptions: list[Subscription] = field(default_factory=list)
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class SubAck:
    """One reason code per subscription: granted QoS 0..2 or a failure code >= 0x80."""

    packet_type: ClassVar[int] = PacketType.SUBACK
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class Unsubscribe:
    packet_type: ClassVar[int] = PacketType.UNSUBSCRIBE
    packet_id: int
    filters: list[str] = field(default_factory=list)
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class UnsubAck:
    """``reason_codes`` is v5 only (one per filter); empty at levels 3/4."""

    packet_type: ClassVar[int] = PacketType.UNSUBACK
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class PingReq:
    packet_type: ClassVar[int] = PacketType.PINGREQ


@dataclass(slots=True)
class PingResp:
    packet_type: ClassVar[int] = PacketType.PINGRESP


@dataclass(slots=True)
class Disconnect:
    """``reason_code``/``properties`` are v5 only (a 3.x DISCONNECT is empty)."""

    packet_type: ClassVar[int] = PacketType.DISCONNECT
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


@dataclass(slots=True)
class Auth:
    """MQTT 5 only."""

    packet_type: ClassVar[int] = PacketType.AUTH
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


Packet = Union[
    Connect, ConnAck, Publish, PubAck, PubRec, PubRel, PubComp, Subscribe, SubAck, Unsubscribe,
    UnsubAck, PingReq, PingResp, Disconnect, Auth,
]
