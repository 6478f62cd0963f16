"""connector.connection.Connection, the asyncio adapter, on a mock transport: bytes in through data_received(),
the machine's effects run through a fake port (connector_fakes), what the client gets read back from the
transport. No sockets, no Kafka, no sleeps."""

from __future__ import annotations

import asyncio

import pytest
from connector.connection import Connection
from connector_fakes import FakePort, FakeTransport, connected, until, v5_connect
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import CLOSED, CONNECTED
from tbmq_mqtt import (
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    encode,
)

pytestmark = pytest.mark.unit


async def test_connect_then_publish_split_across_reads_gets_puback_after_kafka():
    port = FakePort()
    conn, transport, (connack,) = await connected(port, Connect(protocol_level=4, client_id="a", clean_start=True,
                                                                keep_alive=30))
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    assert port.by_client == {"a": conn} and port.by_session == {conn.session_id: conn}
    assert port.started == [("a", True)]
    data = encode(Publish(topic="x/y", payload=b"hello", qos=1, packet_id=5), 4) + \
        encode(Publish(topic="x/z", payload=b"", qos=2, packet_id=6), 4)
    conn.data_received(data[:7])                     # a PUBLISH split across TCP segments
    conn.data_received(data[7:])
    await until(lambda: len(transport.data) >= 8)
    assert transport.packets(4) == [PubAck(5), PubRec(6)]
    assert [(m.topic, m.payload, t) for m, t, _r in port.produced] == [("x/y", b"hello", "x/y"), ("x/z", b"", "x/z")]
    conn.data_received(encode(PubRel(6), 4))
    await until(lambda: bool(transport.data))
    assert transport.packets(4) == [PubComp(6)]


async def test_subscribe_and_live_delivery_and_pubacks():
    port = FakePort()
    conn, transport, _ = await connected(port, v5_connect(clean_start=True, sei=None))
    conn.data_received(encode(Subscribe(packet_id=1, subscriptions=[Subscription("t/#", qos=1)]), 5))
    await until(lambda: bool(transport.data))
    assert transport.packets(5) == [SubAck(1, [1])]
    assert [t.topic_filter for t in port.subscription_sets[0]] == ["t/#"]
    for i in range(3):
        conn.deliver(pb.PublishMsg(topic="t/1", payload=b"%d" % i, qos=1, created_at_ms=1), 1, False, ())
    pubs = transport.packets(5)
    assert [p.payload for p in pubs] == [b"0", b"1", b"2"]
    conn.data_received(b"".join(encode(PubAck(p.packet_id), 5) for p in pubs))
    await until(lambda: not conn.m.out.inflight)
    assert port.stats["msgs_out_qos0"] + port.stats["msgs_out_qos1"] + port.stats["msgs_out_qos2"] == 3


async def test_an_idle_connection_holds_no_task_and_acknowledgements_are_handled_at_once():
    """The packet loop is a task only while a packet's effects need awaiting: none once the CONNECT is done
    (about 0.9 KB per held connection saved), and a PUBACK is applied inside data_received, without one."""
    port = FakePort()
    conn, transport, _ = await connected(port, v5_connect(clean_start=True, sei=None))
    conn.data_received(encode(Subscribe(packet_id=1, subscriptions=[Subscription("t/#", qos=1)]), 5))
    await until(lambda: bool(transport.data))
    await until(lambda: conn._task is None)
    for i in range(2):
        conn.deliver(pb.PublishMsg(topic="t/1", payload=b"%d" % i, qos=1, created_at_ms=1), 1, False, ())
    pubs = transport.packets(5)
    assert len(conn.m.out.inflight) == 2
    conn.data_received(b"".join(encode(PubAck(p.packet_id), 5) for p in pubs))
    assert not conn.m.out.inflight and conn._task is None  # no await in between: handled inline
    conn.data_received(encode(PingReq(), 5))
    assert transport.packets(5) == [PingResp()] and conn._task is None


async def test_a_publish_is_handed_to_the_producer_inside_data_received_without_a_task():
    """The hand-over to the producer runs eagerly (tbmq_platform.eager): aiokafka appends to the open batch
    without waiting, so a PUBLISH is with the producer when data_received returns and no task was started; the
    PUBACK still waits for Kafka's acknowledgement."""
    port = FakePort()
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="p", clean_start=True))
    await until(lambda: conn._task is None)
    conn.data_received(encode(Publish(topic="a/1", payload=b"1", qos=1, packet_id=7), 4))
    assert [m.payload for m, _t, _r in port.produced] == [b"1"] and conn._task is None
    assert transport.data == b""  # the acknowledgement's callback has not run yet
    await until(lambda: bool(transport.data))
    assert transport.packets(4) == [PubAck(7)]


