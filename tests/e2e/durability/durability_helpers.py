"""Helpers of the durability (crash) tests: a numbered QoS 1 publisher that survives its connector's death,
a persistent subscriber that can move to another connector, a module-scoped suite that is healed between
tests, and the final check "every acknowledged sequence number arrived".

The paho wrapper (`Client`), the bounded subscription probe (`routed`) and the bounded waits are the shared
ones of tests/e2e/mqtt_clients.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

from mqtt_clients import Client, real, routed, run, wait_until
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

__all__ = ["SeqPublisher", "SeqSubscriber", "heal", "Verdict", "verdict", "crash_scenario", "running_suite",
           "START_TIMEOUT"]

START_TIMEOUT = 180.0  # per service: the machine is shared and slow


@contextlib.asynccontextmanager
async def running_suite(kafka, tmp_path_factory, name: str, services: list[str], **options):
    """A started Suite on free ports sharing the session's Kafka (2 connectors unless `options` say
    otherwise), stopped at the end."""
    options.setdefault("connectors", 2)
    s = Suite(services=services, ports="free", log_format="json", id_tag=new_tag(),
              run_dir=tmp_path_factory.mktemp(name), start_timeout=START_TIMEOUT, stop_timeout=15,
              kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers, **options)
    await s.start()
    print(f"\n{name} ready in {s.start_seconds:.1f}s, run dir {s.run_dir}")
    try:
        yield s
    finally:
        await s.stop()


async def heal(suite) -> None:
    """Start every instance that is not running (a test that failed half-way leaves its victim dead)."""
    for p in list(suite.procs.values()):
        if not p.running:
            await suite.start_service(p.name, p.instance)


def connect_with_retry(make, ports: list[int], deadline_s: float = 90.0) -> tuple[Client, int, object]:
    """Connect a fresh `make()` client to the first port that accepts it (CONNACK success), cycling through
    `ports` until `deadline_s`; returns (client, port, connack flags)."""
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        for port in ports:
            c = make()
            try:
                flags, rc, _ = c.connect(port, expect_ok=False)
                if c.connack is not None and not rc.is_failure:
                    return c, port, flags
                last = f"port {port}: CONNACK {rc}"
            except (OSError, AssertionError) as e:
                last = f"port {port}: {e!r}"
            c.close()
            time.sleep(0.5)  # back-off between connection attempts (not synchronisation)
    raise AssertionError(f"could not connect within {deadline_s}s: {last}")


class SeqPublisher:
    """Publishes "<tag>0", "<tag>1", ... on `topic` at `qos` (1 or 2) from its own thread, at most `window`
    unacknowledged (QoS 2: acknowledged once PUBCOMP arrived, i.e. after its PUBREC).
    Only messages whose PUBACK arrived are in `acked`. When the connection dies, it reconnects (a new clean
    client, the other connector first) and re-sends every unacknowledged message in sequence order.
    `target` is how far to publish; the test raises it phase by phase."""

    def __init__(self, client_id: str, topic: str, ports: list[int], port: int, window: int = 10, *,
                 qos: int = 1, tag: str = "") -> None:
        self.client_id, self.topic, self.ports, self.window = client_id, topic, ports, window
        self.qos, self.tag = qos, tag
        self.port = port
        self.target = 0
        self.next = 0
        self.acked: set[int] = set()
        self.inflight: dict[int, object] = {}  # seq -> paho MessageInfo
        self.reconnects = 0
        self.resent = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name=f"pub-{client_id}")
        self.client: Client | None = None

    def start(self) -> "SeqPublisher":
        self.client = Client(self.client_id, v5=False, clean=True, max_inflight=self.window)
        self.client.connect(self.port)
        self._thread.start()
        return self

    def _reconnect(self) -> None:
        self.client.close()
        others = [p for p in self.ports if p != self.port] + [self.port]
        self.client, self.port, _ = connect_with_retry(
            lambda: Client(self.client_id, v5=False, clean=True, max_inflight=self.window), others)
        self.reconnects += 1
        for seq in sorted(self.inflight):  # unacknowledged: send again, in order
            self.inflight[seq] = self.client.c.publish(self.topic, self.payload(seq), qos=self.qos)
            self.resent += 1

    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                for seq, info in list(self.inflight.items()):
                    try:
                        published = info.is_published()
                    except RuntimeError:  # published while the connection was dropping: re-sent on reconnect
                        published = False
                    if published:
                        self.acked.add(seq)
                        del self.inflight[seq]
                if self.client.disconnected is not None:
                    self._reconnect()
                elif len(self.inflight) < self.window and self.next < self.target:
                    self.inflight[self.next] = self.client.c.publish(self.topic, self.payload(self.next),
                                                                     qos=self.qos)
                    self.next += 1
                else:
                    time.sleep(0.002)  # idle poll of the acks
        except BaseException as e:  # reported by the test
            self.error = e

    def payload(self, seq: int) -> bytes:
        return f"{self.tag}{seq}".encode()

    @property
    def done(self) -> bool:
        """Everything up to `target` published and acknowledged."""
        return self.next >= self.target and not self.inflight

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.client is not None:
            self.client.close()


class SeqSubscriber:
    """A persistent DEVICE/APPLICATION subscriber (3.1.1, clean_session=False, QoS `qos`) that can reconnect
    (same client id, session kept) to another connector; collects the sequence numbers in arrival order.
    `clean`: a clean-session (live path) subscriber instead, which must stay connected."""

    def __init__(self, client_id: str, topic: str, qos: int = 1, *, clean: bool = False) -> None:
        self.client_id, self.topic, self.qos, self.clean = client_id, topic, qos, clean
        self.client: Client | None = None
        self.port: int | None = None
        self._old: list = []  # messages of earlier connections
        self._previous: Client | None = None  # the last closed connection: its QoS 2 state is taken over
        self._carrying = 0
        self.carried = 0  # QoS 2 messages awaiting PUBREL taken over from closed connections
        self.reconnects = 0
        self.session_present: list[bool] = []

    def _make(self) -> Client:
        """A new connection of the same session: like a real client keeping its session state, it takes over
        the QoS 2 messages of the previous connection that got PUBREC but not yet PUBREL."""
        c = Client(self.client_id, v5=False, clean=self.clean)
        self._carrying = c.resume_session(self._previous) if self._previous is not None else 0
        return c

    def _retire(self) -> None:
        self.client.close()  # its network thread stopped: nothing more arrives on it
        self._old.extend(self.client.messages)
        self._previous = self.client

    def connect(self, port: int) -> None:
        self.client = self._make()
        flags, _, _ = self.client.connect(port)
        self.port = port
        self.session_present.append(bool(flags.session_present))
        self.client.subscribe(self.topic, self.qos)

    def reconnect(self, ports: list[int]) -> None:
        """Close (the old paho loop must not reconnect and take the session over) and connect elsewhere."""
        if self.client is not None:
            self._retire()
        self.client, self.port, flags = connect_with_retry(self._make, ports)
        self.carried += self._carrying
        self.session_present.append(bool(flags.session_present))
        self.reconnects += 1

    def go_offline(self) -> None:
        """DISCONNECT (graceful: the session stays, messages are stored meanwhile)."""
        self._retire()
        self.client = None

    def all_messages(self) -> list:
        return self._old + (list(self.client.messages) if self.client else [])

    def seqs(self, tag: str = "") -> list[int]:
        """The sequence numbers of one publisher (its `tag`; "" = the only one), in arrival order."""
        t = tag.encode()
        return [int(m.payload[len(t):]) for m in real(self.all_messages())
                if m.payload.startswith(t) and (tag or m.payload.isdigit())]

    def dup_flags(self, tag: str = "") -> int:
        return sum(1 for m in real(self.all_messages()) if m.dup and m.payload.startswith(tag.encode()))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


@dataclass
class Verdict:
    acked: int
    published: int
    received: int
    distinct: int
    duplicates: int
    dup_flagged: int
    missing: list[int] = field(default_factory=list)
    out_of_order: list[tuple[int, int]] = field(default_factory=list)  # (seq, after max) first occurrences

    def summary(self) -> str:
        return (f"acked={self.acked} published={self.published} received={self.received} "
                f"distinct={self.distinct} duplicates={self.duplicates} dup_flag={self.dup_flagged} "
                f"missing={len(self.missing)} {self.missing[:20]} "
                f"out_of_order={len(self.out_of_order)} {self.out_of_order[:10]}")


def verdict(pub: SeqPublisher, sub: SeqSubscriber) -> Verdict:
    """Of one publisher's messages at the subscriber (in order per publisher)."""
    seqs = sub.seqs(pub.tag)
    got = set(seqs)
    ooo, top = [], -1
    seen: set[int] = set()
    for s in seqs:  # order: the FIRST occurrence of each number must come after every earlier first one
        if s in seen:
            continue
        seen.add(s)
        if s < top:
            ooo.append((s, top))
        top = max(top, s)
    return Verdict(acked=len(pub.acked), published=pub.next, received=len(seqs), distinct=len(got),
                   duplicates=len(seqs) - len(got), dup_flagged=sub.dup_flags(pub.tag),
                   missing=sorted(pub.acked - got), out_of_order=ooo)


