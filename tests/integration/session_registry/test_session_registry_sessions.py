"""The session registry against a real Kafka, driven by fake connectors: connect, session present, clean
start, takeover, stale disconnect, expiry, client types, APPLICATION backlog, quotas."""

from __future__ import annotations


import pytest
from aiokafka import TopicPartition
from session_registry_harness import eventually
from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_platform.kafka import make_consumer, make_producer
from tbmq_routing.naming import app_client_group

pytestmark = pytest.mark.integration

DEVICE, APPLICATION = pb.CLIENT_TYPE_DEVICE, pb.CLIENT_TYPE_APPLICATION


def subs_cleared(watch, client_id):
    for r in watch.of_key(client_id):
        cs = pb.ClientSubscriptions.FromString(r.value) if r.value is not None else pb.ClientSubscriptions()
        if not cs.subscriptions:
            return True
    return False


async def test_connect_saves_session_and_answers(registry, connectors, sessions, cid):
    (c,) = await connectors(1)
    client = cid()
    resp, sid = await c.connect(client, sei=120, keep_alive=45)
    assert resp.success and not resp.session_present and resp.client_id == client
    assert resp.client_type == DEVICE and resp.session_expiry_interval == 120
    s = await eventually(lambda: sessions.get(client), what="session record")
    assert s.connected and s.service_id == c.service_id and s.session_id == sid and s.persistent
    assert s.session_expiry_interval == 120 and s.keep_alive == 45 and s.mqtt_version == 5
    assert s.connected_at_ms > 0 and s.client_type == DEVICE


async def test_session_present_and_clean_start(registry, connectors, fake_dp, watch, cid):
    (c,) = await connectors(1)
    subs = await watch(topics.CLIENT_SUBSCRIPTIONS)
    client = cid()
    resp, sid = await c.connect(client, clean_start=True, sei=300)
    assert not resp.session_present
    await c.disconnect(client, sid)
    resp, sid = await c.connect(client, clean_start=False, sei=300)
    assert resp.session_present                       # [MQTT-3.2.2-3]
    await c.disconnect(client, sid)
    n_clear = fake_dp.cleared.count(client)
    subs.records.clear()
    resp, _ = await c.connect(client, clean_start=True, sei=300)
    assert not resp.session_present                   # [MQTT-3.2.2-2]
    assert fake_dp.cleared.count(client) == n_clear + 1   # stored DEVICE messages cleared
    await eventually(lambda: subs_cleared(subs, client), what="empty subscription set")


async def test_v5_sei_zero_ends_session_at_disconnect(registry, connectors, sessions, fake_dp, watch, cid):
    (c,) = await connectors(1)
    subs = await watch(topics.CLIENT_SUBSCRIPTIONS)
    client = cid()
    resp, sid = await c.connect(client, clean_start=False, sei=0)
    assert resp.success
    await eventually(lambda: sessions.get(client), what="session")
    subs.records.clear()
    await c.disconnect(client, sid)
    await eventually(lambda: client in sessions.sessions and sessions.get(client) is None, what="removal")
    await eventually(lambda: subs_cleared(subs, client), what="subscriptions removed")
    # nothing was stored for it (a first, non-persistent session): no Clear, which the registry would have
    # made before committing the removal just seen
    assert client not in fake_dp.cleared
    resp, _ = await c.connect(client, clean_start=False, sei=0)
    assert not resp.session_present                   # TBMQ would say present; MQTT 5 says not


