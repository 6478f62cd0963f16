"""`python -m bench kafka-clients`: the Kafka client measured side by side (issue 12, deliverable 3).

aiokafka is the design's client; librdkafka (confluent-kafka) is the alternative the issue allows behind the
platform's factories once a profile shows the client itself is the bound. This command measures both on the
same real local Kafka (tbmq_launcher.kafka.KafkaBroker, the suite's single-node settings), one after the
other in interleaved rounds, on the hop every message pays: an acknowledged produce (the connector's PUBLISH
→ PUBACK) and a consumer of the same partition (the router's fetch), in ONE process, as a service has both.

Per step (a client at a fixed rate, `--seconds` measured after a 2 s warm-up in a fresh child process):
- the client process's CPU per message (every thread: librdkafka's own threads are in the process too);
  a third step per rate, `loop-only`, runs the same paced loop and futures without Kafka: the clients'
  figures minus its figure are the Kafka client's own cost;
- the Kafka JVM's CPU per message over the same window, the share of it spent in the kernel, and its JIT
  compiler's share (`jit_pct`),
- Kafka requests the client sent per second (aiokafka: counted at `AIOKafkaConnection.send`; librdkafka:
  the `tx` of its statistics), produce-acknowledgement and end-to-end latency p50 / p99.

Both clients are configured alike: idempotent acks=all producer, linger 5 ms (the connector's linger under
load, tbmq_platform.coalesce.AdaptiveLinger), the consumer's long-poll returns on the first byte (fetch min
bytes 1, wait 500 ms). The asyncio integration of librdkafka is the one a platform factory would need: the
delivery reports and the fetched records come from a poll thread to the event loop in one
`call_soon_threadsafe` per poll (not per message), and every PUBLISH's acknowledgement is an asyncio future,
as with aiokafka.

Before the measured rounds both clients run at the highest rate until Kafka's JIT settled (bench.procmon,
as `make bench` does). Results: a JSON file in bench/results/ and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from .calibrate import process_cpu_s
from .stats import percentile

CLIENTS = ("aiokafka", "librdkafka")
BASELINE = "loop-only"  # the same paced loop and futures without Kafka: what the clients' figures include besides the client
TOPIC = "kc.bench"
VALUE_BYTES = 120  # about a PublishMsg of a 64 B payload on tbmq.msg.all
LINGER_MS = 5
FETCH_WAIT_MS = 500
KEYS = [f"bench/kc/{i}".encode() for i in range(100)]


# ------------------------------------------------------------------------------------------- child side
class _AioClient:
    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.requests = 0

    async def start(self, on_records) -> None:
        import aiokafka.conn
        from aiokafka import TopicPartition
        from tbmq_platform.kafka import make_consumer, make_producer

        orig = aiokafka.conn.AIOKafkaConnection.send
        me = self

        def counting_send(conn, request, expect_response=True):
            me.requests += 1
            return orig(conn, request, expect_response)

        aiokafka.conn.AIOKafkaConnection.send = counting_send
        self.producer = make_producer(self.bootstrap, client_id="kc-aio-p", linger_ms=LINGER_MS)
        self.consumer = make_consumer(self.bootstrap, group_id=None, client_id="kc-aio-c",
                                      fetch_max_wait_ms=FETCH_WAIT_MS)
        await self.producer.start()
        await self.consumer.start()
        tp = TopicPartition(TOPIC, 0)
        self.consumer.assign([tp])
        await self.consumer.seek_to_end(tp)
        self._task = asyncio.get_running_loop().create_task(self._consume(on_records))

    async def _consume(self, on_records) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=1000)
            for recs in batches.values():
                on_records([r.value for r in recs])

    async def send(self, value: bytes, key: bytes) -> asyncio.Future:
        return await self.producer.send(TOPIC, value, key=key)

    async def stop(self) -> None:
        self._task.cancel()
        await self.producer.stop()
        await self.consumer.stop()


class _RdClient:
    """confluent-kafka on asyncio: produce() from the loop (non-blocking), delivery reports and fetched
    records handed to the loop by two poll threads, one call_soon_threadsafe per poll."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._tx: dict[str, list[tuple[float, int]]] = {"p": [], "c": []}
        self._running = True

    def _stats(self, name: str):
        def cb(raw: str) -> None:
            s = json.loads(raw)
            self._tx[name].append((time.monotonic(), sum(b.get("tx", 0) for b in s.get("brokers", {}).values())))
        return cb

    def requests_per_s(self, t0: float, t1: float) -> float:
        """Requests sent per second inside [t0, t1], from the statistics snapshots (one a second each for the
        producer and the consumer) taken in it."""
        total = 0.0
        for snaps in self._tx.values():
            inside = [(t, n) for t, n in snaps if t0 <= t <= t1]
            if len(inside) < 2:
                return float("nan")
            (ta, na), (tb, nb) = inside[0], inside[-1]
            total += (nb - na) / (tb - ta)
        return total

    async def start(self, on_records) -> None:
        from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition

        self.loop = asyncio.get_running_loop()
        self.producer = Producer({
            "bootstrap.servers": self.bootstrap, "client.id": "kc-rd-p", "acks": "all",
            "enable.idempotence": True, "linger.ms": LINGER_MS, "statistics.interval.ms": 1000,
            "socket.nagle.disable": True,
            "stats_cb": self._stats("p"),
        })
        self.consumer = Consumer({
            "bootstrap.servers": self.bootstrap, "client.id": "kc-rd-c", "group.id": "kc-bench",
            "enable.auto.commit": False, "fetch.min.bytes": 1, "fetch.wait.max.ms": FETCH_WAIT_MS,
            "statistics.interval.ms": 1000, "stats_cb": self._stats("c"), "socket.nagle.disable": True,
        })
        self.consumer.assign([TopicPartition(TOPIC, 0, OFFSET_END)])
        self._acks: list = []
        threading.Thread(target=self._poll_producer, daemon=True).start()
        threading.Thread(target=self._poll_consumer, args=(on_records,), daemon=True).start()

    def _poll_producer(self) -> None:
        acks = self._acks
        while self._running:
            self.producer.poll(0.1)
            if acks:
                done, acks[:] = acks[:], []
                self._to_loop(_resolve, done)

    def _poll_consumer(self, on_records) -> None:
        # consume(n, timeout) waits for n messages or the timeout: the first message is polled for, then
        # what is already queued is taken without waiting
        while self._running:
            first = self.consumer.poll(0.1)
            if first is not None:
                msgs = [first, *self.consumer.consume(999, 0)]
                self._to_loop(on_records, [m.value() for m in msgs if m.error() is None])

    def _to_loop(self, fn, arg) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed (the child is ending)
            self._running = False

    async def send(self, value: bytes, key: bytes) -> asyncio.Future:
        fut = self.loop.create_future()
        acks = self._acks
        self.producer.produce(TOPIC, value, key, on_delivery=lambda err, msg: acks.append((fut, err)))
        return fut

    async def stop(self) -> None:
        self.producer.flush(5)
        self._running = False
        await asyncio.sleep(0.3)
        self.consumer.close()


