"""session_registry.logic: the registry's decisions without Kafka."""

from __future__ import annotations

import pytest
from tbmq.v1 import messages_pb2 as pb

from session_registry import logic
from session_registry.logic import APPLICATION, DEVICE, NEVER_EXPIRES, Counts, Rules
from session_registry.state import Batch, SessionStore

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000
RULES = Rules(session_expiry_max=604800)


def conn_req(cid="c1", *, svc="conn-1", sid="s1", clean=False, sei=0, v=5, rid="r1", user="", t=NOW):
    """sei=None: the CONNECT had no Session Expiry Interval (the connector sends nothing, i.e. 0)."""
    session = pb.SessionInfo(client_id=cid, service_id=svc, session_id=sid, clean_start=clean, mqtt_version=v,
                             keep_alive=60, username=user, client_address="127.0.0.1:5000")
    if sei is not None:
        session.session_expiry_interval = sei
    return pb.SessionEventRequest(request_id=rid, type=pb.SESSION_EVENT_CONNECTION_REQUEST, request_time_ms=t,
                                  session=session)


def disc_req(cid="c1", *, sid="s1", rid="d1", sei=None):
    r = pb.SessionEventRequest(request_id=rid, type=pb.SESSION_EVENT_DISCONNECTION_REQUEST,
                               session=pb.SessionInfo(client_id=cid, session_id=sid), graceful=True)
    if sei is not None:
        r.disconnect_session_expiry_interval = sei
    return r


def stored(cid="c1", *, svc="conn-1", sid="s0", connected=True, persistent=True, sei=3600, v=5,
           ctype=DEVICE, disconnected_at=0, rid="old"):
    return pb.SessionInfo(client_id=cid, service_id=svc, session_id=sid, connected=connected, persistent=persistent,
                          session_expiry_interval=sei, mqtt_version=v, client_type=ctype,
                          disconnected_at_ms=disconnected_at, last_request_id=rid)


def test_a_client_id_naming_a_shared_groups_store_is_refused():
    out = logic.decide(None, conn_req(cid="$share/g/a/+"), RULES, NOW)
    assert not out.response.success
    assert out.response.failure == pb.SESSION_FAILURE_CLIENT_ID_NOT_VALID


# -- expiry interval and persistence -------------------------------------------------------------------

@pytest.mark.parametrize("v,clean,sei,max_,exp_sei,exp_persistent", [
    (5, False, 0, 604800, 0, False),            # v5 SEI 0 ends at disconnect even without clean start
    (5, True, 0, 604800, 0, False),
    (5, False, 100, 604800, 100, True),
    (5, True, 100, 604800, 100, True),          # clean start + SEI > 0: new session that outlives the conn
    (5, False, 10**6, 604800, 604800, True),    # capped
    (5, False, NEVER_EXPIRES, 604800, 604800, True),
    (5, False, NEVER_EXPIRES, NEVER_EXPIRES, NEVER_EXPIRES, True),
    (4, False, 0, 604800, 604800, True),        # 3.1.1 clean session false: the max
    (4, True, 0, 604800, 0, False),
    (3, False, 0, NEVER_EXPIRES, NEVER_EXPIRES, True),
    (4, False, 0, 0, 0, False),                 # max 0: no session outlives its connection
])
def test_expiry_and_persistence(v, clean, sei, max_, exp_sei, exp_persistent):
    out = logic.decide(None, conn_req(clean=clean, sei=sei, v=v), Rules(session_expiry_max=max_), NOW)
    assert out.response.success
    assert out.response.session_expiry_interval == exp_sei
    assert out.session.session_expiry_interval == exp_sei
    assert out.session.persistent is exp_persistent


# -- resume and persistence: the one rule (MQTT-3.1.2-4, -5, -23), at its boundaries ---------------------

