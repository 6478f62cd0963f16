"""The single exception type raised by the codec."""

from __future__ import annotations

__all__ = ["MqttProtocolError"]


class MqttProtocolError(Exception):
    """A packet violates the MQTT specification.

    ``reason_code`` is the MQTT 5 reason code the receiving side must use (0x81 Malformed Packet,
    0x82 Protocol Error, 0x84 Unsupported Protocol Version, 0x85 Client Identifier not valid,
    0x90 Topic Name invalid, 0x94 Topic Alias invalid, 0x95 Packet too large, ...).

    ``packet_type`` is the packet type being decoded when known (1 = CONNECT: the connection layer
    answers with CONNACK instead of DISCONNECT), ``protocol_level`` the level in force (for a
    CONNECT, the level the client asked for, possibly unsupported) or ``None`` when unknown.
    """

    __slots__ = ("reason_code", "message", "packet_type", "protocol_level")

    def __init__(
        self,
        reason_code: int,
        message: str,
        *,
        packet_type: int | None = None,
        protocol_level: int | None = None,
    ) -> None:
        super().__init__(reason_code, message)
        self.reason_code = int(reason_code)
        self.message = message
        self.packet_type = packet_type
        self.protocol_level = protocol_level

    def __str__(self) -> str:
        return f"[0x{self.reason_code:02X}] {self.message}"

    def __repr__(self) -> str:
        return f"MqttProtocolError(0x{self.reason_code:02X}, {self.message!r})"