class _LoopOnly:
    """No Kafka: each send's future is resolved and its record handed to the consumer side on the next loop
    turn, so the paced loop, the futures and the latency bookkeeping cost what they cost in the other steps."""

    def __init__(self, bootstrap: str) -> None:
        self.requests = 0

    async def start(self, on_records) -> None:
        self.loop = asyncio.get_running_loop()
        self.on_records = on_records

    async def send(self, value: bytes, key: bytes) -> asyncio.Future:
        fut = self.loop.create_future()
        self.loop.call_soon(_resolve, [(fut, None)])
        self.loop.call_soon(self.on_records, [value])
        return fut

    async def stop(self) -> None:
        pass


def _resolve(done: list) -> None:
    for fut, err in done:
        if not fut.done():
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(RuntimeError(str(err)))


async def _child(client: str, bootstrap: str, rate: float, seconds: float, warm: float) -> dict:
    c = {"aiokafka": _AioClient, "librdkafka": _RdClient, BASELINE: _LoopOnly}[client](bootstrap)
    e2e: list[float] = []
    acks: list[float] = []
    measuring = [False]
    pad = bytes(VALUE_BYTES - 8)

    def on_records(values) -> None:
        now = time.monotonic_ns()
        if measuring[0]:
            e2e.extend((now - int.from_bytes(v[:8], "big")) / 1e6 for v in values)

    await c.start(on_records)
    loop = asyncio.get_running_loop()
    pending: set = set()

    def acked(t0: int, fut) -> None:
        pending.discard(fut)
        if measuring[0] and not fut.cancelled() and fut.exception() is None:
            acks.append((time.monotonic_ns() - t0) / 1e6)

    async def run_for(duration: float) -> int:
        sent = 0
        start = time.monotonic()
        while True:
            now = time.monotonic()
            if now - start >= duration:
                return sent
            due = int((now - start) * rate) - sent
            for _ in range(due):
                t0 = time.monotonic_ns()
                fut = await c.send(t0.to_bytes(8, "big") + pad, KEYS[sent % len(KEYS)])
                pending.add(fut)
                fut.add_done_callback(lambda f, t0=t0: acked(t0, f))
                sent += 1
            await asyncio.sleep(0.001)

    await run_for(warm)
    print("measure", flush=True)
    measuring[0] = True
    req0, cpu0, t0 = getattr(c, "requests", 0), process_cpu_s(), time.monotonic()
    sent = await run_for(seconds)
    cpu1, t1 = process_cpu_s(), time.monotonic()
    await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 30)
    measuring[0] = False
    await c.stop()
    wall = t1 - t0
    return {"client": client, "rate": rate, "sent": sent, "wall_s": round(wall, 2),
            "client_us_per_msg": round((cpu1 - cpu0) / sent * 1e6, 1), "client_cpu_pct": round((cpu1 - cpu0) / wall * 100, 1),
            "requests_per_s": round(c.requests_per_s(t0, t1) if isinstance(c, _RdClient) else (c.requests - req0) / wall, 1),
            "ack_ms": _p50_p99(acks), "e2e_ms": _p50_p99(e2e)}


