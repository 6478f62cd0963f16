"""bench/codec.py and the generator's receive path against paho-mqtt's encoding of the same packets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench` is not installed

from paho.mqtt import client as paho  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402

from bench import codec  # noqa: E402
from bench.client import WARM, MqttConn, Publisher, Recorder, SubState  # noqa: E402

pytestmark = pytest.mark.unit


def _paho(version: int, client_id: str = "cid", clean: bool = True, **kw) -> tuple[paho.Client, list[bytes]]:
    proto = paho.MQTTv5 if version == 5 else paho.MQTTv311
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto,
                    clean_session=None if version == 5 else clean)
    out: list[bytes] = []
    c._packet_queue = lambda command, packet, mid, qos, info=None: out.append(bytes(packet)) or 0
    c._sock = _FakeSock()
    return c, out


class _FakeSock:
    def close(self):
        pass


@pytest.mark.parametrize("clean", [True, False])
def test_connect_v311_matches_paho(clean):
    c, out = _paho(4, "bench-dev-1", clean=clean)
    c._send_connect(60)
    assert codec.connect("bench-dev-1", clean=clean, keepalive=60) == out[0]


def test_connect_v311_with_username_matches_paho():
    c, out = _paho(4, "u1", clean=False)
    c.username_pw_set("bench")
    c._send_connect(30)
    assert codec.connect("u1", clean=False, keepalive=30, username="bench") == out[0]


@pytest.mark.parametrize("clean", [True, False])
def test_connect_v5_session_expiry_matches_paho(clean):
    c, out = _paho(5, "bench-dev-5")
    c._clean_start = clean
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 3600
    c._connect_properties = props
    c._send_connect(60)
    assert codec.connect("bench-dev-5", clean=clean, keepalive=60, version=5, session_expiry=3600) == out[0]


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("qos", [0, 1])
def test_subscribe_matches_paho(version, qos):
    c, out = _paho(version)
    c._last_mid = 6  # the next mid is 7
    opt = SubscribeOptions(qos=qos) if version == 5 else qos
    c._send_subscribe(False, [(b"bench/x/p2p/7", opt)])
    assert codec.subscribe(7, "bench/x/p2p/7", qos, version=version) == out[0]


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("size", [18, 62, 200])  # 200: two-byte remaining length
def test_publish_matches_paho(version, qos, size):
    enc = codec.PublishEncoder("bench/abc/p2p/42", qos, size, version=version)
    pkt = enc.encode(513, 42, 7, 3, 123456789)
    payload = codec.PAYLOAD.pack(42, 7, 3, 123456789) + b"\x00" * (size - 18)
    c, out = _paho(version)
    c._send_publish(513 if qos else 0, b"bench/abc/p2p/42", payload, qos)
    assert pkt == out[0]
    assert codec.publish("bench/abc/p2p/42", payload, qos, 513 if qos else 0, version=version) == out[0]


def test_puback_pingreq_disconnect_match_paho():
    c, out = _paho(4)
    c._send_puback(65535)
    c._send_pingreq()
    assert codec.puback(65535) == out[0]
    assert codec.PINGREQ_BYTES == out[1]
    assert codec.DISCONNECT_BYTES == b"\xe0\x00"


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16383, 16384, 2097151, 2097152, 268435455])
def test_varint_matches_paho(n):
    assert codec.varint(n) == bytes(paho.Client._pack_remaining_length(None, bytearray(), n))


@pytest.mark.parametrize("version", [4, 5])
def test_split_and_parse_publish(version):
    pkts = [codec.publish(f"t/{i}", bytes(range(i + 20)), qos=i % 2, packet_id=i + 1, version=version)
            for i in range(5)]
    buf = bytearray(b"".join(pkts) + pkts[0][:3])  # plus a partial packet
    got, consumed = codec.split(buf)
    assert len(got) == 5
    assert consumed == len(buf) - 3
    for i, (b0, s, e) in enumerate(got):
        topic, qos, pid, p = codec.parse_publish(buf, b0, s, e, version)
        assert (topic, qos) == (f"t/{i}".encode(), i % 2)
        assert pid == (i + 1 if i % 2 else 0)
        assert bytes(buf[p:e]) == bytes(range(i + 20))


class _Transport:
    def __init__(self):
        self.written: list[bytes] = []

    def write(self, b):
        self.written.append(bytes(b))


def _stream(version: int) -> bytes:
    enc1 = codec.PublishEncoder("a/b", 1, 62, version=version)
    enc0 = codec.PublishEncoder("a/b", 0, 62, version=version)
    out = [b"\x20\x02\x00\x00"]  # CONNACK
    for seq in range(10):
        out.append(enc1.encode(seq + 1, 3, seq, 5, 1000))
    out.append(enc0.encode(0, 3, 4, 5, 1000))        # a duplicate of seq 4
    out.append(enc0.encode(0, 3, 10, WARM, 1000))    # warm-up: counted, no latency
    out.append(enc0.encode(0, 3, 11, 4, 1000))       # an older step: late
    out.append(b"\xd0\x00")                           # PINGRESP
    return b"".join(out)


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_receive_path_fragmented(version, chunk):
    rec = Recorder()
    rec.step = 5
    rec.w0, rec.w1 = 0, 1 << 62
    sub = SubState({"expects": [3]})
    conn = MqttConn(rec, version, sub=sub)
    conn.transport = _Transport()
    data = _stream(version)
    for i in range(0, len(data), chunk):
        conn.data_received(data[i:i + chunk])
    assert rec.received == 13
    assert rec.dups == 1
    assert rec.late == 1
    assert len(rec.lat_us) == 11  # 10 + the duplicate (same step)
    assert sub.missing({3: (0, 12)}) == 0
    assert sub.missing({3: (0, 15)}) == 3
    acks = b"".join(conn.transport.written)
    assert acks == b"".join(codec.puback(i + 1) for i in range(10))


def test_publisher_window_and_puback_latency():
    rec = Recorder()
    rec.w0, rec.w1 = 0, 1 << 62
    pub = Publisher({"id": 1, "topic": "x", "qos": 1}, 62, 4, max_inflight=5)
    conn = MqttConn(rec, 4, pub=pub)
    conn.transport = _Transport()
    pub.conn = conn
    assert pub.send(8, 1) == 5  # window of 5
    assert pub.throttled == 3 and pub.inflight == 5
    conn.data_received(b"".join(codec.puback(i) for i in (1, 2, 3)))
    assert pub.inflight == 2 and pub.acked == 3 and len(rec.puback_us) == 3
    conn.data_received(codec.puback(2))  # an unknown/duplicate PUBACK is ignored
    assert pub.inflight == 2
    assert pub.send(3, 1) == 3 and pub.seq == 8
    pkts, _ = codec.split(bytearray(b"".join(conn.transport.written)))
    assert len(pkts) == 8


def test_skip_properties_reads_one_and_multi_byte_lengths():
    for n in (0, 5, 127, 128, 200, 20000):
        buf = b"xx" + codec.varint(n) + bytes(n) + b"after"
        end = codec.skip_properties(buf, 2)
        assert buf[end:] == b"after", n
