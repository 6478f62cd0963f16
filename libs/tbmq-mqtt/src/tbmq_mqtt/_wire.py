"""Primitive data types (MQTT 5.0 section 1.5): integers, variable byte integers, strings, binary.

Readers take ``(data: bytes, pos, end)`` and return ``(value, new_pos)``; they never read past
``end`` and raise :class:`MqttProtocolError` 0x81 (Malformed Packet) on short or invalid data.
"""

from __future__ import annotations

from struct import Struct

from .errors import MqttProtocolError

MALFORMED = 0x81
PROTOCOL_ERROR = 0x82

MAX_VBI = 268_435_455  # 0xFFFFFF7F on the wire
U16 = Struct("!H")
U32 = Struct("!I")
pack_u16 = U16.pack
pack_u32 = U32.pack
unpack_u16 = U16.unpack_from
unpack_u32 = U32.unpack_from

# Precomputed encodings of small variable byte integers (1 and 2 byte forms): hot path.
_VBI_SMALL: list[bytes] = [bytes((n,)) for n in range(128)] + [
    bytes(((n & 0x7F) | 0x80, n >> 7)) for n in range(128, 16384)
]


def malformed(msg: str) -> MqttProtocolError:
    return MqttProtocolError(MALFORMED, msg)


def encode_vbi(n: int) -> bytes:
    """Variable byte integer, minimum number of bytes [MQTT-1.5.5-1]."""
    if n < 16384:
        if n < 0:
            raise MqttProtocolError(MALFORMED, f"negative variable byte integer {n}")
        return _VBI_SMALL[n]
    if n > MAX_VBI:
        raise MqttProtocolError(MALFORMED, f"variable byte integer {n} > {MAX_VBI}")
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_vbi(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """Decode a variable byte integer; at most 4 bytes, minimal encoding [MQTT-1.5.5-1]."""
    value = 0
    shift = 0
    for i in range(4):
        if pos >= end:
            raise malformed("truncated variable byte integer")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and i:
                raise malformed("variable byte integer not minimally encoded")
            return value, pos
        shift += 7
    raise malformed("variable byte integer longer than 4 bytes")


def read_u8(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos >= end:
        raise malformed("truncated byte")
    return data[pos], pos + 1


def read_u16(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos + 2 > end:
        raise malformed("truncated two byte integer")
    return (data[pos] << 8) | data[pos + 1], pos + 2


def read_u32(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos + 4 > end:
        raise malformed("truncated four byte integer")
    return unpack_u32(data, pos)[0], pos + 4


def read_binary(data: bytes, pos: int, end: int) -> tuple[bytes, int]:
    if pos + 2 > end:
        raise malformed("truncated binary data length")
    n = (data[pos] << 8) | data[pos + 1]
    pos += 2
    stop = pos + n
    if stop > end:
        raise malformed("truncated binary data")
    return data[pos:stop], stop


def read_utf8(data: bytes, pos: int, end: int) -> tuple[str, int]:
    """UTF-8 encoded string. Python's strict decoder rejects ill-formed UTF-8 and encoded
    surrogates U+D800..U+DFFF [MQTT-1.5.4-1]; U+0000 is rejected explicitly [MQTT-1.5.4-2]."""
    if pos + 2 > end:
        raise malformed("truncated string length")
    n = (data[pos] << 8) | data[pos + 1]
    pos += 2
    stop = pos + n
    if stop > end:
        raise malformed("truncated string")
    try:
        s = data[pos:stop].decode("utf-8")
    except UnicodeDecodeError:
        raise malformed("string is not well-formed UTF-8") from None  # [MQTT-1.5.4-1]
    if "\x00" in s:
        raise malformed("string contains U+0000")  # [MQTT-1.5.4-2]
    return s, stop


def encode_utf8(s: str) -> bytes:
    """Length-prefixed UTF-8 string (what is sent is validated like what is received)."""
    try:
        b = s.encode("utf-8")
    except UnicodeEncodeError:
        raise malformed("string contains a surrogate code point") from None  # [MQTT-1.5.4-1]
    if len(b) > 65535:
        raise malformed("string longer than 65535 bytes")
    if "\x00" in s:
        raise malformed("string contains U+0000")  # [MQTT-1.5.4-2]
    return pack_u16(len(b)) + b


def encode_binary(b: bytes) -> bytes:
    if len(b) > 65535:
        raise malformed("binary data longer than 65535 bytes")
    return pack_u16(len(b)) + bytes(b)
