"""MQTT 5 reason codes, which packets may carry them, and the MQTT 3.x CONNACK return codes."""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "ReasonCode",
    "ConnackReturnCode",
    "REASON_CODES_BY_PACKET",
    "SUBACK_V3_CODES",
    "to_v3_connack_return_code",
]


class ReasonCode(IntEnum):
    """MQTT 5.0 reason codes (section 2.4). 0x00 has three names depending on the packet."""

    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnackReturnCode(IntEnum):
    """MQTT 3.1 / 3.1.1 CONNACK return codes."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USER_NAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


# Which reason codes each packet type may carry (MQTT 5.0 sections 3.2.2.2, 3.4.2.1, 3.5.2.1,
# 3.6.2.1, 3.7.2.1, 3.9.3, 3.11.3, 3.14.2.1, 3.15.2.1). Keys are packet type numbers.
_R = ReasonCode
REASON_CODES_BY_PACKET: dict[int, frozenset[int]] = {
    2: frozenset(  # CONNACK
        [0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90,
         0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F]
    ),
    4: frozenset([0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99]),  # PUBACK
    5: frozenset([0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99]),  # PUBREC
    6: frozenset([0x00, 0x92]),  # PUBREL
    7: frozenset([0x00, 0x92]),  # PUBCOMP
    9: frozenset([0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2]),  # SUBACK
    11: frozenset([0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91]),  # UNSUBACK
    14: frozenset(  # DISCONNECT
        [0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8C, 0x8D, 0x8E, 0x8F, 0x90,
         0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0,
         0xA1, 0xA2]
    ),
    15: frozenset([0x00, 0x18, 0x19]),  # AUTH
}

# MQTT 3.1.1 SUBACK return codes (3.9.3): granted QoS 0..2 or 0x80 failure.
SUBACK_V3_CODES = frozenset([0x00, 0x01, 0x02, 0x80])

_V5_TO_V3_CONNACK = {
    0x00: 0,
    0x84: 1,  # Unsupported Protocol Version -> unacceptable protocol version [MQTT-3.1.2-2]
    0x85: 2,  # Client Identifier not valid -> identifier rejected (3.1.1 [MQTT-3.1.3-9]; 5.0 [MQTT-3.1.3-8])
    0x88: 3,
    0x89: 3,
    0x9C: 3,
    0x9D: 3,
    0x9F: 3,
    0x86: 4,
    0x87: 5,
    0x8A: 5,
    0x8C: 5,
}


def to_v3_connack_return_code(reason_code: int) -> int:
    """Map an MQTT 5 CONNACK reason code (or an already-v3 code 0..5) to a 3.x return code.

    Codes with no 3.x equivalent map to 3 (Server unavailable); note that MQTT 3.x servers are
    expected to just close the connection on a malformed CONNECT rather than send CONNACK.
    """
    if 0 <= reason_code <= 5:
        return reason_code
    return _V5_TO_V3_CONNACK.get(reason_code, 3)
