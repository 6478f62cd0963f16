"""Pure pieces of the connector: packet ids, in-flight window, topic aliases, inbound QoS, CONNECT
validation, Kafka payload conversion, settings, Will scheduling."""

from __future__ import annotations

import pytest
from tbmq_connection.connect import ConnectRefused, plan_connect
from tbmq_routing.wills import will_delay_seconds
from tbmq_connection.convert import outbound_publish, publish_msg
from tbmq_connection.flow import (
    AWAIT_PUBCOMP,
    AWAIT_PUBREC,
    DEVICE,
    AliasError,
    InboundAliases,
    InboundQos,
    OutboundWindow,
    OutMsg,
    PacketIds,
)
from connector.grpc_clients import pick_target
from connector.settings import ConnectorSettings
from connector.wills import Wills
from fake_timers import FakeTimers
from tbmq.v1 import messages_pb2 as pb
from tbmq_mqtt import Connect, Properties, Publish, ReasonCode, Will
from tbmq_platform.settings import SettingsError, load

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------------ packet ids
def test_packet_ids_skip_ids_in_use_and_wrap():
    ids = PacketIds()
    assert ids.allocate({65535, 65534}) == 65533
    assert ids.allocate(set()) == 65532
    in_use = set(range(2, 65533))
    assert ids.allocate(in_use) == 1
    assert ids.allocate(in_use) == 65535  # wrapped
    assert ids.allocate(set(range(1, 65536))) is None


def _pub(i: int, size: int = 1) -> Publish:
    return Publish(topic="t", payload=bytes([i]) * size, qos=1)


def test_window_honours_receive_maximum_and_keeps_order():
    w = OutboundWindow(window=2, max_queued=10)
    for i in range(5):
        assert w.offer(OutMsg(qos=1, publish=_pub(i)))
    sent = w.ready()
    assert [m.publish.payload for m in sent] == [b"\x00", b"\x01"]
    assert w.ready() == []
    assert w.on_puback(sent[0].packet_id) is sent[0]
    assert w.on_puback(sent[0].packet_id) is None  # twice: unknown
    assert [m.publish.payload for m in w.ready()] == [b"\x02"]
    assert len(w.inflight) == 2 and len(w.queue) == 2


def test_queue_is_bounded_in_bytes_too():
    # issue 14: what a client that does not read can make the connector hold (MQTT_MAX_QUEUED_BYTES)
    w = OutboundWindow(window=1, max_queued=100, max_queued_bytes=2500)
    assert w.offer(OutMsg(qos=1, publish=_pub(0, 1000)))   # 1001 bytes queued
    assert w.offer(OutMsg(qos=1, publish=_pub(1, 1000)))   # 2002
    assert not w.offer(OutMsg(qos=1, publish=_pub(2, 1000)))  # would be 3003: dropped
    assert w.dropped == 1
    assert w.offer(OutMsg(qos=1, publish=_pub(3, 1000)), force=True)  # stored messages are never dropped
    w.ready()                                              # one goes in flight: its bytes leave the queue
    assert w.queued_bytes == 2002
    assert not w.offer(OutMsg(qos=1, publish=_pub(4, 1000)))
    w.clear()
    assert w.queued_bytes == 0 and w.offer(OutMsg(qos=1, publish=_pub(5, 1000)))


def test_window_queue_is_bounded_but_stored_messages_are_forced():
    w = OutboundWindow(window=1, max_queued=2)
    assert w.offer(OutMsg(qos=1)) and w.offer(OutMsg(qos=1))
    assert not w.offer(OutMsg(qos=1))
    assert w.dropped == 1
    assert w.offer(OutMsg(qos=1, kind=DEVICE, fixed_id=5), force=True)


