"""Redis's CPU per message in the device store's scripts, for the bench's p2p pattern, by Redis's own clock
(docs/performance.md, "The thirty-sixth round"). A measurement tool, not a test: it asserts nothing.

    .venv/bin/python scripts/redis_script_cost.py [rounds=300] [revision ...]

Starts a local Redis (tbmq_launcher.redis, a free port, no persistence) and, per revision, a DeviceMsgStore
(this checkout's Python) on the Lua scripts of that git revision (`git archive <rev> lua`; "worktree", the
default, is the checkout's own lua/; each revision's scripts load under their own SHA). 20 persistent clients are
attached and live (a fetch to the end of their backlog), as connected DEVICE subscribers are; each round saves
one message for each of them in one `save_many_attached` (with its tbmq.msg.all origin, as the router's Persist
path sends them) and then acknowledges all 20 in one `apply_acks`: the save and removal scripts the p2p load
runs, in the same shape. After 50 warm-up rounds, `rounds` rounds are read from `INFO commandstats`: EVALSHA's
time per message (the whole scripts), the commands the scripts call (how many per message, and their own time),
and the difference: the Lua code and its glue around each `redis.call`. The revisions run in turn, twice, in
alternating order (the host's speed drifts by more than a script change is worth).
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tbmq.v1 import messages_pb2 as pb  # noqa: E402
from tbmq_device_persistence.store import Attachment, DeviceMsgStore, StoreConfig  # noqa: E402
from tbmq_launcher.redis import RedisServer, find_free_port  # noqa: E402

CLIENTS = [f"sub-{i:03d}" for i in range(20)]
NOT_SCRIPTS = ("cmdstat_evalsha", "cmdstat_config", "cmdstat_info", "cmdstat_script", "cmdstat_evalsha_ro")


def lua_dir(rev: str) -> Path:
    if rev == "worktree":
        return ROOT / "lua"
    out = Path(tempfile.mkdtemp(prefix=f"lua-{rev}-"))
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "lua"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(out)
    return out / "lua"


async def measure(url: str, lua: Path, rounds: int, tag: str) -> str:
    store = DeviceMsgStore(StoreConfig(redis_url=url, lua_dir=lua, key_prefix=f"{tag}:"))
    await store.start()
    try:
        for c in CLIENTS:
            await store.fetch_undelivered(c, attach=Attachment("connector-1", "s-" + c))
        offset = 0

        async def one_round() -> None:
            nonlocal offset
            now = int(time.time() * 1000)
            batch = {c: [pb.PublishMsg(publisher_id="p" + c, topic="bench/p/" + c, qos=1, payload=b"x" * 64,
                                       created_at_ms=now)] for c in CLIENTS}
            origins = {c: [(3, offset + i)] for i, c in enumerate(CLIENTS)}
            offset += len(CLIENTS)
            saved = await store.save_many_attached(batch, origins=origins)
            await store.apply_acks([(c, saved[c].messages[0].packet_id, saved[c].messages[0].serial)
                                    for c in CLIENTS], [])

        for _ in range(50):
            await one_round()
        r = store.redis
        await r.config_resetstat()
        for _ in range(rounds):
            await one_round()
        stats = await r.info("commandstats")
    finally:
        await store.close()
    n = rounds * len(CLIENTS)
    script_us = stats["cmdstat_evalsha"]["usec"]
    inner = [v for k, v in stats.items() if k not in NOT_SCRIPTS]
    inner_us = sum(v["usec"] for v in inner)
    return (f"EVALSHA {script_us / n:6.2f} µs per message; the commands it calls {sum(v['calls'] for v in inner) / n:5.2f}"
            f" per message, {inner_us / n:5.2f} µs; Lua and glue {(script_us - inner_us) / n:6.2f} µs")


async def main() -> None:
    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and args[0].isdigit() else 300
    revs = args or ["worktree"]
    dirs = {rev: lua_dir(rev) for rev in revs}
    server = RedisServer(find_free_port(), Path(tempfile.mkdtemp(prefix="redis-script-cost-")), appendonly=False)
    await server.start()
    try:
        print(f"{len(CLIENTS)} live clients, one message each per round, then their acknowledgements; {rounds} rounds")
        for turn in range(2):
            for i, rev in enumerate(revs if turn == 0 else revs[::-1]):
                print(f"{rev:>10}: {await measure(server.url, dirs[rev], rounds, f'{turn}{i}')}", flush=True)
    finally:
        await server.stop()


if __name__ == "__main__":
    asyncio.run(main())
