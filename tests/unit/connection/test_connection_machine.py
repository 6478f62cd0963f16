"""Whole flows through the sans-io connection machine (tbmq_connection): no sockets, no event loop, time passed
in. Each test plays a client (connection_harness.Client) and checks the packets it gets and the effects the
connector is asked to run."""

from __future__ import annotations

import pytest
from connection_harness import Client, answer, plain
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import (
    AckStored,
    CatchUpRetained,
    Close,
    FetchStored,
    Online,
    ProducePublish,
    ProduceSubscriptions,
    PubrecStored,
    ReportDisconnect,
    RequestSession,
    ScheduleWill,
    SessionStarted,
    WaitRetained,
)
from tbmq_mqtt import (
    Auth,
    ConnAck,
    ConnackReturnCode,
    Connect,
    Disconnect,
    MqttProtocolError,
    PacketType,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)

pytestmark = pytest.mark.unit

RC = ReasonCode


def msg(topic: str = "t/1", payload: bytes = b"x", qos: int = 1, **kw) -> pb.PublishMsg:
    return pb.PublishMsg(topic=topic, payload=payload, qos=qos, created_at_ms=1, **kw)


def produced(c: Client, eff: ProducePublish, error=None) -> None:
    for _ in range(eff.pending):
        c.call("produced", eff, error)


# ------------------------------------------------------------------------------------------ CONNECT -> PUBLISH -> PUBACK
@pytest.mark.parametrize("level", [4, 5])
def test_connect_publish_puback_only_after_kafka_in_packet_order(level):
    c = Client(level)
    connack = c.connect()
    assert connack.reason_code == 0 and not connack.session_present
    assert c.request.client_id == "dev" and c.request.service_id == "c-1" and c.request.connected
    assert c.take_effects(SessionStarted) == [SessionStarted("dev", True)]
    assert c.take_effects(Online) == [Online("dev")]
    c.send(Publish(topic="a/b", payload=b"1", qos=1, packet_id=1))
    c.send(Publish(topic="a/c", payload=b"2", qos=1, packet_id=2))
    c.send(Publish(topic="a/d", payload=b"3", qos=0))
    e1, e2, e0 = c.take_effects(ProducePublish)
    assert (e1.topic, e1.msg.payload, e1.msg.publisher_id, e1.msg.created_at_ms) == ("a/b", b"1", "dev", c.now)
    assert e0.qos == 0 and e0.pending == 0
    assert c.take() == []                       # nothing acknowledged before Kafka acknowledged
    produced(c, e2)
    assert c.take() == []                       # packet order: 1 first
    produced(c, e1)
    assert c.take() == [PubAck(1), PubAck(2)]
    assert c.m.inbound.pending_acks == 0


def test_retained_publish_waits_for_both_records():
    c = Client(4)
    c.connect()
    c.send(Publish(topic="r", payload=b"1", qos=1, packet_id=7, retain=True))
    (e,) = c.take_effects(ProducePublish)
    assert e.retain and e.pending == 2
    c.call("produced", e, None)
    assert c.take() == []
    c.call("produced", e, None)
    assert c.take() == [PubAck(7)]


def test_kafka_failure_v5_acks_with_unspecified_error_v3_closes():
    c = Client(5)
    c.connect()
    c.send(Publish(topic="a", payload=b"1", qos=1, packet_id=1))
    c.send(Publish(topic="a", payload=b"1", qos=2, packet_id=2))
    e1, e2 = c.take_effects(ProducePublish)
    produced(c, e1, RuntimeError("broker down"))
    c.call("produce_failed", e2, RuntimeError("no producer"))
    assert plain(c.take()) == [PubAck(1, RC.UNSPECIFIED_ERROR), PubRec(2, RC.UNSPECIFIED_ERROR)]
    assert 2 not in c.m.inbound.awaiting_pubrel and c.closed is None

    c = Client(4)
    c.connect()
    c.send(Publish(topic="a", payload=b"1", qos=1, packet_id=1))
    (e,) = c.take_effects(ProducePublish)
    produced(c, e, RuntimeError("broker down"))
    assert c.take() == [] and c.closed is not None   # 3.1.1 has no failure PUBACK: never a false success


# ------------------------------------------------------------------------------------------ QoS 2 both ways
@pytest.mark.parametrize("level", [4, 5])
def test_qos2_inbound_exactly_once(level):
    c = Client(level)
    c.connect()
    c.send(Publish(topic="q", payload=b"1", qos=2, packet_id=9))
    (e,) = c.take_effects(ProducePublish)
    produced(c, e)
    assert c.take() == [PubRec(9)]
    # [MQTT-4.3.3-10] the client re-sends before PUBREL: PUBREC again, not produced again
    c.send(Publish(topic="q", payload=b"1", qos=2, packet_id=9, dup=True))
    assert c.take_effects(ProducePublish) == [] and c.take() == [PubRec(9)]
    c.send(PubRel(9))
    assert c.take() == [PubComp(9)]
    c.send(Publish(topic="q", payload=b"2", qos=2, packet_id=9))   # a new message with the freed id
    assert len(c.take_effects(ProducePublish)) == 1


