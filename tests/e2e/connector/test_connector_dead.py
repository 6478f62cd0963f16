"""Dead connectors end to end (docs/session-registry.md, "Dead connectors"): two connectors + router +
session-registry + device-persistence (+ Redis), paho-mqtt 3.1.1 and 5.0 clients. Connector 2 is SIGKILLed
with a persistent, a non-persistent and two Will clients (one with a Will Delay) on it: the registry, told
nothing, declares it dead after TBMQ_CONNECTOR_TIMEOUT_MS (short here), ends the sessions, publishes the
Wills (the delayed one after its delay) and, later, deletes its topics; the persistent client resumes its
session on connector 1 with the messages queued meanwhile. A graceful stop publishes no Will of a client
that sent DISCONNECT (a marker behind the registry's scan closes that check). A connector paused (SIGSTOP)
until it is declared dead comes back fenced: its connection is closed (v5 0x98) without a Will of its own,
and it stops itself (exit code 1)."""

from __future__ import annotations

import os
import signal

import pytest
from connector_helpers import needs_device_persistence, two_connector_suite
from kafka_views import SessionTable
from mqtt_clients import BOUND, Client, payloads, routed, run, wait_until, watcher_and_prober
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from tbmq_launcher.services import readyz

pytestmark = [pytest.mark.e2e, needs_device_persistence]

TIMEOUT_MS = 1500


@pytest.fixture(scope="module")
async def dc(kafka, tmp_path_factory):
    # short timeouts (docs/testing.md: shorten the setting, wait for the effect)
    env = {"session-registry": {"TBMQ_CONNECTOR_TIMEOUT_MS": str(TIMEOUT_MS),
                                # long enough for a paused run to read its DisconnectCommand after SIGCONT
                                "TBMQ_CONNECTOR_TOPICS_RETENTION_MS": "5000",
                                "TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS": "300"},
           "connector": {"CONNECTOR_HEARTBEAT_INTERVAL_MS": "300"}}
    async with two_connector_suite(kafka, tmp_path_factory.mktemp("suite-dead"),
                                   ["session-registry", "device-persistence", "router", "connector"],
                                   service_env=env) as s:
        yield s


@pytest.fixture(scope="module")
async def table(kafka):
    async with SessionTable(kafka.bootstrap_servers) as t:
        yield t


async def registry_stat(suite, name: str) -> int:
    return (await readyz(suite.health_port("session-registry"))).get(name, 0)


def will_delay(seconds: int) -> Properties:
    p = Properties(PacketTypes.WILLMESSAGE)
    p.WillDelayInterval = seconds
    return p


async def new_run_watched(dc, u: str) -> tuple[Client, Client, int, int]:
    """A new run of connector 2 (the previous test stopped or killed it: tests of this module run in order),
    and a watcher of `<u>/#` with its
    prober on connector 1: (watcher, prober, port of connector 1, port of connector 2)."""
    await dc.start_service("connector", 2)
    one, two = dc.mqtt_ports
    watcher, prober = await watcher_and_prober(u, [one, one])
    return watcher, prober, one, two


async def connected_with_will(table, client: Client, client_id: str, port: int, topic: str, payload: bytes) -> None:
    """`client` connected with a Will (QoS 1) and recorded connected by the registry."""
    await run(client.connect, port, will=(topic, payload, 1, False))
    await wait_until(lambda: table.get(client_id) is not None and table.get(client_id).connected, BOUND,
                     f"the session of {client_id} recorded connected")


async def will_client_to_take_over(dc, table, u: str, on: int):
    """new_run_watched, and a 3.1.1 client `<u>T` with the Will `<u>/will/t` = b"t-gone" on connector `on` (1
    or 2): (watcher, prober, port of connector 1, port of connector 2, the client)."""
    watcher, prober, one, two = await new_run_watched(dc, u)
    first = Client(u + "T", v5=False, clean=True)
    await connected_with_will(table, first, u + "T", (one, two)[on - 1], f"{u}/will/t", b"t-gone")
    return watcher, prober, one, two, first