def _p50_p99(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"p50": round(percentile(ms, 50), 2), "p99": round(percentile(ms, 99), 2), "n": len(ms)}


# ------------------------------------------------------------------------------------------ driver side
def _proc_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    t = psutil.Process(pid).cpu_times()
    return t.user, t.system


def _step(client: str, bootstrap: str, rate: float, seconds: float, kafka_pid: int, warm: float = 2.0) -> dict:
    from .procmon import jit_compile_cpu_s

    cmd = [sys.executable, "-m", "bench.kafka_clients", "--child", client, "--bootstrap", bootstrap,
           "--rate", str(rate), "--seconds", str(seconds), "--warm", str(warm)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if line != "measure":
        p.wait()
        raise RuntimeError(f"{client}: child failed before measuring ({line!r})")
    k0, j0, t0 = _proc_cpu_s(kafka_pid), jit_compile_cpu_s(kafka_pid) or 0.0, time.monotonic()
    out = p.stdout.readline()
    k1, j1, t1 = _proc_cpu_s(kafka_pid), jit_compile_cpu_s(kafka_pid) or 0.0, time.monotonic()
    if p.wait() != 0 or not out:
        raise RuntimeError(f"{client}: child exited with {p.returncode}")
    res = json.loads(out)
    user, system = k1[0] - k0[0], k1[1] - k0[1]
    res["kafka_us_per_msg"] = round((user + system) / res["sent"] * 1e6, 1)
    res["kafka_cpu_pct"] = round((user + system) / (t1 - t0) * 100, 1)
    res["kafka_system_share"] = round(system / (user + system), 3) if user + system else float("nan")
    res["jit_pct"] = round((j1 - j0) / (t1 - t0) * 100, 1)
    return res


async def _start_kafka(workdir: Path):
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from tbmq_launcher.kafka import KafkaBroker

    from .brokers import free_port

    broker = KafkaBroker(port=free_port(), controller_port=free_port(), workdir=workdir)
    await broker.start()
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 1, 1)])
    finally:
        await admin.close()
    return broker


