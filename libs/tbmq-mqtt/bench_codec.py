"""Micro-benchmark of the hot path: PUBLISH/PUBACK encode and decode (µs per packet).

    .venv/bin/python libs/tbmq-mqtt/bench_codec.py
"""

from __future__ import annotations

import time
import timeit

from tbmq_mqtt import MqttDecoder, Properties, PubAck, Publish, Role, encode

N = 200_000


def bench(label: str, fn, n: int = N, per_call: int = 1) -> None:
    # CPU time of this process: steadier than wall time when other jobs share the cores
    best = min(timeit.repeat(fn, number=n, repeat=5, timer=time.process_time))
    print(f"{label:<56} {best / (n * per_call) * 1e6:7.3f} µs")


def main() -> None:
    payload = b"x" * 64
    for level in (4, 5):
        pub0 = Publish("sensors/device-42/temperature", payload, 0)
        pub1 = Publish("sensors/device-42/temperature", payload, 1, packet_id=1234)
        pubp = Publish(
            "sensors/device-42/temperature", payload, 1, packet_id=1234,
            properties=Properties(message_expiry_interval=60, user_properties=(("k", "v"),)),
        )
        pubr = Publish(  # a request: where to answer and which request it is
            "sensors/device-42/temperature", payload, 1, packet_id=1234,
            properties=Properties(response_topic="replies/device-42", correlation_data=b"req-0001"),
        )
        ack = PubAck(1234)
        bench(f"v{level} encode PUBLISH qos0 64B", lambda: encode(pub0, level))
        bench(f"v{level} encode PUBLISH qos1 64B", lambda: encode(pub1, level))
        bench(f"v{level} encode PUBACK", lambda: encode(ack, level))
        dec = MqttDecoder(level, role=Role.ANY)
        b0, b1, ba = encode(pub0, level), encode(pub1, level), encode(ack, level)
        bench(f"v{level} decode PUBLISH qos0 64B (1 packet/feed)", lambda: dec.feed(b0))
        bench(f"v{level} decode PUBLISH qos1 64B (1 packet/feed)", lambda: dec.feed(b1))
        bench(f"v{level} decode PUBACK", lambda: dec.feed(ba))
        batch = b1 * 100
        bench(f"v{level} decode PUBLISH qos1 64B (100 packets/feed), per pkt",
              lambda: dec.feed(batch), N // 100, 100)
        half = len(b1) // 2
        h1, h2 = b1[:half], b1[half:]
        bench(f"v{level} decode PUBLISH qos1 split in 2 feeds",
              lambda: (dec.feed(h1), dec.feed(h2)), N // 2)  # µs per packet
        if level == 5:
            bp = encode(pubp, 5)
            bench("v5 encode PUBLISH qos1 + 2 properties", lambda: encode(pubp, 5))
            bench("v5 decode PUBLISH qos1 + 2 properties", lambda: dec.feed(bp))
            br = encode(pubr, 5)
            bench("v5 decode PUBLISH qos1 + Response Topic, Correlation Data", lambda: dec.feed(br))


if __name__ == "__main__":
    main()