def test_a_live_copy_a_routers_replay_brings_again_is_dropped():
    """[MQTT-4.3.3-2] a QoS 2 message is delivered once: a router that crashed routes its uncommitted
    records again, and their copies come after the first ones on the same downlink partition."""
    c = Client(4)
    c.connect()

    def live(payload: bytes, origin) -> list:
        c.call("deliver", msg(qos=2, payload=payload), 2, False, (), origin=origin)
        return [p.payload for p in c.take()]

    # (origin partition, downlink partition, origin offset, downlink offset)
    assert live(b"a", (3, 0, 10, 100)) == [b"a"]
    assert live(b"b", (3, 0, 11, 101)) == [b"b"]
    assert live(b"a", (3, 0, 10, 102)) == [] and live(b"b", (3, 0, 11, 103)) == []  # the replay
    assert live(b"c", (3, 0, 12, 104)) == [b"c"]  # what comes after the replay is new
    assert c.m.stats["dropped_replayed"] == 2
    # the same record may carry the client twice (its own subscriptions and a shared group): both go
    assert live(b"c2", (3, 0, 12, 104)) == [b"c2"]
    # marks are per (origin partition, downlink partition): lower offsets elsewhere are other messages
    assert live(b"d", (4, 0, 5, 105)) == [b"d"] and live(b"e", (3, 1, 1, 7)) == [b"e"]
    # a record of an older router (no origin) is always delivered
    assert live(b"f", None) == [b"f"]
    assert len(c.m.origins) == 3


@pytest.mark.parametrize("level", [4, 5])
def test_qos2_outbound_live_and_stored(level):
    c = Client(level)
    c.connect(answer(persistent=True, sei=60 if level == 5 else 0))
    (fetch,) = c.take_effects(FetchStored)
    c.call("fetch_finished", fetch)
    c.call("deliver", msg(qos=2), 2, False, ())
    (pub,) = c.take()
    assert pub.qos == 2 and pub.packet_id
    c.send(PubRec(pub.packet_id))
    assert c.take() == [PubRel(pub.packet_id)]
    c.send(PubComp(pub.packet_id))
    assert not c.m.out.inflight and c.of(AckStored) == [] and c.of(PubrecStored) == []  # live: nothing upstream
    # a stored message keeps the store's id and is acknowledged upstream at PUBREC (mark) and PUBCOMP; its
    # PUBREL waits until the mark is stored (a repeated PUBREC meanwhile gets nothing: the PUBREL follows)
    dm = pb.DevicePublishMsg(client_id="dev", packet_id=42, serial=9, msg=msg(qos=2))
    c.call("persisted", dm)
    (pub,) = c.take()
    assert pub.packet_id == 42
    c.send(PubRec(42))
    assert c.take() == [] and c.take_effects(PubrecStored) == [PubrecStored("dev", 42, 9, 42)]
    c.send(PubRec(42))
    assert c.take() == [] and c.take_effects(PubrecStored) == []
    c.call("pubrec_stored", 42)
    assert c.take() == [PubRel(42)]
    c.call("pubrec_stored", 42)  # once only
    assert c.take() == []
    c.send(PubComp(42))
    assert c.take_effects(AckStored) == [AckStored("dev", 42, 9)]
    # a PUBREC for an id we do not have: PUBREL all the same so the client can finish
    c.send(PubRec(77))
    assert c.take() == [PubRel(77, RC.PACKET_IDENTIFIER_NOT_FOUND if level == 5 else 0)]


def test_qos2_stored_pubrels_wait_for_their_marks_and_keep_pubrec_order():
    c = Client(4)
    c.connect(answer(persistent=True))
    (fetch,) = c.take_effects(FetchStored)
    c.call("fetch_finished", fetch)
    for pid, serial in ((10, 1), (11, 2)):
        c.call("persisted", pb.DevicePublishMsg(client_id="dev", packet_id=pid, serial=serial, msg=msg(qos=2)))
    c.call("deliver", msg(qos=2), 2, False, ())  # a live one
    pubs = c.take()
    live = pubs[2].packet_id
    c.send(PubRec(10))
    c.send(PubRec(11))
    c.send(PubRec(live))
    assert c.take() == []  # the live PUBREL queues behind the stored ones [MQTT-4.6.0-3]
    c.call("pubrec_stored", 11)
    assert c.take() == []  # 10's mark is not there yet
    c.call("pubrec_stored", 10)
    assert c.take() == [PubRel(10), PubRel(11), PubRel(live)]
    # a client that sends PUBCOMP before its PUBREL: the id stops waiting, those behind it go
    c.call("persisted", pb.DevicePublishMsg(client_id="dev", packet_id=12, serial=3, msg=msg(qos=2)))
    c.call("persisted", pb.DevicePublishMsg(client_id="dev", packet_id=13, serial=4, msg=msg(qos=2)))
    c.take()
    c.send(PubRec(12))
    c.send(PubRec(13))
    c.call("pubrec_stored", 13)
    c.send(PubComp(12))
    assert c.take() == [PubRel(13)]
    c.call("pubrec_stored", 12)  # late: nothing for an id already completed
    assert c.take() == []