async def test_publishes_reach_the_producer_in_packet_order_with_a_delivery_in_between():
    """A hand-over that has to wait (the partition's batch full) leaves its rest to a task; a delivery that runs
    the machine's effects meanwhile must not hand the next PUBLISH over itself (it would overtake the waiting
    one), and the task ends once the queue is empty."""
    port = FakePort()
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="p", clean_start=True))
    conn.data_received(encode(Subscribe(packet_id=1, subscriptions=[Subscription("t/#", qos=0)]), 4))
    await until(lambda: bool(transport.data))
    transport.packets(4)
    await until(lambda: conn._task is None)
    port.produce_gate = asyncio.get_running_loop().create_future()
    conn.data_received(encode(Publish(topic="a/1", payload=b"1", qos=1, packet_id=1), 4))
    assert conn._task is not None and port.produced == []  # waiting inside the hand-over, in the task
    conn.deliver(pb.PublishMsg(topic="t/1", payload=b"d", qos=0, created_at_ms=1), 0, False, ())
    conn.data_received(encode(Publish(topic="a/1", payload=b"2", qos=1, packet_id=2), 4))
    await until(lambda: bool(transport.data))  # the delivery, at once
    assert port.produced == []
    port.produce_gate.set_result(None)
    await until(lambda: len(port.produced) == 2)
    assert [m.payload for m, _t, _r in port.produced] == [b"1", b"2"]
    await until(lambda: conn._task is None)
    await until(lambda: transport.data.endswith(encode(PubAck(2), 4)))  # after Kafka's acknowledgements
    got = transport.packets(4)
    assert [p.payload for p in got if isinstance(p, Publish)] == [b"d"]
    assert [p.packet_id for p in got if isinstance(p, PubAck)] == [1, 2]


async def test_a_hand_over_that_fails_at_once_is_answered_like_one_that_failed_waiting():
    """The producer refusing a record (closed, its buffer full past the timeout) fails the PUBLISH whether the
    refusal came at once or after a wait: a v5 PUBACK with an error code, in packet order."""
    port = FakePort()
    conn, transport, _ = await connected(port, v5_connect(clean_start=True, sei=None))
    await until(lambda: conn._task is None)
    port.produce_error = RuntimeError("producer closed")
    conn.data_received(encode(Publish(topic="a/1", payload=b"1", qos=1, packet_id=1), 5))
    assert conn._task is None
    (first,) = transport.packets(5)
    port.produce_error = None
    port.produce_gate = asyncio.get_running_loop().create_future()
    conn.data_received(encode(Publish(topic="a/1", payload=b"2", qos=1, packet_id=2), 5))
    port.produce_gate.set_exception(RuntimeError("producer closed"))
    await until(lambda: bool(transport.data))
    (second,) = transport.packets(5)
    assert isinstance(first, PubAck) and first.packet_id == 1 and first.reason_code >= 0x80
    assert isinstance(second, PubAck) and second.packet_id == 2 and second.reason_code == first.reason_code
    assert port.produced == []


async def test_garbage_before_connect_closes_without_an_answer():
    port = FakePort()
    conn = Connection(port)
    transport = FakeTransport()
    conn.connection_made(transport)
    conn.data_received(encode(PubAck(1), 4))         # [MQTT-3.1.0-1]: the first packet must be CONNECT
    assert conn.state == CLOSED and transport.closed and transport.data == b""
    assert port.connections == set() and port.disconnects == []


async def test_malformed_packet_after_connack_v5_disconnects_with_the_code():
    port = FakePort()
    conn, transport, _ = await connected(port, v5_connect(clean_start=True, sei=None))
    conn.data_received(bytes([0x30, 0x02, 0x00, 0x05]))   # PUBLISH whose topic length runs past the packet
    assert conn.state == CLOSED and transport.closed
    (d,) = transport.packets(5)
    assert isinstance(d, Disconnect) and d.reason_code == ReasonCode.MALFORMED_PACKET
    await until(lambda: len(port.disconnects) == 1)
    assert port.by_client == {} and port.by_session == {} and port.connections == set()


async def test_client_not_reading_is_aborted():
    port = FakePort()
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="a", clean_start=True,
                                                       keep_alive=0))
    transport.get_write_buffer_size = lambda: port.settings.write_buffer_limit + 1
    conn.deliver(pb.PublishMsg(topic="t", payload=b"x", qos=0, created_at_ms=1), 0, False, ())
    assert conn.state == CLOSED and transport.aborted