def test_qos2_states_and_failed_pubrec():
    w = OutboundWindow(window=10, max_queued=10)
    w.offer(OutMsg(qos=2))
    w.offer(OutMsg(qos=2))
    a, b = w.ready()
    assert a.state == AWAIT_PUBREC
    assert w.on_pubcomp(a.packet_id) is None  # PUBCOMP before PUBREC: not accepted
    assert w.on_pubrec(a.packet_id) is a and a.state == AWAIT_PUBCOMP
    assert w.on_pubcomp(a.packet_id) is a
    assert w.on_pubrec(b.packet_id, failed=True) is b  # v5 PUBREC >= 0x80 ends the flow
    assert not w.inflight


def test_fixed_ids_wait_for_a_colliding_live_id_and_live_ids_avoid_fixed_ones():
    w = OutboundWindow(window=10, max_queued=10)
    w.offer(OutMsg(qos=1, kind=DEVICE, fixed_id=65535))
    w.offer(OutMsg(qos=1))  # live: must not take 65535
    dev, live = w.ready()
    assert dev.packet_id == 65535 and live.packet_id != 65535
    # a stored message whose id is held by a live in-flight message waits, in order
    w.offer(OutMsg(qos=1, kind=DEVICE, fixed_id=live.packet_id))
    w.offer(OutMsg(qos=1))
    assert w.ready() == []
    w.on_puback(live.packet_id)
    nxt = w.ready()
    assert nxt[0].kind == DEVICE and nxt[0].packet_id == live.packet_id and len(nxt) == 2


def test_pubrel_only_messages_await_pubcomp():
    w = OutboundWindow(window=10, max_queued=10)
    w.offer(OutMsg(qos=2, kind=DEVICE, fixed_id=9, pubrel_only=True), force=True)
    (m,) = w.ready()
    assert m.state == AWAIT_PUBCOMP and w.on_pubcomp(9) is m


# ------------------------------------------------------------------------------------------ aliases
def test_inbound_topic_aliases():
    a = InboundAliases(3)
    assert a.resolve("t/1", None) == "t/1"
    assert a.resolve("t/1", 1) == "t/1"
    assert a.resolve("", 1) == "t/1"
    assert a.resolve("t/2", 1) == "t/2"  # re-mapped
    assert a.resolve("", 1) == "t/2"
    with pytest.raises(AliasError) as e:
        a.resolve("", 2)
    assert e.value.reason_code == 0x82
    with pytest.raises(AliasError) as e:
        a.resolve("x", 4)
    assert e.value.reason_code == 0x94
    with pytest.raises(AliasError) as e:
        a.resolve("x", 0)
    assert e.value.reason_code == 0x94
    with pytest.raises(AliasError):
        InboundAliases(0).resolve("x", 1)


def test_inbound_qos_quota():
    q = InboundQos(2)
    assert not q.over_quota()
    q.pending_acks = 1
    q.awaiting_pubrel.add(5)
    assert q.over_quota()


# ------------------------------------------------------------------------------------------ CONNECT
def plan(c, ka_max=600):
    return plan_connect(c, server_keep_alive_max=ka_max)


def test_empty_client_id_rules():
    p = plan(Connect(protocol_level=5, client_id="", clean_start=False))
    assert p.assigned_client_id and p.client_id
    p = plan(Connect(protocol_level=4, client_id="", clean_start=True))
    assert p.assigned_client_id
    with pytest.raises(ConnectRefused) as e:
        plan(Connect(protocol_level=4, client_id="", clean_start=False))
    assert e.value.reason_code == 0x85
    with pytest.raises(ConnectRefused):
        plan(Connect(protocol_level=3, client_id="", clean_start=True))
    assert plan(Connect(protocol_level=4, client_id="x" * 1000)).client_id == "x" * 1000


def test_a_client_id_naming_a_shared_groups_store_is_refused():
    from tbmq_routing import shared_store_id

    for level in (3, 4, 5):
        with pytest.raises(ConnectRefused) as e:
            plan(Connect(protocol_level=level, client_id=shared_store_id("g", "a/+"), clean_start=True))
        assert e.value.reason_code == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert plan(Connect(protocol_level=4, client_id="ss_g_a/+")).client_id == "ss_g_a/+"  # TBMQ's form: a plain id