# ------------------------------------------------------------------------------------------ takeover
def connected_with_delayed_will() -> Client:
    """A v5 connection (Session Expiry 60 s) with a Will delayed 30 s, its effects taken."""
    c = Client(5)
    will = Will(topic="w", payload=b"bye", qos=1, retain=False, properties=Properties(will_delay_interval=30))
    c.connect(answer(sei=60), will=will, properties=Properties(session_expiry_interval=60))
    c.take_effects()
    return c


@pytest.mark.parametrize("clean_start,expected_delay", [(False, None), (True, 0)])
def test_takeover_closes_without_reporting_and_decides_the_will(clean_start, expected_delay):
    c = connected_with_delayed_will()
    c.call("take_over", pb.DisconnectCommand(session_id=c.m.session_id, reason=pb.DISCONNECT_REASON_SESSION_TAKEN_OVER,
                                             new_session_clean_start=clean_start))
    assert plain(c.take()) == [Disconnect(RC.SESSION_TAKEN_OVER)]
    assert c.closed is not None and c.of(ReportDisconnect) == []   # the registry moved the session on already
    wills = c.of(ScheduleWill)
    if expected_delay is None:
        assert wills == []           # the session continues on the new connection before the delay passed
    else:
        assert [w.delay for w in wills] == [expected_delay]


@pytest.mark.parametrize("level,delay", [(4, 0), (5, 0), (5, 30)])
def test_fenced_connection_closes_without_will_or_report(level, delay):
    # the registry declared this connector run dead, ended the session and owns its Will (published once)
    c = Client(level)
    will = Will(topic="w", payload=b"bye", qos=1, retain=False,
                properties=Properties(will_delay_interval=delay) if level == 5 else Properties())
    c.connect(answer(sei=60), will=will, properties=Properties(session_expiry_interval=60) if level == 5 else None)
    c.take_effects()
    c.call("take_over", pb.DisconnectCommand(session_id=c.m.session_id,
                                             reason=pb.DISCONNECT_REASON_CONNECTOR_FENCED))
    if level == 5:
        assert plain(c.take()) == [Disconnect(RC.ADMINISTRATIVE_ACTION)]
    assert c.closed is not None and c.of(ReportDisconnect) == [] and c.of(ScheduleWill) == []


def test_administrative_disconnect_is_reported_and_sends_the_will_now():
    # the admin service's disconnect (new_session_clean_start: the Will goes at once, its delay not waited for):
    # the registry did not move the session on, so the connector reports the end like any close by the server
    c = connected_with_delayed_will()
    c.call("take_over", pb.DisconnectCommand(session_id=c.m.session_id, reason=pb.DISCONNECT_REASON_ADMINISTRATIVE,
                                             new_session_clean_start=True))
    assert plain(c.take()) == [Disconnect(RC.ADMINISTRATIVE_ACTION)]
    (report,) = c.of(ReportDisconnect)
    assert not report.graceful
    assert [w.delay for w in c.of(ScheduleWill)] == [0]


@pytest.mark.parametrize("level", [4, 5])
def test_a_revoked_connection_is_closed_reported_and_its_will_sent(level):
    """A blocked rule that matches a connected client, or its credential deleted (connector.service): v5
    DISCONNECT 0x98 with the reason as its Reason String, 3.x the socket closed; reported like any close by
    the server, so the Will goes; the CONNECT's user name is what blocked rules match."""
    c = Client(level)
    c.connect(answer(), will=Will(topic="w", payload=b"bye", qos=1, retain=False), username="alice")
    c.take_effects()
    assert c.m.username == "alice"
    c.call("revoke", "blocked by an administrator")
    sent = c.take()
    if level == 5:
        assert plain(sent) == [Disconnect(RC.ADMINISTRATIVE_ACTION)]
        assert sent[0].properties.reason_string == "blocked by an administrator"
    else:
        assert sent == []
    assert c.closed is not None and "access revoked" in c.closed.reason
    (report,) = c.of(ReportDisconnect)
    assert not report.graceful
    assert [w.delay for w in c.of(ScheduleWill)] == [0]
    assert c.m.stats["connections_revoked"] == 1
    c.call("revoke", "again")  # closed: nothing more
    assert c.take() == [] and c.m.stats["connections_revoked"] == 1


