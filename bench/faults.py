"""The `faults` scenario (issue 15, deliverable 5): what each fault costs, under p2p and fan-in load at once.

Load (paho-mqtt clients on threads of the bench process, 3.1.1, QoS 1): `pairs` publisher → persistent
subscriber pairs, and `fanin` publishers into one persistent subscriber on a wildcard, at `rate` msg/s in all.
Every publisher numbers its messages, keeps at most `window` unacknowledged and, when its connection dies,
connects again and re-sends every message it has no PUBACK for; every subscriber (clean session false)
connects again when its connection dies and keeps what it received.

Per fault, in turn on one running broker: the load runs `settle` s, the fault is applied, the load goes on
until deliveries resume and then `after` s more; publishing stops and the subscribers get `drain` s to
receive what is owed. Reported per fault:
  acked       messages whose PUBACK the publisher got during that fault's window
  lost        acknowledged messages that never reached their subscriber (must be 0)
  duplicates  deliveries beyond the first of a message (QoS 1 allows them)
  resume_s    from the fault until the first delivery of a message published after the fault
  stalled_s   the longest time without any delivery, from the fault until publishing stopped (a fault that
              takes a while to bite, such as a Kafka controlled shutdown, shows here rather than in resume_s)
  connect_s   from the fault until a new client's CONNECT got CONNACK 0 (ConnectProbe, from 50 ms into the fault:
              a fresh clean-session client every attempt; the load's clients reconnect with their own back-off,
              so they do not show how soon a device that connects then gets in; a session registry's restart
              shows here)
  restarts    (tbmq-py) how often the launcher's supervisor restarted the victim

tbmq-py (`Suite(supervise=True)`, as `make run`): SIGKILL of each service (the supervisor starts it again),
then a restart of Kafka, then of Redis. Mosquitto, the reference: a Mosquitto of its own with persistence on
(autosave every second, its most durable setting) is SIGKILLed and started again on the same port. amqtt:
not applicable (no persistence to restart from).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


@dataclass
class FaultProfile:
    pairs: int = 20
    fanin: int = 20
    rate: float = 400.0       # msg/s in, all publishers together
    window: int = 20
    settle: float = 5.0       # load before each fault
    after: float = 5.0        # load after deliveries resumed
    resume_max: float = 90.0  # give up waiting for deliveries to resume
    drain: float = 60.0       # after publishing stops, how long owed messages may still arrive

    @classmethod
    def quick(cls) -> "FaultProfile":
        return cls(pairs=4, fanin=4, rate=100.0, settle=2.0, after=2.0, resume_max=60.0, drain=30.0)


def _client(client_id: str, clean: bool, window: int = 20) -> mqtt.Client:
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=clean)
    c.max_inflight_messages_set(window)
    c.max_queued_messages_set(0)
    return c


class Subscriber:
    """A persistent QoS 1 subscriber that reconnects by itself; first arrival time per (publisher, seq)."""

    def __init__(self, host: str, port: int, client_id: str, topic: str) -> None:
        self.host, self.port, self.topic = host, port, topic
        self.first: dict[tuple[str, int], float] = {}
        self.deliveries = 0
        self.lock = threading.Lock()
        self.c = _client(client_id, clean=False)
        self.c.on_message = self._on_message
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe(self.topic, 1) if not rc.is_failure else None
        self.c.reconnect_delay_set(0.2, 2.0)

    def _on_message(self, client, userdata, msg) -> None:
        pub, _, seq = msg.payload.decode().partition(":")
        now = time.monotonic()
        with self.lock:
            self.deliveries += 1
            self.first.setdefault((pub, int(seq)), now)

    def start(self) -> None:
        self.c.connect(self.host, self.port, keepalive=10)
        self.c.loop_start()  # paho reconnects by itself (reconnect_delay_set)

    def stop(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


class Publisher:
    """Numbered QoS 1 messages "<id>:<seq>"; re-sends what is unacknowledged after a reconnect."""

    def __init__(self, host: str, port: int, client_id: str, topic: str, window: int) -> None:
        self.host, self.port, self.id, self.topic, self.window = host, port, client_id, topic, window
        self.next = 0
        self.sent_at: dict[int, float] = {}
        self.acked: dict[int, float] = {}   # seq -> time of its PUBACK
        self.inflight: dict[int, mqtt.MQTTMessageInfo] = {}
        self.connected = threading.Event()
        self.c = _client(self.id, clean=True, window=self.window)
        self.c.on_connect = lambda c, u, f, rc, p: self.connected.set() if not rc.is_failure else None
        self.c.on_disconnect = lambda c, u, f, rc, p: self.connected.clear()
        self.c.on_publish = self._on_publish
        self.c.reconnect_delay_set(0.2, 2.0)
        self._pubacked: set[int] = set()  # mids whose PUBACK arrived (paho's network thread adds them)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        self._pubacked.add(mid)

    def start(self) -> None:
        self.c.connect(self.host, self.port, keepalive=10)
        self.c.loop_start()

    def poll(self) -> None:
        """Collect PUBACKs. (After a reconnect paho itself re-sends every QoS 1 message it has no PUBACK for,
        with DUP set.) A message published while the connection was dropping has an error code in its
        MessageInfo for good (is_published raises), although paho queued it, sent it after the reconnect and
        got its PUBACK: its PUBACK is seen through on_publish instead."""
        now = time.monotonic()
        for seq, info in list(self.inflight.items()):
            try:
                done = info.is_published()
            except RuntimeError:
                done = info.mid in self._pubacked
            if done:
                self._pubacked.discard(info.mid)
                self.acked[seq] = now
                del self.inflight[seq]

    def publish(self) -> bool:
        if len(self.inflight) >= self.window or not self.connected.is_set():
            return False
        seq = self.next
        self.next += 1
        self.sent_at[seq] = time.monotonic()
        self.inflight[seq] = self.c.publish(self.topic, f"{self.id}:{seq}".encode(), qos=1)
        return True

    def stop(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


class ConnectProbe:
    """From `start()`, new clean-session clients CONNECT one after the other (each waits up to `attempt_s` for
    its CONNACK; a refused connection is tried again 50 ms later) until one gets CONNACK 0: `connected_at`."""

    def __init__(self, host: str, port: int, tag: str, limit_s: float, attempt_s: float = 10.0) -> None:
        self.host, self.port, self.tag, self.limit_s, self.attempt_s = host, port, tag, limit_s, attempt_s
        self.connected_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="fault-connect-probe", daemon=True)

    def start(self) -> "ConnectProbe":
        self._thread.start()
        return self

    def _attempt(self, n: int) -> bool:
        ok = threading.Event()
        answered = threading.Event()

        def on_connect(c, u, f, rc, p) -> None:
            if not rc.is_failure:
                ok.set()
            answered.set()

        c = _client(f"fault-{self.tag}-probe-{n}", clean=True)
        c.on_connect = on_connect
        try:
            c.connect(self.host, self.port, keepalive=10)
        except OSError:
            return False
        c.loop_start()
        try:
            answered.wait(self.attempt_s)
            return ok.is_set()
        finally:
            c.disconnect()
            c.loop_stop()

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        n = 0
        while time.monotonic() < deadline:
            n += 1
            if self._attempt(n):
                self.connected_at = time.monotonic()
                return
            time.sleep(0.05)  # the probe's pace between attempts (a refused connection answers at once)

    def join(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        return self.connected_at


@dataclass
class Load:
    host: str
    port: int
    prof: FaultProfile
    tag: str
    pubs: list[Publisher] = field(default_factory=list)
    subs: dict[str, Subscriber] = field(default_factory=dict)   # publisher id -> its subscriber
    _stop: threading.Event = field(default_factory=threading.Event)
    _publishing: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        p, t = self.prof, self.tag
        fan = Subscriber(self.host, self.port, f"fault-{t}-fanin-sub", f"fault/{t}/fanin/+")
        fan.start()
        for i in range(p.pairs):
            s = Subscriber(self.host, self.port, f"fault-{t}-sub-{i}", f"fault/{t}/p2p/{i}")
            s.start()
            pub = Publisher(self.host, self.port, f"fault-{t}-pub-{i}", f"fault/{t}/p2p/{i}", p.window)
            self.pubs.append(pub)
            self.subs[pub.id] = s
        for i in range(p.fanin):
            pub = Publisher(self.host, self.port, f"fault-{t}-fan-{i}", f"fault/{t}/fanin/{i}", p.window)
            self.pubs.append(pub)
            self.subs[pub.id] = fan
        time.sleep(1.0)  # let the subscriptions land (the load is not measured before the first fault)
        for pub in self.pubs:
            pub.start()
        self._thread = threading.Thread(target=self._run, name="fault-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = 1.0 / self.prof.rate
        k = 0
        next_t = time.monotonic()
        while not self._stop.is_set():
            for p in self.pubs:
                p.poll()
            now = time.monotonic()
            if self._publishing.is_set():
                while next_t <= now:
                    self.pubs[k % len(self.pubs)].publish()  # a full window or a lost connection skips a turn
                    k += 1
                    next_t += interval
            else:
                next_t = now
            time.sleep(0.002)  # the load's tick

    def publishing(self, on: bool) -> None:
        (self._publishing.set if on else self._publishing.clear)()

    def snapshot(self) -> dict[str, tuple[int, set[int]]]:
        return {p.id: (p.next, set(p.acked)) for p in self.pubs}

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        for p in self.pubs:
            p.stop()
        for s in {id(s): s for s in self.subs.values()}.values():
            s.stop()

    # -- per-fault accounting -------------------------------------------------------------------------
    def resumed_after(self, t: float) -> float | None:
        """First arrival (after t) of a message published after t."""
        best = None
        for p in self.pubs:
            sub = self.subs[p.id]
            with sub.lock:
                firsts = [(seq, at) for (pid, seq), at in sub.first.items() if pid == p.id and at > t]
            for seq, at in firsts:
                if p.sent_at.get(seq, 0) > t and (best is None or at < best):
                    best = at
        return best

    def verdict(self, before: dict[str, tuple[int, set[int]]]) -> dict:
        acked = lost = 0
        missing: list[str] = []
        for p in self.pubs:
            _, old = before.get(p.id, (0, set()))
            new = set(p.acked) - old
            sub = self.subs[p.id]
            with sub.lock:
                got = {seq for (pid, seq) in sub.first if pid == p.id}
            miss = new - got
            acked += len(new)
            lost += len(miss)
            missing += [f"{p.id}:{s}" for s in sorted(miss)[:3]]
        return {"acked": acked, "lost": lost, "lost_examples": missing[:10]}

    def all_acked_arrived(self) -> bool:
        for p in self.pubs:
            sub = self.subs[p.id]
            with sub.lock:
                got = {seq for (pid, seq) in sub.first if pid == p.id}
            if not set(p.acked) <= got:
                return False
        return True

    def owed_settled(self) -> bool:
        return all(not p.inflight for p in self.pubs) and self.all_acked_arrived()

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest time in [t0, t1] without a first delivery at any subscriber."""
        times = [t0, t1]
        for sub in {id(s): s for s in self.subs.values()}.values():
            with sub.lock:
                times += [at for at in sub.first.values() if t0 < at < t1]
        times.sort()
        return max(b - a for a, b in zip(times, times[1:]))

    def deliveries(self) -> int:
        return sum(s.deliveries for s in {id(s): s for s in self.subs.values()}.values())

    def distinct(self) -> int:
        return sum(len(s.first) for s in {id(s): s for s in self.subs.values()}.values())