async def test_v5_resume_with_sei_zero_is_persistent_until_disconnect(registry, connectors, sessions, fake_dp, cid):
    """MQTT-3.1.2-4/-5/-23: clean start 0 resumes the session whatever the new interval; the answer says
    persistent (the connector fetches what was stored); the interval 0 ends the session at disconnect."""
    (c,) = await connectors(1)
    client = cid()
    resp, sid = await c.connect(client, clean_start=True, sei=600)
    assert resp.persistent and resp.session_expiry_interval == 600
    await c.disconnect(client, sid)
    await eventually(lambda: (x := sessions.get(client)) and not x.connected, what="disconnected")
    n_clear = fake_dp.cleared.count(client)
    resp, sid = await c.connect(client, clean_start=False, sei=0)
    assert resp.success and resp.session_present and resp.persistent and resp.session_expiry_interval == 0
    assert fake_dp.cleared.count(client) == n_clear     # resumed: its stored messages stay
    s = await eventually(lambda: (x := sessions.get(client)) and x.session_id == sid and x, what="resumed")
    assert s.connected and s.persistent and s.session_expiry_interval == 0   # the router keeps storing for it
    await c.disconnect(client, sid)
    await eventually(lambda: client in sessions.sessions and sessions.get(client) is None, what="removal")
    await eventually(lambda: fake_dp.cleared.count(client) > n_clear, what="Clear")
    resp, _ = await c.connect(client, clean_start=False, sei=600)
    assert not resp.session_present


async def test_mqtt311_persistent_session(registry, connectors, sessions, cid):
    (c,) = await connectors(1)
    client = cid()
    resp, sid = await c.connect(client, version=4, clean_start=False)
    assert resp.success and not resp.session_present
    await c.disconnect(client, sid)
    await eventually(lambda: sessions.get(client) and not sessions.get(client).connected, what="disconnected")
    resp, sid = await c.connect(client, version=4, clean_start=False)
    assert resp.session_present
    resp, sid = await c.connect(client, version=4, clean_start=True)   # takes over its own session
    assert not resp.session_present
    await c.disconnect(client, sid)
    await eventually(lambda: client in sessions.sessions and sessions.get(client) is None,
                     what="clean session removed at disconnect")


async def test_takeover_across_connectors(registry, connectors, sessions, cid):
    a, b = await connectors(2)
    client = cid()
    resp, sid_a = await a.connect(client, sei=300)
    assert resp.success
    resp, sid_b = await b.connect(client, sei=300, clean_start=False)
    assert resp.success and resp.session_present
    cmds = await eventually(lambda: [d for d in a.all_disconnects() if d.client_id == client], what="disconnect")
    assert len(cmds) == 1
    assert cmds[0].session_id == sid_a and cmds[0].reason == pb.DISCONNECT_REASON_SESSION_TAKEN_OVER
    assert not cmds[0].new_session_clean_start
    assert not [d for d in b.all_disconnects() if d.client_id == client]
    s = await eventually(lambda: (x := sessions.get(client)) and x.session_id == sid_b and x, what="new owner")
    assert s.service_id == b.service_id and s.connected

    # the old connection's disconnect arrives late: stale, nothing changes
    await a.disconnect(client, sid_a)
    # and a takeover on the same connector also disconnects the older connection
    resp, sid_b2 = await b.connect(client, sei=300, clean_start=True)
    assert resp.success and not resp.session_present
    cmds_b = await eventually(lambda: [d for d in b.all_disconnects() if d.client_id == client], what="same-svc")
    assert cmds_b[0].session_id == sid_b and cmds_b[0].new_session_clean_start
    s = await eventually(lambda: (x := sessions.get(client)) and x.session_id == sid_b2 and x, what="owner b2")
    assert s.connected            # the stale disconnect of sid_a did not disconnect the newest session


async def test_stale_disconnect_after_takeover(registry, connectors, sessions, cid):
    a, b = await connectors(2)
    client = cid()
    _, sid_a = await a.connect(client, sei=0)
    _, sid_b = await b.connect(client, sei=0)
    await a.disconnect(client, sid_a)               # stale: non-persistent, yet must not remove the session
    # a later request on the same partition is processed after it: use one as a barrier
    part, _ = await a.request_partition(client)
    probe = cid()
    while (await a.request_partition(probe))[0] != part:
        probe = cid()
    await a.connect(probe)
    # ... and its session record is written after any the stale disconnect caused (one partition)
    await eventually(lambda: sessions.get(probe) is not None, what="the probe's session saved")
    s = sessions.get(client)
    assert s is not None and s.connected and s.session_id == sid_b and s.service_id == b.service_id


