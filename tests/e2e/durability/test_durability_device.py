"""Crash durability of a persistent DEVICE subscriber's messages, end to end through the real suite.

"Nothing acknowledged is ever lost: a QoS 1/2 message that got its PUBACK survives the crash (SIGKILL) of any
one service." A 3.1.1 clean_session=False QoS 1 subscriber on connector 1, a QoS 1 publisher of numbered
messages on connector 2; one service is SIGKILLed mid-stream and started again; every message whose PUBACK
the publisher received must reach the subscriber (duplicates allowed, QoS 1), first occurrences in order
(the design orders a persistent DEVICE client's messages by serial, and one topic is one tbmq.msg.all
partition). The last test holds a clean-session (live path) subscriber to the same promise.

Run: .venv/bin/pytest tests/e2e/durability -q -rA -s
"""

from __future__ import annotations

import pytest
from durability_helpers import SeqPublisher, SeqSubscriber, crash_scenario, verdict
from mqtt_clients import Client, routed, run, wait_until

# slow: ~5-17 s per test here, but each one kills and restarts a service (consumer-group rebalances) and the
# folder needs its own suite: ~3 min in all, more on a loaded machine
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


async def test_durability_device_router_killed(healed, unique):
    await crash_scenario(healed, unique, "router")


async def test_durability_device_persistence_killed(healed, unique):
    await crash_scenario(healed, unique, "device-persistence")


async def test_durability_device_session_registry_killed(healed, unique):
    # the subscriber disconnects while the registry is dead and reconnects (other connector) after its
    # restart: the session must still be there (session present) with everything it missed, i.e. the
    # registry rebuilt its state, applied the queued disconnect and did not Clear the store
    await crash_scenario(healed, unique, "session-registry", sub_offline_while_down=True)


async def test_durability_device_subscriber_connector_killed(healed, unique):
    await crash_scenario(healed, unique, "connector", 1)


async def test_durability_device_publisher_connector_killed(healed, unique):
    await crash_scenario(healed, unique, "connector", 2)


async def test_durability_device_persistence_killed_subscriber_reconnects_meanwhile(healed, unique):
    # the subscriber leaves and comes back (other connector) while device-persistence is down: the
    # registry resumes the session without it, but FetchUndelivered fails; once device-persistence is back
    # the connected subscriber must get what was stored and the new messages without reconnecting again
    await crash_scenario(healed, unique, "device-persistence", sub_offline_while_down=True,
                         sub_back_while_down=True)


async def test_durability_device_persistence_killed_subscriber_offline(healed, unique):
    # the subscriber is offline while device-persistence dies and restarts (its messages are replayed from
    # tbmq.msg.persisted into Redis with new serials); it comes back after the restart
    await crash_scenario(healed, unique, "device-persistence", sub_offline_while_down=True)


async def test_durability_device_router_killed_subscriber_offline(healed, unique):
    # the subscriber is offline while the router dies and restarts (its uncommitted messages are routed
    # again, into the store); it comes back after the restart
    await crash_scenario(healed, unique, "router", sub_offline_while_down=True)


BACKLOG = 10_000  # stored for the offline subscriber: its drain takes about a second here (paho)