# ------------------------------------------------------------------------------------------ the scenario
PHASE = 150  # messages per phase: before the kill, while the victim is down, after its restart


async def crash_scenario(suite, unique, victim: str, instance: int = 1, *, client_prefix: str = "dev",
                         sub_offline_while_down: bool = False, sub_back_while_down: bool = False,
                         pairs: int = 1, fault=None, publishers: int = 1, qos: int = 1,
                         window: int = 10, clean_subscriber: bool = False) -> list[Verdict]:
    """Subscriber (persistent, QoS 1) on connector 1, publisher on connector 2; publish PHASE messages,
    SIGKILL `victim` once 2/3 of them are acknowledged (the rest are in flight or still to be sent), publish
    PHASE more while it is down, start it again, publish PHASE more; then every acknowledged number must
    reach the subscriber (duplicates allowed), first occurrences in order. `pairs` such publisher/subscriber
    pairs (each its own topic) run at once.

    Killing the subscriber's connector (connector 1) makes the subscriber reconnect to connector 2 with the
    same client id and clean_session=False; killing the publisher's (connector 2) makes the publisher
    reconnect to connector 1 and re-send what was not acknowledged. `sub_offline_while_down`: the
    subscriber disconnects right after the kill (its DISCONNECTION_REQUEST waits in Kafka for a registry)
    and comes back, on the other connector, after the restart (or, `sub_back_while_down`, while the victim
    is still down): session present, nothing missed, no further reconnect needed.

    `publishers` publishers per subscriber (fan-in: order is checked per publisher), each with up to `window`
    messages unacknowledged, publishing and subscribing at `qos` (2: QoS 2 both ways).

    `clean_subscriber`: the subscribers are clean-session clients (the live path,
    tbmq.msg.downlink.basic) that stay connected on connector 1 throughout.

    `fault`: instead of the kill and the test's own restart, `await fault()` (e.g. a SIGKILL that the suite's
    supervisor must heal by itself, or a Kafka/Redis restart) at the same point; the third phase then runs
    once it returned."""
    u = unique(client_prefix)
    ports = suite.mqtt_ports
    subs: list[SeqSubscriber] = []
    pubs: list[SeqPublisher] = []
    for i in range(pairs):
        topic = f"dur/{u}/{i}"
        sub = SeqSubscriber(f"{u}-sub{i}" if pairs > 1 else f"{u}-sub", topic, qos, clean=clean_subscriber)
        await run(sub.connect, ports[0])
        subs.append(sub)
        probe = Client(f"probe-{u}-{i}", v5=False)  # publisher/probe ids never match the APPLICATION pattern
        await run(probe.connect, ports[1])
        await routed(probe, sub.client, topic, 1, timeout=90)
        await run(probe.close)
    links: list[tuple[SeqPublisher, SeqSubscriber]] = []  # every publisher with its subscriber
    for i, sub in enumerate(subs):
        for j in range(publishers):
            name = f"pub-{u}-{i}" if pairs > 1 else f"pub-{u}"
            pub = SeqPublisher(f"{name}-{j}" if publishers > 1 else name, sub.topic, ports, ports[1], window,
                               qos=qos, tag=f"{j}:" if publishers > 1 else "")
            await run(pub.start)
            pubs.append(pub)
            links.append((pub, sub))

    def all_done() -> bool:
        return all(p.done for p in pubs) or any(p.error for p in pubs)

    t0 = time.monotonic()
    phases = {}
    try:
        for pub in pubs:
            pub.target = PHASE
        await wait_until(lambda: all(len(p.acked) >= 2 * PHASE // 3 for p in pubs) or any(p.error for p in pubs),
                         120, "first acks")
        if fault is None:
            rc = await suite.kill_service(victim, instance)
            assert rc == -9, f"{victim}-{instance} exit code {rc}"
        phases["killed_at_acked"] = [len(p.acked) for p in pubs]
        if victim == "connector" and instance == 1:  # the subscribers' connector
            for sub in subs:
                await wait_until(lambda: sub.client.disconnected is not None, 30, "subscriber disconnect")
                await run(sub.reconnect, [ports[1]])
        if sub_offline_while_down:
            for sub in subs:
                await run(sub.go_offline)
                if sub_back_while_down:
                    await run(sub.reconnect, [ports[1]])
        for pub in pubs:
            pub.target = 2 * PHASE
        t_start = time.monotonic()
        if fault is None:
            await wait_until(all_done, 120, "acks while the victim is down")
            phases["down_acked"] = [len(p.acked) for p in pubs]
            await suite.start_service(victim, instance)
        else:
            await fault()
        phases["restart_s"] = round(time.monotonic() - t_start, 1)
        if sub_offline_while_down and not sub_back_while_down:
            for sub in subs:
                await run(sub.reconnect, [ports[1]])
        for pub in pubs:
            pub.target = 3 * PHASE
        await wait_until(all_done, 120, "acks after the restart")
        for pub in pubs:
            assert pub.error is None, f"publisher thread failed: {pub.error!r}"
        await wait_until(lambda: all(p.acked <= set(s.seqs(p.tag)) for p, s in links), 120,
                         "every acknowledged message at the subscriber")
    finally:
        verdicts = []
        for pub in pubs:
            pub.stop()
        for sub in subs:
            await run(sub.close)
        for pub, sub in links:
            v = verdict(pub, sub)
            verdicts.append(v)
            print(f"\n[{victim}-{instance}] {sub.client_id} <- {pub.client_id}: {v.summary()} phases={phases} "
                  f"pub_reconnects={pub.reconnects} resent={pub.resent} sub_reconnects={sub.reconnects} "
                  f"session_present={sub.session_present} qos2_carried={sub.carried} stream_s={time.monotonic() - t0:.1f}")
    for v, (pub, sub) in zip(verdicts, links):
        assert not v.missing, f"{sub.client_id}: acknowledged messages lost: {v.summary()}"
        assert not v.out_of_order, f"{sub.client_id}: order broken: {v.summary()}"
        assert all(sub.session_present[1:]), f"session not present on reconnect: {sub.session_present}"
    return verdicts
