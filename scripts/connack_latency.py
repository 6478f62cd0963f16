"""CONNACK latency of persistent and clean reconnects with paho-mqtt: median, p99 and max in ms over -n
reconnects of one client id, MQTT 3.1.1 and 5.0 (persistent: clean session 0 / clean start 0 with Session
Expiry Interval 600, after one connection that subscribed; a 0.2 s pause between reconnects), after an
untimed pass of --warmup reconnects of each kind. The first few dozen reconnects after Kafka started run on
its cold paths (most likely its JIT: the transaction requests a reconnect costs are not compiled yet) and take
about twice as long; without the warm-up the first row measured them and the others did not
(docs/performance.md, "The sixteenth round").

    .venv/bin/python -m tbmq_launcher run            # another terminal
    .venv/bin/python scripts/connack_latency.py --port 1883 -n 40

A measurement tool (docs/performance.md), not a test: it asserts nothing."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def one(cid, v5, persistent, port, subscribe=False):
    kw = {} if v5 else {"clean_session": not persistent}
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311, **kw)
    ev = threading.Event()
    got = {}

    def on_connect(client, ud, flags, rc, props=None):
        got["t"] = time.perf_counter()
        got["sp"] = flags.session_present
        ev.set()

    c.on_connect = on_connect
    ckw = {}
    if v5:
        ckw["clean_start"] = not persistent
        if persistent:
            p = Properties(PacketTypes.CONNECT)
            p.SessionExpiryInterval = 600
            ckw["properties"] = p
    t0 = time.perf_counter()
    c.connect("127.0.0.1", port, keepalive=60, **ckw)
    c.loop_start()
    assert ev.wait(10), "no CONNACK"
    dt = (got["t"] - t0) * 1000
    if subscribe:
        c.subscribe("connack/" + cid, qos=1)
        time.sleep(0.3)  # the SUBACK (a tool, not a test)
    c.disconnect()
    c.loop_stop()
    return dt, got["sp"]


def rows(v5, persistent, port, n):
    """`n` timed reconnects of a new client id (after one connection that subscribed): (ms each, session
    present each)."""
    cid = f"connack-{uuid.uuid4().hex[:8]}"
    one(cid, v5, persistent, port, subscribe=True)
    xs, sp = [], []
    for _ in range(n):
        dt, present = one(cid, v5, persistent, port)
        xs.append(dt)
        sp.append(present)
        time.sleep(0.2)
    return xs, sp


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("-n", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=40, help="untimed reconnects of each kind first (0: none)")
    a = ap.parse_args()
    if a.warmup:
        for v5 in (False, True):
            for persistent in (True, False):
                rows(v5, persistent, a.port, a.warmup)
    for v5 in (False, True):
        for persistent in (True, False):
            xs, sp = rows(v5, persistent, a.port, a.n)
            xs.sort()
            p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
            print(f"{'5.0' if v5 else '3.1.1'} {'persistent' if persistent else 'clean':10s} n={len(xs)} "
                  f"median {statistics.median(xs):6.1f} ms  p99 {p99:6.1f} ms  max {xs[-1]:6.1f} ms  "
                  f"session_present={sum(sp)}/{len(sp)}", flush=True)


if __name__ == "__main__":
    main()