async def wills_after_marker(prober: Client, watcher: Client, topic: str) -> list[bytes]:
    """What `watcher` got on `topic` up to a marker `prober` publishes there now: anything produced on that
    topic before (same key, same partition of tbmq.msg.all) arrived before the marker."""
    await run(prober.publish, topic, b"marker", 1)
    assert await run(watcher.wait, lambda: b"marker" in payloads(watcher, topic))
    return payloads(watcher, topic)


async def test_sigkilled_connector_sessions_end_and_wills_are_published(dc, table, unique):
    u = unique("dead")
    live, doomed = dc.mqtt_ports
    watcher, prober = await watcher_and_prober(u, [live, live])    # both on the connector that stays

    persistent = Client(u + "P", clean=False, session_expiry=300)             # v5, outlives its connection
    await run(persistent.connect, doomed)
    await run(persistent.subscribe, f"{u}/q", 1)
    await routed(prober, persistent, f"{u}/q", 1)
    plain = Client(u + "N", v5=False, clean=True)                              # 3.1.1, ends with it
    await run(plain.connect, doomed, will=(f"{u}/will/n", b"n-gone", 1, False))
    await run(plain.subscribe, f"{u}/n", 1)
    delayed = Client(u + "D", clean=True, session_expiry=60)                   # v5, Will Delay 2 s
    await run(delayed.connect, doomed, will=(f"{u}/will/d", b"d-gone", 1, False, will_delay(2)))
    clients = (persistent, plain, delayed)
    await wait_until(lambda: all(table.get(c.c._client_id.decode()) is not None
                                 and table.get(c.c._client_id.decode()).connected for c in clients),
                     BOUND, "the three sessions recorded connected")
    assert table.get(u + "D").HasField("will") and table.get(u + "D").will_delay == 2

    assert await dc.kill_service("connector", 2) is not None
    for c in clients:
        c.stop_loop()            # no reconnect attempts to the dead port

    # declared dead after the timeout: sessions end as on a lost connection
    await wait_until(lambda: table.removed(u + "N"), BOUND, "the non-persistent session removed")
    await wait_until(lambda: table.offline(u + "P") and table.offline(u + "D"), BOUND,
                     "the persistent sessions disconnected")
    p = table.get(u + "P")
    assert p is not None and p.persistent and p.session_expiry_interval == 300 and p.disconnected_at_ms > 0
    # the Wills reach a subscriber on the other connector; the delayed one after its delay [MQTT-3.1.3-9]
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/will/n") == [b"n-gone"])
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/will/d") == [b"d-gone"])
    await wait_until(lambda: not table.get(u + "D").HasField("will"), BOUND, "the delayed Will dropped once sent")

    # queued while offline, delivered when the persistent client resumes on connector 1
    await run(prober.publish, f"{u}/q", b"queued-1", 1)
    again = Client(u + "P", clean=False, session_expiry=300)
    flags, _, _ = await run(again.connect, live)
    assert flags.session_present
    assert await run(again.wait, lambda: b"queued-1" in payloads(again, f"{u}/q"))

    # the dead connector's topics go once it has stayed dead TBMQ_CONNECTOR_TOPICS_RETENTION_MS
    await wait_until(lambda: registry_stat(dc, "connector_topics_deleted"), BOUND, "the dead connector's topics deleted")
    for c in (again, watcher, prober):
        await run(c.close)