async def test_disconnect_with_new_expiry_and_expiry_scan(registry, connectors, sessions, fake_dp, watch, cid):
    (c,) = await connectors(1)
    subs = await watch(topics.CLIENT_SUBSCRIPTIONS)
    client = cid()
    _, sid = await c.connect(client, sei=3600)
    await c.disconnect(client, sid, sei=1)           # DISCONNECT changes the interval to 1 s
    s = await eventually(lambda: (x := sessions.get(client)) and not x.connected and x, what="disconnected")
    assert s.session_expiry_interval == 1 and s.persistent
    # expired within ~1 s + the 300 ms scan: session, subscriptions, stored messages gone
    await eventually(lambda: client in sessions.sessions and sessions.get(client) is None, timeout=10,
                     what="expiry")
    await eventually(lambda: subs_cleared(subs, client), what="subscriptions cleared")
    assert client in fake_dp.cleared
    resp, _ = await c.connect(client, sei=60)
    assert not resp.session_present


async def test_reconnect_before_expiry_keeps_session(registry, connectors, sessions, cid):
    (c,) = await connectors(1)
    client = cid()
    _, sid = await c.connect(client, sei=2)
    await c.disconnect(client, sid)
    await eventually(lambda: (x := sessions.get(client)) is not None and not x.connected, what="disconnected")
    resp, sid2 = await c.connect(client, sei=2)
    assert resp.session_present
    # a marker session with the same interval, disconnected later: once the expiry scan removed it, the
    # old session's expiry time has passed too; connected, so it never expires
    marker = cid()
    _, msid = await c.connect(marker, sei=2)
    await c.disconnect(marker, msid)
    await eventually(lambda: marker in sessions.sessions and sessions.get(marker) is None, timeout=15,
                     what="the marker session expired")
    s = sessions.get(client)
    assert s is not None and s.connected and s.session_id == sid2


async def test_application_type_topic_and_expiry(registry, connectors, sessions, watch, kafka, cid):
    (c,) = await connectors(1)
    removed = await watch(topics.SYS_APP_REMOVED)
    client = cid("app")
    resp, sid = await c.connect(client, sei=1)
    assert resp.success and resp.client_type == APPLICATION
    s = await eventually(lambda: sessions.get(client), what="session")
    assert s.client_type == APPLICATION
    probe = make_consumer(kafka.bootstrap_servers, group_id=None, client_id="probe")
    await probe.start()
    try:
        await probe._client.force_metadata_update()
        assert probe.partitions_for_topic(topics.app_topic_name(client)), "APPLICATION topic created"
    finally:
        await probe.stop()
    # by username too
    resp, _ = await c.connect(cid("dev"), username="appuser")
    assert resp.client_type == APPLICATION
    resp, _ = await c.connect(cid("dev"), username="someone")
    assert resp.client_type == DEVICE
    # expiry of an APPLICATION session: the topic is to be removed
    await c.disconnect(client, sid)
    ev = await eventually(lambda: removed.of_key(client), timeout=10, what="app removed")
    e = pb.ApplicationRemovedEvent.FromString(ev[0].value)
    assert e.client_id == client and e.topic == topics.app_topic_name(client) and e.removed_at_ms > 0


async def test_type_change_clears_old_type_store(registry, connectors, fake_dp, watch, cid):
    (c,) = await connectors(1)
    removed = await watch(topics.SYS_APP_REMOVED)
    client = cid("typ")
    _, sid = await c.connect(client, sei=600, username="appuser")       # APPLICATION by username
    await c.disconnect(client, sid)
    resp, sid = await c.connect(client, sei=600, username="plain")      # now DEVICE
    assert resp.client_type == DEVICE and resp.session_present
    await eventually(lambda: removed.of_key(client), what="APPLICATION -> DEVICE: topic removed")
    await c.disconnect(client, sid)
    before = fake_dp.cleared.count(client)
    resp, _ = await c.connect(client, sei=600, username="appuser")      # DEVICE -> APPLICATION
    assert resp.client_type == APPLICATION
    assert fake_dp.cleared.count(client) == before + 1


