"""Helpers of app-delivery's end-to-end tests: a paho-mqtt client on its own network thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

BOUND = 30.0


class Mqtt:
    def __init__(self, client_id: str, *, clean: bool = True, session_expiry: int | None = None,
                 max_inflight: int = 100) -> None:
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.c.max_inflight_messages_set(max_inflight)
        self.c.max_queued_messages_set(0)
        self.clean = clean
        self.session_expiry = session_expiry
        self.messages: list[mqtt.MQTTMessage] = []
        self.cond = threading.Condition()
        self.connack = None
        self.suback = None
        self.disconnected = None
        self.c.on_message = self._on_message
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = self._on_subscribe
        self.c.on_disconnect = self._on_disconnect

    def _on_message(self, client, userdata, msg):
        with self.cond:
            self.messages.append(msg)
            self.cond.notify_all()

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.connack = (flags, reason_code, properties)
            self.cond.notify_all()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties):
        with self.cond:
            self.suback = (mid, reason_codes)
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.disconnected = reason_code
            self.cond.notify_all()

    def wait(self, pred: Callable[[], bool], timeout: float = BOUND) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def connect(self, port: int, keepalive: int = 60):
        p = PahoProperties(PacketTypes.CONNECT)
        if self.session_expiry is not None:
            p.SessionExpiryInterval = self.session_expiry
        self.connack = None
        self.disconnected = None
        self.c.connect("127.0.0.1", port, keepalive=keepalive, clean_start=self.clean, properties=p)
        self.c.loop_start()
        assert self.wait(lambda: self.connack is not None), "no CONNACK"
        assert not self.connack[1].is_failure, f"CONNACK {self.connack}"
        return self.connack

    def subscribe(self, topic_filter: str, qos: int = 1):
        self.suback = None
        _, mid = self.c.subscribe(topic_filter, qos)
        assert self.wait(lambda: self.suback is not None and self.suback[0] == mid), "no SUBACK"
        return self.suback[1]

    def publish(self, topic: str, payload: bytes, qos: int = 1):
        return self.c.publish(topic, payload, qos=qos)

    def count(self) -> int:
        with self.cond:
            return len(self.messages)

    def snapshot(self) -> list[mqtt.MQTTMessage]:
        with self.cond:
            return list(self.messages)

    def disconnect(self):
        try:
            self.c.disconnect()
        finally:
            self.c.loop_stop()


def run(fn, *args, **kw):
    return asyncio.to_thread(fn, *args, **kw)


async def routed(pub: Mqtt, sub: Mqtt, topic: str, qos: int = 1, timeout: float = 60.0) -> None:
    """Publish probes until `sub` receives one: the router knows the subscription."""
    deadline = time.monotonic() + timeout
    i = 0
    while time.monotonic() < deadline:
        payload = f"probe-{i}".encode()
        info = pub.publish(topic, payload, qos)
        await run(info.wait_for_publish, 10)
        if await run(sub.wait, lambda: any(m.payload == payload for m in sub.messages), 1.0):
            return
        i += 1
    raise AssertionError(f"subscription to {topic} not routed within {timeout}s")


def real(messages) -> list:
    return [m for m in messages if not m.payload.startswith(b"probe-")]