async def test_graceful_stop_sends_no_will_after_disconnect(dc, table, unique):
    u = unique("stop")
    watcher, prober, live, stopping = await new_run_watched(dc, u)   # the killed connector's topics made again

    polite = Client(u + "G", clean=True, session_expiry=60)
    await connected_with_will(table, polite, u + "G", stopping, f"{u}/will/g", b"g-must-not")
    n = table.updates.get(u + "G", 0)
    await run(polite.close, wait=True)          # DISCONNECT 0x00: no Will [MQTT-3.1.2-10]
    await wait_until(lambda: table.updates.get(u + "G", 0) > n and table.offline(u + "G"), BOUND,
                     "the registry to record the DISCONNECT")

    declared = await registry_stat(dc, "connectors_declared_dead")
    assert await dc.stop_service("connector", 2) == 0
    # the stopped heartbeat declares it at once; then a whole scan round must pass after that
    await wait_until(lambda: _above(dc, "connectors_declared_dead", declared), BOUND, "the stopped run declared")
    scans = await registry_stat(dc, "session_scans")
    await wait_until(lambda: _above(dc, "session_scans", scans), BOUND, "a session scan after it")
    # marker: a CONNECT behind any request that scan wrote (one request partition in the tests), then a
    # PUBLISH on the Will's topic behind any Will that request would have published (same key, same partition)
    marker = Client(u + "m")
    await run(marker.connect, live)
    assert await wills_after_marker(marker, watcher, f"{u}/will/g") == [b"marker"]
    for c in (marker, watcher, prober):
        await run(c.close)


async def _above(suite, name: str, value: int) -> bool:
    return await registry_stat(suite, name) > value


async def test_paused_connector_comes_back_fenced(dc, table, unique):
    u = unique("zombie")
    watcher, prober, live, paused = await new_run_watched(dc, u)
    z = Client(u + "Z")
    await connected_with_will(table, z, u + "Z", paused, f"{u}/will/z", b"z-gone")

    pid = dc.instance("connector", 2).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_until(lambda: table.offline(u + "Z"), BOUND, "the paused run declared dead, its session ended")
        assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/will/z") == [b"z-gone"])   # the registry's
    finally:
        os.kill(pid, signal.SIGCONT)
    # back: the registry's DisconnectCommand closes the connection (0x98) and the fenced run stops itself
    assert await run(z.wait, lambda: z.disconnected is not None)
    z.stop_loop()
    assert int(z.disconnected.value) == 0x98
    proc = dc.instance("connector", 2)
    await wait_until(lambda: not proc.running, BOUND, "the fenced connector run to stop itself")
    assert await dc.stop_service("connector", 2) == 1
    # no Will of its own: a marker behind anything it produced (it flushed before exiting; same topic, same
    # partition of tbmq.msg.all)
    assert await wills_after_marker(prober, watcher, f"{u}/will/z") == [b"z-gone", b"marker"]
    for c in (watcher, prober):
        await run(c.close)


async def test_will_of_a_client_that_reconnected_before_the_dead_connector_was_declared(dc, table, unique):
    u = unique("fast")
    watcher, prober, live, _, first = await will_client_to_take_over(dc, table, u, on=2)
    await dc.kill_service("connector", 2)
    first.stop_loop()
    again = Client(u + "T", v5=False, clean=True)        # back at once, before the timeout: a takeover
    await run(again.connect, live)
    # the dead connector never sends it; the registry does once the connector is declared dead [MQTT-3.1.4-3]
    assert await run(watcher.wait, lambda: payloads(watcher, f"{u}/will/t") == [b"t-gone"])
    await wait_until(lambda: not table.get(u + "T").HasField("taken_over_will"), BOUND, "the taken over Will settled")
    assert table.get(u + "T").connected
    for c in (again, watcher, prober):
        await run(c.close)


async def test_takeover_on_a_live_connector_sends_the_will_once(dc, table, unique):
    u = unique("live")
    watcher, prober, _, two, first = await will_client_to_take_over(dc, table, u, on=1)
    second = Client(u + "T", v5=False, clean=True)
    await run(second.connect, two)                      # connector 1 is alive: it sends the Will itself
    assert await run(first.wait, lambda: first.disconnected is not None)
    first.stop_loop()
    # the registry drops its copy once a heartbeat of connector 1 is read after the takeover
    await wait_until(lambda: table.get(u + "T").connected and not table.get(u + "T").HasField("taken_over_will"),
                     BOUND, "the taken over Will settled")
    # marker behind a second copy (it would be in the transaction that settled it; same topic, same partition)
    assert await wills_after_marker(prober, watcher, f"{u}/will/t") == [b"t-gone", b"marker"]
    await dc.stop_service("connector", 2)
    for c in (second, watcher, prober):
        await run(c.close)
