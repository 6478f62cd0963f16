"""Sans-io encoder and streaming decoder for MQTT 3.1 (level 3), 3.1.1 (level 4) and 5.0 (level 5).

Spec statement ids cited as [MQTT-x.y.z-n] are those of MQTT 5.0 unless marked "3.1.1".
"""

from __future__ import annotations

from enum import Enum

from . import _wire as w
from ._wire import (
    MALFORMED,
    PROTOCOL_ERROR,
    encode_binary,
    encode_utf8,
    encode_vbi,
    pack_u16,
    read_binary,
    read_u16,
    read_utf8,
    read_vbi,
)
from .errors import MqttProtocolError
from .packets import (
    EMPTY_PROPERTIES,
    MQTT_5,
    PROTOCOL_NAMES,
    SUPPORTED_PROTOCOL_LEVELS,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    PingReq,
    PingResp,
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
)
from .properties import WILL, decode_properties, encode_properties
from .reason_codes import REASON_CODES_BY_PACKET, SUBACK_V3_CODES, to_v3_connack_return_code

__all__ = [
    "Role",
    "MqttDecoder",
    "decode",
    "encode",
    "server_error_response",
    "MAX_PACKET_SIZE",
    "DEFAULT_MAX_PACKET_SIZE",
]

MAX_PACKET_SIZE = 1 + 4 + w.MAX_VBI  # largest packet the protocol can express
DEFAULT_MAX_PACKET_SIZE = MAX_PACKET_SIZE

TOPIC_NAME_INVALID = 0x90


class Role(str, Enum):
    """Which side of the connection the decoder sits on.

    SERVER decodes what a client sends: the first packet must be CONNECT [MQTT-3.1.0-1], a second
    CONNECT is a Protocol Error [MQTT-3.1.0-2], server-to-client packets (CONNACK, SUBACK,
    UNSUBACK, PINGRESP) are Protocol Errors and a PUBLISH must not carry Subscription Identifiers
    [MQTT-3.3.4-6]. CLIENT decodes what a server sends (CONNECT, SUBSCRIBE, UNSUBSCRIBE, PINGREQ
    are Protocol Errors) and needs ``protocol_level``. ANY accepts every packet type (tools, tests);
    a CONNECT sets the protocol level.
    """

    SERVER = "server"
    CLIENT = "client"
    ANY = "any"


_C2S = frozenset((1, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15))
_S2C = frozenset((2, 3, 4, 5, 6, 7, 9, 11, 13, 14, 15))

# Required fixed-header flags per packet type; None = PUBLISH (flags carry DUP/QoS/RETAIN).
# [MQTT-2.1.3-1]: "Where a flag bit is marked as Reserved, it is reserved for future use and MUST
# be set to the value listed"; otherwise the packet is Malformed.
_REQUIRED_FLAGS = (None, 0, 0, None, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0, 0)

_NAMES = {t.value: t.name for t in PacketType}


# --------------------------------------------------------------------------------------------
# decoding of packet bodies: f(flags, data, pos, end, level, server) -> Packet
# ``data[pos:end]`` is the variable header + payload; ``server`` is True for Role.SERVER.
# --------------------------------------------------------------------------------------------


def _check_reason(ptype: int, rc: int) -> int:
    if rc not in REASON_CODES_BY_PACKET[ptype]:
        raise w.malformed(f"reason code 0x{rc:02X} not valid in {_NAMES[ptype]}")
    return rc


def _check_topic_name(topic: str, what: str = "topic name") -> None:
    # [MQTT-3.3.2-2]: the Topic Name in a PUBLISH MUST NOT contain wildcard characters
    if "+" in topic or "#" in topic:
        raise MqttProtocolError(TOPIC_NAME_INVALID, f"wildcard in {what} {topic!r}")


