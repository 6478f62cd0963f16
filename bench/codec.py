"""A tiny, specialised MQTT encoder/decoder: only what the load generator needs.

Packets: CONNECT (3.1.1, and 5.0 with Session Expiry Interval), CONNACK, PUBLISH QoS 0/1, PUBACK,
SUBSCRIBE, SUBACK, PINGREQ/PINGRESP, DISCONNECT. No validation beyond framing: the broker is trusted.
(libs/tbmq-mqtt is the full sans-io codec; this one trades completeness for a few µs per message.)

Benchmark payload (fixed layout, little endian, padded to `size` bytes):
    u32 publisher id | u32 sequence number | u16 step tag | u64 send time (time.monotonic_ns)
CLOCK_MONOTONIC is system-wide on Linux, so send and receive times compare across processes.
"""

from __future__ import annotations

import struct

CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14

PAYLOAD = struct.Struct("<IIHQ")
PAYLOAD_HEADER = PAYLOAD.size  # 18 bytes
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

PINGREQ_BYTES = b"\xc0\x00"
DISCONNECT_BYTES = b"\xe0\x00"


def varint(n: int) -> bytes:
    """MQTT Variable Byte Integer."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return _U16.pack(len(b)) + b


def connect(client_id: str, *, clean: bool = True, keepalive: int = 60, version: int = 4,
            session_expiry: int | None = None, username: str | None = None,
            password: str | None = None) -> bytes:
    """CONNECT; version 4 = MQTT 3.1.1, 5 = MQTT 5.0 (clean = Clean Start)."""
    flags = 0x02 if clean else 0
    if username is not None:
        flags |= 0x80
    if password is not None:
        flags |= 0x40
    var = _str("MQTT") + bytes((version, flags)) + _U16.pack(keepalive)
    if version == 5:
        props = b""
        if session_expiry:
            props = b"\x11" + _U32.pack(session_expiry)
        var += varint(len(props)) + props
    body = var + _str(client_id)
    if username is not None:
        body += _str(username)
    if password is not None:
        body += _str(password)
    return b"\x10" + varint(len(body)) + body


def subscribe(packet_id: int, topic_filter: str, qos: int, *, version: int = 4) -> bytes:
    body = _U16.pack(packet_id) + (b"\x00" if version == 5 else b"") + _str(topic_filter) + bytes((qos,))
    return b"\x82" + varint(len(body)) + body


class PublishEncoder:
    """Encodes PUBLISH packets for one topic; the fixed part is built once."""

    __slots__ = ("qos", "_head_q0", "_head_q1", "_props", "pad")

    def __init__(self, topic: str, qos: int, payload_size: int, *, version: int = 4) -> None:
        if payload_size < PAYLOAD_HEADER:
            raise ValueError(f"payload must be at least {PAYLOAD_HEADER} bytes")
        self.qos = qos
        t = _str(topic)
        self._props = b"\x00" if version == 5 else b""
        self.pad = b"\x00" * (payload_size - PAYLOAD_HEADER)
        rl0 = len(t) + len(self._props) + payload_size
        self._head_q0 = b"\x30" + varint(rl0) + t + self._props
        # QoS 1: the packet id sits between topic and properties
        self._head_q1 = (b"\x32" + varint(rl0 + 2) + t, self._props)

    def encode(self, packet_id: int, pub_id: int, seq: int, step: int, ts_ns: int) -> bytes:
        payload = PAYLOAD.pack(pub_id, seq, step, ts_ns) + self.pad
        if self.qos == 0:
            return self._head_q0 + payload
        head, props = self._head_q1
        return head + _U16.pack(packet_id) + props + payload


def publish(topic: str, payload: bytes, qos: int = 0, packet_id: int = 0, *, version: int = 4,
            retain: bool = False, dup: bool = False) -> bytes:
    """Generic PUBLISH (tests, backlog seeding)."""
    b0 = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    body = _str(topic) + (_U16.pack(packet_id) if qos else b"") + (b"\x00" if version == 5 else b"") + payload
    return bytes((b0,)) + varint(len(body)) + body


def puback(packet_id: int) -> bytes:
    """PUBACK with success (the v5 form without reason code is identical)."""
    return b"\x40\x02" + _U16.pack(packet_id)


def split(buf: bytearray):
    """Split complete packets off the front of `buf`.

    Returns (packets, consumed) where packets is a list of (first_byte, body_start, body_end) offsets into
    `buf`; the caller deletes `consumed` bytes afterwards.
    """
    out = []
    i = 0
    n = len(buf)
    while i + 2 <= n:
        b0 = buf[i]
        # remaining length (1-4 bytes)
        j = i + 1
        mult = 1
        rl = 0
        while True:
            if j >= n:
                return out, i
            b = buf[j]
            rl += (b & 0x7F) * mult
            j += 1
            if b < 0x80:
                break
            mult <<= 7
        end = j + rl
        if end > n:
            return out, i
        out.append((b0, j, end))
        i = end
    return out, i


def skip_properties(buf, p: int) -> int:
    """Offset just past the v5 properties that start at `p` (a variable byte integer length, then them)."""
    plen = 0
    mult = 1
    while True:
        b = buf[p]
        p += 1
        plen += (b & 0x7F) * mult
        if b < 0x80:
            break
        mult <<= 7
    return p + plen


def parse_publish(buf, b0: int, start: int, end: int, version: int = 4):
    """-> (topic, qos, packet_id, payload_offset). Payload is buf[payload_offset:end]."""
    qos = (b0 >> 1) & 3
    tlen = (buf[start] << 8) | buf[start + 1]
    p = start + 2
    topic = bytes(buf[p:p + tlen])
    p += tlen
    pid = 0
    if qos:
        pid = (buf[p] << 8) | buf[p + 1]
        p += 2
    if version == 5:
        p = skip_properties(buf, p)
    return topic, qos, pid, p


def parse_connack(buf, start: int, end: int) -> tuple[bool, int]:
    """-> (session_present, return/reason code)."""
    return bool(buf[start] & 1), buf[start + 1]


def parse_suback(buf, start: int, end: int, version: int = 4) -> tuple[int, list[int]]:
    pid = (buf[start] << 8) | buf[start + 1]
    p = start + 2
    if version == 5:
        p = skip_properties(buf, p)
    return pid, list(buf[p:end])
