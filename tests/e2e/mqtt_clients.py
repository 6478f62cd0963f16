"""MQTT client helpers shared by every end-to-end test (tests/e2e/*): one paho-mqtt wrapper, bounded waits and
the `routed()` subscription probe.

Importable as `mqtt_clients` from any module under tests/e2e (tests/e2e/conftest.py puts this folder on
sys.path). Every wait here is bounded; blocking paho calls belong in a thread (`await run(...)`): the launcher
pumps the services' output on the test's event loop, which must never block.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from waits import poll, wait_until  # the one bounded wait (tests/waits.py), re-exported

__all__ = ["BOUND", "PROBE", "Client", "run", "poll", "wait_until", "routed", "watcher_and_prober", "real",
           "payloads", "fast_publish", "mosquitto_drain"]

BOUND = 20.0  # default bound (seconds) of every wait below
PROBE = b"probe-"  # payload prefix of routed()'s probe messages


def run(fn, *args, **kw):
    """`fn(*args, **kw)` in a thread (blocking paho calls off the event loop)."""
    return asyncio.to_thread(fn, *args, **kw)


class Client:
    """A paho-mqtt client (callback API 2) on its own network thread. What its callbacks receive is kept under
    one Condition `cond`: `messages` (every PUBLISH, in arrival order), `connack` (flags, reason code,
    properties), `suback` and `unsuback` (mid, reason codes), `pubacks` (mid -> the reason code of its PUBACK /
    PUBREC / PUBCOMP), `disconnected` (the reason code of the last disconnect) and `disconnect_properties` (its v5
    properties).

    v5: MQTT 5.0 (clean -> Clean Start, session_expiry -> Session Expiry Interval) or 3.1.1 (clean ->
    clean_session; session_expiry unused). max_inflight: paho's outgoing QoS>0 window (None: paho's 20).
    timeout: the default bound of this client's waits (connect, subscribe, publish, wait).
    websocket: MQTT over WebSocket (paho's transport="websockets", path `ws_path`). tls: paho's `tls_set`
    arguments (ca_certs=..., certfile=..., keyfile=...): MQTT over TLS, or WSS with `websocket`.
    auth: (username, password) sent in CONNECT."""

    def __init__(self, client_id: str, *, v5: bool = True, clean: bool = True, session_expiry: int | None = None,
                 max_inflight: int | None = None, timeout: float = BOUND, websocket: bool = False,
                 ws_path: str = "/mqtt", tls: dict | None = None, auth: tuple[str, str | None] | None = None) -> None:
        self.client_id = client_id
        self.v5, self.clean, self.session_expiry, self.timeout = v5, clean, session_expiry, timeout
        kw = {} if v5 else {"clean_session": clean}
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
                             transport="websockets" if websocket else "tcp", **kw)
        if websocket:
            self.c.ws_set_options(path=ws_path)
        if tls is not None:
            self.c.tls_set(**tls)
        if max_inflight is not None:
            self.c.max_inflight_messages_set(max_inflight)
        if auth is not None:
            self.c.username_pw_set(*auth)
        self.cond = threading.Condition()
        self.messages: list[mqtt.MQTTMessage] = []
        self.connack = None
        self.suback = None
        self.unsuback = None
        self.pubacks: dict[int, object] = {}
        self.disconnected = None
        self.disconnect_properties = None
        self.disconnects: list = []  # every disconnect's reason code, in order (paho reconnects by itself)
        self.c.on_message = self._on_message
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = self._on_subscribe
        self.c.on_unsubscribe = self._on_unsubscribe
        self.c.on_publish = self._on_publish
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

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties):
        with self.cond:
            self.unsuback = (mid, reason_codes)
            self.cond.notify_all()

    def _on_publish(self, client, userdata, mid, reason_code, properties):
        with self.cond:
            self.pubacks[mid] = reason_code
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.disconnected = reason_code
            self.disconnect_properties = properties
            self.disconnects.append(reason_code)
            self.cond.notify_all()

    def wait(self, pred: Callable[[], bool], timeout: float | None = None) -> bool:
        """Whether `pred()` (evaluated under `cond`, after every callback) holds within the bound."""
        with self.cond:
            return self.cond.wait_for(pred, self.timeout if timeout is None else timeout)

    def connect(self, port: int, *, keepalive: int = 60, will=None, expect_ok: bool = True,
                timeout: float | None = None, bind_address: str = "", **props):
        """CONNECT to 127.0.0.1:`port` (from `bind_address`, e.g. another loopback address) and wait for the
        CONNACK (or a disconnect); `props`: further v5 CONNECT properties (ReceiveMaximum=7). will: (topic,
        payload, qos, retain[, properties]). Returns `connack`."""
        if will is not None:
            self.c.will_set(*will[:4], properties=will[4] if len(will) > 4 else None)
        kw = {}
        if self.v5:
            p = Properties(PacketTypes.CONNECT)
            if self.session_expiry is not None:
                p.SessionExpiryInterval = self.session_expiry
            for k, v in props.items():
                setattr(p, k, v)
            kw = {"clean_start": self.clean, "properties": p}
        with self.cond:
            self.connack = self.disconnected = None
        self.c.connect("127.0.0.1", port, keepalive=keepalive, bind_address=bind_address, **kw)
        self.c.loop_start()
        assert self.wait(lambda: self.connack is not None or self.disconnected is not None, timeout), "no CONNACK"
        if expect_ok:
            assert self.connack is not None and not self.connack[1].is_failure, f"CONNACK {self.connack}"
        return self.connack

    def subscribe(self, *args, timeout: float | None = None, **kw):
        """paho's subscribe(topic, qos, options, properties), then wait for its SUBACK: the reason codes."""
        self.suback = None
        _, mid = self.c.subscribe(*args, **kw)
        assert self.wait(lambda: self.suback is not None and self.suback[0] == mid, timeout), "no SUBACK"
        return self.suback[1]

    def flush(self, timeout: float | None = None) -> None:
        """One round trip: an UNSUBSCRIBE of a filter this client never subscribed, and its UNSUBACK. paho
        sends the PUBACKs of the messages it received in its NEXT network turn, after `on_message`, so a test
        that saw a message may run before the server read its PUBACK; once the UNSUBACK is here, the server
        read every packet queued before it (paho writes them in order)."""
        self.unsubscribe(f"tbmq-test-flush/{self.client_id}", timeout=timeout)

    def unsubscribe(self, topic: str, timeout: float | None = None):
        """UNSUBSCRIBE, then wait for its UNSUBACK: the reason codes (v5; 3.1.1: an empty list)."""
        self.unsuback = None
        _, mid = self.c.unsubscribe(topic)
        assert self.wait(lambda: self.unsuback is not None and self.unsuback[0] == mid, timeout), "no UNSUBACK"
        return self.unsuback[1]

    def publish(self, topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False, properties=None,
                wait: bool = True, timeout: float | None = None, check: bool = True) -> mqtt.MQTTMessageInfo:
        """PUBLISH; with `wait` and QoS > 0, wait (bounded) for its PUBACK/PUBCOMP, asserted unless not `check`."""
        info = self.c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if wait and qos:
            info.wait_for_publish(self.timeout if timeout is None else timeout)
            if check:
                assert info.is_published()
        return info

    def messages_on(self, topic: str) -> list[mqtt.MQTTMessage]:
        with self.cond:
            return [m for m in self.messages if m.topic == topic]

    def snapshot(self) -> list[mqtt.MQTTMessage]:
        with self.cond:
            return list(self.messages)

    def awaiting_pubrel(self) -> dict:
        """The QoS 2 messages this client received and answered with PUBREC whose PUBREL has not arrived:
        part of the client's session state (MQTT 3.1.1 section 4.1, MQTT 5.0 section 4.1). paho delivers a
        QoS 2 message at its PUBREL and keeps these only in its Client object: a PUBREL for an id it does not
        know is answered with PUBCOMP and the message is lost for the application (paho's own comment, #284)."""
        with self.c._in_message_mutex:
            return {mid: m for mid, m in self.c._in_messages.items() if m.qos == 2}

    def resume_session(self, old: "Client") -> int:
        """Before connect(): take over `old`'s QoS 2 messages awaiting PUBREL, as a client that keeps its
        session state does; the PUBREL the server re-sends on the resumed session then delivers them here.
        Returns how many were taken over."""
        carried = old.awaiting_pubrel()
        with self.c._in_message_mutex:
            self.c._in_messages.update(carried)
        return len(carried)

    def close(self, session_expiry: int | None = None, *, wait: bool = False) -> None:
        """DISCONNECT (v5: with this Session Expiry Interval if given) and stop the network thread; `wait`: for
        the disconnect to complete first (bounded, not asserted)."""
        p = None
        if session_expiry is not None:
            p = Properties(PacketTypes.DISCONNECT)
            p.SessionExpiryInterval = session_expiry
        try:
            self.c.disconnect(properties=p)
        except Exception:
            pass
        if wait:
            self.wait(lambda: self.disconnected is not None)
        self.stop_loop()

    def stop_loop(self) -> None:
        """paho's loop_stop() without its race: it reads `_thread` twice (None? then join it), and the network
        thread sets it to None when it ends, which it does by itself after a DISCONNECT or a lost connection;
        in between, loop_stop raised AttributeError ('NoneType' object has no attribute 'join'), seen in CI on a
        busy host. The thread is read once here; paho-mqtt 2.2's attributes (requirements.lock)."""
        thread = self.c._thread
        if thread is None:
            return
        self.c._thread_terminate = True
        if thread is not threading.current_thread():
            thread.join()


def connack_code(port: int, client_id: str, v5: bool = True, auth=None, *, bind_address: str = "",
                 start: threading.Barrier | None = None) -> int:
    """The reason code of a CONNECT's CONNACK as paho reports it (0: accepted; paho maps 3.1.1's return codes
    onto the v5 reasons: 3 → 0x88, 4 → 0x86, 5 → 0x87; -1: no CONNACK), the client closed after it. With
    `start`, the CONNECT is sent once every thread waiting on that barrier is ready (CONNECTs at once)."""
    c = Client(client_id, v5=v5, auth=auth)
    if start is not None:
        start.wait(BOUND)
    got = c.connect(port, expect_ok=False, bind_address=bind_address)
    c.close()
    return got[1].value if got is not None else -1


def real(messages: Iterable[mqtt.MQTTMessage]) -> list[mqtt.MQTTMessage]:
    """The messages that are not routed()'s probes."""
    return [m for m in messages if not m.payload.startswith(PROBE)]


def has_real(messages: list[mqtt.MQTTMessage], n: int) -> bool:
    """At least `n` messages that are not probes. For `Client.wait` predicates, which run after every
    message: the list is filtered only once it is long enough (filtering it every time is quadratic and
    made the test client, not the broker, the bottleneck of a 50,000-message drain)."""
    return len(messages) >= n and len(real(messages)) >= n


def payloads(c: Client, topic: str) -> list[bytes]:
    """Payloads `c` received on `topic`, probes left out."""
    return [m.payload for m in real(c.messages_on(topic))]


async def routed(pub: Client, sub: Client, topic: str, qos: int = 0, timeout: float = BOUND, *,
                 probe_wait: float = 0.5, puback_timeout: float | None = None, puback_required: bool = True) -> None:
    """Publish probes ("probe-<i>") on `topic` from `pub` until `sub` receives one: the router knows the
    subscription (it learns subscriptions asynchronously, so tests wait with this, never a bare sleep).
    Each probe waits `probe_wait` s for its arrival, and (QoS > 0) up to `puback_timeout` (default: pub's
    bound) for its PUBACK, which fails the test when missing unless not `puback_required`."""
    deadline = time.monotonic() + timeout
    i = 0
    while time.monotonic() < deadline:
        payload = PROBE + str(i).encode()
        await run(pub.publish, topic, payload, qos, timeout=puback_timeout, check=puback_required)
        if await run(sub.wait, lambda: any(m.payload == payload for m in sub.messages_on(topic)), probe_wait):
            return
        i += 1
    raise AssertionError(f"subscription to {topic} not routed within {timeout}s")


async def watcher_and_prober(prefix: str, ports: list[int], qos: int = 1) -> tuple[Client, Client]:
    """v5 clients `<prefix>w`, subscribed to `<prefix>/#` at `qos` on ports[1], and `<prefix>p` on ports[0],
    the subscription routed (probes at `qos` on `<prefix>/probe`): (watcher, prober)."""
    watcher = Client(prefix + "w")
    await run(watcher.connect, ports[1])
    await run(watcher.subscribe, f"{prefix}/#", qos)
    prober = Client(prefix + "p")
    await run(prober.connect, ports[0])
    await routed(prober, watcher, f"{prefix}/probe", qos)
    return watcher, prober


async def fast_publish(port: int, topic: str, seqs: Iterable[int], client_id: str, *, window: int = 1000,
                       timeout: float = 180.0) -> None:
    """QoS 1 PUBLISHes (payload = decimal sequence number) from a raw asyncio MQTT 3.1.1 client with up to
    `window` unacknowledged (paho is too slow for 100,000): returns once every PUBACK came, raises when one
    did not within `timeout` seconds in all."""
    from tbmq_mqtt import Connect, MqttDecoder, PubAck, Publish, Role, encode

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    decoder = MqttDecoder(4, role=Role.CLIENT)
    room = asyncio.Semaphore(window)
    done = asyncio.Event()
    total = 0
    sent_all = False

    async def read() -> None:
        nonlocal total
        while data := await reader.read(65536):
            for pkt in decoder.feed(data):
                if isinstance(pkt, PubAck):
                    total += 1
                    room.release()
                    if sent_all and total == count:
                        done.set()
        done.set()

    async def go() -> None:
        nonlocal count, sent_all
        writer.write(encode(Connect(protocol_level=4, client_id=client_id, clean_start=True, keep_alive=60), 4))
        reading = asyncio.ensure_future(read())
        pid = 0
        for s in seqs:
            await room.acquire()
            pid = pid % 65535 + 1
            writer.write(encode(Publish(topic=topic, payload=b"%d" % s, qos=1, packet_id=pid), 4))
            count += 1
            if count % 256 == 0:
                await writer.drain()
        await writer.drain()
        sent_all = True
        if total == count:
            done.set()
        await done.wait()
        reading.cancel()

    count = 0
    try:
        await asyncio.wait_for(go(), timeout)
    finally:
        writer.close()
    assert total == count, f"{total} of {count} PUBLISHes acknowledged"


async def mosquitto_drain(port: int, client_id: str, topic: str, count: int, *, v5: bool = True,
                          session_expiry: int = 3600, timeout: float = 240.0) -> list[tuple[str, bytes]]:
    """Resumes persistent session `client_id` with mosquitto_sub (libmosquitto, C: paho's one-packet-per-turn
    reads take ~200 µs a message, 20 s for a 100,000 backlog), subscribed to `topic` at QoS 1, and returns
    (topic, payload) of the first `count` messages it received, in order (payloads without a newline). It
    exits after them (-C), having acknowledged each (libmosquitto sends a QoS 1 PUBACK before on_message);
    fails when it exits with an error or does not get them within `timeout` s (-W)."""
    args = ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-i", client_id, "-c", "-q", "1",
            "-t", topic, "-C", str(count), "-W", str(int(timeout)), "-F", "%t|%p"]
    args += ["-V", "mqttv5", "-x", str(session_expiry)] if v5 else ["-V", "mqttv311"]
    proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout + 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    got = [(t.decode(), p) for t, _, p in (line.partition(b"|") for line in out.splitlines())]
    assert proc.returncode == 0, f"mosquitto_sub exited {proc.returncode} after {len(got)} of {count}: {err!r}"
    return got
