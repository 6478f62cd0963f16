"""CPU per record of the connector's way of producing, against two cheaper ways to hand aiokafka the same records
(docs/performance.md, "The thirtieth round"; `direct`: "The thirty-sixth round"). A measurement tool, not a
test: it asserts nothing.

    .venv/bin/python scripts/produce_cost.py [rate=1000] [seconds=15] [rounds=3]

Starts a local Kafka (tbmq_launcher.kafka, free ports, a temporary log dir) with one topic of one partition
(tbmq.msg.all in the single-node profile), and one producer as tbmq_platform.kafka.make_producer makes it with
the connector's busy linger (PRODUCER_LINGER_MS). A paced loop (1 ms ticks) hands it `rate` records a second of
100 keys (client ids) and 120-byte values with one header, each with a done callback, as the connector's
PUBLISH path does. Per mode it reports the process's CPU (user + system, every thread) per record and the
produce requests sent, and the CPU of the hand-over alone (the calling thread's CPU inside the hand-over, per
record: what the mode changes, without the loop's and the sender's share); `idle` is the paced loop alone, the
cost every mode pays besides its records:

- `send`: `await producer.send(...)` per record (the connector before the thirty-sixth round), one future and
  one RecordMetadata per record, the callback on each record's future;
- `direct`: `await DirectSend(producer)(...)` per record (tbmq_platform.kafka; the connector's
  ConnectorService.produce_publish and the router since the thirty-sixth round): `send`'s record, partition
  and future, without `send`'s per-record metadata wait, partition sets and size estimate;
- `append`: the record appended to aiokafka's open batch of the partition (`MessageBatch._builder.append`,
  an internal) when there is one, its callback on that batch's future, else `send`; no coroutine and no
  future per record;
- `batch`: one `create_batch()` per window of the linger, filled here and handed over with `send_batch`
  (public API) at the first tick after the window, one callback per batch that calls the records' callbacks.

The modes run in turn, `rounds` times, in alternating order."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiokafka.conn  # noqa: E402
import uvloop  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # noqa: E402
from aiokafka.structs import TopicPartition  # noqa: E402

from bench.brokers import free_port  # noqa: E402
from tbmq_launcher.kafka import KafkaBroker  # noqa: E402
from tbmq_platform.kafka import DirectSend, make_producer  # noqa: E402
from tbmq_platform.settings import PRODUCER_LINGER_MS  # noqa: E402

TOPIC = "produce-cost"
KEYS = [f"client-{i:04d}".encode() for i in range(100)]
VALUE = b"v" * 120
HEADERS = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
TICK_S = 0.001
REQUESTS = [0]
HANDING = [0.0]  # thread CPU seconds inside the hand-overs of the current mode


def _counting(send):
    def counted(self, request, expect_response=True):
        REQUESTS[0] += 1
        return send(self, request, expect_response)
    return counted


aiokafka.conn.AIOKafkaConnection.send = _counting(aiokafka.conn.AIOKafkaConnection.send)


def _done(fut) -> None:
    """What the connector's callback reads of a produced record: whether it failed."""
    if not fut.cancelled():
        fut.exception()


async def _paced(rate: float, seconds: float, hand, tick=None) -> int:
    """Calls `await hand(i)` for records due at `rate` a second, in 1 ms ticks, and `await tick(now)` after
    each tick's records when given; returns the count."""
    t0, n = time.monotonic(), 0
    while (now := time.monotonic()) - t0 < seconds:
        due = int((now - t0) * rate)
        while n < due:
            c0 = time.thread_time()
            await hand(n)
            HANDING[0] += time.thread_time() - c0
            n += 1
        if tick is not None:
            await tick(now)
        await asyncio.sleep(TICK_S)
    return n


async def mode_idle(producer, rate, seconds):
    async def hand(i):
        pass
    await _paced(0.0, seconds, hand)  # the same loop with no record due
    return int(rate * seconds)


