"""Throughput of the DEVICE message store against a real Redis, next to redis-benchmark's EVALSHA rate.

    python -m device_persistence.bench --redis-url redis://127.0.0.1:6380/0
    python -m device_persistence.bench --cluster 127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002
    python -m device_persistence.bench --spawn standalone|cluster [--no-aof]   # temporary Redis

What is measured:
  * save: `save_many` rounds: every client gets `--batch` messages per round (one save_messages.lua
    call per group of clients: standalone up to 200 clients per call, cluster the clients of one hash
    slot; the calls pipelined), `--concurrency` save_many calls in flight; saved messages/s.
  * fetch: `fetch_undelivered` of every client (gathered); fetched messages/s.
  * redis-benchmark (unless --no-redis-benchmark): `EVALSHA <return 1> 0` (the bare script-call ceiling
    of the server) and `EVALSHA <save_messages.lua> 4 ...` with one message per call (the server-side
    cost of our script), both with -P 16 pipelining and 50 connections. Cluster: against the one master
    owning the benchmark client's slot (a per-master figure).
Keys use the prefix `bench:` and are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tbmq.v1 import messages_pb2

from tbmq_device_persistence.store import DeviceMsgStore, StoreConfig, script_source


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m device_persistence.bench", description=__doc__.split("\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--redis-url", help="standalone Redis, e.g. redis://127.0.0.1:6380/0")
    target.add_argument("--cluster", help="comma list of host:port of a Redis Cluster")
    target.add_argument("--spawn", choices=["standalone", "cluster"], help="start a temporary Redis")
    p.add_argument("--no-aof", action="store_true", help="with --spawn: appendonly no (default: AOF everysec)")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--batch", type=int, default=10, help="messages per client per round")
    p.add_argument("--messages", type=int, default=200_000, help="total messages to save")
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument("--concurrency", type=int, default=4, help="save_many calls in flight")
    p.add_argument("--limit", type=int, default=10000)
    p.add_argument("--no-redis-benchmark", action="store_true")
    p.add_argument("--rb-requests", type=int, default=200_000, help="redis-benchmark -n")
    return p.parse_args()


async def _bench_store(cfg: StoreConfig, a: argparse.Namespace) -> dict:
    msg = messages_pb2.PublishMsg(
        publisher_id="bench-pub", topic="bench/t", payload=os.urandom(a.payload), qos=1,
        created_at_ms=int(time.time() * 1000), publisher_mqtt_version=5,
    )  # fmt: skip
    clients = [f"c{i}" for i in range(a.clients)]
    groups = [clients[i :: a.concurrency] for i in range(a.concurrency)]
    rounds = max(1, a.messages // (a.clients * a.batch))
    batch = [msg] * a.batch
    res: dict = {"rounds": rounds}
    async with DeviceMsgStore(cfg) as store:
        await asyncio.gather(*(store.clear(c) for c in clients))
        # warm-up (connections, script cache)
        await store.save_many({c: [msg] for c in clients[: min(50, len(clients))]})
        await asyncio.gather(*(store.clear(c) for c in clients[:50]))
        saved = 0

        async def worker(group: list[str]) -> int:
            n = 0
            for _ in range(rounds):
                out = await store.save_many({c: batch for c in group})
                n += sum(len(v) for v in out.values())
            return n

        calls0 = store.stats.save_calls
        t0 = time.perf_counter()
        saved = sum(await asyncio.gather(*(worker(g) for g in groups)))
        dt = time.perf_counter() - t0
        res.update(saved=saved, save_s=dt, save_rate=saved / dt, clients_rate=rounds * len(clients) / dt,
                   calls_rate=(store.stats.save_calls - calls0) / dt)

        sem = asyncio.Semaphore(64)

        async def fetch(c: str) -> int:
            async with sem:
                return len(await store.fetch_undelivered(c))

        t0 = time.perf_counter()
        fetched = sum(await asyncio.gather(*(fetch(c) for c in clients)))
        dt = time.perf_counter() - t0
        res.update(fetched=fetched, fetch_s=dt, fetch_rate=fetched / dt)
        dropped = sum(await asyncio.gather(*(store.clear(c) for c in clients)))
        res["cleared"] = dropped
    return res


def _redis_benchmark(host: str, port: int, args: list[str], n: int, cluster: bool = False) -> float | None:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    cmd = [exe, "-h", host, "-p", str(port), "-n", str(n), "-c", "50", "-P", "16", "-q"]
    if cluster:
        cmd.append("--cluster")
    out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300).stdout
    m = re.findall(r"([\d.]+) requests per second", out.replace("\r", "\n"))
    return float(m[-1]) if m else None


async def _script_load(nodes: list[tuple[str, int]], text: str) -> str:
    """SCRIPT LOAD on every node (redis-benchmark --cluster sends EVALSHA to the key's owner)."""
    from tbmq_launcher.redis import redis_command

    sha = ""
    for host, port in nodes:
        sha = await redis_command(host, port, "SCRIPT", "LOAD", text)
        if isinstance(sha, Exception):
            raise sha
    return sha


async def _bench_redis_benchmark(cfg: StoreConfig, nodes: list[tuple[str, int]], a) -> dict:
    tag = "{bench:rb}"  # one client; in a cluster: against the master that owns its slot
    host, port = nodes[0]
    if cfg.cluster:
        async with DeviceMsgStore(replace(cfg, key_prefix="")) as store:
            owner = store.redis.get_node_from_key(f"{tag}_messages")
            host, port = owner.host, int(owner.port)
    trivial = await _script_load([(host, port)], "return 1")
    save = await _script_load([(host, port)], script_source("save_messages"))
    n = a.rb_requests
    res = {"EVALSHA <return 1> 0": _redis_benchmark(host, port, ["evalsha", trivial, "0"], n, False)}
    # limit 65535 and at most 65000 calls: no trimming, one message per call
    value = "Pxx" + "x" * a.payload  # "xx": the packet-id bytes (argv holds no NUL; never read here)
    record = f"604800000,{len(value)}:{value}"  # save_messages.lua record format, one message
    res["EVALSHA save_messages.lua (1 msg)"] = _redis_benchmark(
        host, port,
        ["evalsha", save, "4", f"{tag}_messages", f"{tag}_pids", f"{tag}_state", f"{tag}_attached",
         "65535", str(cfg.bytes_limit), str(cfg.handed_out_limit), record],
        min(n, 65_000), False,
    )  # fmt: skip
    async with DeviceMsgStore(replace(cfg, key_prefix="")) as store:
        await store.clear("bench:rb")
    return res


async def _main(a: argparse.Namespace) -> None:
    spawned = None
    tmp = None
    try:
        if a.spawn:
            from tbmq_launcher.redis import RedisCluster, RedisServer, find_free_port

            tmp = tempfile.mkdtemp(prefix="dp-bench-")
            if a.spawn == "standalone":
                spawned = RedisServer(find_free_port(), Path(tmp), appendonly=not a.no_aof)
                await spawned.start()
                a.redis_url = spawned.url
            else:
                ports = [find_free_port(cluster_bus=True) for _ in range(3)]
                spawned = RedisCluster(ports, Path(tmp), appendonly=not a.no_aof)
                await spawned.start()
                a.cluster = ",".join(spawned.nodes)
        if a.cluster:
            nodes = tuple(n.strip() for n in a.cluster.split(",") if n.strip())
            cfg = StoreConfig(cluster_nodes=nodes, messages_limit=a.limit, key_prefix="bench:")
            hostports = [n.rpartition(":") for n in nodes]
            rb_nodes = [(h, int(p)) for h, _, p in hostports]
        else:
            cfg = StoreConfig(redis_url=a.redis_url, messages_limit=a.limit, key_prefix="bench:")
            from redis.connection import parse_url

            u = parse_url(a.redis_url)
            rb_nodes = [(u.get("host", "localhost"), int(u.get("port", 6379)))]
        mode = "cluster (%d masters)" % len(cfg.cluster_nodes) if cfg.cluster else "standalone"
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
        print(f"redis: {mode}; clients={a.clients} batch={a.batch} payload={a.payload}B "
              f"concurrency={a.concurrency}")  # fmt: skip
        r = await _bench_store(cfg, a)
        print(f"store save:  {r['saved']} msgs in {r['save_s']:.2f}s = {r['save_rate']:,.0f} msg/s "
              f"({r['clients_rate']:,.0f} client batches/s in {r['calls_rate']:,.0f} script calls/s)")  # fmt: skip
        print(f"store fetch: {r['fetched']} msgs in {r['fetch_s']:.2f}s = {r['fetch_rate']:,.0f} msg/s")
        if not a.no_redis_benchmark:
            rb = await _bench_redis_benchmark(cfg, rb_nodes, a)
            for k, v in rb.items():
                print(f"redis-benchmark {k}: " + (f"{v:,.0f} req/s" if v else "n/a"))
    finally:
        if spawned is not None:
            await spawned.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    asyncio.run(_main(_parse()))


if __name__ == "__main__":
    main()
