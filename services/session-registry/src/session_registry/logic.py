"""The registry's decisions, without I/O: (stored session, request, rules, now) → Outcome.

An Outcome says what to write in the batch's Kafka transaction (the session record, the response, an
empty subscription set, a disconnect command, an ApplicationRemovedEvent, the APPLICATION backlog's offset
reset) and which side effects must succeed *before* the transaction (DevicePersistence.Clear, creating the
APPLICATION topic). When a side effect fails, the I/O layer uses `Outcome.fallback` instead.

Session lifetime (docs/session-registry.md). These are THE rules: the connector applies the registry's
answer (SessionEventResponse.session_expiry_interval and .persistent) and decides neither itself.
  * SEI = min(requested, max) (`Rules.cap`, the one setting MQTT_CLIENT_SESSION_EXPIRY_MAX_EXPIRY_INTERVAL,
    also applied to the interval a v5 DISCONNECT sets); 0xFFFFFFFF (never) only survives when the max is
    0xFFFFFFFF. MQTT 3.x: clean session = false asks for "never", so it gets the max; clean session = true
    gets 0. The SEI says what happens AFTER this connection ends [MQTT-3.1.2-23]: 0 = the session ends with it.
  * session present = an alive stored session and clean start = 0 [MQTT-3.1.2-4, MQTT-3.1.2-5,
    MQTT-3.2.2-2, MQTT-3.2.2-3], whatever the new SEI.
  * persistent (`is_persistent`: messages are kept for the client, stored while it is offline, fetched on
    connect) = SEI > 0 or session present. A session resumed with a new SEI of 0 is persistent for this
    connection (its queued messages are delivered, new ones queued while connected) and ends with it.
  * Inbound QoS 2 state (`awaiting_pubrel`): the packet ids a DISCONNECTION_REQUEST reports as answered PUBREC
    and not released are kept with a session that outlives the connection (SessionInfo.awaiting_pubrel) and
    handed back, once, in the answer of the CONNECT that resumes it, so the client's re-sent PUBLISH is answered
    PUBREC without being forwarded again [MQTT-4.3.3-10]. The connected record holds none: the connection
    owns them, and ids a crashed connector never reported are lost (at worst one duplicate, never a loss:
    an id kept past its PUBREL could swallow a new message that reuses it).
  * A stored session is *alive* (`is_alive`) when it outlives its connection (persistent and SEI > 0) and
    is connected or not expired (disconnected_at + SEI > now). A connected session with SEI 0 ends when it
    is taken over; a dead one is cleared by the next connect or by the expiry scan.

Dead connectors (docs/session-registry.md, "Dead connectors"; session_registry.liveness decides which are):
  * A CONNECTOR_GONE_REQUEST (one per session still connected on a connector declared dead, written by the
    scan of the partition's owner) ends the session exactly as a connection lost without DISCONNECT:
    a persistent one is kept disconnected and starts its expiry, a non-persistent one is removed with its
    subscriptions. Only the connection it names (session id) is ended: a client that reconnected since is
    left alone.
  * The Will of a dead connector's client (stored with the connected session from its CONNECTION_REQUEST)
    is published by the registry, inside the transaction that ends the session (exactly once): at once
    when its delay is 0 (`will_delay_seconds`, tbmq_routing.wills: v5 Will Delay, capped by the session's
    end [MQTT-3.1.2-8]); otherwise kept with the disconnected record and published by a WILL_DUE_REQUEST
    once the delay ends, by the session's clean-up when it ends first, or by a clean-start connect of the
    client (the old session ended); dropped when a connect resumes the session first [MQTT-3.1.3-9].
    A connection that ends through its connector drops the stored Will: no Will after DISCONNECT 0x00
    [MQTT-3.1.2-10], and otherwise the connector sends it itself.
  * A takeover of a connection whose Will must go [MQTT-3.1.4-3] (no delay, or the new connection starts
    clean) keeps that Will in the new record (`taken_over_will`): its connector sends it when alive, but a
    client often reconnects elsewhere before its dead connector is declared dead. A TAKEN_OVER_WILL_REQUEST
    (the scan, session_registry.liveness.taken_over_will_fate) then publishes it (the run died before the
    takeover) or drops it (a heartbeat after the takeover: the run sent it).
  * Fencing: a CONNECTION_REQUEST of a connector run (incarnation) declared dead is refused (`fenced`,
    answered CONNECTOR_FENCED, CONNACK Server unavailable): a dead run cannot start sessions again, and each CONNECTOR_GONE_REQUEST
    also sends its connection a DisconnectCommand(CONNECTOR_FENCED) (closed without a Will, should the run
    still be alive; a new run of the connector reads its disconnect topic from the end). Its DISCONNECTION_REQUESTs are
    applied (a gracefully stopped connector's last ones; one of a session already ended is stale).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tbmq.v1 import messages_pb2 as pb
from tbmq_platform import topics
from tbmq_routing import is_reserved_client_id
from tbmq_routing.wills import will_delay_seconds

NEVER_EXPIRES = 0xFFFFFFFF
DEVICE = pb.CLIENT_TYPE_DEVICE
APPLICATION = pb.CLIENT_TYPE_APPLICATION


@dataclass(frozen=True)
class Rules:
    session_expiry_max: int = 604800
    application_client_id_pattern: str = ""
    application_username_pattern: str = ""
    sessions_limit: int = 0
    application_clients_limit: int = 0
    request_max_age_ms: int = 0

    @classmethod
    def from_settings(cls, s) -> "Rules":
        return cls(s.session_expiry_max, s.application_client_id_pattern, s.application_username_pattern,
                   s.sessions_limit, s.application_clients_limit, s.request_max_age_ms)

    def __post_init__(self):
        object.__setattr__(self, "_client_re",
                           re.compile(self.application_client_id_pattern)
                           if self.application_client_id_pattern else None)
        object.__setattr__(self, "_user_re",
                           re.compile(self.application_username_pattern)
                           if self.application_username_pattern else None)

    def client_type(self, client_id: str, username: str) -> int:
        if self._client_re is not None and self._client_re.fullmatch(client_id):
            return APPLICATION
        if self._user_re is not None and username and self._user_re.fullmatch(username):
            return APPLICATION
        return DEVICE

    def cap(self, requested: int) -> int:
        return min(requested, self.session_expiry_max)

    def effective_expiry(self, mqtt_version: int, clean_start: bool, requested: int) -> int:
        if mqtt_version < 5:
            return self.cap(NEVER_EXPIRES) if not clean_start else 0
        return self.cap(requested)


@dataclass(frozen=True)
class Counts:
    sessions: int = 0
    applications: int = 0


@dataclass
class Outcome:
    """What one request does. `session` is written when `write_session` (None = delete the record)."""

    kind: str                                   # short label for logs/tests: connected, quota, ignored, ...
    write_session: bool = False
    session: pb.SessionInfo | None = None
    response: pb.SessionEventResponse | None = None
    response_service_id: str = ""
    clear_subscriptions: pb.ClientSubscriptions | None = None
    disconnect: tuple[str, pb.DisconnectCommand] | None = None   # (service id, command)
    app_removed: pb.ApplicationRemovedEvent | None = None
    reset_app_offsets: str = ""                 # client id whose APPLICATION backlog is skipped
    # side effects before the transaction
    device_clear: str = ""                      # client id for DevicePersistence.Clear
    # the Clear must not hold up the answer: the new session never reads the device store (see decide_connect)
    device_clear_deferrable: bool = False
    ensure_app_topic: str = ""                  # client id whose APPLICATION topic must exist
    publish: pb.PublishMsg | None = None        # a Will the registry publishes (tbmq.msg.all) in the transaction
    fallback: "Outcome | None" = None           # used when a side effect fails
    retry_side_effects: bool = False            # retry the side effects for a bounded time first
    notes: list[str] = field(default_factory=list)

    @property
    def has_side_effects(self) -> bool:
        return bool(self.device_clear or self.ensure_app_topic)


def is_expired(s: pb.SessionInfo, now_ms: int) -> bool:
    """A disconnected persistent session past its expiry (never for 0xFFFFFFFF)."""
    if s.connected or s.session_expiry_interval == NEVER_EXPIRES:
        return False
    return s.disconnected_at_ms + s.session_expiry_interval * 1000 <= now_ms


def is_persistent(session_expiry_interval: int, session_present: bool) -> bool:
    """Whether a new connection's session keeps messages for its client (SessionInfo.persistent and the
    answer's `persistent`): it outlives the connection (SEI after the cap > 0), or it resumes an existing
    session, which MQTT 5 resumes whatever the new SEI [MQTT-3.1.2-4, MQTT-3.1.2-5]; the new SEI only governs
    what happens after this connection ends [MQTT-3.1.2-23] (0: the session ends with it, decide_disconnect)."""
    return session_expiry_interval > 0 or session_present


def is_alive(s: pb.SessionInfo | None, now_ms: int) -> bool:
    """A stored session that a clean-start-0 connect resumes: it outlives its connection (persistent, SEI > 0)
    and is connected or not expired. A connected session with SEI 0 (a resumed one included) ends with its
    connection, so a takeover does not resume it (Mosquitto neither)."""
    if s is None or not s.persistent or s.session_expiry_interval == 0:
        return False
    return s.connected or not is_expired(s, now_ms)


def needs_cleanup(s: pb.SessionInfo, now_ms: int) -> bool:
    """What the expiry scan looks for: a disconnected session that is over (expired or not persistent)."""
    return not s.connected and not is_alive(s, now_ms)


def awaiting_pubrel(ids) -> list[int]:
    """The inbound QoS 2 packet ids to keep: valid ids (1..65535), each once, in order."""
    return sorted({i for i in ids if 0 < i <= 0xFFFF})


def resumed_awaiting_pubrel(stored: pb.SessionInfo | None, session_present: bool) -> list[int]:
    """What a CONNECT's answer hands back: the resumed (disconnected) session's ids awaiting PUBREL; none
    for a new session, and none from a connected record (the connection being taken over holds its own)."""
    if not session_present or stored is None or stored.connected:
        return []
    return list(stored.awaiting_pubrel)


def _empty_subscriptions(client_id: str, client_type: int) -> pb.ClientSubscriptions:
    return pb.ClientSubscriptions(client_id=client_id, client_type=client_type)


def _app_removed(client_id: str, now_ms: int) -> pb.ApplicationRemovedEvent:
    return pb.ApplicationRemovedEvent(client_id=client_id, topic=topics.app_topic_name(client_id),
                                      removed_at_ms=now_ms)


def _answer(req: pb.SessionEventRequest, *, success: bool, failure: int = pb.SESSION_FAILURE_NONE,
            session_present: bool = False, client_type: int = DEVICE, sei: int = 0,
            persistent: bool = False) -> pb.SessionEventResponse:
    return pb.SessionEventResponse(request_id=req.request_id, client_id=req.session.client_id, success=success,
                                   session_present=session_present, failure=failure, client_type=client_type,
                                   session_expiry_interval=sei, persistent=persistent)


def _failed(kind: str, req: pb.SessionEventRequest, failure: int, client_type: int = DEVICE,
            sei: int = 0) -> Outcome:
    return Outcome(kind, response=_answer(req, success=False, failure=failure, client_type=client_type, sei=sei),
                   response_service_id=req.session.service_id)


def has_will(s: pb.SessionInfo | None) -> bool:
    return s is not None and s.HasField("will")


def will_due_at_ms(s: pb.SessionInfo) -> int | None:
    """When the Will kept with a disconnected record (its connector died during the Will Delay) is due."""
    if s.connected or not s.HasField("will"):
        return None
    return s.disconnected_at_ms + 1000 * will_delay_seconds(s.mqtt_version, s.will_delay, s.session_expiry_interval)


def will_due(s: pb.SessionInfo, now_ms: int) -> bool:
    at = will_due_at_ms(s)
    return at is not None and at <= now_ms


def _published_now(will: pb.PublishMsg, now_ms: int) -> pb.PublishMsg:
    """A stored Will as published now (its Message Expiry counts from now)."""
    msg = pb.PublishMsg()
    msg.CopyFrom(will)
    msg.created_at_ms = now_ms
    return msg


def _without_will(s: pb.SessionInfo) -> None:
    s.ClearField("will")
    s.will_delay = 0


def decide(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, rules: Rules, now_ms: int,
           counts: Counts = Counts(), fenced: bool = False) -> Outcome:
    """`fenced`: the request comes from a connector run declared dead (session_registry.liveness)."""
    if stored is not None and req.request_id and stored.last_request_id == req.request_id:
        return Outcome("duplicate")  # already applied (and answered) in a committed transaction
    if req.type == pb.SESSION_EVENT_CONNECTION_REQUEST:
        if fenced:
            conn = req.session
            return _failed("fenced", req, pb.SESSION_FAILURE_CONNECTOR_FENCED,
                           rules.client_type(conn.client_id, conn.username))
        return decide_connect(stored, req, rules, now_ms, counts)
    if req.type == pb.SESSION_EVENT_DISCONNECTION_REQUEST:
        # applied even from a dead run: a stopped connector's last reports are read after its `stopped`
        # heartbeat, and one of a session already ended is stale anyway
        return decide_disconnect(stored, req, rules, now_ms)
    if req.type == pb.SESSION_EVENT_CONNECTOR_GONE_REQUEST:
        return decide_connector_gone(stored, req, now_ms)
    if req.type == pb.SESSION_EVENT_WILL_DUE_REQUEST:
        return decide_will_due(stored, req, now_ms)
    if req.type == pb.SESSION_EVENT_TAKEN_OVER_WILL_REQUEST:
        return decide_taken_over_will(stored, req, now_ms)
    if req.type == pb.SESSION_EVENT_CLEAR_SESSION_REQUEST:
        return decide_clear(stored, req, now_ms)
    if req.type == pb.SESSION_EVENT_REMOVE_APPLICATION_TOPIC_REQUEST:
        if stored is not None and stored.client_type == APPLICATION:
            return Outcome("ignored")
        return Outcome("app-topic-removed", app_removed=_app_removed(req.session.client_id, now_ms))
    return Outcome("ignored")


def decide_connect(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, rules: Rules, now_ms: int,
                   counts: Counts = Counts()) -> Outcome:
    conn = req.session
    cid = conn.client_id
    client_type = rules.client_type(cid, conn.username)
    sei = rules.effective_expiry(conn.mqtt_version, conn.clean_start, conn.session_expiry_interval)

    if not cid or is_reserved_client_id(cid):  # empty, or a shared group's store id (tbmq_routing.naming)
        return _failed("invalid", req, pb.SESSION_FAILURE_CLIENT_ID_NOT_VALID, client_type, sei)
    if rules.request_max_age_ms and req.request_time_ms and now_ms - req.request_time_ms > rules.request_max_age_ms:
        return _failed("too-old", req, pb.SESSION_FAILURE_SERVER_UNAVAILABLE, client_type, sei)
    if stored is not None and stored.connected and stored.session_id == conn.session_id:
        # the same connection asking twice with another request id: nothing to change (TBMQ fails it)
        return _failed("same-session", req, pb.SESSION_FAILURE_UNSPECIFIED_ERROR, client_type, sei)

    # quotas: a client that already has a record does not add a session
    if rules.sessions_limit and stored is None and counts.sessions >= rules.sessions_limit:
        return _failed("quota", req, pb.SESSION_FAILURE_QUOTA_EXCEEDED, client_type, sei)
    if (rules.application_clients_limit and client_type == APPLICATION
            and (stored is None or stored.client_type != APPLICATION)
            and counts.applications >= rules.application_clients_limit):
        return _failed("quota", req, pb.SESSION_FAILURE_QUOTA_EXCEEDED, client_type, sei)

    prior = is_alive(stored, now_ms)
    session_present = prior and not conn.clean_start
    persistent = is_persistent(sei, session_present)
    out = Outcome("connected", write_session=True, response_service_id=conn.service_id)
    if stored is not None and not stored.connected and has_will(stored):
        # a Will left by a dead connector, its delay still running: a resumed session cancels it
        # [MQTT-3.1.3-9]; otherwise the old session ended, and its Will goes now [MQTT-3.1.2-8]
        if session_present:
            out.notes.append("pending Will cancelled: session resumed")
        else:
            out.publish = _published_now(stored.will, now_ms)
    out.retry_side_effects = True
    out.fallback = _failed("unavailable", req, pb.SESSION_FAILURE_SERVER_UNAVAILABLE, client_type, sei)

    if not session_present:
        # a new session starts empty: whatever the old one subscribed to goes
        out.clear_subscriptions = _empty_subscriptions(cid, client_type)
    old_type = stored.client_type if stored is not None else None
    if old_type == DEVICE and (not session_present or client_type != DEVICE):
        out.device_clear = cid                       # old DEVICE messages (clean start, dead, or type change)
    elif old_type != DEVICE and client_type == DEVICE and persistent:
        # strays saved after an earlier removal, or left by a deferred Clear (below) of an earlier
        # DEVICE -> APPLICATION change: a persistent DEVICE session must start from a clean store
        out.device_clear = cid
    if out.device_clear and not (client_type == DEVICE and persistent):
        # Only a persistent DEVICE session fetches from device-persistence. A non-persistent DEVICE or an
        # APPLICATION session never reads the messages this Clear removes, and the next persistent DEVICE
        # session of the client cannot resume this one (a non-persistent session is never alive; an
        # APPLICATION one changes type), so its connect clears again, blocking, before it can read them.
        # So device-persistence being down must not fail this connect: the Clear is best effort and
        # retried in the background (docs/session-registry.md, "Clear that does not block").
        out.device_clear_deferrable = True
    if old_type == APPLICATION and client_type != APPLICATION:
        out.app_removed = _app_removed(cid, now_ms)  # no longer APPLICATION: its topic goes
    elif old_type == APPLICATION and not session_present:
        out.reset_app_offsets = cid                  # same topic, backlog skipped
    if client_type == APPLICATION:
        out.ensure_app_topic = cid
    if stored is not None and stored.connected:
        out.disconnect = (stored.service_id, pb.DisconnectCommand(
            client_id=cid, session_id=stored.session_id, new_session_clean_start=conn.clean_start,
            reason=pb.DISCONNECT_REASON_SESSION_TAKEN_OVER))
        out.notes.append(f"takeover of {stored.session_id} on {stored.service_id}")

    out.session = pb.SessionInfo(
        client_id=cid, service_id=conn.service_id, session_id=conn.session_id, client_type=client_type,
        connected=True, clean_start=conn.clean_start, persistent=persistent, session_expiry_interval=sei,
        mqtt_version=conn.mqtt_version, keep_alive=conn.keep_alive, connected_at_ms=now_ms,
        disconnected_at_ms=0, client_address=conn.client_address, username=conn.username,
        last_request_id=req.request_id, connector_incarnation=conn.connector_incarnation)
    # a non-persistent DEVICE session whose CONNECT clears an earlier DEVICE session's store without blocking:
    # its removal clears again (SessionInfo.clear_at_end); one that found no DEVICE session stores nothing
    out.session.clear_at_end = bool(out.device_clear) and client_type == DEVICE and not persistent
    if conn.HasField("will"):
        out.session.will.CopyFrom(conn.will)
        out.session.will_delay = conn.will_delay
    if stored is not None and stored.HasField("taken_over_will"):
        out.session.taken_over_will.CopyFrom(stored.taken_over_will)   # still undecided: kept
    elif stored is not None and stored.connected and has_will(stored):
        delay = will_delay_seconds(stored.mqtt_version, stored.will_delay, stored.session_expiry_interval)
        if delay <= 0 or conn.clean_start:
            # the taken over connection's Will goes now [MQTT-3.1.4-3, MQTT-3.1.2-8] (with a delay, a resumed
            # session cancels it [MQTT-3.1.3-9]): its connector sends it if alive; kept until that is known
            out.session.taken_over_will.CopyFrom(pb.TakenOverWill(
                will=stored.will, service_id=stored.service_id,
                connector_incarnation=stored.connector_incarnation, taken_over_at_ms=now_ms))
    out.response = _answer(req, success=True, session_present=session_present, client_type=client_type, sei=sei,
                           persistent=persistent)
    out.response.awaiting_pubrel.extend(resumed_awaiting_pubrel(stored, session_present))
    # the routers know the stored session (and maybe its subscriptions, cleared above when not resumed): the
    # connector marks tbmq.msg.all before CONNACK (tbmq_platform.marks). A client id new to the registry
    # has neither, and its first SUBSCRIBE marks.
    out.response.mark_routing = stored is not None
    return out


def _removal(kind: str, stored: pb.SessionInfo, now_ms: int) -> Outcome:
    """Remove a session with its subscriptions and stored messages: a DEVICE session that kept messages
    (persistent), or whose store still owes a Clear (clear_at_end), is cleared in device-persistence. A
    non-persistent DEVICE session that found no earlier DEVICE session stored nothing: no call (the common
    clean-session disconnect; docs/session-registry.md, "Clear that does not block"). Copies a router stored
    after such a removal (its view of the session not read yet) expire with their TTL, and the next persistent
    DEVICE session of the client starts with a blocking Clear anyway."""
    cid = stored.client_id
    out = Outcome(kind, write_session=True, session=None,
                  clear_subscriptions=_empty_subscriptions(cid, stored.client_type))
    if stored.client_type == DEVICE and (stored.persistent or stored.clear_at_end):
        out.device_clear = cid
    return out


def decide_disconnect(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, rules: Rules,
                      now_ms: int) -> Outcome:
    if stored is None or stored.session_id != req.session.session_id or not stored.connected:
        return Outcome("stale")
    sei = stored.session_expiry_interval
    if stored.mqtt_version >= 5 and req.HasField("disconnect_session_expiry_interval"):
        # section 3.14.2.2.2 (no id): a session that was 0 at CONNECT cannot be given an interval at DISCONNECT
        if sei > 0:
            sei = rules.cap(req.disconnect_session_expiry_interval)
    # the connector owns the Will of a connection that ends through it: none after DISCONNECT 0x00
    # [MQTT-3.1.2-10], otherwise it sends it itself; the stored copy goes
    return _connection_ended(stored, req.request_id, sei, awaiting_pubrel(req.awaiting_pubrel), now_ms,
                             ("disconnected", "removed"))


def decide_connector_gone(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, now_ms: int) -> Outcome:
    """The connection's connector was declared dead: the session ends as on a connection lost without
    DISCONNECT, and its Will (if any) is published now or kept for its delay [MQTT-3.1.2-8, MQTT-3.1.3-9]."""
    if stored is None or stored.session_id != req.session.session_id or not stored.connected:
        return Outcome("stale")        # ended, or reconnected since the request was made
    sei = stored.session_expiry_interval
    delay = will_delay_seconds(stored.mqtt_version, stored.will_delay, sei) if has_will(stored) else 0
    out = _connection_ended(stored, req.request_id, sei, [], now_ms, ("connector-gone", "connector-gone-removed"),
                            keep_will=delay > 0)
    # should the run still be alive (paused, cut off), its connection closes without a Will of its own
    out.disconnect = (stored.service_id, pb.DisconnectCommand(
        client_id=stored.client_id, session_id=stored.session_id, reason=pb.DISCONNECT_REASON_CONNECTOR_FENCED,
        connector_incarnation=stored.connector_incarnation))
    if out.fallback is not None:
        out.fallback.disconnect = out.disconnect
    if has_will(stored) and delay <= 0:
        out.publish = _published_now(stored.will, now_ms)
        if out.fallback is not None:
            out.fallback.publish = out.publish
    return out


def decide_will_due(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, now_ms: int) -> Outcome:
    """The Will Delay of a dead connector's client ended before the session did [MQTT-3.1.3-9]: publish it."""
    if (stored is None or stored.session_id != req.session.session_id or not will_due(stored, now_ms)):
        return Outcome("ignored")      # resumed, ended (Will already sent) or not due yet
    s = pb.SessionInfo()
    s.CopyFrom(stored)
    _without_will(s)
    s.last_request_id = req.request_id
    return Outcome("will-sent", write_session=True, session=s, publish=_published_now(stored.will, now_ms))


