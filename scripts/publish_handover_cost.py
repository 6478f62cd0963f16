"""CPU per PUBLISH of the connector's packet path alone: data_received -> decoder -> machine -> hand-over to the
producer -> (Kafka's acknowledgement) -> PUBACK written, on the unit tests' fake port and transport
(tests/unit/connector/connector_fakes.py: no sockets, no Kafka; the fake producer's futures are done at once, as
a batch's are once Kafka answered). Each PUBLISH arrives in a data_received call of its own (one per client
and round at 10 msg/s per publisher, as in the bench's p2p load), and the loop then runs until its PUBACK is
written. A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/publish_handover_cost.py [publishes=20000] [rounds=5]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "tests"), str(root / "tests" / "unit" / "connector")]

from connector_fakes import FakePort, connected  # noqa: E402
from tbmq_mqtt import Connect, Publish, encode  # noqa: E402


async def one_round(n: int) -> float:
    port = FakePort()
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="p", clean_start=True))
    packets = [encode(Publish(topic="bench/p/1", payload=b"x" * 62, qos=1, packet_id=i % 65535 + 1), 4)
               for i in range(n)]
    transport.data = b""
    t0 = time.thread_time()
    for data in packets:
        conn.data_received(data)
        while conn._task is not None or len(transport.data) < 4:  # the PUBACK (4 bytes) written
            await asyncio.sleep(0)
        transport.data = b""
    return (time.thread_time() - t0) / n * 1e6


async def main() -> None:
    n, rounds = (int(a) for a in (sys.argv[1:3] + ["20000", "5"][len(sys.argv[1:3]):]))
    await one_round(2000)  # warm-up
    got = [await one_round(n) for _ in range(rounds)]
    print(f"{n} PUBLISHes a round: " + ", ".join(f"{g:.2f}" for g in got) + f" us each; min {min(got):.2f}")


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