def test_keep_alive_and_server_keep_alive():
    assert plan(Connect(protocol_level=5, keep_alive=30, client_id="a")).server_keep_alive is None
    p = plan(Connect(protocol_level=5, keep_alive=0, client_id="a"), ka_max=100)
    assert p.keep_alive == 100 and p.server_keep_alive == 100
    p = plan(Connect(protocol_level=5, keep_alive=1000, client_id="a"), ka_max=100)
    assert p.keep_alive == 100 and p.server_keep_alive == 100
    p = plan(Connect(protocol_level=4, keep_alive=1000, client_id="a"), ka_max=100)
    assert p.keep_alive == 1000 and p.server_keep_alive is None  # 3.x cannot be told otherwise
    assert plan(Connect(protocol_level=5, keep_alive=0, client_id="a"), ka_max=0).keep_alive == 0


def test_session_expiry_receive_maximum_packet_size_will_delay():
    c = Connect(protocol_level=5, client_id="a", properties=Properties(
        session_expiry_interval=0xFFFFFFFF, receive_maximum=5, maximum_packet_size=1000, topic_alias_maximum=4),
        will=Will(topic="w", properties=Properties(will_delay_interval=30)))
    p = plan(c)
    assert p.requested_session_expiry == 0xFFFFFFFF  # as sent: the registry caps it (its one setting)
    assert p.receive_maximum == 5 and p.maximum_packet_size == 1000 and p.topic_alias_maximum == 4
    assert p.will_delay == 30
    p3 = plan(Connect(protocol_level=4, client_id="a", clean_start=False))
    assert p3.requested_session_expiry == 0 and p3.receive_maximum == 65535 and p3.maximum_packet_size is None
    assert plan(Connect(protocol_level=5, client_id="a", clean_start=False)).requested_session_expiry == 0  # absent


def test_invalid_will_topic_refused():
    with pytest.raises(ConnectRefused) as e:
        plan(Connect(protocol_level=5, client_id="a", will=Will(topic="a/+")))
    assert e.value.reason_code == 0x90


def test_will_delay_rule():
    # persistence is the registry's answer (session_registry.logic.is_persistent; test_connector_session_answer)
    assert will_delay_seconds(5, 30, 10) == 10    # the session ends first
    assert will_delay_seconds(5, 30, 100) == 30
    assert will_delay_seconds(5, 30, 0) == 0      # ends with the connection (a resumed one with 0 included)
    assert will_delay_seconds(4, 30, 100) == 0    # 3.x has no Will Delay


# ------------------------------------------------------------------------------------------ conversion
def test_publish_round_trip_with_expiry():
    p = Publish(topic="a/b", payload=b"x", qos=1, retain=True, packet_id=3, properties=Properties(
        message_expiry_interval=10, content_type="c", user_properties=(("k", "v"), ("k", "w")),
        response_topic="r", correlation_data=b"cd", payload_format_indicator=1))
    msg = publish_msg(p, "a/b", publisher_id="pub", service_id="connector-1", mqtt_version=5, now_ms=1_000_000)
    assert msg.retain and msg.qos == 1 and msg.message_expiry_interval == 10
    out = outbound_publish(msg, 0, False, [7], 1_004_000, v5=True)
    assert out.qos == 0 and not out.retain and out.properties.message_expiry_interval == 6
    assert out.properties.subscription_identifiers == (7,)
    assert out.properties.user_properties == (("k", "v"), ("k", "w"))
    assert out.properties.correlation_data == b"cd" and out.properties.payload_format_indicator == 1
    assert outbound_publish(msg, 1, False, [], 1_004_001, v5=True).properties.message_expiry_interval == 6
    assert outbound_publish(msg, 1, False, [], 1_009_999, v5=True).properties.message_expiry_interval == 1
    assert outbound_publish(msg, 1, False, [], 1_010_000, v5=True) is None  # expired [MQTT-3.3.2-5]
    v3 = outbound_publish(msg, 1, True, [7], 1_004_000, v5=False)
    assert v3.properties == Properties()