@pytest.mark.parametrize("level", [4, 5])
def test_a_connect_revoked_before_its_connack_is_answered_then_closed(level):
    """A blocked rule (or a deleted credential) that arrives while the CONNECT waits for the session registry
    (its check already passed): the CONNACK is still sent, so the client is not left without an answer, and
    the connection is closed right after it, as a connected one would be, with its Will."""
    c = Client(level)
    c.send(Connect(protocol_level=level, client_id="dev", clean_start=True, keep_alive=0,
                   will=Will(topic="w", payload=b"bye", qos=1, retain=False), properties=Properties(),
                   username="alice"))
    (request,) = c.take_effects(RequestSession)
    c.call("revoke", "blocked by an administrator")
    assert c.take() == [] and c.closed is None and c.m.stats["connections_revoked"] == 0
    c.run(c.m.session_answer(answer(), c.now))
    sent = c.take()
    assert isinstance(sent[0], ConnAck) and sent[0].reason_code == 0
    if level == 5:
        assert plain(sent[1:]) == [Disconnect(RC.ADMINISTRATIVE_ACTION)]
    else:
        assert sent[1:] == []
    assert c.closed is not None and "access revoked" in c.closed.reason
    (report,) = c.of(ReportDisconnect)
    assert not report.graceful
    assert [w.delay for w in c.of(ScheduleWill)] == [0]
    assert c.m.stats["connections_revoked"] == 1


# ------------------------------------------------------------------------------------------ keep alive
@pytest.mark.parametrize("level", [4, 5])
def test_keep_alive_timeout_after_one_and_a_half_periods(level):
    c = Client(level)
    c.connect(keep_alive=10)
    c.advance(14_000)
    assert c.closed is None
    c.m.bytes_received(c.now)         # a PINGREQ arrives
    c.send(PingReq())
    assert c.take() == [PingResp()]
    c.advance(14_999)                 # 15 s after the PINGREQ is the deadline
    assert c.closed is None
    c.advance(1)
    assert c.closed is not None and "keep alive" in c.closed.reason
    assert plain(c.take()) == ([Disconnect(RC.KEEP_ALIVE_TIMEOUT)] if level == 5 else [])
    (report,) = c.of(ReportDisconnect)
    assert not report.graceful


def test_server_keep_alive_caps_a_v5_client():
    c = Client(5, server_keep_alive_max=20)
    connack = c.connect(keep_alive=0)
    assert connack.properties.server_keep_alive == 20
    c.advance(30_000)
    assert c.closed is not None


def test_no_connect_within_the_connect_timeout():
    c = Client(4, connect_timeout_ms=2000)
    c.advance(1999)
    assert c.closed is None
    c.advance(1)
    assert c.closed is not None and c.of(ReportDisconnect) == []


# ------------------------------------------------------------------------------------------ will and will delay
def test_will_v3_at_once_on_a_lost_connection_not_after_disconnect():
    will = Will(topic="w", payload=b"bye", qos=0, retain=False)
    c = Client(4)
    c.connect(will=will)
    c.call("connection_lost", "reset by peer")
    (w,) = c.of(ScheduleWill)
    assert (w.client_id, w.will, w.delay) == ("dev", will, 0)
    assert c.of(ReportDisconnect)[0].graceful is False

    c = Client(4)
    c.connect(will=will)
    c.send(Disconnect())
    assert c.of(ScheduleWill) == [] and c.of(ReportDisconnect)[0].graceful   # [MQTT-3.1.2-10]


def test_connection_request_carries_the_will_for_the_registry_and_the_disconnect_does_not():
    # the registry publishes it should this connector die [MQTT-3.1.2-8] (docs/session-registry.md)
    will = Will(topic="w/dev", payload=b"bye", qos=1, retain=True,
                properties=Properties(will_delay_interval=30, content_type="text/plain"))
    c = Client(5)
    c.connect(answer(sei=60), will=will, properties=Properties(session_expiry_interval=60))
    assert c.request.HasField("will") and c.request.will_delay == 30
    w = c.request.will
    assert (w.topic, w.payload, w.qos, w.retain, w.content_type, w.publisher_id) == (
        "w/dev", b"bye", 1, True, "text/plain", "dev")
    c.send(Disconnect())
    (report,) = c.of(ReportDisconnect)
    assert not report.session.HasField("will")

    c = Client(4)
    c.connect()
    assert not c.request.HasField("will") and c.request.will_delay == 0


@pytest.mark.parametrize("reason,sei,delay", [(RC.DISCONNECT_WITH_WILL_MESSAGE, 60, 30), (None, 10, 10),
                                              (None, 0, 0)])
