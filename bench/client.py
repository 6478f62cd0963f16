"""Raw asyncio.Protocol MQTT connections for the load generator (one class, publisher and subscriber roles).

The hot path (data_received, Publisher.send) is written inline on purpose: one pass over each chunk, one
write per chunk of PUBACKs, one write per batch of PUBLISHes. Keep it that way: every µs here is charged to
the generator, and the generator must not be the bottleneck.
"""

from __future__ import annotations

import asyncio
import struct
import time
from array import array

from . import codec

WARM = 0xFFFF  # step tag of warm-up messages: counted for loss, not for latency
_PAYLOAD_UNPACK = codec.PAYLOAD.unpack_from
_monotonic_ns = time.monotonic_ns
_PUBACKS: list[bytes] | None = None


def _puback_table() -> list[bytes]:
    global _PUBACKS
    if _PUBACKS is None:
        _PUBACKS = [b"\x40\x02" + struct.pack(">H", i) for i in range(65536)]
    return _PUBACKS


class Recorder:
    """Per-worker measurement state of the current step (reset between steps)."""

    __slots__ = ("step", "w0", "w1", "lat_us", "puback_us", "in_window", "late", "dups", "received",
                 "first_recv_ns", "last_recv_ns", "disconnects")

    def __init__(self) -> None:
        self.step = -1
        self.w0 = 0
        self.w1 = 0
        self.disconnects = 0
        self.reset()

    def reset(self) -> None:
        self.lat_us = array("q")
        self.puback_us = array("q")
        self.in_window = 0     # deliveries received inside [w0, w1)
        self.late = 0          # deliveries tagged with an older step
        self.dups = 0          # deliveries of a (publisher, seq) already seen by that subscriber
        self.received = 0      # all deliveries
        self.first_recv_ns = 0
        self.last_recv_ns = 0


class SubState:
    """A subscriber's identity and what it has seen; outlives its connections (backlog reconnect)."""

    __slots__ = ("spec", "seen", "conn")

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.seen: dict[int, bytearray] = {}
        self.conn: MqttConn | None = None

    def missing(self, ranges: dict[int, tuple[int, int]]) -> int:
        """How many messages of the expected (publisher, [a, b)) ranges were not seen."""
        total = 0
        for pub_id in self.expected_pubs(ranges):
            a, b = ranges[pub_id]
            if b <= a:
                continue
            bm = self.seen.get(pub_id)
            if bm is None:
                total += b - a
                continue
            have = bm[a:b]
            total += (b - a - len(have)) + have.count(0)
        return total

    def expected_pubs(self, ranges):
        exp = self.spec.get("expects")
        if exp == "all":
            return list(ranges)
        return [p for p in exp if p in ranges]