def decide_taken_over_will(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, now_ms: int) -> Outcome:
    """The fate of the taken over connection's Will is known (the request's publish_will): publish or drop."""
    if stored is None or stored.session_id != req.session.session_id or not stored.HasField("taken_over_will"):
        return Outcome("ignored")
    s = pb.SessionInfo()
    s.CopyFrom(stored)
    s.ClearField("taken_over_will")
    s.last_request_id = req.request_id
    out = Outcome("taken-over-will-dropped", write_session=True, session=s)
    if req.publish_will:
        out.kind = "taken-over-will-sent"
        out.publish = _published_now(stored.taken_over_will.will, now_ms)
    return out


def _connection_ended(stored: pb.SessionInfo, request_id: str, sei: int, pubrel: list[int], now_ms: int,
                      kinds: tuple[str, str], keep_will: bool = False) -> Outcome:
    """The connected `stored` session's connection ended; `sei` governs what follows."""
    # the interval governs what happens after the connection: 0 ends the session now, also one that was
    # persistent for the connection because it resumed an existing session [MQTT-3.1.2-23]
    persistent = sei > 0
    if persistent:
        s = pb.SessionInfo()
        s.CopyFrom(stored)
        s.connected = False
        s.disconnected_at_ms = now_ms
        s.session_expiry_interval = sei
        s.persistent = True
        s.last_request_id = request_id
        s.awaiting_pubrel[:] = pubrel
        if not keep_will:
            _without_will(s)
        return Outcome(kinds[0], write_session=True, session=s)
    out = _removal(kinds[1], stored, now_ms)
    if stored.client_type == APPLICATION:
        out.reset_app_offsets = stored.client_id   # the backlog of a session that ended
    # if Clear fails: keep a dead record (disconnected, not persistent) for the expiry scan to retry
    dead = pb.SessionInfo()
    dead.CopyFrom(stored)
    dead.connected = False
    dead.persistent = False
    dead.disconnected_at_ms = now_ms
    dead.session_expiry_interval = 0
    dead.last_request_id = request_id
    dead.clear_at_end = bool(out.device_clear)   # the Clear still owed: the expiry scan's removal makes it
    del dead.awaiting_pubrel[:]
    _without_will(dead)
    out.fallback = Outcome("removal-deferred", write_session=True, session=dead,
                           clear_subscriptions=out.clear_subscriptions, reset_app_offsets=out.reset_app_offsets)
    return out


