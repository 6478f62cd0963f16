"""What the origin check costs save_messages.lua (docs/performance.md, the eighth round).

On a fresh redis-server (no AOF): 100 clients per save_many_attached call, batches of 1 and of 10 messages
per client (62-byte payloads), every save with its source header, with and without the origin header
(one origin per record, partitions spread); 5 saves per set, the two modes alternating set by set, 40
rounds (the first 4 discarded). Reported: the median EVALSHA time per message from INFO commandstats.

    .venv/bin/python scripts/save_origin_cost.py
"""

import asyncio
import statistics
import tempfile
from pathlib import Path

from tbmq_device_persistence.store import DeviceMsgStore, Source, StoreConfig
from tbmq.v1 import messages_pb2 as pb
from tbmq_launcher.redis import RedisServer, find_free_port


async def evalsha_usec(r) -> int:
    """Server time spent in EVALSHA so far (INFO commandstats), µs."""
    return (await r.info("commandstats")).get("cmdstat_evalsha", {}).get("usec", 0)


async def main():
    srv = RedisServer(find_free_port(), Path(tempfile.mkdtemp()), appendonly=False)
    await srv.start()
    try:
        store = DeviceMsgStore(StoreConfig(redis_url=f"redis://127.0.0.1:{srv.port}/0"))
        await store.start()
        m = pb.PublishMsg(publisher_id="p", topic="t/1", qos=1, payload=b"x" * 62)
        res = {("origin", b): [] for b in (1, 10)} | {("plain", b): [] for b in (1, 10)}
        off = 0
        for rnd in range(40):
            for per in (1, 10):
                for mode in (("origin", "plain") if rnd % 2 == 0 else ("plain", "origin")):
                    clients = [f"c{per}-{mode}-{i}" for i in range(100)]
                    batches = {c: [m] * per for c in clients}
                    src = {c: Source(3, list(range(off + 1, off + per + 1))) for c in clients}
                    orig = {c: [(i % 16, off + i) for i in range(per)] for c in clients} if mode == "origin" else None
                    off += per + 1
                    u0 = await evalsha_usec(store.redis)
                    for _ in range(5):
                        await store.save_many_attached(batches, sources=src, origins=orig)
                        src = {c: Source(3, [o + per + 1 for o in s.offsets]) for c, s in src.items()}
                        if orig:
                            orig = {c: [(p, o + per) for p, o in v] for c, v in orig.items()}
                    u1 = await evalsha_usec(store.redis)
                    if rnd >= 4:
                        res[(mode, per)].append((u1 - u0) / (5 * 100 * per))
                    # acknowledge everything so stores stay small
                    for c in clients:
                        await store.clear(c)
        for k, v in sorted(res.items()):
            print(k, "median us/msg", round(statistics.median(v), 2), "n", len(v))
        await store.close()
    finally:
        await srv.stop()


if __name__ == "__main__":
    asyncio.run(main())
