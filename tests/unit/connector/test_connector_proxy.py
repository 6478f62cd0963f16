"""connector.proxy.parse_header: PROXY protocol v1 and v2 headers as HAProxy writes them (the v2 bytes are the
spec's layout, built field by field here), partial headers, and what is refused."""

from __future__ import annotations

import socket
import struct

import pytest
from connector.proxy import V2_SIGNATURE, ProxyHeaderError, parse_header

pytestmark = pytest.mark.unit

MQTT_CONNECT = b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"


def v2(cmd: int, fam: int, body: bytes) -> bytes:
    return V2_SIGNATURE + bytes([0x20 | cmd, fam]) + struct.pack("!H", len(body)) + body


def v2_inet(src: str, sport: int, tlvs: bytes = b"") -> bytes:
    body = socket.inet_pton(socket.AF_INET, src) + socket.inet_pton(socket.AF_INET, "10.0.0.1")
    return v2(0x1, 0x11, body + struct.pack("!HH", sport, 1883) + tlvs)


def v2_inet6(src: str, sport: int) -> bytes:
    body = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, "::1")
    return v2(0x1, 0x21, body + struct.pack("!HH", sport, 1883))


@pytest.mark.parametrize("header, address", [
    (b"PROXY TCP4 192.0.2.7 10.0.0.1 50123 1883\r\n", ("192.0.2.7", 50123)),
    (b"PROXY TCP6 2001:db8::7 ::1 50123 8883\r\n", ("2001:db8::7", 50123)),
    (b"PROXY UNKNOWN\r\n", None),
    (b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n", None),
    (v2_inet("192.0.2.7", 50123), ("192.0.2.7", 50123)),
    (v2_inet("192.0.2.7", 50123, tlvs=b"\x04\x00\x03abc"), ("192.0.2.7", 50123)),  # a TLV after the address
    (v2_inet6("2001:db8::7", 443), ("2001:db8::7", 443)),
    (v2(0x0, 0x00, b""), None),              # LOCAL: the balancer's own health check
    (v2(0x1, 0x31, b"\x00" * 216), None),    # a UNIX socket's addresses
])
def test_headers_give_the_client_address_and_their_length(header, address):
    assert parse_header(header + MQTT_CONNECT) == (len(header), address)
    for cut in range(len(header)):  # any prefix: more is needed, never an error
        assert parse_header(header[:cut]) is None


@pytest.mark.parametrize("data", [
    MQTT_CONNECT,                                                  # a client that talks MQTT at once
    b"\x16\x03\x01\x02\x00\x01",                                   # a TLS ClientHello
    b"GET /mqtt HTTP/1.1\r\n",                                     # a WebSocket upgrade
    b"PROXY TCP4 192.0.2.7 10.0.0.1 50123\r\n",                    # a field missing
    b"PROXY TCP4 2001:db8::7 10.0.0.1 50123 1883\r\n",             # v6 address as TCP4
    b"PROXY TCP4 192.0.2.7 10.0.0.1 99999 1883\r\n",               # port out of range
    b"PROXY TCP4 192.0.2.7 10.0.0.1 0050 1883\r\n",                # not canonical
    b"PROXY TCP4 " + b"1" * 120,                                   # no CRLF within 107 bytes
    V2_SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", 4) + b"\x00" * 4,  # too short for AF_INET
    V2_SIGNATURE + bytes([0x12, 0x11]) + struct.pack("!H", 0),    # version 1 in a v2 header
    V2_SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", 60000),  # longer than we accept
    b"\r\n\r\n\x00\r\nQUIX\n",                                     # a wrong signature
])
def test_anything_else_is_refused(data):
    with pytest.raises(ProxyHeaderError):
        parse_header(data)


def test_nothing_yet_needs_more():
    assert parse_header(b"") is None


def test_the_balancers_allowed_to_send_headers():
    from connector.proxy import parse_sources, trusted

    sources = parse_sources("10.0.0.0/8, 192.0.2.7, 2001:db8::/32")
    assert trusted("10.1.2.3", sources) and trusted("192.0.2.7", sources) and trusted("2001:db8::1", sources)
    assert trusted("::ffff:10.1.2.3", sources)  # an IPv4 client on a dual-stack socket
    assert not trusted("192.0.2.8", sources) and not trusted("127.0.0.1", sources) and not trusted("?", sources)
    assert trusted("203.0.113.9", parse_sources(""))  # none named: any
    with pytest.raises(ValueError, match="'10.0.0.300' is not an address or a network"):
        parse_sources("10.0.0.300")