async def test_application_clean_start_skips_backlog(registry, connectors, kafka, cid):
    (c,) = await connectors(1)
    client = cid("app")
    _, sid = await c.connect(client, sei=600)
    name = topics.app_topic_name(client)
    producer = make_producer(kafka.bootstrap_servers, client_id="backlog")
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(name, b"m%d" % i, key=b"t")
    finally:
        await producer.stop()
    await c.disconnect(client, sid)
    resp, _ = await c.connect(client, sei=600, clean_start=False)
    assert resp.session_present
    group = app_client_group(client)
    tp = TopicPartition(name, 0)
    probe = make_consumer(kafka.bootstrap_servers, group_id=group, client_id="probe")
    await probe.start()
    try:
        probe.assign([tp])
        assert await probe.committed(tp) is None          # resumed session: backlog untouched
        resp, _ = await c.connect(client, sei=600, clean_start=True)
        assert resp.success and not resp.session_present
        end = (await probe.end_offsets([tp]))[tp]
        assert end >= 5
        assert await probe.committed(tp) == end           # clean start: backlog skipped
    finally:
        await probe.stop()


async def test_device_persistence_down_fails_connect(registry, connectors, fake_dp, sessions, cid):
    (c,) = await connectors(1)
    client = cid()
    _, sid = await c.connect(client, sei=600)
    await c.disconnect(client, sid)
    fake_dp.fail = True
    try:
        resp, sid2 = await c.connect(client, sei=600, clean_start=True)
        assert not resp.success and resp.failure == pb.SESSION_FAILURE_SERVER_UNAVAILABLE
        s = sessions.get(client)
        assert s is not None and s.session_id == sid and not s.connected   # nothing changed
        resp, _ = await c.connect(client, sei=600, clean_start=False)      # resuming needs no Clear
        assert resp.success and resp.session_present
    finally:
        fake_dp.fail = False


async def test_device_persistence_down_does_not_block_non_persistent_connect(registry, connectors, fake_dp,
                                                                             sessions, cid):
    """A session that will not be a persistent DEVICE never reads the device store: its connect is answered
    while device-persistence is down (the Clear is deferred and retried); a persistent DEVICE clean start
    still waits for the Clear and is refused."""
    (c,) = await connectors(1)
    client = cid()
    _, sid = await c.connect(client, sei=600)                          # a stored persistent DEVICE session
    await c.disconnect(client, sid)
    await eventually(lambda: sessions.get(client) is not None and not sessions.get(client).connected,
                     what="session stored disconnected")
    fake_dp.fail = True
    try:
        resp, sid2 = await c.connect(client, sei=0, clean_start=True)  # non-persistent DEVICE reconnect
        assert resp.success and not resp.session_present and resp.client_type == DEVICE
        await eventually(lambda: (s := sessions.get(client)) is not None and s.session_id == sid2
                         and s.connected and not s.persistent, what="non-persistent session saved")
        resp, sid3 = await c.connect(client, sei=0)                    # takeover by another non-persistent one
        assert resp.success and not resp.session_present
        assert [d.session_id for d in c.all_disconnects() if d.client_id == client] == [sid2]
        resp, _ = await c.connect(client, sei=600, clean_start=True)   # persistent DEVICE: blocking Clear
        assert not resp.success and resp.failure == pb.SESSION_FAILURE_SERVER_UNAVAILABLE
        s = sessions.get(client)
        assert s is not None and s.session_id == sid3 and s.connected  # nothing changed
        before = fake_dp.cleared.count(client)
    finally:
        fake_dp.fail = False
    # the deferred Clear is retried in the background once device-persistence is back
    await eventually(lambda: fake_dp.cleared.count(client) > before, 15, what="deferred Clear retried")
    resp, _ = await c.connect(client, sei=600, clean_start=True)
    assert resp.success
    ids = [r.request_id for r in c.all_responses() if r.client_id == client]
    assert len(ids) == len(set(ids)) == 5                              # each of the 5 connects answered once
