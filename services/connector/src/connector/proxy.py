"""The PROXY protocol (HAProxy's, versions 1 and 2) in front of a listener: a load balancer that terminates the
client's TCP connection (AWS NLB, HAProxy, nginx stream, Envoy) opens its own to the connector and sends, before
anything else, a header naming the client's address. With MQTT_PROXY_PROTOCOL on for a listener, that address
is the connection's: blocked rules by IP, the connect rate per IP, logs and the session's client address.

`parse_header(data)` is pure: `None` while `data` may still grow into a header, else `(length, address)`:
the header's length in bytes (what to consume before MQTT, TLS or the WebSocket upgrade begins) and the
client's `(host, port)`, or `None` for a header that carries no address (v1 `UNKNOWN`, v2 `LOCAL`: the
balancer's own health checks; the socket's peer stands). `ProxyHeaderError` for anything else: the
connection is closed without a byte answered (a listener that expects the header never guesses).

`parse_sources(raw)` / `trusted(ip, sources)`: MQTT_PROXY_PROTOCOL_FROM, the balancers' addresses or networks;
a connection from anywhere else is closed before its header is read (a client that reached the listener past
the balancer could otherwise claim any address).

`read_header(loop, sock, timeout)` reads exactly the header from an accepted socket (peeking, so the first
bytes after it stay in the socket for the TLS handshake or the MQTT codec).

Spec: https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct

from tbmq_platform.settings import csv

V1_PREFIX = b"PROXY "
V1_MAX = 107                      # the longest v1 header, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_FIXED = 16                     # signature, version/command, family/protocol, length
V2_MAX = V2_FIXED + 4096          # the address block and TLVs a header may carry here (the spec allows 64 KiB)
PEEK = V2_MAX

_V2_LOCAL, _V2_PROXY = 0x0, 0x1
_AF_INET, _AF_INET6, _AF_UNIX = 0x1, 0x2, 0x3


class ProxyHeaderError(ValueError):
    pass


Sources = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def parse_sources(raw: str) -> Sources:
    """A comma list of addresses or networks (10.0.0.0/8, 2001:db8::/32); empty = any."""
    out = []
    for part in csv(raw):
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not an address or a network") from None
    return tuple(out)


def trusted(ip: str, sources: Sources) -> bool:
    """May a connection from `ip` send a PROXY header (no `sources`: any may)?"""
    if not sources:
        return True
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in sources)


def parse_header(data: bytes) -> tuple[int, tuple[str, int] | None] | None:
    """See the module docstring."""
    if data[:1] == V2_SIGNATURE[:1]:
        return _v2(data)
    if data[:1] == b"P":
        return _v1(data)
    if data:
        raise ProxyHeaderError("no PROXY protocol header")
    return None


def _v1(data: bytes) -> tuple[int, tuple[str, int] | None] | None:
    if len(data) < len(V1_PREFIX):
        if not V1_PREFIX.startswith(data):
            raise ProxyHeaderError("no PROXY protocol header")
        return None
    if not data.startswith(V1_PREFIX):
        raise ProxyHeaderError("no PROXY protocol header")
    end = data.find(b"\r\n", 0, V1_MAX)
    if end < 0:
        if len(data) >= V1_MAX:
            raise ProxyHeaderError("PROXY v1 header longer than 107 bytes")
        return None
    try:
        parts = data[:end].decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise ProxyHeaderError("PROXY v1 header not ASCII") from None
    if parts[1] == "UNKNOWN":
        return end + 2, None
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProxyHeaderError(f"PROXY v1 header malformed: {data[:end]!r}")
    _, family, src, _dst, sport, _dport = parts
    try:
        addr = ipaddress.ip_address(src)
        port = int(sport)
    except ValueError:
        raise ProxyHeaderError(f"PROXY v1 address malformed: {data[:end]!r}") from None
    if addr.version != (4 if family == "TCP4" else 6) or not 0 <= port <= 65535 or sport != str(port):
        raise ProxyHeaderError(f"PROXY v1 address malformed: {data[:end]!r}")
    return end + 2, (str(addr), port)


def _v2(data: bytes) -> tuple[int, tuple[str, int] | None] | None:
    n = min(len(data), len(V2_SIGNATURE))
    if data[:n] != V2_SIGNATURE[:n]:
        raise ProxyHeaderError("no PROXY protocol header")
    if len(data) < V2_FIXED:
        return None
    ver_cmd, fam, length = data[12], data[13], struct.unpack("!H", data[14:16])[0]
    if ver_cmd >> 4 != 2 or ver_cmd & 0xF not in (_V2_LOCAL, _V2_PROXY):
        raise ProxyHeaderError(f"PROXY v2 version/command {ver_cmd:#04x} not supported")
    if V2_FIXED + length > V2_MAX:
        raise ProxyHeaderError(f"PROXY v2 header of {V2_FIXED + length} bytes (at most {V2_MAX} here)")
    total = V2_FIXED + length
    if len(data) < total:
        return None
    if ver_cmd & 0xF == _V2_LOCAL:
        return total, None
    family = fam >> 4
    body = data[V2_FIXED:total]
    if family == _AF_INET and length >= 12:
        return total, (str(ipaddress.IPv4Address(body[0:4])), struct.unpack("!H", body[8:10])[0])
    if family == _AF_INET6 and length >= 36:
        return total, (str(ipaddress.IPv6Address(body[0:16])), struct.unpack("!H", body[32:34])[0])
    if family in (0, _AF_UNIX):  # UNSPEC, or a UNIX socket: no address of ours to take
        return total, None
    raise ProxyHeaderError(f"PROXY v2 address family {fam:#04x} with {length} bytes not supported")


async def read_header(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                      timeout: float) -> tuple[str, int] | None:
    """Consume the PROXY header at the start of `sock` (non-blocking) and return its client address (None: the
    header names none). Raises ProxyHeaderError, TimeoutError, or OSError (the peer went away)."""
    async with asyncio.timeout(timeout):
        while True:
            await _readable(loop, sock)
            data = sock.recv(PEEK, socket.MSG_PEEK)
            if not data:
                raise ConnectionResetError("closed before its PROXY header")
            parsed = parse_header(data)
            if parsed is not None:
                length, address = parsed
                got = sock.recv(length)  # exactly the header: the peeked bytes are there
                if len(got) != length:
                    raise ProxyHeaderError("PROXY header shorter than peeked")
                return address
            if len(data) >= PEEK:
                raise ProxyHeaderError("PROXY header too long")
            await _more(loop, sock, len(data))


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def _more(loop: asyncio.AbstractEventLoop, sock: socket.socket, have: int) -> None:
    """Wait until more than `have` bytes can be peeked (a header split over segments)."""
    while True:
        await asyncio.sleep(0.005)  # a header split over TCP segments is rare: poll the peek briefly
        data = sock.recv(PEEK, socket.MSG_PEEK)
        if len(data) > have or not data:
            return


__all__ = ["ProxyHeaderError", "Sources", "parse_header", "parse_sources", "read_header", "trusted"]