def test_will_delay_is_bounded_by_the_session(reason, sei, delay):
    will = Will(topic="w", payload=b"bye", qos=0, retain=False, properties=Properties(will_delay_interval=30))
    c = Client(5)
    c.connect(answer(sei=sei), will=will, properties=Properties(session_expiry_interval=sei))
    if reason is None:
        c.call("connection_lost", "gone")
    else:
        c.send(Disconnect(reason))
    assert [w.delay for w in c.of(ScheduleWill)] == [delay]   # [MQTT-3.1.3-9] [MQTT-3.1.2-8]


# ------------------------------------------------------------------------------------------ flow control
def test_receive_maximum_inbound_v5_disconnects_0x93():
    c = Client(5, receive_maximum=2)
    connack = c.connect()
    assert connack.properties.receive_maximum == 2
    for pid in (1, 2):
        c.send(Publish(topic="a", payload=b"", qos=1, packet_id=pid))
    assert c.closed is None
    c.send(Publish(topic="a", payload=b"", qos=1, packet_id=3))
    assert plain(c.take()) == [Disconnect(RC.RECEIVE_MAXIMUM_EXCEEDED)] and c.closed is not None


def test_receive_maximum_outbound_is_the_clients():
    c = Client(5)
    c.connect(properties=Properties(receive_maximum=2))
    for i in range(3):
        c.call("deliver", msg(payload=b"%d" % i), 1, False, ())
    sent = c.take()
    assert [p.payload for p in sent] == [b"0", b"1"]            # the window is the client's Receive Maximum
    c.run(c.m.pubacks([PubAck(sent[0].packet_id)], c.now))
    assert [p.payload for p in c.take()] == [b"2"]


def test_qos0_dropped_while_the_client_does_not_read():
    c = Client(4)
    c.connect()
    c.call("transport_paused")
    c.call("deliver", msg(qos=0), 0, False, ())
    c.call("deliver", msg(qos=1), 1, False, ())
    assert c.take() == [] and c.m.stats["dropped_qos0_slow"] == 1
    c.call("transport_resumed")
    assert [p.qos for p in c.take()] == [1]


def test_too_large_for_the_client_is_not_sent():
    c = Client(5)
    c.connect(properties=Properties(maximum_packet_size=64))
    c.call("deliver", msg(payload=b"x" * 100), 1, False, ())
    c.call("deliver", msg(payload=b"ok"), 1, False, ())
    assert [p.payload for p in c.take()] == [b"ok"] and c.m.stats["dropped_too_large"] == 1   # [MQTT-3.1.2-25]


# ------------------------------------------------------------------------------------------ topic aliases inbound
def test_inbound_topic_aliases():
    c = Client(5, topic_alias_maximum=2)
    connack = c.connect()
    assert connack.properties.topic_alias_maximum == 2
    c.send(Publish(topic="long/topic", payload=b"1", qos=0, properties=Properties(topic_alias=1)))
    c.send(Publish(topic="", payload=b"2", qos=0, properties=Properties(topic_alias=1)))
    assert [e.topic for e in c.take_effects(ProducePublish)] == ["long/topic", "long/topic"]
    c.send(Publish(topic="", payload=b"3", qos=0, properties=Properties(topic_alias=2)))   # never set
    assert plain(c.take()) == [Disconnect(RC.PROTOCOL_ERROR)] and c.closed is not None

    c = Client(5, topic_alias_maximum=2)
    c.connect()
    c.send(Publish(topic="a", payload=b"1", qos=0, properties=Properties(topic_alias=3)))  # above our maximum
    assert plain(c.take()) == [Disconnect(RC.TOPIC_ALIAS_INVALID)]


# ------------------------------------------------------------------------------------------ protocol errors
def test_bad_connect_answers_with_connack():
    c = Client(5)
    c.call("decode_error", MqttProtocolError(RC.UNSUPPORTED_PROTOCOL_VERSION, "level 6",
                                             packet_type=PacketType.CONNECT, protocol_level=5))
    assert plain(c.take()) == [ConnAck(False, RC.UNSUPPORTED_PROTOCOL_VERSION)] and c.closed is not None

    c = Client(4)   # 3.1.1: empty client id without clean session -> identifier rejected
    c.send(Connect(protocol_level=4, client_id="", clean_start=False, keep_alive=0))
    (ack,) = c.take()
    assert ack.reason_code == ConnackReturnCode.IDENTIFIER_REJECTED and c.closed is not None   # 3.x code

    c = Client(5)
    c.send(Connect(protocol_level=5, client_id="x", clean_start=True, keep_alive=0,
                   properties=Properties(authentication_method="SCRAM")))
    assert plain(c.take()) == [ConnAck(False, RC.BAD_AUTHENTICATION_METHOD)]