@pytest.mark.parametrize("victim", ["device-persistence", "connector"])
async def test_durability_device_backlog_drain_killed_midway(healed, unique, victim):
    # a backlog stored for an offline subscriber is drained when it comes back: device-persistence streams
    # each page in parts as it reads them (FetchUndeliveredParts) while the connector delivers the parts
    # before; `victim` is SIGKILLed once the first stored messages arrived (mid-drain) and started again.
    # device-persistence: the connector's page ends where the stream broke and the rest is fetched once it is
    # back (the connection stays up); the subscriber's connector: the client reconnects to the other one.
    # Every acknowledged message must arrive, first occurrences in order.
    u = unique("dev")
    ports = healed.mqtt_ports
    sub = SeqSubscriber(f"{u}-sub", f"dur/{u}/backlog")
    await run(sub.connect, ports[0])
    probe = Client(f"probe-{u}", v5=False)
    await run(probe.connect, ports[1])
    await routed(probe, sub.client, sub.topic, 1, timeout=90)
    await run(probe.close)
    await run(sub.go_offline)
    pub = SeqPublisher(f"pub-{u}", sub.topic, ports, ports[1], window=100)
    try:
        await run(pub.start)
        pub.target = BACKLOG
        await wait_until(lambda: pub.done or pub.error is not None, 300, "the backlog published")
        assert pub.error is None, f"publisher thread failed: {pub.error!r}"
        await run(sub.reconnect, [ports[0]])
        await wait_until(lambda: sub.seqs(), 60, "the first stored message")
        rc = await healed.kill_service(victim, 1)
        assert rc == -9, f"{victim}-1 exit code {rc}"
        at_kill = len(set(sub.seqs()))
        if victim == "connector":
            await wait_until(lambda: sub.client.disconnected is not None, 30, "subscriber disconnect")
            await run(sub.reconnect, [ports[1]])
        await healed.start_service(victim, 1)
        await wait_until(lambda: pub.acked <= set(sub.seqs()), 180, "the whole backlog at the subscriber")
    finally:
        pub.stop()
        await run(sub.close)
    v = verdict(pub, sub)
    print(f"\n[{victim}-1 killed mid-drain] {v.summary()} at_kill={at_kill} reconnects={sub.reconnects}")
    assert at_kill < BACKLOG, f"the drain was over before the kill ({at_kill} of {BACKLOG})"
    assert len(pub.acked) == BACKLOG
    assert not v.missing, f"acknowledged messages lost: {v.summary()}"
    assert not v.out_of_order, f"order broken: {v.summary()}"
    assert all(sub.session_present[1:]), f"session not present on reconnect: {sub.session_present}"


# Fan-in with larger windows, QoS 2 both ways (issue 15, deliverable 6): three publishers, each with up to
# 100 messages unacknowledged, into one persistent subscriber; every acknowledged (PUBREC'd) message
# arrives, in order per publisher.
@pytest.mark.parametrize("victim,instance", [("router", 1), ("device-persistence", 1), ("connector", 1),
                                             ("connector", 2)])
async def test_durability_device_qos2_fan_in_wide_windows(healed, unique, victim, instance):
    verdicts = await crash_scenario(healed, unique, victim, instance, publishers=3, qos=2, window=100)
    if victim in ("router", "device-persistence") or (victim, instance) == ("connector", 1):
        # exactly once across its crash:
        # - the router: what it routes again (routed, not committed) is not stored again (save_messages.lua's
        #   origins: every PersistedMsg names its tbmq.msg.all record); before, 101-149 of 450 came twice;
        # - device-persistence: the records it replays (saved, not committed) are not stored again
        #   (save_messages.lua's source offsets); before, about 50 of each publisher's 450 came twice;
        # - the subscriber's connector: PUBREL goes out only once the PUBREC is stored, so a message the
        #   client completed is never owed again (tbmq_connection.machine); before, 20-37 of 450 came twice
        assert all(v.duplicates == 0 for v in verdicts), [v.summary() for v in verdicts]


# The live path (clean-session subscriber, tbmq.msg.downlink.basic), QoS 2 both ways, the router SIGKILLed
# with 3 x 100 messages in flight: what it routed but had not committed is routed again after its restart,
# and the subscriber's connection takes one copy per tbmq.msg.all record (tbmq_routing.origins.OriginMarks;
# before, the replayed copies reached the client a second time with new packet ids).
async def test_durability_live_qos2_router_killed_exactly_once(healed, unique):
    verdicts = await crash_scenario(healed, unique, "router", publishers=3, qos=2, window=100,
                                    clean_subscriber=True)
    assert all(v.duplicates == 0 for v in verdicts), [v.summary() for v in verdicts]
