"""Dead connectors: session_registry.liveness (which runs are dead, clock injected) and the registry's
decisions for their sessions and Wills (logic: CONNECTOR_GONE, WILL_DUE, fencing), without Kafka."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb

from session_registry import logic
from session_registry.liveness import Liveness
from session_registry.logic import APPLICATION, DEVICE, Rules

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000
RULES = Rules(session_expiry_max=604800)
TIMEOUT = 10_000


def hb(svc="conn-1", inc="run-a", stopped=False):
    return pb.ConnectorHeartbeat(service_id=svc, incarnation=inc, stopped=stopped)


def will(topic="wills/c1", payload=b"gone", retain=False):
    return pb.PublishMsg(publisher_id="c1", topic=topic, payload=payload, qos=1, retain=retain, created_at_ms=1)


def connected(cid="c1", *, sid="s1", sei=3600, v=5, w=None, delay=0, ctype=DEVICE, inc="run-a"):
    s = pb.SessionInfo(client_id=cid, service_id="conn-1", session_id=sid, connected=True, persistent=sei > 0,
                       session_expiry_interval=sei, mqtt_version=v, client_type=ctype, connected_at_ms=NOW - 5000,
                       last_request_id="old", connector_incarnation=inc)
    if w is not None:
        s.will.CopyFrom(w)
        s.will_delay = delay
    return s


def gone(s, rid="g1"):
    return logic.scan_request(pb.SESSION_EVENT_CONNECTOR_GONE_REQUEST, s, rid, NOW)


# -- liveness ----------------------------------------------------------------------------------------

def test_silent_connector_is_declared_dead_after_the_timeout_only():
    lv = Liveness(TIMEOUT)
    assert lv.observe(hb(), NOW) == []
    assert lv.sweep(NOW + TIMEOUT) == []                     # exactly the timeout: still alive
    lv.observe(hb(), NOW + 5000)                            # a heartbeat restarts the count
    assert lv.sweep(NOW + TIMEOUT + 1) == []
    assert lv.sweep(NOW + 5000 + TIMEOUT + 1) == [("conn-1", "run-a")]
    assert lv.sweep(NOW + 10 * TIMEOUT) == []                # declared once
    assert lv.gone("conn-1", "run-a", NOW) and lv.fenced("conn-1", "run-a")


def test_an_outage_of_the_heartbeat_channel_is_not_silence():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    lv.observe(hb("conn-2", "run-b"), NOW)
    step = lv.gap_ms // 2
    t = NOW
    while t + step <= NOW + TIMEOUT // 2:                    # the caller's checks while heartbeats flow
        t += step
        assert lv.needs_confirmation(t)
        lv.confirm(t)
        lv.observe(hb(), t)                                  # conn-1 keeps beating, conn-2 went quiet
    # Kafka restarts: nothing is confirmed for longer than a timeout, nobody's heartbeat got through
    back = t + TIMEOUT + 5000
    assert lv.silent(back) == ["conn-1", "conn-2"]            # as it looks before the channel is checked
    lv.confirm(back)                                          # the registry reads the topic again
    assert lv.silent(back) == [] and lv.sweep(back + TIMEOUT) == []
    lv.observe(hb(), back + step)                             # conn-1's heartbeat gets through again
    t = back + step
    while t < back + TIMEOUT + 1:                             # confirmed without gaps from now on
        t += step
        lv.confirm(t)
    assert lv.sweep(t) == [("conn-2", "run-b")]               # silent a whole timeout since the outage
    assert lv.gone("conn-2", "run-b", t) and not lv.gone("conn-1", "run-a", t)


def test_silence_counts_while_the_channel_is_confirmed_without_heartbeats():
    lv = Liveness(TIMEOUT)
    assert not lv.needs_confirmation(NOW)                     # nobody to judge: no checks
    lv.observe(hb(), NOW)
    assert not lv.needs_confirmation(NOW + lv.gap_ms // 2 - 1)
    t = NOW
    while t <= NOW + TIMEOUT:
        t += lv.gap_ms // 2
        assert lv.needs_confirmation(t)
        lv.confirm(t)
    assert lv.sweep(t) == [("conn-1", "run-a")]
    assert not lv.needs_confirmation(t + 10 * TIMEOUT)       # nobody alive left to judge


def test_stopped_heartbeat_declares_dead_at_once():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    assert lv.observe(hb(stopped=True), NOW + 1) == [("conn-1", "run-a")]
    assert lv.gone("conn-1", "run-a", NOW + 1)


def test_a_declared_dead_run_stays_dead_when_its_heartbeats_come_back():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    lv.sweep(NOW + TIMEOUT + 1)
    assert lv.observe(hb(), NOW + TIMEOUT + 2) == []        # a paused process: fenced, not revived
    assert lv.fenced("conn-1", "run-a") and lv.gone("conn-1", "run-a", NOW + TIMEOUT + 2)


def test_a_new_run_replaces_the_old_one_at_once():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(inc="run-a"), NOW)
    assert lv.observe(hb(inc="run-b"), NOW + 1) == [("conn-1", "run-a")]
    assert lv.gone("conn-1", "run-a", NOW + 1)
    assert not lv.gone("conn-1", "run-b", NOW + 1) and not lv.fenced("conn-1", "run-b")


def test_unknown_service_is_never_judged_and_unknown_runs_wait_a_timeout():
    lv = Liveness(TIMEOUT)
    assert not lv.gone("conn-9", "x", NOW) and not lv.fenced("conn-9", "x")
    lv.observe(hb(inc="run-b"), NOW)
    # a run with no heartbeat read (an earlier one compacted away, or a newer one not read yet)
    assert not lv.gone("conn-1", "run-z", NOW + TIMEOUT)
    assert not lv.fenced("conn-1", "run-z")                 # its CONNECTs are never refused on a guess
    assert lv.gone("conn-1", "run-z", NOW + TIMEOUT + 1)


def test_dead_services_after_the_topic_retention_and_forget():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    lv.observe(hb(svc="conn-2", inc="x"), NOW)
    lv.observe(hb(stopped=True), NOW + 1)
    assert lv.dead_services(NOW + 1000, 1000) == []
    assert lv.dead_services(NOW + 1001, 1000) == ["conn-1"]
    lv.forget("conn-1")
    assert lv.dead_services(NOW + 10**9, 1000) == []
    assert lv.fenced("conn-1", "run-a")                     # still refused


# -- CONNECTOR_GONE ----------------------------------------------------------------------------------

def test_gone_persistent_session_is_disconnected_and_starts_its_expiry():
    s = connected(sei=3600)
    out = logic.decide(s, gone(s), RULES, NOW)
    assert out.kind == "connector-gone" and out.write_session
    assert not out.session.connected and out.session.disconnected_at_ms == NOW
    assert out.session.persistent and out.session.session_expiry_interval == 3600
    assert out.clear_subscriptions is None and out.publish is None and out.response is None
    assert not logic.is_expired(out.session, NOW + 3599_999) and logic.is_expired(out.session, NOW + 3600_000)


@pytest.mark.parametrize("ctype", [DEVICE, APPLICATION])
def test_gone_non_persistent_session_is_removed_with_its_subscriptions(ctype):
    s = connected(sei=0, ctype=ctype)
    out = logic.decide(s, gone(s), RULES, NOW)
    assert out.kind == "connector-gone-removed" and out.write_session and out.session is None
    assert out.clear_subscriptions == pb.ClientSubscriptions(client_id="c1", client_type=ctype)
    assert out.device_clear == ""   # a non-persistent session that owes no Clear stored nothing
    assert out.reset_app_offsets == ("c1" if ctype == APPLICATION else "")
    s.clear_at_end = True           # its CONNECT had found an earlier DEVICE session
    assert logic.decide(s, gone(s), RULES, NOW).device_clear == ("c1" if ctype == DEVICE else "")


@pytest.mark.parametrize("sei", [0, 3600])
def test_gone_closes_the_connection_should_the_run_still_be_alive(sei):
    s = connected(sei=sei, w=will())
    out = logic.decide(s, gone(s), RULES, NOW)
    cmd = pb.DisconnectCommand(client_id="c1", session_id="s1", reason=pb.DISCONNECT_REASON_CONNECTOR_FENCED,
                               connector_incarnation="run-a")
    assert out.disconnect == ("conn-1", cmd)                 # closed there without a Will of its own
    if out.fallback is not None:
        assert out.fallback.disconnect == out.disconnect


def test_gone_is_stale_for_a_client_that_reconnected_or_ended():
    s = connected(sid="s1")
    req = gone(s)
    newer = connected(sid="s2")
    assert logic.decide(newer, req, RULES, NOW).kind == "stale"
    ended = connected(sid="s1")
    ended.connected = False
    assert logic.decide(ended, req, RULES, NOW).kind == "stale"
    assert logic.decide(None, req, RULES, NOW).kind == "stale"


@pytest.mark.parametrize("v,sei,delay", [(4, 3600, 0), (5, 3600, 0), (5, 0, 30)])
def test_gone_publishes_an_undelayed_will_in_the_transaction(v, sei, delay):
    # 3.1.1 has no delay; v5 delay 0; a delay longer than a session that ends now [MQTT-3.1.2-8]
    s = connected(v=v, sei=sei, w=will(), delay=delay)
    out = logic.decide(s, gone(s), RULES, NOW)
    assert out.publish is not None and out.publish.topic == "wills/c1" and out.publish.payload == b"gone"
    assert out.publish.created_at_ms == NOW                  # its Message Expiry counts from publication
    if out.session is not None:
        assert not out.session.HasField("will")              # published once: not kept
    if out.fallback is not None:
        assert out.fallback.publish == out.publish and not out.fallback.session.HasField("will")


def test_gone_keeps_a_delayed_will_until_it_is_due_then_publishes_it_once():
    s = connected(sei=3600, w=will(), delay=30)
    out = logic.decide(s, gone(s), RULES, NOW)
    assert out.publish is None and out.session.HasField("will")
    rec = out.session
    assert logic.will_due_at_ms(rec) == NOW + 30_000
    assert not logic.will_due(rec, NOW + 29_999)
    req = logic.scan_request(pb.SESSION_EVENT_WILL_DUE_REQUEST, rec, "w1", NOW + 29_999)
    assert logic.decide(rec, req, RULES, NOW + 29_999).kind == "ignored"
    due = logic.decide(rec, req, RULES, NOW + 30_000)
    assert due.kind == "will-sent" and due.publish.topic == "wills/c1"
    assert not due.session.HasField("will") and not logic.will_due(due.session, NOW + 10**9)
    assert logic.decide(due.session, req, RULES, NOW + 30_001).kind in ("duplicate", "ignored")


def test_delayed_will_capped_by_the_session_expiry():
    s = connected(sei=10, w=will(), delay=30)
    rec = logic.decide(s, gone(s), RULES, NOW).session
    assert logic.will_due_at_ms(rec) == NOW + 10_000         # the session ends first [MQTT-3.1.2-8]


def test_resumed_session_cancels_the_pending_will():
    s = connected(sei=3600, w=will(), delay=30)
    rec = logic.decide(s, gone(s), RULES, NOW).session
    req = pb.SessionEventRequest(request_id="r2", type=pb.SESSION_EVENT_CONNECTION_REQUEST, request_time_ms=NOW,
                                 session=pb.SessionInfo(client_id="c1", service_id="conn-2", session_id="s2",
                                                        clean_start=False, mqtt_version=5,
                                                        session_expiry_interval=3600))
    out = logic.decide(rec, req, RULES, NOW + 5000)
    assert out.response.session_present and out.publish is None   # [MQTT-3.1.3-9]
    assert not out.session.HasField("will")


def test_clean_start_connect_publishes_the_pending_will():
    s = connected(sei=3600, w=will(), delay=30)
    rec = logic.decide(s, gone(s), RULES, NOW).session
    req = pb.SessionEventRequest(request_id="r2", type=pb.SESSION_EVENT_CONNECTION_REQUEST, request_time_ms=NOW,
                                 session=pb.SessionInfo(client_id="c1", service_id="conn-2", session_id="s2",
                                                        clean_start=True, mqtt_version=5))
    out = logic.decide(rec, req, RULES, NOW + 5000)
    assert not out.response.session_present and out.publish.topic == "wills/c1"


def test_session_expiry_publishes_the_pending_will():
    s = connected(sei=3600, w=will(), delay=0xFFFFFFFF)   # a delay longer than the session
    rec = logic.decide(s, gone(s), RULES, NOW).session
    assert logic.will_due_at_ms(rec) == NOW + 3600_000
    later = NOW + 3600_000
    assert logic.needs_cleanup(rec, later)
    out = logic.decide(rec, logic.clear_request(rec, "x1", later), RULES, later)
    assert out.kind == "cleared" and out.publish.topic == "wills/c1"


# -- the stored Will follows the connection ------------------------------------------------------------

def test_connect_stores_the_will_and_a_disconnect_drops_it():
    req = pb.SessionEventRequest(request_id="r1", type=pb.SESSION_EVENT_CONNECTION_REQUEST, request_time_ms=NOW,
                                 session=pb.SessionInfo(client_id="c1", service_id="conn-1", session_id="s1",
                                                        mqtt_version=5, session_expiry_interval=60,
                                                        connector_incarnation="run-a", will=will(), will_delay=5))
    out = logic.decide(None, req, RULES, NOW)
    assert out.session.will == will() and out.session.will_delay == 5
    assert out.session.connector_incarnation == "run-a"
    d = pb.SessionEventRequest(request_id="d1", type=pb.SESSION_EVENT_DISCONNECTION_REQUEST,
                               session=pb.SessionInfo(client_id="c1", session_id="s1"))
    after = logic.decide(out.session, d, RULES, NOW + 1)
    assert after.kind == "disconnected" and not after.session.HasField("will") and after.publish is None


def test_fenced_connect_is_refused_and_disconnects_still_apply():
    req = pb.SessionEventRequest(request_id="r1", type=pb.SESSION_EVENT_CONNECTION_REQUEST, request_time_ms=NOW,
                                 session=pb.SessionInfo(client_id="c1", service_id="conn-1", session_id="s1",
                                                        mqtt_version=5))
    out = logic.decide(None, req, RULES, NOW, fenced=True)
    assert out.kind == "fenced" and not out.write_session
    assert not out.response.success and out.response.failure == pb.SESSION_FAILURE_CONNECTOR_FENCED
    assert out.response_service_id == "conn-1"
    s = connected(sid="s1", w=will())
    d = pb.SessionEventRequest(request_id="d1", type=pb.SESSION_EVENT_DISCONNECTION_REQUEST,
                               session=pb.SessionInfo(client_id="c1", session_id="s1"), graceful=True)
    after = logic.decide(s, d, RULES, NOW, fenced=True)
    assert after.kind == "disconnected" and after.publish is None   # a stopped connector's last report


def test_silent_lists_without_declaring():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    assert lv.silent(NOW + TIMEOUT + 1) == ["conn-1"]
    assert not lv.gone("conn-1", "run-a", NOW + TIMEOUT + 1)     # not declared until swept
    lv.observe(hb(), NOW + TIMEOUT + 2)                           # a late-read heartbeat: alive after all
    assert lv.sweep(NOW + TIMEOUT + 3) == []


# -- a takeover before the old connector is declared dead ----------------------------------------------

def reconnect(*, clean: bool, sid="s2", svc="conn-2"):
    return pb.SessionEventRequest(request_id="r2", type=pb.SESSION_EVENT_CONNECTION_REQUEST, request_time_ms=NOW,
                                  session=pb.SessionInfo(client_id="c1", service_id=svc, session_id=sid,
                                                         clean_start=clean, mqtt_version=5,
                                                         session_expiry_interval=3600))


@pytest.mark.parametrize("v,delay,clean,kept", [
    (4, 0, False, True),     # 3.1.1: the Will goes at the takeover [MQTT-3.1.4-3]
    (5, 0, False, True),
    (5, 30, True, True),     # the old session ended: at once [MQTT-3.1.2-8]
    (5, 30, False, False),   # resumed before the delay passed: cancelled [MQTT-3.1.3-9]
])
def test_takeover_keeps_the_old_connections_will_until_its_fate_is_known(v, delay, clean, kept):
    old = connected(v=v, sei=3600, w=will(), delay=delay)
    out = logic.decide(old, reconnect(clean=clean), RULES, NOW + 100)
    assert out.kind == "connected" and out.disconnect[1].reason == pb.DISCONNECT_REASON_SESSION_TAKEN_OVER
    assert out.publish is None                               # not now: its connector sends it if alive
    assert out.session.HasField("taken_over_will") is kept
    if kept:
        t = out.session.taken_over_will
        assert (t.will, t.service_id, t.connector_incarnation, t.taken_over_at_ms) == (
            will(), "conn-1", "run-a", NOW + 100)


@pytest.mark.parametrize("publish", [True, False])
def test_taken_over_will_is_published_or_dropped_once(publish):
    new = logic.decide(connected(v=4, w=will()), reconnect(clean=True), RULES, NOW).session
    req = logic.scan_request(pb.SESSION_EVENT_TAKEN_OVER_WILL_REQUEST, new, "t1", NOW + 20_000)
    req.publish_will = publish
    out = logic.decide(new, req, RULES, NOW + 20_000)
    assert out.write_session and not out.session.HasField("taken_over_will") and out.session.connected
    assert (out.publish is not None) is publish
    if publish:
        assert out.publish.topic == "wills/c1" and out.publish.created_at_ms == NOW + 20_000
    assert logic.decide(out.session, req, RULES, NOW + 20_001).kind in ("duplicate", "ignored")
    other = pb.SessionEventRequest()
    other.CopyFrom(req)
    other.session.session_id = "s9"                          # reconnected again since: not this record's
    other.request_id = "t2"
    assert logic.decide(new, other, RULES, NOW).kind == "ignored"


def test_taken_over_will_survives_a_further_connect_and_disconnect():
    new = logic.decide(connected(v=4, w=will()), reconnect(clean=False), RULES, NOW).session
    d = pb.SessionEventRequest(request_id="d2", type=pb.SESSION_EVENT_DISCONNECTION_REQUEST,
                               session=pb.SessionInfo(client_id="c1", session_id="s2"))
    off = logic.decide(new, d, RULES, NOW + 1).session
    assert off.HasField("taken_over_will")
    again = logic.decide(off, reconnect(clean=False, sid="s3"), RULES, NOW + 2).session
    assert again.taken_over_will == new.taken_over_will


def test_taken_over_will_fate_from_heartbeats():
    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    at = NOW + 1000                                          # the takeover, no heartbeat read since
    assert lv.taken_over_will_fate("conn-1", "run-a", at, at) is None
    lv.sweep(NOW + TIMEOUT + 1)                              # died before the takeover: nobody sent it
    assert lv.taken_over_will_fate("conn-1", "run-a", at, NOW + TIMEOUT + 1) is True

    lv = Liveness(TIMEOUT)
    lv.observe(hb(), NOW)
    lv.observe(hb(), at + 1)                                 # alive after the takeover: it sent the Will
    assert lv.taken_over_will_fate("conn-1", "run-a", at, at + 1) is False
    lv.sweep(at + 1 + TIMEOUT + 1)
    assert lv.taken_over_will_fate("conn-1", "run-a", at, at + 1 + TIMEOUT + 1) is False
    assert lv.taken_over_will_fate("conn-9", "x", at, at + 10 * TIMEOUT) is None   # never heard of