async def test_takeover_command_closes_with_session_taken_over():
    port = FakePort()
    conn, transport, _ = await connected(port, v5_connect(clean_start=True, sei=None))
    port.by_session[conn.session_id].take_over(pb.DisconnectCommand(session_id=conn.session_id))
    (d,) = transport.packets(5)
    assert d.reason_code == ReasonCode.SESSION_TAKEN_OVER
    assert d.properties.reason_string == "session taken over by a newer connection"
    assert conn.state == CLOSED and port.disconnects == [] and port.connections == set()


async def test_connection_lost_reports_the_disconnect_and_sends_the_will():
    from tbmq_mqtt import Will
    port = FakePort()
    will = Will(topic="w", payload=b"bye", qos=0, retain=False)
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="a", clean_start=True,
                                                       keep_alive=0, will=will))
    assert conn.state == CONNECTED
    conn.connection_lost(ConnectionResetError("reset"))
    assert port.wills == [("a", will, 0)]
    (info, graceful, _expiry), = port.disconnects
    assert not graceful and info.client_id == "a"


async def test_connections_over_the_limits_are_closed_before_connect():
    # issue 14, limits: MQTT_MAX_CONNECTIONS per connector, MQTT_CONNECT_RATE_PER_IP (token bucket per address)
    port = FakePort(env={"MQTT_MAX_CONNECTIONS": "2", "MQTT_CONNECT_RATE_PER_IP": "1",
                         "MQTT_CONNECT_BURST_PER_IP": "10"})
    conns = []
    for _ in range(3):
        conn, transport = Connection(port), FakeTransport()
        conn.connection_made(transport)
        conns.append((conn, transport))
    assert [t.aborted for _c, t in conns] == [False, False, True]
    assert port.stats["refused_max_connections"] == 1
    conns[2][0].data_received(encode(Connect(protocol_level=4, client_id="late"), 4))  # ignored, no machine
    assert conns[2][1].data == b""

    port = FakePort(env={"MQTT_CONNECT_RATE_PER_IP": "2", "MQTT_CONNECT_BURST_PER_IP": "3"})
    aborted = []
    for _ in range(4):
        conn, transport = Connection(port), FakeTransport()
        conn.connection_made(transport)
        aborted.append(transport.aborted)
    assert aborted == [False, False, False, True] and port.stats["refused_connect_rate"] == 1
    port.clock += 0.5  # one token back at 2/s
    conn, transport = Connection(port), FakeTransport()
    conn.connection_made(transport)
    assert not transport.aborted


async def test_reading_pauses_on_bytes_held_not_only_on_packets():
    # issue 14, limits: what a client can make one connection hold is bounded in bytes (MQTT_INBOUND_BUFFER_BYTES)
    port = FakePort(env={"MQTT_INBOUND_BUFFER_BYTES": "4096", "MQTT_INBOUND_QUEUE_MAX": "1000"})
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="big", clean_start=True))
    big = encode(Publish(topic="t", payload=b"x" * 3000, qos=0), 4)
    port.produce_gate = asyncio.get_running_loop().create_future()  # the producer's batch full: packets are held
    conn.data_received(big + big)  # two packets, 6 KB: over the byte bound, far under the packet bound
    assert transport.paused
    port.produce_gate.set_result(None)
    await until(lambda: not transport.paused)  # processed: reading goes on
    assert len(port.produced) == 2


async def test_packets_handled_at_once_hold_nothing_and_leave_reading_on():
    port = FakePort(env={"MQTT_INBOUND_BUFFER_BYTES": "4096", "MQTT_INBOUND_QUEUE_MAX": "1000"})
    conn, transport, _ = await connected(port, Connect(protocol_level=4, client_id="big", clean_start=True))
    big = encode(Publish(topic="t", payload=b"x" * 3000, qos=0), 4)
    conn.data_received(big + big)  # handed to the producer inside the call: nothing left in the queue
    assert not transport.paused and conn.inq == [] and conn._inq_bytes == 0
    assert len(port.produced) == 2


async def test_a_qos0_record_kafka_did_not_take_is_counted_not_silent():
    from collections import Counter

    from connector.connection import _qos0_done

    stats = Counter()
    loop = asyncio.get_running_loop()
    ok, failed = loop.create_future(), loop.create_future()
    ok.set_result(None)
    failed.set_exception(RuntimeError("broker gone"))
    _qos0_done(stats, ok)
    _qos0_done(stats, failed)
    assert stats["dropped_qos0_not_stored"] == 1  # tbmq_messages_dropped_total{reason="qos0_not_stored"}