def test_protocol_errors_after_connack_disconnect_with_the_reason_code():
    c = Client(5)
    c.connect()
    c.send(Auth())
    assert plain(c.take()) == [Disconnect(RC.PROTOCOL_ERROR)] and c.closed is not None

    c = Client(5)
    c.connect(properties=Properties(session_expiry_interval=0))
    c.send(Disconnect(0, Properties(session_expiry_interval=60)))    # section 3.14.2.2.2
    assert plain(c.take()) == [Disconnect(RC.PROTOCOL_ERROR)]

    c = Client(5)
    c.connect()
    c.call("decode_error", MqttProtocolError(RC.MALFORMED_PACKET, "bad"))
    assert plain(c.take()) == [Disconnect(RC.MALFORMED_PACKET)]

    c = Client(4)     # 3.1.1: no DISCONNECT from a server, just closed
    c.connect()
    c.call("decode_error", MqttProtocolError(RC.MALFORMED_PACKET, "bad"))
    assert c.take() == [] and c.closed is not None


def test_publish_while_the_registry_answers_is_a_protocol_error():
    c = Client(5)
    c.send(Connect(protocol_level=5, client_id="x", clean_start=True, keep_alive=0))
    c.send(Publish(topic="a", payload=b"", qos=0))
    assert c.closed is not None and c.take() == []          # not connected yet: no DISCONNECT
    (report,) = c.of(ReportDisconnect)                       # the request was made: its end is reported
    c.call("session_answer", answer())                        # a late answer changes nothing
    assert c.take() == []


@pytest.mark.parametrize("failure,code", [(pb.SESSION_FAILURE_QUOTA_EXCEEDED, RC.QUOTA_EXCEEDED),
                                          (pb.SESSION_FAILURE_CLIENT_ID_NOT_VALID, RC.CLIENT_IDENTIFIER_NOT_VALID)])
def test_registry_refusal_is_the_connack_code(failure, code):
    c = Client(5)
    c.send(Connect(protocol_level=5, client_id="x", clean_start=True, keep_alive=0))
    c.call("session_answer", answer(success=False, failure=failure))
    assert plain(c.take()) == [ConnAck(False, code)] and c.closed is not None
    assert c.of(ReportDisconnect) == []                      # no session was created


def test_no_answer_from_the_registry_is_server_unavailable():
    c = Client(4)
    c.send(Connect(protocol_level=4, client_id="x", clean_start=True, keep_alive=0))
    c.call("session_failed", "timeout")
    (ack,) = c.take()
    assert ack.reason_code == ConnackReturnCode.SERVER_UNAVAILABLE and c.closed is not None


def test_shutdown_disconnects_v5_with_server_shutting_down():
    c = Client(5)
    c.connect()
    c.call("shutdown")
    assert plain(c.take()) == [Disconnect(RC.SERVER_SHUTTING_DOWN)]


# ------------------------------------------------------------------------------------------ subscribe
@pytest.mark.parametrize("level", [4, 5])
def test_subscribe_acks_after_kafka_then_retained(level):
    retained = {"r/#": [msg("r/1", b"kept", qos=1, retain=True)]}
    c = Client(level, retained=lambda f: retained.get(f, ()))
    c.connect()
    c.take_effects()
    c.send(Subscribe(packet_id=3, subscriptions=[Subscription("r/#", qos=1), Subscription("bad/#/x", qos=1)]))
    # the retained view's catch-up is asked first, then the set is written, then the catch-up awaited
    effects = c.take_effects()
    assert [type(e) for e in effects] == [CatchUpRetained, ProduceSubscriptions, WaitRetained]
    assert [t.topic_filter for t in effects[1].subscriptions] == ["r/#"]
    assert c.m.subs == {} and c.take() == []                      # applied once Kafka acknowledged
    c.call("subscriptions_written", None)
    assert c.take() == [] and c.m.awaiting_retained               # SUBACK waits for the retained view too
    c.call("retained_ready")
    suback, pub = c.take()
    assert suback == SubAck(3, [1, RC.TOPIC_FILTER_INVALID if level == 5 else RC.UNSPECIFIED_ERROR])
    assert pub.retain and pub.payload == b"kept"              # [MQTT-3.3.1-9]
    # the same subscription again: nothing to write, acknowledged at once
    c.send(Subscribe(packet_id=4, subscriptions=[Subscription("r/#", qos=1)]))
    assert c.take_effects(ProduceSubscriptions) == [] and c.take() == []
    c.call("retained_ready")
    assert isinstance(c.take()[0], SubAck)
    c.take_effects()
    # Retain Handling 2 (v5) or a filter without retained messages asked: no catch-up, SUBACK after Kafka only
    c.send(Subscribe(packet_id=6, subscriptions=[Subscription("q/1", qos=0, retain_handling=2 if level == 5 else 0)]))
    assert (CatchUpRetained in [type(e) for e in c.take_effects()]) is (level != 5)
    c.call("subscriptions_written", None)
    if level != 5:
        c.call("retained_ready")
    assert isinstance(c.take()[0], SubAck)
    c.send(Unsubscribe(packet_id=7, filters=["q/1"]))
    c.call("subscriptions_written", None)
    c.take()
    c.take_effects()
    c.send(Unsubscribe(packet_id=5, filters=["r/#", "nope"]))
    (ps,) = c.take_effects(ProduceSubscriptions)
    assert ps.subscriptions == []
    c.call("subscriptions_written", None)
    assert c.take() == [UnsubAck(5, [0, RC.NO_SUBSCRIPTION_EXISTED] if level == 5 else [])]