class MqttConn(asyncio.Protocol):
    """One MQTT connection. `sub` set → it records deliveries; `pub` set → it handles PUBACKs."""

    def __init__(self, rec: Recorder, version: int = 4, sub: SubState | None = None,
                 pub: "Publisher | None" = None) -> None:
        self.rec = rec
        self.version = version
        self.sub = sub
        self.pub = pub
        self.seen = sub.seen if sub is not None else None
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.connack: asyncio.Future | None = None
        self.suback: asyncio.Future | None = None
        self.closed = False
        self.closing = False  # set when we close on purpose
        self.connack_ns = 0
        self.last_send = 0.0

    # -- connection ------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.closing:
            self.rec.disconnects += 1
        for fut in (self.connack, self.suback):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.closed:
            try:
                self.transport.write(codec.DISCONNECT_BYTES)
            except Exception:
                pass
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    # -- receive path ----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        now = _monotonic_ns()
        if self.buf:
            data = self.buf + data
        n = len(data)
        i = 0
        acks = None
        rec = self.rec
        seen = self.seen
        v5 = self.version == 5
        while i + 2 <= n:
            b0 = data[i]
            b = data[i + 1]
            if b < 0x80:
                rl = b
                j = i + 2
            else:
                rl = b & 0x7F
                mult = 128
                j = i + 2
                while True:
                    if j >= n:
                        rl = -1
                        break
                    b = data[j]
                    j += 1
                    rl += (b & 0x7F) * mult
                    if b < 0x80:
                        break
                    mult <<= 7
                if rl < 0:
                    break
            end = j + rl
            if end > n:
                break
            t = b0 >> 4
            if t == 3:  # PUBLISH
                p = j + 2 + ((data[j] << 8) | data[j + 1])
                if b0 & 6:
                    if acks is None:
                        acks = []
                    acks.append((data[p] << 8) | data[p + 1])
                    p += 2
                if v5:
                    pl = data[p]
                    if pl < 0x80:  # the usual one-byte property length, inline on the hot path
                        p += 1 + pl
                    else:
                        p = codec.skip_properties(data, p)
                if end - p >= 18 and seen is not None:
                    pub_id, seq, step, ts = _PAYLOAD_UNPACK(data, p)
                    rec.received += 1
                    if step == rec.step:
                        rec.lat_us.append((now - ts) // 1000)
                    elif step != WARM:
                        rec.late += 1
                    if rec.w0 <= now < rec.w1:
                        rec.in_window += 1
                    bm = seen.get(pub_id)
                    if bm is None:
                        bm = seen[pub_id] = bytearray(max(seq + 1, 4096))
                    elif seq >= len(bm):
                        bm.extend(bytes(max(seq + 1 - len(bm), len(bm))))
                    if bm[seq]:
                        rec.dups += 1
                    else:
                        bm[seq] = 1
                    if not rec.first_recv_ns:
                        rec.first_recv_ns = now
                    rec.last_recv_ns = now
            elif t == 4:  # PUBACK
                pub = self.pub
                if pub is not None:
                    pid = (data[j] << 8) | data[j + 1]
                    sent = pub.sent_ns[pid]
                    if sent:
                        pub.sent_ns[pid] = 0
                        pub.inflight -= 1
                        pub.acked += 1
                        if sent >= rec.w0:
                            rec.puback_us.append((now - sent) // 1000)
            elif t == 2:  # CONNACK
                self.connack_ns = now
                if self.connack is not None and not self.connack.done():
                    self.connack.set_result(codec.parse_connack(data, j, end))
            elif t == 9:  # SUBACK
                if self.suback is not None and not self.suback.done():
                    self.suback.set_result(codec.parse_suback(data, j, end, self.version))
            # PINGRESP (13) and anything else: ignored
            i = end
        self.buf = data[i:] if i < n else b""
        if acks:
            tbl = _PUBACKS or _puback_table()
            self.transport.write(b"".join([tbl[a] for a in acks]))


class Publisher:
    """A publishing client: a fixed topic, increasing sequence numbers, bounded QoS 1 window."""

    __slots__ = ("pub_id", "enc", "qos", "seq", "next_pid", "sent_ns", "inflight", "acked", "conn",
                 "max_inflight", "throttled", "spec")

    def __init__(self, spec: dict, payload_size: int, version: int, max_inflight: int = 20000) -> None:
        self.spec = spec
        self.pub_id = spec["id"]
        self.qos = spec["qos"]
        self.enc = codec.PublishEncoder(spec["topic"], self.qos, payload_size, version=version)
        self.seq = 0
        self.next_pid = 1
        self.sent_ns = [0] * 65536
        self.inflight = 0
        self.acked = 0
        self.throttled = 0
        self.max_inflight = min(max_inflight, 65000)
        self.conn: MqttConn | None = None

    def send(self, count: int, step: int) -> int:
        """Write `count` PUBLISHes in one write; returns how many were sent (QoS 1 window permitting)."""
        conn = self.conn
        if conn is None or conn.closed:
            self.throttled += count
            return 0
        enc = self.enc.encode
        pub_id = self.pub_id
        seq = self.seq
        now = _monotonic_ns()
        if self.qos == 0:
            out = [enc(0, pub_id, s, step, now) for s in range(seq, seq + count)]
            self.seq = seq + count
            conn.transport.write(b"".join(out))
            return count
        room = self.max_inflight - self.inflight
        if count > room:
            self.throttled += count - max(room, 0)
            count = max(room, 0)
        out = []
        sent_ns = self.sent_ns
        pid = self.next_pid
        k = 0
        while k < count:
            if sent_ns[pid]:  # packet id still in flight (wrapped around): stop here
                self.throttled += count - k
                break
            sent_ns[pid] = now
            out.append(enc(pid, pub_id, seq, step, now))
            seq += 1
            k += 1
            pid = pid + 1 if pid < 65535 else 1
        self.next_pid = pid
        self.seq = seq
        self.inflight += k
        if out:
            conn.transport.write(b"".join(out))
        return k


async def open_conn(loop, host: str, port: int, client_id: str, rec: Recorder, *, version: int = 4,
                    clean: bool = True, session_expiry: int | None = None, username: str | None = None,
                    sub: SubState | None = None, pub: Publisher | None = None, keepalive: int = 60,
                    timeout: float = 10.0) -> tuple[MqttConn, bool]:
    """TCP connect + CONNECT + CONNACK. Returns (conn, session_present); raises on refusal/timeout."""
    _, conn = await asyncio.wait_for(
        loop.create_connection(lambda: MqttConn(rec, version, sub, pub), host, port), timeout)
    conn.connack = loop.create_future()
    conn.write(codec.connect(client_id, clean=clean, keepalive=keepalive, version=version,
                             session_expiry=session_expiry, username=username))
    try:
        present, code = await asyncio.wait_for(conn.connack, timeout)
    except BaseException:
        conn.abort()
        raise
    if code != 0:
        conn.abort()
        raise ConnectionRefusedError(f"CONNACK code {code} for {client_id}")
    return conn, present


async def subscribe(conn: MqttConn, topic_filter: str, qos: int, packet_id: int = 1,
                    timeout: float = 10.0) -> list[int]:
    conn.suback = asyncio.get_running_loop().create_future()
    conn.write(codec.subscribe(packet_id, topic_filter, qos, version=conn.version))
    _, codes = await asyncio.wait_for(conn.suback, timeout)
    if any(c >= 0x80 for c in codes):
        raise RuntimeError(f"SUBSCRIBE {topic_filter} refused: {codes}")
    return codes