PRIORS = {
    "none": None,
    "offline": stored(connected=False, disconnected_at=NOW - 1000, sei=600),
    "offline-never": stored(connected=False, disconnected_at=NOW - 10**12, sei=NEVER_EXPIRES, v=4),
    "online": stored(connected=True, sei=600),                                  # takeover
    "online-ends-with-it": stored(connected=True, persistent=True, sei=0),      # resumed earlier with SEI 0
    "online-sei0": stored(connected=True, persistent=False, sei=0),
    "dead": stored(connected=False, persistent=False, sei=0, disconnected_at=NOW - 1),
    "expired": stored(connected=False, disconnected_at=NOW - 600_000, sei=600),  # exactly at its end
    "expires-next-ms": stored(connected=False, disconnected_at=NOW - 599_999, sei=600),
}
ALIVE = {"offline", "offline-never", "online", "expires-next-ms"}   # what a clean-start-0 connect resumes


@pytest.mark.parametrize("prior", PRIORS)
@pytest.mark.parametrize("v,clean,sei,exp_sei", [
    (5, False, None, 0),                  # the case: resume with no Session Expiry Interval
    (5, False, 0, 0),
    (5, False, 1, 1),
    (5, False, 600, 600),
    (5, True, None, 0),
    (5, True, 0, 0),
    (5, True, 600, 600),
    (5, False, 604800, 604800),           # at the cap
    (5, False, 604801, 604800),           # above it: capped
    (5, False, NEVER_EXPIRES, 604800),
    (4, False, None, 604800),             # 3.1.1 clean session 0: "never", capped
    (4, True, None, 0),                   # 3.1.1 clean session 1
    (3, False, None, 604800),
    (3, True, None, 0),
])
def test_resume_and_persistence(prior, v, clean, sei, exp_sei):
    out = logic.decide(PRIORS[prior], conn_req(clean=clean, sei=sei, v=v), RULES, NOW)
    present = prior in ALIVE and not clean
    r = out.response
    assert r.success and r.session_present is present
    assert r.session_expiry_interval == out.session.session_expiry_interval == exp_sei
    # persistent for this connection: it outlives it, or it resumes a session whatever the new interval
    assert r.persistent is out.session.persistent is (exp_sei > 0 or present)
    assert r.persistent is logic.is_persistent(exp_sei, present)
    # a new session starts empty; a resumed one keeps its subscriptions and stored messages
    assert (out.clear_subscriptions is None) is present
    if present:
        assert out.device_clear == "" and out.reset_app_offsets == ""
    # after this connection: only an interval > 0 keeps the session (a takeover resumes only then)
    assert logic.is_alive(out.session, NOW) is (exp_sei > 0)


@pytest.mark.parametrize("max_,exp_sei,exp_persistent", [
    (0, 0, True),                  # the cap was lowered to 0: resumed for this connection, ends with it
    (1, 1, True),
    (NEVER_EXPIRES, 600, True),
])
def test_cap_applies_to_a_resumed_session(max_, exp_sei, exp_persistent):
    out = logic.decide(PRIORS["offline"], conn_req(sei=600), Rules(session_expiry_max=max_), NOW)
    assert out.response.session_present
    assert out.response.session_expiry_interval == exp_sei and out.response.persistent is exp_persistent


def test_resumed_session_with_interval_zero_ends_with_its_connection():
    resumed = logic.decide(PRIORS["offline"], conn_req(sid="s1", clean=False, sei=None), RULES, NOW)
    assert resumed.response.session_present and resumed.response.persistent
    s = resumed.session
    assert s.persistent and s.session_expiry_interval == 0 and s.connected
    # its connection ends: the session, its subscriptions and its stored messages go
    end = logic.decide(s, disc_req(sid="s1"), RULES, NOW + 5)
    assert end.kind == "removed" and end.write_session and end.session is None
    assert end.clear_subscriptions is not None and end.device_clear == "c1"
    assert end.fallback.session is not None and logic.needs_cleanup(end.fallback.session, NOW + 5)
    # the DISCONNECT cannot give it an interval: the CONNECT's was 0 (section 3.14.2.2.2, no id)
    assert logic.decide(s, disc_req(sid="s1", sei=60), RULES, NOW + 5).session is None
    # taken over while connected: not resumed (it ends with its connection; Mosquitto does the same), and the
    # next persistent DEVICE session starts from a cleared store (blocking)
    t = logic.decide(s, conn_req(sid="s2", rid="r2", clean=False, sei=600), RULES, NOW + 5)
    assert not t.response.session_present and t.disconnect[1].session_id == "s1"
    assert t.device_clear == "c1" and not t.device_clear_deferrable and t.clear_subscriptions is not None