def test_no_expiry_means_none():
    msg = pb.PublishMsg(topic="t", created_at_ms=1)
    assert outbound_publish(msg, 0, False, [], 10**12, v5=True).properties == Properties()


# ------------------------------------------------------------------------------------------ settings
def test_settings_defaults_and_errors(monkeypatch):
    s = load(ConnectorSettings, {})
    assert s.instance_id == "connector-1" and s.mqtt_port == 1883 and s.health_port == 8081
    assert s.app_delivery_grpc_targets == ("localhost:9062",)
    s = load(ConnectorSettings, {"TBMQ_SERVICE_ID": "c-7", "APP_DELIVERY_GRPC_TARGETS": "a:1,b:2"})
    assert s.instance_id == "c-7" and s.app_delivery_grpc_targets == ("a:1", "b:2")
    import socket
    s = load(ConnectorSettings, {"TBMQ_SERVICE_ID_FROM_HOSTNAME": "true"})
    assert s.instance_id == socket.gethostname()
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, {"MQTT_PORT": "x", "MQTT_RECEIVE_MAXIMUM": "0"})
    assert "MQTT_PORT" in str(e.value) and "MQTT_RECEIVE_MAXIMUM" in str(e.value)


def test_app_delivery_target_is_stable_per_client():
    targets = ("a:1", "b:2", "c:3")
    assert pick_target(targets, "client-1") == pick_target(targets, "client-1")
    assert len({pick_target(targets, f"c{i}") for i in range(100)}) == 3


# ------------------------------------------------------------------------------------------ wills
def test_will_delay_cancelled_by_reconnect_and_fired_by_session_end():
    sent = []
    timers = FakeTimers()
    wills = Wills(lambda cid, will, level: sent.append(cid), call_later=timers.call_later)
    wills.schedule("a", "s1", object(), 5, 0)
    assert sent == ["a"]
    wills.schedule("b", "s1", object(), 5, 0.05)
    wills.on_connected("b", clean_start=False)  # reconnected in time: no Will
    wills.schedule("c", "s1", object(), 5, 0.05)
    wills.on_connected("c", clean_start=True)   # the session ended: at once
    assert sent == ["a", "c"]
    wills.schedule("d", "s1", object(), 5, 0.05)
    timers.advance(0.049)
    assert sent == ["a", "c"]
    timers.advance(0.001)
    assert sent == ["a", "c", "d"]
    timers.advance(1)  # b's cancelled timer never fires
    assert sent == ["a", "c", "d"]
    # another connector took the session: seen on tbmq.client.session
    wills.schedule("e", "s1", object(), 5, 10)
    info = pb.SessionInfo(client_id="e", session_id="s2", connected=True, clean_start=False)
    wills.on_session_record(b"e", info.SerializeToString())
    assert "e" not in wills.pending and sent == ["a", "c", "d"]
    # own disconnect record (same session id) changes nothing; removal of the session sends it
    wills.schedule("f", "s1", object(), 5, 10)
    wills.on_session_record(b"f", pb.SessionInfo(client_id="f", session_id="s1").SerializeToString())
    assert "f" in wills.pending
    wills.on_session_record(b"f", None)
    assert sent[-1] == "f"


def test_docs_list_every_setting():
    from pathlib import Path

    from tbmq_platform.settings import CommonSettings, describe

    root = Path(__file__).resolve().parents[3]
    doc = (root / "docs" / "connector.md").read_text()
    readme = (root / "services" / "connector" / "README.md").read_text()
    architecture = (root / "docs" / "architecture.md").read_text()
    common = {var for var, _default, _doc in describe(CommonSettings)} - {"HEALTH_PORT"}
    for var in common:
        assert f"`{var}`" in architecture, var  # the common settings are documented once, there
    for var, _default, _doc in describe(ConnectorSettings):
        if var in common:
            continue
        assert f"`{var}`" in doc, var
        assert var in readme, var