async def mode_send(producer, rate, seconds):
    async def hand(i):
        (await producer.send(TOPIC, VALUE, key=KEYS[i % 100], headers=HEADERS)).add_done_callback(_done)
    return await _paced(rate, seconds, hand)


async def mode_direct(producer, rate, seconds):
    direct = DirectSend(producer)

    async def hand(i):
        (await direct(TOPIC, VALUE, KEYS[i % 100], HEADERS)).add_done_callback(_done)
    n = await _paced(rate, seconds, hand)
    direct.close()
    return n


async def mode_append(producer, rate, seconds):
    batches = producer._message_accumulator._batches
    tp = TopicPartition(TOPIC, 0)

    async def hand(i):
        key = KEYS[i % 100]
        pending = batches.get(tp)
        if pending:
            batch = pending[-1]
            if batch._builder.append(timestamp=None, key=key, value=VALUE, headers=HEADERS) is not None:
                batch.future.add_done_callback(_done)
                return
        (await producer.send(TOPIC, VALUE, key=key, headers=HEADERS)).add_done_callback(_done)
    return await _paced(rate, seconds, hand)


async def mode_batch(producer, rate, seconds):
    window = PRODUCER_LINGER_MS / 1000
    state = {"batch": None, "callbacks": [], "opened": 0.0}
    futures = []

    async def flush():
        batch, callbacks = state["batch"], state["callbacks"]
        state["batch"], state["callbacks"] = None, []
        fut = await producer.send_batch(batch, TOPIC, partition=0)
        fut.add_done_callback(lambda f, cbs=callbacks: [cb(f) for cb in cbs])
        futures.append(fut)

    async def hand(i):
        if state["batch"] is None:
            state["batch"], state["opened"] = producer.create_batch(), time.monotonic()
        state["batch"].append(key=KEYS[i % 100], value=VALUE, timestamp=None, headers=HEADERS)
        state["callbacks"].append(_done)

    async def tick(now):
        if state["batch"] is not None and now - state["opened"] >= window:
            await flush()
    n = await _paced(rate, seconds, hand, tick)
    if state["batch"] is not None:
        await flush()
    await asyncio.gather(*futures)
    return n


MODES = {"idle": mode_idle, "send": mode_send, "direct": mode_direct, "append": mode_append, "batch": mode_batch}


async def main() -> None:
    args = [float(a) for a in sys.argv[1:4]]
    rate, seconds, rounds = args + [1000.0, 15.0, 3.0][len(args):]
    workdir = tempfile.mkdtemp(prefix="produce-cost-")
    kafka = KafkaBroker(port=free_port(), controller_port=free_port(), workdir=workdir)
    await kafka.start()
    try:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
        await admin.start()
        await admin.create_topics([NewTopic(TOPIC, 1, 1)])
        await admin.close()
        producer = make_producer(kafka.bootstrap_servers, client_id="produce-cost", linger_ms=int(PRODUCER_LINGER_MS))
        await producer.start()
        await producer.send_and_wait(TOPIC, b"warm-up", key=b"warm-up")
        order = list(MODES)
        print(f"{rate:.0f} records/s for {seconds:.0f} s per mode, linger {PRODUCER_LINGER_MS} ms, 1 partition")
        for r in range(int(rounds)):
            for name in order if r % 2 == 0 else order[::-1]:
                REQUESTS[0], HANDING[0] = 0, 0.0
                cpu0 = time.process_time()
                n = await MODES[name](producer, rate, seconds)
                await asyncio.sleep(0.2)  # the last requests answered
                cpu = time.process_time() - cpu0
                print(f"{name:7} {cpu / n * 1e6:6.1f} µs of CPU per record, {REQUESTS[0] / seconds:5.1f} requests/s, "
                      f"hand-over {HANDING[0] / n * 1e6:5.2f} µs", flush=True)
        await producer.stop()
    finally:
        await kafka.stop()


if __name__ == "__main__":
    uvloop.run(main())