def test_resumed_application_session_with_interval_zero():
    rules = Rules(application_client_id_pattern="c1")
    prior = stored(ctype=APPLICATION, connected=False, disconnected_at=NOW - 1, sei=600)
    out = logic.decide(prior, conn_req(sid="s1", clean=False, sei=0), rules, NOW)
    r = out.response
    assert r.session_present and r.persistent and r.client_type == APPLICATION and r.session_expiry_interval == 0
    assert out.reset_app_offsets == "" and out.ensure_app_topic == "c1" and out.device_clear == ""
    end = logic.decide(out.session, disc_req(sid="s1"), rules, NOW)
    assert end.session is None and end.reset_app_offsets == "c1" and end.device_clear == ""


def test_type_change_on_a_resumed_session_with_interval_zero():
    # APPLICATION -> DEVICE: the resumed DEVICE session reads the device store, so strays are cleared first
    prior = stored(ctype=APPLICATION, connected=False, disconnected_at=NOW - 1, sei=600)
    out = logic.decide(prior, conn_req(sei=0), RULES, NOW)
    assert out.response.persistent and out.response.client_type == DEVICE
    assert out.device_clear == "c1" and not out.device_clear_deferrable and out.app_removed is not None
    # DEVICE -> APPLICATION: nothing reads the device store any more, the Clear does not block
    out = logic.decide(stored(connected=False, disconnected_at=NOW - 1, sei=600), conn_req(sei=0),
                       Rules(application_client_id_pattern="c1"), NOW)
    assert out.response.persistent and out.response.client_type == APPLICATION
    assert out.device_clear == "c1" and out.device_clear_deferrable


def test_failed_answers_are_not_persistent():
    out = logic.decide(None, conn_req(sei=600), Rules(sessions_limit=1), NOW, Counts(sessions=1))
    assert not out.response.success and not out.response.persistent


def test_new_session_fields_and_response():
    out = logic.decide(None, conn_req(sei=30), RULES, NOW)
    s = out.session
    assert out.write_session and s.connected and s.service_id == "conn-1" and s.session_id == "s1"
    assert s.connected_at_ms == NOW and s.last_request_id == "r1" and s.keep_alive == 60 and s.mqtt_version == 5
    assert out.response_service_id == "conn-1"
    r = out.response
    assert (r.request_id, r.client_id, r.success, r.session_present) == ("r1", "c1", True, False)
    assert out.disconnect is None
    assert out.clear_subscriptions is not None and not out.clear_subscriptions.subscriptions
    assert out.device_clear == "c1"  # a new persistent DEVICE session starts with an empty store
    non_persistent = logic.decide(None, conn_req(sei=0), RULES, NOW)
    assert non_persistent.device_clear == ""  # no device-persistence call for a session that stores nothing


# -- session present -----------------------------------------------------------------------------------

def test_session_present_when_prior_persistent_and_not_clean():
    prior = stored(connected=False, disconnected_at=NOW - 1000, sei=3600)
    out = logic.decide(prior, conn_req(clean=False, sei=3600), RULES, NOW)
    assert out.response.session_present
    assert out.clear_subscriptions is None and out.device_clear == ""


def test_clean_start_clears_old_session():
    prior = stored(connected=False, disconnected_at=NOW - 1000)
    out = logic.decide(prior, conn_req(clean=True, sei=3600), RULES, NOW)
    assert not out.response.session_present
    assert out.clear_subscriptions.client_id == "c1" and not out.clear_subscriptions.subscriptions
    assert out.device_clear == "c1"
    assert out.retry_side_effects
    assert out.fallback.response.failure == pb.SESSION_FAILURE_SERVER_UNAVAILABLE
    assert not out.fallback.write_session