def decide_clear(stored: pb.SessionInfo | None, req: pb.SessionEventRequest, now_ms: int) -> Outcome:
    if stored is None:
        return Outcome("ignored")
    if req.session.session_id and stored.session_id != req.session.session_id:
        return Outcome("ignored")          # reconnected since the request was made
    if stored.connected and not req.force_cleanup:
        return Outcome("ignored")
    out = _removal("cleared", stored, now_ms)
    if not stored.connected and has_will(stored):
        out.publish = _published_now(stored.will, now_ms)   # the session ends before the Will Delay [MQTT-3.1.2-8]
    if stored.client_type == APPLICATION:
        out.app_removed = _app_removed(stored.client_id, now_ms)
    if stored.connected:
        out.disconnect = (stored.service_id, pb.DisconnectCommand(
            client_id=stored.client_id, session_id=stored.session_id,
            reason=pb.DISCONNECT_REASON_ADMINISTRATIVE))
    out.fallback = Outcome("clear-deferred")   # record kept; the expiry scan asks again
    return out


def scan_request(kind: int, stored: pb.SessionInfo, request_id: str, now_ms: int) -> pb.SessionEventRequest:
    """A request the registry's own scans send for a stored session (CLEAR_SESSION for an expired one,
    CONNECTOR_GONE for one connected on a dead connector, WILL_DUE for a delayed Will that is due): through
    the request topic, so it is serialised with the client's own events and applied by the partition's owner."""
    s = pb.SessionInfo(client_id=stored.client_id, service_id=stored.service_id, session_id=stored.session_id,
                       connector_incarnation=stored.connector_incarnation)
    return pb.SessionEventRequest(request_id=request_id, type=kind, session=s, request_time_ms=now_ms)


def clear_request(stored: pb.SessionInfo, request_id: str, now_ms: int) -> pb.SessionEventRequest:
    """The CLEAR_SESSION_REQUEST the expiry scan sends for an expired session."""
    return scan_request(pb.SESSION_EVENT_CLEAR_SESSION_REQUEST, stored, request_id, now_ms)