def _packet_id(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos + 2 > end:
        raise w.malformed("truncated packet identifier")
    pid = (data[pos] << 8) | data[pos + 1]
    if pid == 0:
        # [MQTT-2.2.1-3]: SUBSCRIBE, UNSUBSCRIBE and PUBLISH (QoS > 0) need a non-zero id
        raise MqttProtocolError(PROTOCOL_ERROR, "packet identifier 0")
    return pid, pos + 2


def _expect_end(pos: int, end: int, ptype: int) -> None:
    if pos != end:
        raise w.malformed(f"{_NAMES[ptype]}: {end - pos} unexpected trailing bytes")


def _decode_connect(flags, data, pos, end, level, server) -> Connect:
    name, pos = read_utf8(data, pos, end)
    if pos >= end:
        raise w.malformed("truncated CONNECT")
    lvl = data[pos]
    pos += 1
    if name not in ("MQTT", "MQIsdp"):
        # [MQTT-3.1.2-1]: an incorrect protocol name: the server MAY disconnect
        raise MqttProtocolError(PROTOCOL_ERROR, f"unknown protocol name {name!r}")
    if lvl not in SUPPORTED_PROTOCOL_LEVELS or PROTOCOL_NAMES[lvl] != name:
        # [MQTT-3.1.2-2]: unsupported level -> CONNACK 0x84 (v5) / return code 0x01 (3.1.1)
        raise MqttProtocolError(
            0x84, f"unsupported protocol {name!r} level {lvl}", protocol_level=lvl
        )
    try:
        return _decode_connect_rest(data, pos, end, lvl)
    except MqttProtocolError as e:
        e.protocol_level = lvl
        raise


def _decode_connect_rest(data, pos, end, level) -> Connect:
    if pos + 3 > end:
        raise w.malformed("truncated CONNECT")
    cflags = data[pos]
    keep_alive = (data[pos + 1] << 8) | data[pos + 2]
    pos += 3
    if cflags & 0x01:
        raise w.malformed("CONNECT reserved flag set")  # [MQTT-3.1.2-3]
    will_flag = cflags & 0x04
    will_qos = (cflags >> 3) & 0x03
    will_retain = bool(cflags & 0x20)
    has_password = cflags & 0x40
    has_username = cflags & 0x80
    if not will_flag:
        if will_qos:
            raise w.malformed("Will QoS set without Will Flag")  # [MQTT-3.1.2-11]
        if will_retain:
            raise w.malformed("Will Retain set without Will Flag")  # [MQTT-3.1.2-13]
    elif will_qos == 3:
        raise w.malformed("Will QoS 3")  # [MQTT-3.1.2-12]
    if level < MQTT_5 and has_password and not has_username:
        raise w.malformed("password without user name")  # 3.1.1 [MQTT-3.1.2-22]
    props = EMPTY_PROPERTIES
    if level == MQTT_5:
        props, pos = decode_properties(data, pos, end, PacketType.CONNECT)
    client_id, pos = read_utf8(data, pos, end)
    clean = bool(cflags & 0x02)
    if not client_id:
        if level == 3:
            # MQTT 3.1: the Client Identifier is 1 to 23 characters -> identifier rejected
            raise MqttProtocolError(0x85, "empty client identifier (MQTT 3.1)")
        if level == 4 and not clean:
            # 3.1.1 [MQTT-3.1.3-8]: empty ClientId with CleanSession 0 -> CONNACK 0x02
            raise MqttProtocolError(0x85, "empty client identifier without clean session")
    will = None
    if will_flag:
        wprops = EMPTY_PROPERTIES
        if level == MQTT_5:
            wprops, pos = decode_properties(data, pos, end, WILL)
        wtopic, pos = read_utf8(data, pos, end)
        if not wtopic:
            raise MqttProtocolError(TOPIC_NAME_INVALID, "empty will topic")  # [MQTT-4.7.3-1]
        _check_topic_name(wtopic, "will topic")
        wpayload, pos = read_binary(data, pos, end)
        will = Will(wtopic, wpayload, will_qos, will_retain, wprops)
    username = None
    if has_username:
        username, pos = read_utf8(data, pos, end)
    password = None
    if has_password:
        password, pos = read_binary(data, pos, end)
    _expect_end(pos, end, 1)
    return Connect(level, client_id, clean, keep_alive, username, password, will, props)


def _decode_connack(flags, data, pos, end, level, server) -> ConnAck:
    if pos + 2 > end:
        raise w.malformed("truncated CONNACK")
    ack_flags = data[pos]
    rc = data[pos + 1]
    pos += 2
    if ack_flags & 0xFE:
        raise w.malformed("CONNACK reserved flags set")  # [MQTT-3.2.2-1]
    props = EMPTY_PROPERTIES
    if level == MQTT_5:
        _check_reason(2, rc)
        props, pos = decode_properties(data, pos, end, PacketType.CONNACK)
    elif rc > 5:
        raise w.malformed(f"CONNACK return code {rc}")
    _expect_end(pos, end, 2)
    return ConnAck(bool(ack_flags), rc, props)


def _decode_publish(flags, data, pos, end, level, server) -> Publish:
    qos = (flags >> 1) & 3
    if qos == 3:
        raise w.malformed("PUBLISH QoS 3")  # [MQTT-3.3.1-4]
    dup = flags & 8
    if dup and not qos:
        raise w.malformed("PUBLISH QoS 0 with DUP=1")  # [MQTT-3.3.1-2]
    if pos + 2 > end:
        raise w.malformed("truncated topic name")
    stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
    if stop > end:
        raise w.malformed("truncated topic name")
    try:
        topic = data[pos + 2 : stop].decode()
    except UnicodeDecodeError:
        raise w.malformed("topic name is not well-formed UTF-8") from None  # [MQTT-1.5.4-1]
    if "+" in topic or "#" in topic:
        raise MqttProtocolError(TOPIC_NAME_INVALID, f"wildcard in topic name {topic!r}")  # [MQTT-3.3.2-2]
    if "\x00" in topic:
        raise w.malformed("topic name contains U+0000")  # [MQTT-1.5.4-2]
    pos = stop
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise w.malformed("truncated packet identifier")
        packet_id = (data[pos] << 8) | data[pos + 1]
        if not packet_id:
            raise MqttProtocolError(PROTOCOL_ERROR, "PUBLISH packet identifier 0")  # [MQTT-2.2.1-3]
        pos += 2
    props = EMPTY_PROPERTIES
    if level == MQTT_5:
        if pos < end and data[pos] == 0:
            pos += 1
        else:
            props, pos = decode_properties(data, pos, end, 3)
            if server and props.subscription_identifiers:
                # [MQTT-3.3.4-6]: a PUBLISH sent to the server MUST NOT contain a Subscription Id
                raise MqttProtocolError(PROTOCOL_ERROR, "Subscription Identifier in client PUBLISH")
        if not topic and props.topic_alias is None:
            # 3.3.2.1: zero length Topic Name without Topic Alias is a Protocol Error
            raise MqttProtocolError(PROTOCOL_ERROR, "empty topic name without topic alias")
    elif not topic:
        raise MqttProtocolError(TOPIC_NAME_INVALID, "empty topic name")  # [MQTT-4.7.3-1]
    return Publish(topic, data[pos:end], qos, bool(flags & 1), bool(dup), packet_id, props)


def _ack_decoder(cls, ptype):
    def decode_ack(flags, data, pos, end, level, server):
        if pos + 2 > end:
            raise w.malformed(f"truncated {_NAMES[ptype]}")
        pid = (data[pos] << 8) | data[pos + 1]
        if not pid:
            raise MqttProtocolError(PROTOCOL_ERROR, f"{_NAMES[ptype]} packet identifier 0")  # [MQTT-2.2.1-5]
        pos += 2
        if pos == end:
            return cls(pid)
        if level != MQTT_5:
            raise w.malformed(f"{_NAMES[ptype]} remaining length must be 2")
        rc = data[pos]
        _check_reason(ptype, rc)
        pos += 1
        props = EMPTY_PROPERTIES
        if pos < end:  # 3.4.2.2: property length omitted when remaining length < 4
            props, pos = decode_properties(data, pos, end, ptype)
            _expect_end(pos, end, ptype)
        return cls(pid, rc, props)

    return decode_ack


def _decode_subscribe(flags, data, pos, end, level, server) -> Subscribe:
    pid, pos = _packet_id(data, pos, end)
    props = EMPTY_PROPERTIES
    v5 = level == MQTT_5
    if v5:
        props, pos = decode_properties(data, pos, end, 8)
    subs = []
    while pos < end:
        topic_filter, pos = read_utf8(data, pos, end)
        if pos >= end:
            raise w.malformed("missing subscription options")
        opts = data[pos]
        pos += 1
        qos = opts & 3
        if v5:
            if opts & 0xC0:
                raise w.malformed("reserved subscription option bits set")  # [MQTT-3.8.3-5]
            if qos == 3:
                raise MqttProtocolError(PROTOCOL_ERROR, "subscription QoS 3")  # 3.8.3.1
            rh = (opts >> 4) & 3
            if rh == 3:
                raise MqttProtocolError(PROTOCOL_ERROR, "Retain Handling 3")  # 3.8.3.1
            no_local = bool(opts & 4)
            if no_local and topic_filter.startswith("$share/"):
                # [MQTT-3.8.3-4]: No Local on a Shared Subscription is a Protocol Error
                raise MqttProtocolError(PROTOCOL_ERROR, "No Local on a shared subscription")
            subs.append(Subscription(topic_filter, qos, no_local, bool(opts & 8), rh))
        else:
            if opts & 0xFC or qos == 3:
                # 3.1.1 [MQTT-3-8.3-4]: reserved bits and QoS 3 are malformed
                raise w.malformed(f"invalid requested QoS byte 0x{opts:02X}")
            subs.append(Subscription(topic_filter, qos))
    if not subs:
        # the payload MUST contain at least one Topic Filter / options pair: [MQTT-3.8.3-2];
        # 3.1.1 [MQTT-3.8.3-3] (3.1.1 numbering; in 5.0 that id is No Local)
        raise MqttProtocolError(PROTOCOL_ERROR, "SUBSCRIBE without topic filters")
    return Subscribe(pid, subs, props)


def _decode_suback(flags, data, pos, end, level, server) -> SubAck:
    pid, pos = _packet_id(data, pos, end)
    props = EMPTY_PROPERTIES
    if level == MQTT_5:
        props, pos = decode_properties(data, pos, end, 9)
        allowed = REASON_CODES_BY_PACKET[9]
    else:
        allowed = SUBACK_V3_CODES
    codes = list(data[pos:end])
    if not codes:
        raise MqttProtocolError(PROTOCOL_ERROR, "SUBACK without reason codes")
    for rc in codes:
        if rc not in allowed:
            raise w.malformed(f"SUBACK reason code 0x{rc:02X}")
    return SubAck(pid, codes, props)


def _decode_unsubscribe(flags, data, pos, end, level, server) -> Unsubscribe:
    pid, pos = _packet_id(data, pos, end)
    props = EMPTY_PROPERTIES
    if level == MQTT_5:
        props, pos = decode_properties(data, pos, end, 10)
    filters = []
    while pos < end:
        f, pos = read_utf8(data, pos, end)
        filters.append(f)
    if not filters:
        # [MQTT-3.10.3-2]: the payload MUST contain at least one Topic Filter
        raise MqttProtocolError(PROTOCOL_ERROR, "UNSUBSCRIBE without topic filters")
    return Unsubscribe(pid, filters, props)


def _decode_unsuback(flags, data, pos, end, level, server) -> UnsubAck:
    pid, pos = _packet_id(data, pos, end)
    if level != MQTT_5:
        _expect_end(pos, end, 11)
        return UnsubAck(pid)
    props, pos = decode_properties(data, pos, end, 11)
    codes = list(data[pos:end])
    if not codes:
        raise MqttProtocolError(PROTOCOL_ERROR, "UNSUBACK without reason codes")
    allowed = REASON_CODES_BY_PACKET[11]
    for rc in codes:
        if rc not in allowed:
            raise w.malformed(f"UNSUBACK reason code 0x{rc:02X}")
    return UnsubAck(pid, codes, props)


def _empty_decoder(cls, ptype):
    packet = cls

    def decode_empty(flags, data, pos, end, level, server):
        if pos != end:
            raise w.malformed(f"{_NAMES[ptype]} must have remaining length 0")
        return packet()

    return decode_empty


def _reason_props_decoder(cls, ptype):
    """DISCONNECT and AUTH: v5 reason code and properties, both omittable (3.14.2.1, 3.15.2.1)."""

    def decode_rp(flags, data, pos, end, level, server):
        if level != MQTT_5:
            if ptype == 15:
                raise w.malformed("AUTH is MQTT 5 only")
            if pos != end:
                raise w.malformed("DISCONNECT must have remaining length 0")
            return cls()
        if pos == end:
            return cls()
        rc = _check_reason(ptype, data[pos])
        pos += 1
        props = EMPTY_PROPERTIES
        if pos < end:
            props, pos = decode_properties(data, pos, end, ptype)
            _expect_end(pos, end, ptype)
        return cls(rc, props)

    return decode_rp


_DECODERS = (
    None,
    _decode_connect,
    _decode_connack,
    _decode_publish,
    _ack_decoder(PubAck, 4),
    _ack_decoder(PubRec, 5),
    _ack_decoder(PubRel, 6),
    _ack_decoder(PubComp, 7),
    _decode_subscribe,
    _decode_suback,
    _decode_unsubscribe,
    _decode_unsuback,
    _empty_decoder(PingReq, 12),
    _empty_decoder(PingResp, 13),
    _reason_props_decoder(Disconnect, 14),
    _reason_props_decoder(Auth, 15),
)


class MqttDecoder:
    """Streaming decoder: ``feed(bytes) -> list[Packet]``, buffering partial packets.

    * ``protocol_level``: 3, 4 or 5; ``None`` until a CONNECT is decoded (server side). It can
      be assigned later (a client sets it to the level of the CONNECT it sent).
    * ``max_packet_size``: the largest whole packet (fixed header included) accepted; a larger
      declared Remaining Length raises 0x95 (Packet too large) as soon as the fixed header is
      read, before the body is buffered.
    * ``role``: see :class:`Role`.

    Once ``feed`` has raised :class:`MqttProtocolError` the decoder is failed and every later
    call raises the same error (the connection must be closed). Packets that preceded the bad
    packet in the same ``feed`` call are dropped.
    """

    __slots__ = ("protocol_level", "max_packet_size", "role", "_server", "_connected", "_buf",
                 "_need", "_error")

    def __init__(
        self,
        protocol_level: int | None = None,
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        *,
        role: Role | str = Role.SERVER,
    ) -> None:
        role = Role(role)
        if protocol_level is not None and protocol_level not in SUPPORTED_PROTOCOL_LEVELS:
            raise ValueError(f"unsupported protocol level {protocol_level}")
        if role is Role.CLIENT and protocol_level is None:
            raise ValueError("a client-side decoder needs protocol_level")
        if max_packet_size < 2:
            raise ValueError("max_packet_size must be >= 2")
        self.protocol_level = protocol_level
        self.max_packet_size = max_packet_size
        self.role = role
        self._server = role is Role.SERVER
        self._connected = False  # SERVER: a CONNECT has been decoded
        self._buf = bytearray()
        self._need = 0  # feed() does not try to parse until the buffer holds this many bytes
        self._error: MqttProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a packet."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Packet]:
        if self._error is not None:
            raise self._error
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return []
            data = bytes(buf)
            buf.clear()
        elif data.__class__ is not bytes:
            data = bytes(data)
        n = len(data)
        pos = 0
        out: list[Packet] = []
        ptype = 0
        server = self._server
        client = self.role is Role.CLIENT
        max_size = self.max_packet_size
        try:
            while pos < n:
                b0 = data[pos]
                ptype = b0 >> 4
                flags = b0 & 0x0F
                if server:
                    if not self._connected:
                        if ptype != 1:
                            # [MQTT-3.1.0-1]: the first packet sent by the client MUST be CONNECT
                            raise MqttProtocolError(PROTOCOL_ERROR, "first packet is not CONNECT")
                    elif ptype == 1:
                        # [MQTT-3.1.0-2]: a second CONNECT is a Protocol Error
                        raise MqttProtocolError(PROTOCOL_ERROR, "second CONNECT")
                    elif ptype not in _C2S:
                        if ptype == 0:
                            raise w.malformed("reserved packet type 0")
                        raise MqttProtocolError(
                            PROTOCOL_ERROR, f"{_NAMES[ptype]} is not sent by clients"
                        )
                elif ptype == 0:
                    raise w.malformed("reserved packet type 0")
                elif client and ptype not in _S2C:
                    raise MqttProtocolError(PROTOCOL_ERROR, f"{_NAMES[ptype]} is not sent by servers")
                required = _REQUIRED_FLAGS[ptype]
                if required is not None and flags != required:
                    raise w.malformed(
                        f"{_NAMES[ptype]} fixed header flags 0x{flags:X}, must be 0x{required:X}"
                    )  # [MQTT-2.1.3-1]
                # Remaining Length: variable byte integer, at most 4 bytes [MQTT-1.5.5-1]
                i = pos + 1
                if i < n and data[i] < 0x80:  # fast path: one byte
                    rl = data[i]
                    i += 1
                else:
                    rl = 0
                    shift = 0
                    complete = False
                    while i < n:
                        b = data[i]
                        i += 1
                        rl |= (b & 0x7F) << shift
                        if not b & 0x80:
                            if b == 0:
                                raise w.malformed("remaining length not minimally encoded")
                            complete = True
                            break
                        shift += 7
                        if shift == 28:
                            raise w.malformed("remaining length longer than 4 bytes")
                    if not complete:
                        self._need = n - pos + 1  # fixed header incomplete
                        break
                total = i - pos + rl
                if total > max_size:
                    raise MqttProtocolError(
                        0x95, f"packet of {total} bytes exceeds maximum {max_size}"
                    )
                end = pos + total
                if end > n:
                    self._need = total
                    break
                level = self.protocol_level
                if ptype == 1:
                    packet = _decode_connect(flags, data, i, end, level, server)
                    self.protocol_level = packet.protocol_level
                    self._connected = True
                else:
                    if level is None:
                        raise MqttProtocolError(
                            PROTOCOL_ERROR, f"{_NAMES[ptype]} before the protocol level is known"
                        )
                    packet = _DECODERS[ptype](flags, data, i, end, level, server)
                out.append(packet)
                pos = end
        except MqttProtocolError as e:
            if e.packet_type is None:
                e.packet_type = ptype
            if e.protocol_level is None:
                e.protocol_level = self.protocol_level
            self._error = e
            buf.clear()
            raise
        if pos < n:
            buf += memoryview(data)[pos:]
        return out


def decode(data: bytes, protocol_level: int | None = None, *, role: Role | str = Role.ANY) -> Packet:
    """Decode exactly one complete packet (raises 0x81 if ``data`` is short or has extra bytes)."""
    dec = MqttDecoder(protocol_level, role=role)
    packets = dec.feed(data)
    if len(packets) != 1 or dec.buffered:
        raise MqttProtocolError(MALFORMED, "data is not exactly one complete packet")
    return packets[0]


# --------------------------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------------------------

_BYTE = [bytes((i,)) for i in range(256)]


def _frame(b0: int, body: bytes) -> bytes:
    n = len(body)
    if n > w.MAX_VBI:
        raise w.malformed("packet too large to encode")
    return _BYTE[b0] + encode_vbi(n) + body


def _check_pid(pid) -> int:
    if pid is None or not 0 < pid <= 0xFFFF:
        raise MqttProtocolError(PROTOCOL_ERROR, f"invalid packet identifier {pid!r}")  # [MQTT-2.2.1-3]
    return pid


def _check_qos(qos: int) -> int:
    if qos not in (0, 1, 2):
        raise w.malformed(f"invalid QoS {qos!r}")  # [MQTT-3.3.1-4]
    return qos


def _enc_connect(p: Connect, level: int) -> bytes:
    lvl = p.protocol_level
    if lvl not in SUPPORTED_PROTOCOL_LEVELS:
        raise MqttProtocolError(0x84, f"unsupported protocol level {lvl}")
    v5 = lvl == MQTT_5
    flags = 0x02 if p.clean_start else 0
    will = p.will
    if will is not None:
        flags |= 0x04 | (_check_qos(will.qos) << 3) | (0x20 if will.retain else 0)
    if p.username is not None:
        flags |= 0x80
    if p.password is not None:
        if lvl < MQTT_5 and p.username is None:
            raise w.malformed("password without user name")  # 3.1.1 [MQTT-3.1.2-22]
        flags |= 0x40
    if not 0 <= p.keep_alive <= 0xFFFF:
        raise w.malformed("keep alive out of range")
    parts = [encode_utf8(PROTOCOL_NAMES[lvl]), bytes((lvl, flags)), pack_u16(p.keep_alive)]
    if v5:
        parts.append(encode_properties(p.properties, 1))
    parts.append(encode_utf8(p.client_id))
    if will is not None:
        _check_topic_name(will.topic, "will topic")
        if v5:
            parts.append(encode_properties(will.properties, WILL))
        parts.append(encode_utf8(will.topic))
        parts.append(encode_binary(will.payload))
    if p.username is not None:
        parts.append(encode_utf8(p.username))
    if p.password is not None:
        parts.append(encode_binary(p.password))
    return _frame(0x10, b"".join(parts))


def _enc_connack(p: ConnAck, level: int) -> bytes:
    if level == MQTT_5:
        return _frame(
            0x20,
            bytes((1 if p.session_present else 0, p.reason_code))
            + encode_properties(p.properties, 2),
        )
    rc = to_v3_connack_return_code(p.reason_code)
    sp = 1 if (p.session_present and level == 4 and rc == 0) else 0  # 3.1.1 [MQTT-3.2.2-4]
    return bytes((0x20, 2, sp, rc))


def _enc_publish(p: Publish, level: int) -> bytes:
    qos = p.qos
    topic = p.topic
    if "+" in topic or "#" in topic:
        raise MqttProtocolError(TOPIC_NAME_INVALID, f"wildcard in topic name {topic!r}")  # [MQTT-3.3.2-2]
    t = encode_utf8(topic)
    if qos:
        if qos > 2:
            raise w.malformed(f"invalid QoS {qos!r}")  # [MQTT-3.3.1-4]
        pid = p.packet_id
        if pid is None or not 0 < pid <= 0xFFFF:
            raise MqttProtocolError(PROTOCOL_ERROR, f"invalid packet identifier {pid!r}")
        t += pack_u16(pid)
        b0 = 0x30 | (qos << 1) | (8 if p.dup else 0)
    elif qos == 0:
        b0 = 0x30  # DUP is always 0 for QoS 0 [MQTT-3.3.1-2]
    else:
        raise w.malformed(f"invalid QoS {qos!r}")
    if p.retain:
        b0 |= 1
    payload = p.payload
    if level == MQTT_5:
        props = p.properties
        if props is EMPTY_PROPERTIES:
            t += b"\x00"
        else:
            t += encode_properties(props, 3)
    elif not topic:
        raise MqttProtocolError(TOPIC_NAME_INVALID, "empty topic name")  # [MQTT-4.7.3-1]
    n = len(t) + len(payload)
    if n < 128:
        return b"".join((bytes((b0, n)), t, payload))
    return b"".join((_BYTE[b0], encode_vbi(n), t, payload))


def _ack_encoder(b0: int, ptype: int):
    head = bytes((b0, 2))

    def enc(p, level):
        pid = p.packet_id
        if pid is None or not 0 < pid <= 0xFFFF:
            raise MqttProtocolError(PROTOCOL_ERROR, f"invalid packet identifier {pid!r}")
        rc = p.reason_code
        props = p.properties
        if level != MQTT_5 or (rc == 0 and props is EMPTY_PROPERTIES):
            return head + pack_u16(pid)
        if rc not in REASON_CODES_BY_PACKET[ptype]:
            raise w.malformed(f"reason code 0x{rc:02X} not valid in {_NAMES[ptype]}")
        pb = encode_properties(props, ptype)
        if pb == b"\x00":
            if rc == 0:
                return head + pack_u16(pid)
            return bytes((b0, 3)) + pack_u16(pid) + _BYTE[rc]
        return _frame(b0, pack_u16(pid) + _BYTE[rc] + pb)

    return enc


def _enc_subscribe(p: Subscribe, level: int) -> bytes:
    if not p.subscriptions:
        # [MQTT-3.8.3-2]; 3.1.1 [MQTT-3.8.3-3]
        raise MqttProtocolError(PROTOCOL_ERROR, "SUBSCRIBE without topic filters")
    parts = [pack_u16(_check_pid(p.packet_id))]
    v5 = level == MQTT_5
    if v5:
        parts.append(encode_properties(p.properties, 8))
    for s in p.subscriptions:
        parts.append(encode_utf8(s.filter))
        opts = _check_qos(s.qos)
        if v5:
            if s.retain_handling not in (0, 1, 2):
                raise MqttProtocolError(PROTOCOL_ERROR, "Retain Handling 3")
            opts |= (4 if s.no_local else 0) | (8 if s.retain_as_published else 0)
            opts |= s.retain_handling << 4
        parts.append(_BYTE[opts])
    return _frame(0x82, b"".join(parts))


def _enc_suback(p: SubAck, level: int) -> bytes:
    parts = [pack_u16(_check_pid(p.packet_id))]
    codes = p.reason_codes
    if level == MQTT_5:
        parts.append(encode_properties(p.properties, 9))
        allowed = REASON_CODES_BY_PACKET[9]
        for rc in codes:
            if rc not in allowed:
                raise w.malformed(f"SUBACK reason code 0x{rc:02X}")
    else:
        codes = [rc if rc <= 2 else 0x80 for rc in codes]  # v5 failure codes -> 0x80
    parts.append(bytes(codes))
    return _frame(0x90, b"".join(parts))


def _enc_unsubscribe(p: Unsubscribe, level: int) -> bytes:
    if not p.filters:
        raise MqttProtocolError(PROTOCOL_ERROR, "UNSUBSCRIBE without topic filters")  # [MQTT-3.10.3-2]
    parts = [pack_u16(_check_pid(p.packet_id))]
    if level == MQTT_5:
        parts.append(encode_properties(p.properties, 10))
    parts.extend(encode_utf8(f) for f in p.filters)
    return _frame(0xA2, b"".join(parts))


def _enc_unsuback(p: UnsubAck, level: int) -> bytes:
    pid = pack_u16(_check_pid(p.packet_id))
    if level != MQTT_5:
        return b"\xb0\x02" + pid
    allowed = REASON_CODES_BY_PACKET[11]
    for rc in p.reason_codes:
        if rc not in allowed:
            raise w.malformed(f"UNSUBACK reason code 0x{rc:02X}")
    return _frame(0xB0, pid + encode_properties(p.properties, 11) + bytes(p.reason_codes))


def _reason_props_encoder(b0: int, ptype: int):
    def enc(p, level):
        if level != MQTT_5:
            if ptype == 15:
                raise MqttProtocolError(PROTOCOL_ERROR, "AUTH is MQTT 5 only")
            return bytes((b0, 0))
        rc = p.reason_code
        if rc not in REASON_CODES_BY_PACKET[ptype]:
            raise w.malformed(f"reason code 0x{rc:02X} not valid in {_NAMES[ptype]}")
        pb = encode_properties(p.properties, ptype)
        if pb == b"\x00":
            if rc == 0:
                return bytes((b0, 0))
            return bytes((b0, 1, rc))
        return _frame(b0, _BYTE[rc] + pb)

    return enc


_ENCODERS = {
    Connect: _enc_connect,
    ConnAck: _enc_connack,
    Publish: _enc_publish,
    PubAck: _ack_encoder(0x40, 4),
    PubRec: _ack_encoder(0x50, 5),
    PubRel: _ack_encoder(0x62, 6),
    PubComp: _ack_encoder(0x70, 7),
    Subscribe: _enc_subscribe,
    SubAck: _enc_suback,
    Unsubscribe: _enc_unsubscribe,
    UnsubAck: _enc_unsuback,
    PingReq: lambda p, level: b"\xc0\x00",
    PingResp: lambda p, level: b"\xd0\x00",
    Disconnect: _reason_props_encoder(0xE0, 14),
    Auth: _reason_props_encoder(0xF0, 15),
}


def encode(packet: Packet, protocol_level: int) -> bytes:
    """Encode ``packet`` for a connection at ``protocol_level`` (3, 4 or 5).

    A CONNECT is encoded at its own ``protocol_level``. At levels 3/4, v5-only fields
    (properties, reason codes of acks/DISCONNECT, subscription options other than QoS) are
    dropped; CONNACK/SUBACK v5 failure codes are mapped to their 3.x equivalents. Invalid
    values raise :class:`MqttProtocolError`.
    """
    enc = _ENCODERS.get(packet.__class__)
    if enc is None:
        raise TypeError(f"not an MQTT packet: {packet!r}")
    if protocol_level not in SUPPORTED_PROTOCOL_LEVELS:
        raise ValueError(f"unsupported protocol level {protocol_level}")
    return enc(packet, protocol_level)


def server_error_response(err: MqttProtocolError) -> bytes | None:
    """What a server sends before closing the connection because of ``err`` (None: just close).

    * error in a CONNECT of a v5 client: CONNACK with the reason code (0x80 when the code is not
      a CONNACK code) [MQTT-3.2.2-8]; 3.x client or unsupported level: a 3.1.1-format CONNACK only
      for 0x84 (return code 1, [MQTT-3.1.2-2]) and 0x85 (return code 2, 3.1.1 [MQTT-3.1.3-9]), else
      nothing;
    * error after CONNECT on a v5 connection: DISCONNECT with the reason code (4.13.1);
    * 3.x connection, or an error before any CONNECT: nothing.
    """
    rc = err.reason_code
    level = err.protocol_level
    if err.packet_type == PacketType.CONNECT:
        if level == MQTT_5:
            if rc not in REASON_CODES_BY_PACKET[2]:
                rc = 0x80
            return encode(ConnAck(False, rc), MQTT_5)
        if rc in (0x84, 0x85):
            return encode(ConnAck(False, rc), 4)
        return None
    if level == MQTT_5:
        if rc not in REASON_CODES_BY_PACKET[14]:
            rc = 0x80
        return encode(Disconnect(rc), MQTT_5)
    return None