@pytest.mark.parametrize("prior,clean", [
    (None, False),                                                       # a client id new to the registry
    (stored(connected=False, disconnected_at=NOW - 1000), False),        # resumed
    (stored(connected=False, disconnected_at=NOW - 1000), True),         # cleared by a clean start
    (stored(svc="conn-A", connected=True), False),                       # taken over
    (stored(connected=False, disconnected_at=NOW - 3601_000, sei=3600), False),  # expired, not scanned yet
    (stored(connected=False, disconnected_at=NOW - 1000, ctype=APPLICATION), False),  # now a DEVICE
])
def test_a_connect_over_a_known_session_asks_for_marks_before_connack(prior, clean):
    """mark_routing (tbmq_platform.marks): the routers may hold the stored session and its subscriptions,
    so the connector marks tbmq.msg.all before CONNACK; a client id the registry never saw has nothing."""
    out = logic.decide(prior, conn_req(clean=clean, sei=3600), RULES, NOW)
    assert out.response.success
    assert out.response.mark_routing is (prior is not None)


def test_expired_session_is_not_present():
    prior = stored(connected=False, disconnected_at=NOW - 3601_000, sei=3600)
    out = logic.decide(prior, conn_req(clean=False, sei=3600), RULES, NOW)
    assert not out.response.session_present
    assert out.device_clear == "c1" and out.clear_subscriptions is not None


def test_never_expiring_session_stays_present():
    prior = stored(connected=False, disconnected_at=NOW - 10**12, sei=NEVER_EXPIRES)
    assert logic.decide(prior, conn_req(sei=10), RULES, NOW).response.session_present


def test_takeover_of_connected_session():
    prior = stored(svc="conn-A", sid="old", connected=True, persistent=True)
    out = logic.decide(prior, conn_req(svc="conn-B", sid="new", clean=False, sei=60), RULES, NOW)
    svc, cmd = out.disconnect
    assert svc == "conn-A"
    assert (cmd.client_id, cmd.session_id, cmd.new_session_clean_start, cmd.reason) == (
        "c1", "old", False, pb.DISCONNECT_REASON_SESSION_TAKEN_OVER)
    assert out.response.session_present
    assert out.session.service_id == "conn-B" and out.session.session_id == "new"


def test_takeover_on_same_connector_and_of_non_persistent_session():
    prior = stored(svc="conn-1", sid="old", connected=True, persistent=False, sei=0)
    out = logic.decide(prior, conn_req(svc="conn-1", sid="new", clean=False, sei=60), RULES, NOW)
    assert out.disconnect[0] == "conn-1" and out.disconnect[1].session_id == "old"
    assert not out.response.session_present          # a SEI 0 session ends with its connection
    assert out.clear_subscriptions is not None


def test_same_session_twice_fails_without_change():
    prior = stored(sid="s1", connected=True)
    out = logic.decide(prior, conn_req(sid="s1", rid="other"), RULES, NOW)
    assert not out.response.success and not out.write_session


def test_duplicate_request_is_skipped():
    prior = stored(rid="r1")
    out = logic.decide(prior, conn_req(rid="r1"), RULES, NOW)
    assert out.kind == "duplicate" and out.response is None and not out.write_session


def test_too_old_request():
    rules = Rules(request_max_age_ms=1000)
    out = logic.decide(None, conn_req(t=NOW - 5000), rules, NOW)
    assert not out.response.success and out.response.failure == pb.SESSION_FAILURE_SERVER_UNAVAILABLE
    assert not out.write_session


# -- client type ---------------------------------------------------------------------------------------