def test_subscribe_not_written_acks_failure():
    c = Client(5)
    c.connect()
    c.send(Subscribe(packet_id=3, subscriptions=[Subscription("a", qos=1)]))
    c.call("subscriptions_written", RuntimeError("kafka"))
    assert plain(c.take()) == [SubAck(3, [RC.UNSPECIFIED_ERROR])] and c.m.subs == {}


def test_expired_message_is_not_delivered():
    c = Client(5)
    c.connect()
    m = msg(message_expiry_interval=5)
    m.created_at_ms = c.now - 6000
    c.call("deliver", m, 1, False, ())
    assert c.take() == []                                    # [MQTT-3.3.2-5]
    m.created_at_ms = c.now - 2000
    c.call("deliver", m, 1, False, ())
    (pub,) = c.take()
    assert pub.properties.message_expiry_interval == 3


@pytest.mark.parametrize("level", [4, 5])
def test_expiry_is_checked_again_when_a_message_leaves_the_queue(level):
    """A message that waited behind the in-flight window goes out with the interval left when it is sent
    [MQTT-3.3.2-6], and not at all once it expired meanwhile [MQTT-3.3.2-5]: a live one is dropped, a stored
    DEVICE one acknowledged upstream (the store removes it). MQTT 3.1.1 carries no interval, but expires too."""
    c = Client(level, max_inflight=1)
    c.connect(answer(persistent=True, sei=60 if level == 5 else 0),
              properties=Properties(receive_maximum=1, session_expiry_interval=60) if level == 5 else None)
    (fetch,) = c.take_effects(FetchStored)
    c.call("fetch_finished", fetch)
    c.call("deliver", msg(payload=b"first"), 1, False, ())
    (first,) = c.take()
    for payload, interval in ((b"five", 5), (b"ten", 10), (b"one", 1)):
        m = msg(payload=payload, message_expiry_interval=interval)
        m.created_at_ms = c.now
        c.call("deliver", m, 1, False, ())
    stored = msg(payload=b"stored", message_expiry_interval=2)
    stored.created_at_ms = c.now
    c.call("persisted", pb.DevicePublishMsg(client_id="dev", packet_id=42, serial=7, msg=stored))
    assert c.take() == [] and c.of(AckStored) == []  # all queued behind "first"
    c.advance(3500)
    c.send(PubAck(first.packet_id))
    (five,) = c.take()
    assert five.payload == b"five"
    assert five.properties.message_expiry_interval == (2 if level == 5 else None)  # 1.5 s left, rounded up
    c.advance(2000)
    c.send(PubAck(five.packet_id))
    (ten,) = c.take()
    assert ten.payload == b"ten" and ten.properties.message_expiry_interval == (5 if level == 5 else None)
    c.take_effects()
    c.send(PubAck(ten.packet_id))  # "one" (1 s) and "stored" (2 s) expired while they waited
    assert c.take() == []
    assert c.take_effects(AckStored) == [AckStored("dev", 42, 7)]
    assert c.m.stats["dropped_expired"] == 2 and not c.m.out.inflight and not c.m.out.queue
    # one delivered in time is sent at once, with its interval as it is then
    m = msg(payload=b"now", message_expiry_interval=5)
    m.created_at_ms = c.now - 1200
    c.call("deliver", m, 1, False, ())
    (now,) = c.take()
    assert now.payload == b"now" and now.properties.message_expiry_interval == (4 if level == 5 else None)


def test_the_library_is_pure():
    """No event loop, Kafka, Redis or gRPC in tbmq_connection: it is driven by its caller."""
    import tbmq_connection
    from purity import assert_imports_none_of

    assert_imports_none_of(tbmq_connection, {"asyncio", "aiokafka", "redis", "grpc", "socket", "time", "threading"})


# ------------------------------------------------------------------------------------------ outbound topic aliases
def test_outbound_aliases_lru_map():
    from tbmq_connection.flow import OutboundAliases
    a = OutboundAliases(2)
    assert a.assign("x") == (1, False) and a.assign("y") == (2, False)
    assert a.assign("x") == (1, True)                # known: x is now the most recently used
    assert a.assign("z") == (2, False)               # full: y (least recently used) gives its alias to z
    assert a.assign("y") == (1, False)               # and x's goes to y
    a.forget("y")                                    # y's PUBLISH was not sent: the client does not know it
    assert a.assign("w") == (1, False)
    assert a.assign("z") == (2, True)


