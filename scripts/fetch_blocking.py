"""How long a backlog fetched in pages blocks Redis for everybody else, by the size of the script calls.

    .venv/bin/python scripts/fetch_blocking.py [rounds] [page] [chunk...]

Starts a private redis-server (no persistence), and for each `chunk` (StoreConfig.fetch_chunk_messages) and
round: saves a 10,000-message backlog of 62-byte payloads for a fresh client, then fetches it in pages of
`page` (the first of 250, as the connector asks) through DeviceMsgStore, while another process PINGs the
same Redis every 0.5 ms. Prints per round the fetch's wall time per message, Redis's EVALSHA time per
message (INFO commandstats) and the other client's PING latencies: its max is the longest a script made
every other client (saves, acknowledgements) wait. Default: 4 rounds, pages of 1,875, chunks 500 and 100,000
(= one call per page, the behaviour before parts)."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services" / "device-persistence" / "src"))

from tbmq.v1 import messages_pb2 as pb  # noqa: E402
from tbmq_launcher.redis import RedisServer, find_free_port  # noqa: E402

from tbmq_device_persistence.store import Attachment, DeviceMsgStore, StoreConfig  # noqa: E402

BACKLOG = 10_000


PINGER = """
import socket, sys, time
port, secs = int(sys.argv[1]), float(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
lat, end = [], time.monotonic() + secs
while time.monotonic() < end:
    t = time.perf_counter(); s.sendall(b"PING\\r\\n"); s.recv(64); lat.append(time.perf_counter() - t)
    time.sleep(0.0005)
lat.sort()
print(f"{lat[len(lat) // 2] * 1e3:.2f} {lat[int(len(lat) * 0.99)] * 1e3:.2f} {lat[-1] * 1e3:.2f}")
"""


async def rounds(port: int, chunk: int, n: int, page: int) -> None:
    store = DeviceMsgStore(StoreConfig(redis_url=f"redis://127.0.0.1:{port}/0", fetch_chunk_messages=chunk))
    await store.start()
    walls = []
    try:
        for k in range(n):
            cid = f"bench-{chunk}-{k}"
            for _ in range(0, BACKLOG, 2500):
                await store.save_batch(cid, [pb.PublishMsg(topic="bench/abc/backlog", payload=b"x" * 62, qos=1)
                                             for _ in range(2500)])
            await store.redis.config_resetstat()
            pinger = subprocess.Popen([sys.executable, "-c", PINGER, str(port), "0.5"], stdout=subprocess.PIPE,
                                      text=True)
            await asyncio.sleep(0.05)
            att, after, first, more, got = Attachment("conn", "s1"), 0, True, True, 0
            t0 = time.perf_counter()
            while more:
                resp = await store.fetch_undelivered_response(cid, att, check=not first, after=after,
                                                              max_messages=250 if first else page)
                first, more = False, resp.more
                got += len(resp.messages)
                after = resp.messages[-1].serial if resp.messages else after
            wall = time.perf_counter() - t0
            p50, p99, worst = pinger.communicate(timeout=30)[0].split()
            ev = (await store.redis.info("commandstats")).get("cmdstat_evalsha", {})
            walls.append(wall)
            print(f"chunk {chunk:>6}: {got} in {wall * 1e3:6.1f} ms ({wall * 1e6 / got:5.2f} us/msg, EVALSHA "
                  f"{ev.get('usec', 0) / got:5.2f} us/msg); another client's PING p50 {p50} p99 {p99} "
                  f"max {worst} ms", flush=True)
            await store.clear(cid)
    finally:
        await store.close()
    print(f"chunk {chunk:>6}: median fetch {statistics.median(walls) * 1e3:.1f} ms")


async def run(n: int, page: int, chunks: list[int]) -> None:
    with tempfile.TemporaryDirectory() as d:
        async with RedisServer(find_free_port(), Path(d), appendonly=False) as redis:
            for chunk in chunks:
                await rounds(redis.port, chunk, n, page)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    page = int(sys.argv[2]) if len(sys.argv) > 2 else 1875
    asyncio.run(run(n, page, [int(c) for c in sys.argv[3:]] or [500, 100_000]))


if __name__ == "__main__":
    main()