def drive(args) -> int:
    from .procmon import JitSettle, jit_compile_cpu_s

    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        print("confluent-kafka is not installed (requirements.lock; scripts/bootstrap.sh)", file=sys.stderr)
        return 2
    rates = [float(r) for r in args.rates.split(",")]
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory(prefix="kc-bench-") as tmp:
        broker = loop.run_until_complete(_start_kafka(Path(tmp) / "kafka"))
        try:
            pid = broker.pid
            bootstrap = broker.bootstrap_servers
            settle = JitSettle()
            t_end = time.monotonic() + args.jit_settle_max
            chunks = 0
            while True:  # both clients at the highest rate until the JIT settled (or the bound)
                for client in CLIENTS:
                    _step(client, bootstrap, max(rates), 8.0, pid, warm=1.0)
                chunks += 1
                done = settle.feed(jit_compile_cpu_s(pid) or 0.0, time.monotonic())
                print(f"warm-up chunk {chunks}: JIT {'settled' if done else 'compiling'}", flush=True)
                if done or time.monotonic() >= t_end:
                    break
            steps = []
            for rnd in range(args.rounds):
                for rate in rates:
                    order = CLIENTS if rnd % 2 == 0 else tuple(reversed(CLIENTS))
                    for client in (*order, BASELINE):
                        r = _step(client, bootstrap, rate, args.seconds, pid)
                        r["round"] = rnd + 1
                        steps.append(r)
                        print(_fmt(r), flush=True)
        finally:
            loop.run_until_complete(broker.stop())
    import platform
    out = {"timestamp": time.strftime("%Y%m%d-%H%M%S"), "command": " ".join(sys.argv),
           "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                       "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
           "warmup_chunks": chunks, "steps": steps, "summary": summarize(steps)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kafka-clients-{out['timestamp']}.json"
    path.write_text(json.dumps(out, indent=1))
    print()
    print(table(out["summary"]))
    print(f"\nresults: {path}")
    return 0


def _fmt(r: dict) -> str:
    return (f"  round {r['round']} {r['client']:>10} @ {r['rate']:>6,.0f}/s: client {r['client_us_per_msg']:>6.1f} "
            f"µs/msg ({r['client_cpu_pct']:.0f} %), Kafka {r['kafka_us_per_msg']:>6.1f} µs/msg (JIT {r['jit_pct']:.0f} %, "
            f"system {100 * r['kafka_system_share']:.0f} %), "
            f"{r['requests_per_s']:>6.0f} req/s, ack p50/p99 {r['ack_ms']['p50']}/{r['ack_ms']['p99']} ms, "
            f"e2e p50/p99 {r['e2e_ms']['p50']}/{r['e2e_ms']['p99']} ms")


def summarize(steps: list[dict]) -> list[dict]:
    """Median over the rounds of every figure, per (rate, client)."""
    out = []
    for rate in sorted({s["rate"] for s in steps}):
        for client in (*CLIENTS, BASELINE):
            ss = [s for s in steps if s["rate"] == rate and s["client"] == client]
            if not ss:
                continue
            med = lambda f: round(statistics.median(f(s) for s in ss), 2)  # noqa: E731
            out.append({"rate": rate, "client": client, "rounds": len(ss),
                        "client_us_per_msg": med(lambda s: s["client_us_per_msg"]),
                        "kafka_us_per_msg": med(lambda s: s["kafka_us_per_msg"]),
                        "kafka_system_share": med(lambda s: s.get("kafka_system_share", float("nan"))),
                        "requests_per_s": med(lambda s: s["requests_per_s"]),
                        "ack_p50": med(lambda s: s["ack_ms"]["p50"]), "ack_p99": med(lambda s: s["ack_ms"]["p99"]),
                        "e2e_p50": med(lambda s: s["e2e_ms"]["p50"]), "e2e_p99": med(lambda s: s["e2e_ms"]["p99"])})
    return out


def table(summary: list[dict]) -> str:
    rows = ["| msg/s | client | client µs/msg | Kafka µs/msg (in the kernel) | Kafka requests/s | ack p50 / p99 ms "
            "| e2e p50 / p99 ms |",
            "|---:|---|---:|---:|---:|---|---|"]
    for s in summary:
        share = s.get("kafka_system_share", float("nan"))
        rows.append(f"| {s['rate']:,.0f} | {s['client']} | {s['client_us_per_msg']:.1f} | {s['kafka_us_per_msg']:.1f} "
                    f"({100 * share:.0f} %) | {s['requests_per_s']:.0f} | {s['ack_p50']:.2f} / {s['ack_p99']:.2f} | "
                    f"{s['e2e_p50']:.2f} / {s['e2e_p99']:.2f} |")
    return "\n".join(rows)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="python -m bench kafka-clients")
    ap.add_argument("--rates", default="1000,2500,5000", help="fixed rates, msg/s (comma list)")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured seconds per step")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each client at each rate)")
    ap.add_argument("--jit-settle-max", type=float, default=180.0,
                    help="warm-up seconds at most before the rounds (until Kafka's JIT settled)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return ap


def _child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=(*CLIENTS, BASELINE), required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--warm", type=float, default=2.0)
    a = ap.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    res = asyncio.run(_child(a.child, a.bootstrap, a.rate, a.seconds, a.warm))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