def test_outbound_topic_aliases_when_the_client_accepts_them():
    c = Client(5)
    c.connect(properties=Properties(topic_alias_maximum=2, maximum_packet_size=200))
    for topic in ("a/1", "a/1", "a/2", "a/3", "a/1"):
        c.call("deliver", msg(topic, qos=0), 0, False, ())
    c.call("deliver", msg("a/3", b"x" * 300, qos=1), 1, False, ())    # too large: not sent, a/3 keeps its alias
    c.call("deliver", msg("a/4", b"x" * 300, qos=1), 1, False, ())    # too large: its new alias is undone
    c.call("deliver", msg("a/3", qos=1), 1, False, ())
    got = [(p.topic, p.properties.topic_alias) for p in c.take()]
    # [MQTT-3.3.2-11]: never above the client's maximum; the name only when the alias is (re)assigned
    assert got == [("a/1", 1), ("", 1), ("a/2", 2), ("a/3", 1), ("a/1", 2), ("", 1)]

    c = Client(5)                                    # Topic Alias Maximum absent (0): no aliases
    c.connect()
    c.call("deliver", msg("a/1", qos=0), 0, False, ())
    c.call("deliver", msg("a/1", qos=0), 0, False, ())
    assert [(p.topic, p.properties.topic_alias) for p in c.take()] == [("a/1", None), ("a/1", None)]


# ------------------------------------------------------------------------------------------ reason strings
def test_reason_strings_unless_request_problem_information_is_0():
    c = Client(5)
    c.connect()
    c.send(Publish(topic="a", payload=b"", qos=1, packet_id=1))
    (e,) = c.take_effects(ProducePublish)
    produced(c, e, RuntimeError("down"))
    (ack,) = c.take()
    assert ack.reason_code == RC.UNSPECIFIED_ERROR and ack.properties.reason_string
    c.call("decode_error", MqttProtocolError(RC.MALFORMED_PACKET, "bad remaining length"))
    (d,) = c.take()
    assert d.properties.reason_string == "bad remaining length"

    c = Client(5)
    c.connect(properties=Properties(request_problem_information=False))
    c.send(Publish(topic="a", payload=b"", qos=1, packet_id=1))
    (e,) = c.take_effects(ProducePublish)
    produced(c, e, RuntimeError("down"))
    assert c.take() == [PubAck(1, RC.UNSPECIFIED_ERROR)]           # [MQTT-3.1.2-29]: not on a PUBACK
    c.send(Subscribe(packet_id=2, subscriptions=[Subscription("s", qos=1)]))
    c.call("subscriptions_written", RuntimeError("down"))
    assert c.take() == [SubAck(2, [RC.UNSPECIFIED_ERROR])]         # nor on a SUBACK
    c.call("shutdown")
    (d,) = c.take()
    assert d.properties.reason_string == "server shutting down"    # DISCONNECT may always carry one


def test_reason_string_left_out_when_it_would_exceed_the_clients_maximum_packet_size():
    c = Client(5)
    c.connect(properties=Properties(maximum_packet_size=16))
    c.call("decode_error", MqttProtocolError(RC.MALFORMED_PACKET, "a long explanation " * 5))
    assert c.take() == [Disconnect(RC.MALFORMED_PACKET)]


def test_registry_refusal_carries_a_reason_string():
    c = Client(5)
    c.send(Connect(protocol_level=5, client_id="x", clean_start=True, keep_alive=0))
    c.call("session_answer", answer(success=False, failure=pb.SESSION_FAILURE_QUOTA_EXCEEDED))
    (ack,) = c.take()
    assert ack.reason_code == RC.QUOTA_EXCEEDED and "QUOTA_EXCEEDED" in ack.properties.reason_string


# ------------------------------------------------------------------------------------------ response information
@pytest.mark.parametrize("requested,configured,expected", [(True, "resp/", "resp/"), (False, "resp/", None),
                                                           (True, "", None)])
def test_response_information_when_requested_and_configured(requested, configured, expected):
    c = Client(5, response_information=configured)
    connack = c.connect(properties=Properties(request_response_information=requested))
    assert connack.properties.response_information == expected     # [MQTT-3.1.2-28]


def test_inbound_qos2_ids_reported_only_when_kafka_acknowledged():
    """An id whose PUBLISH Kafka did not (yet) acknowledge is not reported: re-sent, it is produced again."""
    c = Client(5)
    c.connect(answer(present=False, sei=600, persistent=True), properties=Properties(session_expiry_interval=600))
    for pid in (1, 2, 3):
        c.send(Publish(topic="t", payload=b"x", qos=2, packet_id=pid))
    e1, e2, e3 = c.take_effects(ProducePublish)
    c.call("produced", e1, None)
    c.call("produced", e3, RuntimeError("refused"))
    c.call("connection_lost", "gone")
    (report,) = c.of(ReportDisconnect)
    assert report.awaiting_pubrel == (1,)
