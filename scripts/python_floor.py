"""The floor of a Python MQTT broker's client-facing work, measured by `make bench` beside the real brokers
(docs/performance.md, "The thirty-ninth round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/python_floor.py run --layout whole --brokers floor,mosquitto --scenarios p2p \
        --rates p2p=100,1000,2500 --search none          # any `python -m bench` arguments; "floor" is added
    .venv/bin/python scripts/python_floor.py relay PORT  # the relay alone

The "floor" broker is a relay of about a hundred lines on uvloop, one process: MQTT 3.1.1 CONNECT/CONNACK,
SUBSCRIBE/SUBACK on exact topic names, a QoS 1 PUBLISH answered with its PUBACK and written on at once to the
one subscriber of its topic, that subscriber's PUBACK read and dropped. No storage, no Kafka, no session, no
flow control: the same socket reads and writes per p2p message as the connector (a PUBLISH and a PUBACK in,
a PUBACK and a PUBLISH out), with the least Python a process can run around them. What tbmq-py's connector
spends above it is its own work per message (the MQTT machine, the hand-over to Kafka, the forwards, the
acknowledgements), not the sockets.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PUBLISH, CONNECT, SUBSCRIBE, PINGREQ, DISCONNECT = 3, 1, 8, 12, 14  # a PUBACK (4) is read and dropped
SUBS: dict[bytes, "Relay"] = {}


def varlen(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


class Relay(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.pid = 0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        i, n = 0, len(buf)
        while n - i >= 2:
            mult, length, j = 1, 0, i + 1
            while True:
                if j >= n:
                    self.buf = buf[i:]
                    return
                b = buf[j]
                length += (b & 0x7F) * mult
                mult <<= 7
                j += 1
                if not b & 0x80:
                    break
            if j + length > n:
                break
            self.packet(buf[i], buf[j:j + length])
            i = j + length
        self.buf = buf[i:]

    def packet(self, first: int, body: bytes) -> None:
        kind = first >> 4
        write = self.transport.write
        if kind == PUBLISH:
            tl = struct.unpack_from("!H", body)[0]
            topic, off = body[2:2 + tl], 2 + tl
            if (first >> 1) & 3:
                write(b"\x40\x02" + body[off:off + 2])
                off += 2
            sub = SUBS.get(topic)
            if sub is not None:
                sub.pid = sub.pid % 65535 + 1
                rest = topic + struct.pack("!H", sub.pid) + body[off:]
                sub.transport.write(b"\x32" + varlen(len(rest) + 2) + struct.pack("!H", tl) + rest)
        elif kind == CONNECT:
            write(b"\x20\x02\x00\x00")
        elif kind == SUBSCRIBE:
            off, granted = 2, bytearray()
            while off < len(body):
                tl = struct.unpack_from("!H", body, off)[0]
                SUBS[body[off + 2:off + 2 + tl]] = self
                off += 2 + tl + 1
                granted.append(1)
            write(bytes([0x90, 2 + len(granted)]) + body[:2] + bytes(granted))
        elif kind == PINGREQ:
            write(b"\xd0\x00")
        elif kind == DISCONNECT:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        for topic in [t for t, conn in SUBS.items() if conn is self]:
            del SUBS[topic]


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Relay, "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    if sys.argv[1:2] == ["relay"]:
        import uvloop
        uvloop.run(serve(int(sys.argv[2])))
        return
    from bench import brokers, cli

    class Floor(brokers._ProcBroker):
        name = "floor"

        def command(self) -> list[str]:
            self.notes = ["scripts/python_floor.py: the client-facing floor of a Python broker (uvloop)"]
            return [sys.executable, str(Path(__file__).resolve()), "relay", str(self.port)]

    brokers.BROKERS["floor"] = Floor
    sys.exit(cli.main(sys.argv[1:]))


if __name__ == "__main__":
    main()