def test_client_type_rules():
    rules = Rules(application_client_id_pattern=r"app-.*", application_username_pattern=r"svc|backend")
    assert rules.client_type("app-1", "") == APPLICATION
    assert rules.client_type("xapp-1", "") == DEVICE   # full match
    assert rules.client_type("dev", "backend") == APPLICATION
    assert rules.client_type("dev", "backend2") == DEVICE
    assert Rules().client_type("app-1", "svc") == DEVICE
    out = logic.decide(None, conn_req("app-1", sei=60), rules, NOW)
    assert out.response.client_type == APPLICATION and out.session.client_type == APPLICATION
    assert out.ensure_app_topic == "app-1" and out.device_clear == ""


def test_type_change_device_to_application_clears_device_store():
    rules = Rules(application_client_id_pattern="c1")
    prior = stored(ctype=DEVICE, connected=False, disconnected_at=NOW - 1)
    out = logic.decide(prior, conn_req(sei=60), rules, NOW)
    assert out.response.session_present           # the session itself (subscriptions) continues
    assert out.device_clear == "c1" and out.app_removed is None and out.ensure_app_topic == "c1"


def test_type_change_application_to_device_removes_topic():
    prior = stored(ctype=APPLICATION, connected=False, disconnected_at=NOW - 1)
    out = logic.decide(prior, conn_req(sei=60), RULES, NOW)
    assert out.app_removed.client_id == "c1" and out.app_removed.topic == "tbmq.msg.app.c1"
    assert out.reset_app_offsets == ""
    # the DEVICE -> APPLICATION Clear may have been deferred: a persistent DEVICE session clears, blocking
    assert out.device_clear == "c1" and not out.device_clear_deferrable
    non_persistent = logic.decide(prior, conn_req(clean=True, sei=0), RULES, NOW)
    assert not non_persistent.response.persistent and non_persistent.device_clear == ""
    # resumed with SEI 0 it is persistent for the connection: test_type_change_on_a_resumed_session_...


def test_application_clean_start_resets_backlog():
    rules = Rules(application_client_id_pattern="c1")
    prior = stored(ctype=APPLICATION, connected=False, disconnected_at=NOW - 1)
    out = logic.decide(prior, conn_req(clean=True, sei=60), rules, NOW)
    assert out.reset_app_offsets == "c1" and out.app_removed is None
    resumed = logic.decide(prior, conn_req(clean=False, sei=60), rules, NOW)
    assert resumed.reset_app_offsets == "" and resumed.response.session_present


# -- quotas --------------------------------------------------------------------------------------------

def test_sessions_quota():
    rules = Rules(sessions_limit=2)
    out = logic.decide(None, conn_req(), rules, NOW, Counts(sessions=2))
    assert not out.response.success and out.response.failure == pb.SESSION_FAILURE_QUOTA_EXCEEDED
    assert not out.write_session
    # an existing client reconnecting does not add a session
    assert logic.decide(stored(connected=False, disconnected_at=NOW), conn_req(), rules, NOW,
                        Counts(sessions=2)).response.success
    assert logic.decide(None, conn_req(), rules, NOW, Counts(sessions=1)).response.success


def test_application_quota():
    rules = Rules(application_clients_limit=1, application_client_id_pattern="app.*")
    out = logic.decide(None, conn_req("app2"), rules, NOW, Counts(sessions=5, applications=1))
    assert out.response.failure == pb.SESSION_FAILURE_QUOTA_EXCEEDED
    assert logic.decide(None, conn_req("dev"), rules, NOW, Counts(sessions=5, applications=1)).response.success


# -- disconnect ----------------------------------------------------------------------------------------

def test_disconnect_persistent_keeps_session():
    prior = stored(sid="s1", sei=100)
    out = logic.decide(prior, disc_req(sid="s1"), RULES, NOW)
    assert out.kind == "disconnected" and out.write_session
    assert not out.session.connected and out.session.disconnected_at_ms == NOW and out.session.persistent
    assert out.clear_subscriptions is None and out.device_clear == "" and out.response is None


