"""CONNACK and SUBACK latency of persistent reconnects while the bench's p2p load runs (issue 12: what the
connector's adaptive linger costs the records a CONNACK or SUBACK waits for). Starts tbmq-py as `make bench`
does under `rate` msg/s of p2p load (bench.profile.SteadyLoad), and 10 s into it reconnects `n` times with
paho-mqtt (MQTT 3.1.1, clean session 0, five client ids in turn), each time subscribing to one new filter;
prints the medians and p90s in ms, then every CONNACK in order (a retry inside the registry's transaction
shows as a single reconnect of 100 ms or more).

    .venv/bin/python scripts/connack_under_load.py [n] [rate]      # defaults: 30 reconnects, 1,000 msg/s

A measurement tool (docs/performance.md, "The forty-fourth round" and "The forty-fifth round"), not a test: it
asserts nothing."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from bench.profile import SteadyLoad  # noqa: E402


def reconnect(client_id: str, port: int, topic: str) -> tuple[float, float]:
    """One persistent connect and SUBSCRIBE: (CONNACK ms, SUBACK ms)."""
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=False)
    connected, subscribed, at = threading.Event(), threading.Event(), {}
    c.on_connect = lambda *a, **k: (at.__setitem__("connack", time.perf_counter()), connected.set())
    c.on_subscribe = lambda *a, **k: (at.__setitem__("suback", time.perf_counter()), subscribed.set())
    t0 = time.perf_counter()
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        assert connected.wait(10), "no CONNACK"
        t1 = time.perf_counter()
        c.subscribe(topic, qos=1)
        assert subscribed.wait(10), "no SUBACK"
    finally:
        c.disconnect()
        c.loop_stop()
    return (at["connack"] - t0) * 1000, (at["suback"] - t1) * 1000


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * len(xs))]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rate = float(sys.argv[2]) if len(sys.argv) > 2 else 1000.0
    with SteadyLoad("tbmq", rate=rate, seconds=25 + n * 0.6) as load:
        time.sleep(10)  # into the load (a tool: the reconnects are meant to land in the middle of it)
        connacks, subacks = [], []
        for i in range(n):
            c, s = reconnect(f"connack-load-{i % 5}", load.broker.port, f"connack/load/{i}")
            connacks.append(c)
            subacks.append(s)
            time.sleep(0.2)
    print(f"under {rate:,.0f} msg/s: CONNACK median {statistics.median(connacks):.1f} / p90 {p90(connacks):.1f} ms; "
          f"SUBACK median {statistics.median(subacks):.1f} / p90 {p90(subacks):.1f} ms")
    print("CONNACKs in ms, in order:", " ".join(f"{c:.0f}" for c in connacks))


if __name__ == "__main__":
    main()
