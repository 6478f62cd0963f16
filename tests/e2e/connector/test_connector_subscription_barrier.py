"""Subscriptions take effect at SUBACK, across connectors (issue 13, behaviour 3; docs/connector.md,
"Subscriptions take effect at SUBACK"; docs/router.md, "Routing after SUBACK").

Through the real suite (session-registry, router, TWO connectors), with paho-mqtt 3.1.1 and 5.0 clients,
many pairs at once. Each pair: A on connector 1, B on connector 2. Every iteration, a new A, fresh topics:
1. A connects and subscribes; on SUBACK, B publishes QoS 1: A must receive it (the router routes the publish with
   the new subscription);
2. A unsubscribes; on UNSUBACK, B publishes QoS 1 again: A must not receive it;
3. B publishes a retained QoS 1 message to another fresh topic; on its PUBACK, A subscribes to that
   topic: the retained message must come with the SUBSCRIBE.

"Received or not" is decided without any timing: a witness W on connector 1 (A's connector) subscribes
to every topic of the test. The router sends one tbmq.msg.downlink.basic record per connector for all of
its live recipients, and the connector delivers to all of them in one synchronous step, so once W holds
a message, A's copy (if routed to A) has been written to A's socket. A then makes one request/response
round trip (a SUBSCRIBE of a sync topic): paho handles A's packets in order, so when that SUBACK is in,
anything written to A before it has been received. For the retained direction the retained messages go
out with the SUBACK, so the same round trip settles it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from connector_helpers import two_connector_suite
from mqtt_clients import BOUND, Client, routed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAIRS = 20
ITERATIONS = 50  # per pair: PAIRS * ITERATIONS = 1,000 of each direction


class Recorder(Client):
    """A Client that also keeps the set of payloads it received."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.payloads: set[bytes] = set()

    def _on_message(self, client, userdata, msg):
        with self.cond:
            self.payloads.add(msg.payload)
            self.messages.append(msg)
            self.cond.notify_all()

    def has(self, payload: bytes) -> bool:
        with self.cond:
            return payload in self.payloads


@pytest.fixture(scope="module")
async def mq(kafka, tmp_path_factory):
    async with two_connector_suite(kafka, tmp_path_factory.mktemp("suite-barrier"),
                                   ["session-registry", "router", "connector"],
                                   redis_url="redis://127.0.0.1:1/0") as s:
        yield s


def _pair(w: Recorder, port: int, v5: bool, b: Client, prefix: str, misses: dict) -> None:
    """ITERATIONS of the three directions (module docstring), blocking (runs in a thread). A is a new
    client every iteration (connect, then subscribe at once: the request/response pattern), so the
    router must also know its fresh session when it routes B's publish."""
    sync = f"{prefix}/sync"
    a: Recorder | None = None

    def settle(payload: bytes) -> bool:
        """W has `payload` (routed and delivered on connector 1); then whether A has it."""
        assert w.wait(lambda: payload in w.payloads), f"{payload!r} never reached the witness"
        a.subscribe(sync, 0)  # a round trip on A's connection: what was written to A before it is in
        return a.has(payload)

    for i in range(ITERATIONS):
        a = Recorder(f"{prefix}-a{i}", v5=v5)
        a.connect(port)
        topic = f"{prefix}/t{i}"
        a.subscribe(topic, 1)
        after_suback = f"{topic} after SUBACK".encode()
        b.publish(topic, after_suback, 1)
        if not settle(after_suback):
            misses["after SUBACK"].append(topic)
        a.unsubscribe(topic)
        after_unsuback = f"{topic} after UNSUBACK".encode()
        b.publish(topic, after_unsuback, 1)
        if settle(after_unsuback):
            misses["after UNSUBACK"].append(topic)
        retained_topic = f"{prefix}/r{i}"
        retained = f"{retained_topic} retained".encode()
        b.publish(retained_topic, retained, 1, retain=True)  # waits for the PUBACK
        a.subscribe(retained_topic, 1)
        a.subscribe(sync, 0)
        if not a.has(retained):
            misses["retained"].append(retained_topic)
        b.publish(retained_topic, b"", 1, retain=True)  # clears it [MQTT-3.3.1-6]
        a.close()


async def test_publish_after_suback_reaches_the_subscription_and_none_after_unsuback(mq, unique):
    prefix = unique("sb")
    ports = mq.mqtt_ports
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=PAIRS + 1, thread_name_prefix="pair") as pool:
        def blocking(fn, *args):
            return loop.run_in_executor(pool, fn, *args)

        w = Recorder(prefix + "-w")
        await blocking(w.connect, ports[0])
        await blocking(w.subscribe, f"{prefix}/#", 1)
        probe = Client(prefix + "-probe")
        await blocking(probe.connect, ports[1])
        await routed(probe, w, f"{prefix}/probe", 1)  # the witness's own subscription is in the router
        pairs = []
        for k in range(PAIRS):
            v5 = k % 2 == 1  # 3.1.1 and 5.0 pairs
            b = Client(f"{prefix}-b{k}", v5=v5)
            await blocking(b.connect, ports[1])
            pairs.append((v5, b, f"{prefix}/{k}"))
        misses: dict[str, list[str]] = {"after SUBACK": [], "after UNSUBACK": [], "retained": []}
        try:
            await asyncio.wait_for(asyncio.gather(*(blocking(_pair, w, ports[0], v5, b, p, misses)
                                                    for v5, b, p in pairs)), BOUND * ITERATIONS)
        finally:
            for c in (w, probe, *(b for _, b, _ in pairs)):
                await blocking(c.close)
    counts = {k: len(v) for k, v in misses.items()}
    print(f"{PAIRS * ITERATIONS} iterations per direction, misses: {counts}")
    assert counts == {"after SUBACK": 0, "after UNSUBACK": 0, "retained": 0}, misses