def test_disconnect_non_persistent_removes_session():
    prior = stored(sid="s1", sei=0, persistent=False)
    prior.clear_at_end = True   # its CONNECT found an earlier DEVICE session: the store owes a Clear
    out = logic.decide(prior, disc_req(sid="s1"), RULES, NOW)
    assert out.write_session and out.session is None
    assert out.clear_subscriptions is not None and out.device_clear == "c1"
    # Clear failing: a dead record stays for the expiry scan, still owing the Clear
    dead = out.fallback.session
    assert dead is not None and not dead.persistent and dead.clear_at_end
    assert logic.needs_cleanup(dead, NOW)
    assert logic.decide(dead, logic.clear_request(dead, "x1", NOW + 1), RULES, NOW + 1).device_clear == "c1"


def test_a_clean_session_that_found_no_device_session_ends_without_a_clear():
    """The common clean-session churn: nothing was stored for it, so its removal makes no device-persistence
    call (about a third of the stack's CPU per connect and disconnect, docs/performance.md, the 26th round)."""
    first = logic.decide(None, conn_req(sid="s1", clean=True, sei=0), RULES, NOW)
    assert not first.session.persistent and not first.session.clear_at_end and first.device_clear == ""
    end = logic.decide(first.session, disc_req(sid="s1"), RULES, NOW + 5)
    assert end.kind == "removed" and end.session is None and end.clear_subscriptions is not None
    assert end.device_clear == ""
    assert not end.fallback.session.clear_at_end
    # one that followed a DEVICE session (persistent or not) clears at its CONNECT without blocking and again
    # at its end: that Clear may have failed, and a router not up to date may have stored copies meanwhile
    for prior in (stored(connected=False, disconnected_at=NOW - 1000), first.session):
        again = logic.decide(prior, conn_req(sid="s2", rid="r2", clean=True, sei=0), RULES, NOW + 10)
        assert again.device_clear == "c1" and again.device_clear_deferrable and again.session.clear_at_end
        assert logic.decide(again.session, disc_req(sid="s2"), RULES, NOW + 20).device_clear == "c1"
    # a persistent session is always cleared at its removal, and is not flagged (persistent says it)
    kept = logic.decide(None, conn_req(sid="s3", clean=True, sei=60), RULES, NOW)
    assert kept.session.persistent and not kept.session.clear_at_end
    assert logic.decide(kept.session, disc_req(sid="s3", sei=0), RULES, NOW + 5).device_clear == "c1"


def test_disconnect_changes_expiry():
    prior = stored(sid="s1", sei=100)
    to_zero = logic.decide(prior, disc_req(sid="s1", sei=0), RULES, NOW)
    assert to_zero.session is None and to_zero.write_session
    longer = logic.decide(prior, disc_req(sid="s1", sei=10**7), RULES, NOW)
    assert longer.session.session_expiry_interval == 604800
    # a session that was 0 at CONNECT cannot be extended at DISCONNECT (section 3.14.2.2.2, no id)
    zero = stored(sid="s1", sei=0, persistent=False)
    assert logic.decide(zero, disc_req(sid="s1", sei=50), RULES, NOW).session is None
    # 3.x has no DISCONNECT properties
    v4 = stored(sid="s1", sei=604800, v=4)
    assert logic.decide(v4, disc_req(sid="s1", sei=0), RULES, NOW).session.persistent


def test_stale_disconnect_is_ignored():
    prior = stored(sid="new")
    out = logic.decide(prior, disc_req(sid="old"), RULES, NOW)
    assert out.kind == "stale" and not out.write_session and out.clear_subscriptions is None
    assert logic.decide(None, disc_req(), RULES, NOW).kind == "stale"


# -- clear / expiry ------------------------------------------------------------------------------------

def test_expiry_rules():
    s = stored(connected=False, sei=10, disconnected_at=NOW - 9_000)
    assert not logic.needs_cleanup(s, NOW) and logic.needs_cleanup(s, NOW + 1_000)
    assert not logic.needs_cleanup(stored(connected=True, sei=10), NOW + 10**9)
    assert not logic.needs_cleanup(stored(connected=False, sei=NEVER_EXPIRES), NOW + 10**12)


