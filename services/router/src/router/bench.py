"""End-to-end throughput of ONE router instance: `python -m router.bench [--messages N] [--subscriptions M]`.

1. Kafka: `--bootstrap host:port`, or (default) a fresh local broker started with tbmq_launcher in a
   temp dir (so tbmq.msg.all holds only the benchmark's records).
2. State: M subscriptions (client i subscribes `bench/<i>/#` at QoS 1, optionally `--fanout F` clients
   per filter), every client connected on one of `--connectors` connectors (live path).
3. Backlog: N PublishMsg (QoS 1, 32-byte payload) on topics `bench/<j mod (M/F)>/x` written to tbmq.msg.all
   BEFORE the router starts.
4. One router subprocess (entry point `router`, fresh consumer group) rebuilds its state and drains the
   backlog; the benchmark reads the downlink topics and reports msg/s from the first to the last output
   record (every message produces one BasicDownlink per connector holding its recipients).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

from aiokafka import AIOKafkaConsumer

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.kafka import ensure_topics, make_producer, topic_partitions


async def _readyz(port: int) -> dict | None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    try:
        writer.write(b"GET /readyz HTTP/1.0\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
        head, _, body = data.partition(b"\r\n\r\n")
        return json.loads(body) if b" 200 " in head.split(b"\r\n")[0] else None
    finally:
        writer.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(args) -> dict:
    broker = None
    workdir = tempfile.mkdtemp(prefix="router-bench-")
    bootstrap = args.bootstrap
    if not bootstrap:
        from tbmq_launcher.kafka import KafkaBroker

        broker = KafkaBroker(port=_free_port(), controller_port=_free_port(),
                             workdir=os.path.join(workdir, "kafka"), heap="1g")
        await broker.start()
        bootstrap = broker.bootstrap_servers
    tag = uuid.uuid4().hex[:8]
    connectors = [f"bench{tag}c{i}" for i in range(args.connectors)]
    proc = None
    try:
        specs = list(topics.static_topics())
        for c in connectors:
            specs.extend(topics.service_topics(c))
        await ensure_topics(bootstrap, specs)
        producer = make_producer(bootstrap, client_id="router-bench", linger_ms=20, max_batch_size=1 << 20)
        await producer.start()
        t0 = time.monotonic()
        filters = max(1, args.subscriptions // args.fanout)
        futs = []
        for i in range(args.subscriptions):
            cid = f"b{tag}x{i}"
            f = i % filters
            cs = pb.ClientSubscriptions(client_id=cid, subscriptions=[
                pb.TopicSubscription(topic_filter=f"bench{tag}/{f}/#", qos=1)])
            si = pb.SessionInfo(client_id=cid, service_id=connectors[i % len(connectors)], connected=True)
            futs.append(await producer.send(topics.CLIENT_SUBSCRIPTIONS, cs.SerializeToString(), key=cid.encode()))
            futs.append(await producer.send(topics.CLIENT_SESSION, si.SerializeToString(), key=cid.encode()))
        payload = os.urandom(16).hex().encode()
        now = int(time.time() * 1000)
        for j in range(args.messages):
            t = f"bench{tag}/{j % filters}/x"
            m = pb.PublishMsg(publisher_id="benchpub", topic=t, payload=payload, qos=1, created_at_ms=now,
                              publisher_mqtt_version=5, publisher_service_id=connectors[0])
            futs.append(await producer.send(topics.MSG_ALL, m.SerializeToString(), key=t.encode()))
        await asyncio.gather(*futs)
        await producer.stop()
        print(f"loaded {args.subscriptions} subscriptions and {args.messages} messages in "
              f"{time.monotonic() - t0:.1f}s", file=sys.stderr)

        # expected output records: one per (message, connector holding at least one matching client)
        per_filter_conns = {}
        for i in range(args.subscriptions):
            per_filter_conns.setdefault(i % filters, set()).add(i % len(connectors))
        expected = sum(len(per_filter_conns[j % filters]) for j in range(args.messages))

        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_poll_records=10000)
        await consumer.start()
        tps = []
        for c in connectors:
            tps += await topic_partitions(consumer, topics.downlink_basic_topic(c), attempts=50)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)

        health_port = _free_port()
        env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=bootstrap, HEALTH_PORT=str(health_port),
                   TBMQ_SERVICE_ID=f"router-bench-{tag}", ROUTER_GROUP_ID=f"router-bench-{tag}",
                   ROUTER_DATA_DIR=os.path.join(workdir, "router"), LOG_LEVEL="WARNING")
        exe = shutil.which("router", path=os.path.dirname(sys.executable)) or sys.executable
        argv = [exe] if exe.endswith("router") else [exe, "-m", "router"]
        t_start = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL if not args.verbose else None,
                                stderr=subprocess.DEVNULL if not args.verbose else None)
        ready = None
        while ready is None:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}")
            if time.monotonic() - t_start > 120:
                raise RuntimeError("router not ready within 120 s")
            ready = await _readyz(health_port)
            await asyncio.sleep(0.05)
        t_ready = time.monotonic()
        import psutil

        rp = psutil.Process(proc.pid)
        cpu_first = cpu_last = None
        got = 0
        first = last = None
        deadline = time.monotonic() + args.timeout
        while got < expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {got}/{expected} output records within {args.timeout}s")
            batches = await consumer.getmany(timeout_ms=500, max_records=10000)
            n = sum(len(v) for v in batches.values())
            if n:
                now_m = time.monotonic()
                c = rp.cpu_times()
                if first is None:
                    first, cpu_first = now_m, c.user + c.system
                last, cpu_last = now_m, c.user + c.system
                got += n
        await consumer.stop()
        details = await _readyz(health_port) or {}
        elapsed = last - first if last and first and last > first else float("nan")
        return {
            "messages": args.messages, "subscriptions": args.subscriptions, "fanout": args.fanout,
            "connectors": args.connectors, "output_records": got,
            "rebuild_s": details.get("rebuilt_in_s"), "ready_after_start_s": round(t_ready - t_start, 2),
            "drain_s": round(elapsed, 2), "msg_per_s": round(args.messages / elapsed),
            "records_per_s": round(got / elapsed),
            "router_cpu_s": round(cpu_last - cpu_first, 2),
            "msg_per_router_cpu_s": round(args.messages / max(cpu_last - cpu_first, 1e-9)),
            "load_average": os.getloadavg()[0],
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        }
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if broker is not None:
            await broker.stop(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m router.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--subscriptions", type=int, default=10_000)
    ap.add_argument("--fanout", type=int, default=1, help="subscribers per filter (same filter)")
    ap.add_argument("--connectors", type=int, default=4)
    ap.add_argument("--bootstrap", default="", help="use this Kafka instead of starting one")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--verbose", action="store_true", help="show the router's output")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
