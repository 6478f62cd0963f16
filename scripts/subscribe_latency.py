"""SUBSCRIBE latencies across two connectors with paho-mqtt 5.0: median, p99 and max in ms over -n rounds,
each on a fresh topic (docs/performance.md, "Subscriptions take effect at SUBACK"):

- suback:         SUBSCRIBE -> SUBACK (A on --port);
- first message:  SUBSCRIBE -> the first message, published QoS 1 by B (on --port2) as soon as A has the
                  SUBACK (a message that never arrives within --wait s is counted as missed);
- retained:       SUBSCRIBE -> the retained message B published (QoS 1, PUBACK received) just before.

    .venv/bin/python -m tbmq_launcher run --connectors 2 --free-ports   # another terminal
    .venv/bin/python scripts/subscribe_latency.py --port <MQTT 1> --port2 <MQTT 2> -n 200

A measurement tool, not a test: it asserts nothing."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


class Timed:
    def __init__(self, cid: str, port: int) -> None:
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
        self.ev = {}
        self.t = {}
        self.c.on_connect = lambda *a: self._mark("connack")
        self.c.on_subscribe = lambda *a: self._mark("suback")
        self.c.on_message = lambda client, ud, msg: self._mark(msg.payload.decode())
        self.c.connect("127.0.0.1", port, keepalive=60, clean_start=True)
        self.c.loop_start()
        assert self.wait("connack", 10), "no CONNACK"

    def _mark(self, key: str) -> None:
        self.t[key] = time.perf_counter()
        self.ev.setdefault(key, threading.Event()).set()

    def wait(self, key: str, timeout: float) -> bool:
        return self.ev.setdefault(key, threading.Event()).wait(timeout)

    def reset(self) -> None:
        self.ev.clear()
        self.t.clear()


def stats(xs: list[float]) -> str:
    if not xs:
        return "n=0"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return f"n={len(xs)} median {statistics.median(xs):6.1f} ms  p99 {p99:6.1f} ms  max {xs[-1]:6.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=1883, help="connector of the subscriber A")
    ap.add_argument("--port2", type=int, default=1884, help="connector of the publisher B")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--wait", type=float, default=2.0, help="s to wait for a message before counting it missed")
    a = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    sub, pub = Timed(f"subl-a-{run}", a.port), Timed(f"subl-b-{run}", a.port2)
    suback, first, retained = [], [], []
    missed_first = missed_retained = 0
    for i in range(a.n):
        topic = f"subl/{run}/t{i}"
        sub.reset()
        t0 = time.perf_counter()
        sub.c.subscribe(topic, qos=1)
        assert sub.wait("suback", 10), "no SUBACK"
        pub.c.publish(topic, b"first", qos=1).wait_for_publish(10)
        suback.append((sub.t["suback"] - t0) * 1000)
        if sub.wait("first", a.wait):
            first.append((sub.t["first"] - t0) * 1000)
        else:
            missed_first += 1
        rtopic = f"subl/{run}/r{i}"
        pub.c.publish(rtopic, b"retained", qos=1, retain=True).wait_for_publish(10)
        sub.reset()
        t0 = time.perf_counter()
        sub.c.subscribe(rtopic, qos=1)
        if sub.wait("retained", a.wait):
            retained.append((sub.t["retained"] - t0) * 1000)
        else:
            missed_retained += 1
        pub.c.publish(rtopic, b"", qos=1, retain=True).wait_for_publish(10)
        sub.c.unsubscribe(topic)
        sub.c.unsubscribe(rtopic)
    print(f"SUBSCRIBE -> SUBACK          {stats(suback)}")
    print(f"SUBSCRIBE -> first message   {stats(first)}  missed {missed_first}")
    print(f"SUBSCRIBE -> retained        {stats(retained)}  missed {missed_retained}")
    for c in (sub, pub):
        c.c.disconnect()
        c.c.loop_stop()


if __name__ == "__main__":
    main()