def test_clear_request_rules():
    s = stored(connected=False, sei=10, disconnected_at=NOW - 20_000, ctype=APPLICATION, sid="s9")
    req = logic.clear_request(s, "x1", NOW)
    out = logic.decide(s, req, RULES, NOW)
    assert out.kind == "cleared" and out.write_session and out.session is None
    assert out.app_removed.topic == "tbmq.msg.app.c1" and out.clear_subscriptions is not None
    assert out.device_clear == ""
    # reconnected meanwhile: another session id
    assert logic.decide(stored(sid="s10"), req, RULES, NOW).kind == "ignored"
    # connected and no force: ignored; with force: removed and disconnected
    live = stored(sid="s9", connected=True)
    assert logic.decide(live, req, RULES, NOW).kind == "ignored"
    req.force_cleanup = True
    forced = logic.decide(live, req, RULES, NOW)
    assert forced.kind == "cleared" and forced.disconnect[1].reason == pb.DISCONNECT_REASON_ADMINISTRATIVE
    assert forced.device_clear == "c1"


# -- state ---------------------------------------------------------------------------------------------

def test_store_overlay_and_counts():
    st = SessionStore()
    a = stored("a", ctype=APPLICATION)
    st.apply_record(b"a", a.SerializeToString())
    assert st.counts() == Counts(1, 1)
    b = Batch(st)
    b.put("b", stored("b"))
    assert b.counts() == Counts(2, 1) and st.counts() == Counts(1, 1)
    b.put("a", None)
    assert b.get("a") is None and b.counts() == Counts(1, 0)
    b.commit_to_store()
    assert st.get("a") is None and st.get("b").client_id == "b" and st.counts() == Counts(1, 0)
    # the view reads our writes back: overlay entries go
    st.apply_record(b"b", stored("b").SerializeToString())
    st.apply_record(b"a", None)
    assert not st.overlay and st.counts() == Counts(1, 0)
    # the view sees a record before we noted the commit: the overlay stays correct, cleared on assignment
    st.apply_record(b"c", stored("c").SerializeToString())
    st.committed("c", stored("c"))
    assert st.get("c").client_id == "c" and st.counts() == Counts(2, 0)
    st.drop_overlay()
    assert st.get("c").client_id == "c" and st.counts() == Counts(2, 0) and not st.pending


# -- Clear that does not block the answer ----------------------------------------------------------------

@pytest.mark.parametrize("prior", [
    stored(connected=False, persistent=False, sei=0, disconnected_at=NOW - 1),   # dead non-persistent record
    stored(connected=False, disconnected_at=NOW - 1000),                        # disconnected persistent
    stored(connected=False, disconnected_at=NOW - 3601_000, sei=3600),          # expired
    stored(connected=True),                                                     # takeover of a connected one
    stored(connected=True, persistent=False, sei=0),                            # takeover, non-persistent
])
@pytest.mark.parametrize("clean", [False, True])
def test_non_persistent_device_connect_clears_without_blocking(prior, clean):
    out = logic.decide(prior, conn_req(clean=clean, sei=0), RULES, NOW)
    assert out.response.success
    if logic.is_alive(prior, NOW) and not clean:
        # resumes the alive session (it ends at disconnect, whose removal clears): nothing to clear now
        assert out.response.session_present and out.device_clear == ""
        return
    assert not out.response.session_present
    assert out.device_clear == "c1" and out.device_clear_deferrable
    assert out.clear_subscriptions is not None


def test_persistent_device_connect_keeps_blocking_clear():
    for prior in (None, stored(connected=False, persistent=False, sei=0, disconnected_at=NOW - 1),
                  stored(connected=True), stored(connected=False, disconnected_at=NOW - 1000)):
        out = logic.decide(prior, conn_req(clean=True, sei=60), RULES, NOW)
        assert out.device_clear == "c1" and not out.device_clear_deferrable
        assert out.retry_side_effects
        assert out.fallback.response.failure == pb.SESSION_FAILURE_SERVER_UNAVAILABLE
        assert not out.fallback.write_session
    # v3.1.1 clean session = false is persistent too
    out = logic.decide(stored(connected=False, persistent=False, sei=0, disconnected_at=NOW - 1),
                       conn_req(v=4, clean=False), RULES, NOW)
    assert out.session.persistent and out.device_clear == "c1" and not out.device_clear_deferrable