def _wait(pred, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)  # the bench's own bounded poll (not a test)
    return bool(pred())


def run_faults(broker, prof: FaultProfile, log=print) -> dict:
    """The scenario against a started broker of the bench (bench.brokers)."""
    name = getattr(broker, "name", "?")
    if name == "tbmq":
        faults = _tbmq_faults(broker)
        host, port = broker.host, broker.port
        ref = None
    elif name == "mosquitto":
        from .brokers import Mosquitto

        ref = Mosquitto(broker.workdir.parent / "faults", durable=True)
        ref.start()
        host, port = ref.host, ref.port
        faults = [("kill -9 mosquitto (persistence on)", lambda: _kill_restart_mosquitto(ref))]
    else:
        return {"skipped": f"{name}: not applicable (no persistence to restart from)"}
    tag = f"{name}-{os.getpid()}-{int(time.time()) % 100000}"
    load = Load(host, port, prof, tag)
    rows = []
    try:
        load.start()
        load.publishing(True)
        for label, apply in faults:
            time.sleep(prof.settle)  # steady load before the fault
            load.publishing(True)
            before = load.snapshot()
            deliveries0, distinct0 = load.deliveries(), load.distinct()
            t_fault = time.monotonic()
            log(f"    fault: {label}")
            probe = ConnectProbe(host, port, tag, prof.resume_max)
            # its first CONNECT 50 ms into the fault: a kill has landed by then (a Kafka restart is still
            # stopping the broker, whose CONNECTs are still answered)
            threading.Timer(0.05, probe.start).start()
            extra = apply() or {}
            resumed = None
            if _wait(lambda: load.resumed_after(t_fault) is not None, prof.resume_max):
                resumed = load.resumed_after(t_fault) - t_fault
            time.sleep(prof.after)  # load goes on after the recovery
            load.publishing(False)
            stalled = load.longest_gap(t_fault, time.monotonic())
            connected = probe.join(prof.resume_max)
            settled = _wait(load.owed_settled, prof.drain)
            v = load.verdict(before)
            dups = (load.deliveries() - deliveries0) - (load.distinct() - distinct0)
            row = {"fault": label, **v, "duplicates": dups,
                   "resume_s": None if resumed is None else round(resumed, 2), "stalled_s": round(stalled, 2),
                   "connect_s": None if connected is None else round(connected - t_fault, 2),
                   "settled": settled, **extra}
            rows.append(row)
            log(f"      acked {row['acked']}, lost {row['lost']}, duplicates {dups}, deliveries resumed after "
                f"{'never' if resumed is None else f'{resumed:.2f}s'} (longest stall {stalled:.2f}s), a new "
                f"CONNECT accepted after {'never' if connected is None else f'{connected - t_fault:.2f}s'}"
                + (f", restarts {extra['restarts']}" if "restarts" in extra else "")
                + ("" if settled else ", NOT SETTLED (owed messages still missing)"))
    finally:
        load.stop()
        if ref is not None:
            ref.stop()
    return {"params": prof.__dict__, "faults": rows,
            "lost_total": sum(r["lost"] for r in rows), "acked_total": sum(r["acked"] for r in rows)}


def _kill_restart_mosquitto(ref) -> dict:
    port = ref.port
    os.kill(ref.proc.pid, signal.SIGKILL)
    ref.proc.wait()
    ref.start(port=port)
    return {}


def _tbmq_faults(broker) -> list:
    suite = broker.suite

    def kill(service: str):
        def apply() -> dict:
            p = suite.instance(service, 1)
            sid, before, old = p.service_id, suite.restarts(p.service_id), p.pid
            os.kill(old, signal.SIGKILL)
            back = _wait(lambda: suite.restarts(sid) > before and p.running and p.pid != old, 180, 0.1)
            return {"restarts": suite.restarts(sid) - before, "restarted": back}
        return apply

    faults = [(f"kill -9 {s}", kill(s)) for s in ("session-registry", "device-persistence", "app-delivery",
                                                   "router", "connector") if (s, 1) in suite.procs]
    faults.append(("restart Kafka", lambda: broker._run(suite.restart_kafka(), timeout=180) or {}))
    faults.append(("restart Redis", lambda: broker._run(suite.restart_redis(), timeout=60) or {}))
    return faults