def test_device_to_application_clear_does_not_block():
    rules = Rules(application_client_id_pattern="c1")
    for prior in (stored(ctype=DEVICE, connected=False, disconnected_at=NOW - 1),   # session present
                  stored(ctype=DEVICE, connected=True)):                           # takeover
        for sei in (0, 60):
            out = logic.decide(prior, conn_req(sei=sei), rules, NOW)
            assert out.response.client_type == APPLICATION
            assert out.device_clear == "c1" and out.device_clear_deferrable
            assert out.ensure_app_topic == "c1"   # topic creation still must succeed before the answer
            assert out.fallback.response.failure == pb.SESSION_FAILURE_SERVER_UNAVAILABLE


def test_deferrable_only_for_connects():
    prior = stored(connected=True, persistent=False, sei=0, sid="s1")
    prior.clear_at_end = True
    removal = logic.decide(prior, disc_req(sid="s1"), RULES, NOW)
    assert removal.device_clear == "c1" and not removal.device_clear_deferrable
    assert removal.fallback.kind == "removal-deferred"
    first_non_persistent = logic.decide(None, conn_req(sei=0), RULES, NOW)
    assert first_non_persistent.device_clear == "" and not first_non_persistent.device_clear_deferrable


# -- inbound QoS 2 state (packet ids awaiting PUBREL) -------------------------------------------------------

def _disc_with_pubrel(ids, **kw):
    r = disc_req(**kw)
    r.awaiting_pubrel.extend(ids)
    return r


def test_awaiting_pubrel_kept_with_a_persistent_session_and_returned_once_on_resume():
    prior = stored(sid="s1", sei=100)
    gone = logic.decide(prior, _disc_with_pubrel([9, 3, 9, 0, 70000]), RULES, NOW)
    assert gone.kind == "disconnected" and list(gone.session.awaiting_pubrel) == [3, 9]  # valid ids, once, sorted
    back = logic.decide(gone.session, conn_req(sid="s2", clean=False, sei=100, rid="r2"), RULES, NOW + 1000)
    assert back.response.session_present and list(back.response.awaiting_pubrel) == [3, 9]
    # the connected record holds none: the connection owns them now, and reports them at its end
    assert list(back.session.awaiting_pubrel) == []
    # a connector crash (no DISCONNECTION_REQUEST) then a takeover: nothing handed back (at worst a duplicate)
    again = logic.decide(back.session, conn_req(sid="s3", clean=False, sei=100, rid="r3"), RULES, NOW + 2000)
    assert again.response.session_present and list(again.response.awaiting_pubrel) == []


@pytest.mark.parametrize("case", ["clean start", "expired", "interval 0"])
def test_awaiting_pubrel_not_handed_to_a_new_session(case):
    prior = stored(sid="s1", sei=0 if case == "interval 0" else 100)
    gone = logic.decide(prior, _disc_with_pubrel([5]), RULES, NOW)
    if case == "interval 0":
        assert gone.session is None and list(gone.fallback.session.awaiting_pubrel) == []
        return
    later = NOW + (200_000 if case == "expired" else 1000)
    back = logic.decide(gone.session, conn_req(sid="s2", clean=case == "clean start", sei=100, rid="r2"),
                        RULES, later)
    assert not back.response.session_present and list(back.response.awaiting_pubrel) == []


def test_stale_disconnect_does_not_write_awaiting_pubrel():
    prior = stored(sid="s2", sei=100)   # the session moved on to another connection
    assert logic.decide(prior, _disc_with_pubrel([5], sid="s1"), RULES, NOW).kind == "stale"
