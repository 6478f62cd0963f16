"""The connector applies the session registry's answer (persistence, capped interval) instead of deciding it
(session_registry.logic is the one home of the rules): a Connection driven through CONNECT and DISCONNECT with a
fake port (connector_fakes: no Kafka, no gRPC)."""

from __future__ import annotations

import pytest
from connector_fakes import FakePort, connected, until, v5_connect
from tbmq.v1 import messages_pb2 as pb
from tbmq_connection import CLOSED, CONNECTED
from tbmq_mqtt import Connect, Disconnect, Properties, PubComp, Publish, PubRec, PubRel, ReasonCode, encode

pytestmark = pytest.mark.unit


def answer(*, present: bool, sei: int, persistent: bool,
           client_type: int = pb.CLIENT_TYPE_DEVICE) -> pb.SessionEventResponse:
    return pb.SessionEventResponse(success=True, session_present=present, session_expiry_interval=sei,
                                   persistent=persistent, client_type=client_type)


async def disconnect(conn, transport, packet: Disconnect) -> list:
    conn.data_received(encode(packet, 5))
    await until(lambda: conn.state == CLOSED)
    return transport.packets(5)


async def test_resumed_session_with_interval_zero_fetches_its_stored_messages():
    port = FakePort(answer(present=True, sei=0, persistent=True))
    conn, transport, (connack,) = await connected(port, v5_connect(clean_start=False, sei=None))
    # the request carries the interval as sent and leaves persistence to the registry
    req = port.requests[0]
    assert req.session_expiry_interval == 0 and not req.persistent and not req.clean_start
    assert connack.session_present and connack.reason_code == 0
    assert connack.properties.session_expiry_interval is None   # the answer's 0 is what the client asked for
    assert conn.state == CONNECTED and conn.m.persistent and conn.m.device
    await until(lambda: port.device.of("fetch") == [("dev", conn.session_id)])   # its queued messages are fetched
    port.device.answer("dev", [])
    await until(lambda: not conn.m.fetching)
    # the connection ends: the session (interval 0) ends with it; a DISCONNECT may not give it one
    sent = await disconnect(conn, transport, Disconnect(reason_code=0,
                                                        properties=Properties(session_expiry_interval=60)))
    assert isinstance(sent[-1], Disconnect) and sent[-1].reason_code == ReasonCode.PROTOCOL_ERROR
    (info, graceful, expiry), = port.disconnects
    assert expiry is None and info.persistent and info.session_expiry_interval == 0


@pytest.mark.parametrize("client_type", [pb.CLIENT_TYPE_DEVICE, pb.CLIENT_TYPE_APPLICATION])
@pytest.mark.parametrize("persistent", [True, False])
async def test_stored_messages_follow_the_answer_not_the_interval(client_type, persistent):
    """Same CONNECT (interval 0), two answers: the connector fetches (DEVICE) / opens the stream (APPLICATION)
    exactly when the registry says persistent."""
    port = FakePort(answer(present=persistent, sei=0, persistent=persistent, client_type=client_type))
    conn, transport, (connack,) = await connected(port, v5_connect(clean_start=False, sei=None))
    assert connack.session_present is persistent
    device = persistent and client_type == pb.CLIENT_TYPE_DEVICE
    if device:
        await until(lambda: bool(port.device.of("fetch")))
    assert conn.m.device is device and bool(port.device.of("fetch")) is device
    assert len(port.app_streams) == int(persistent and client_type == pb.CLIENT_TYPE_APPLICATION)
    conn.close("test")
    if device:
        port.device.answer("dev", [])
    assert all(s.stopped is False for s in port.app_streams)   # stopped in the background
    await until(lambda: all(t.done() for t in port.bg))
    assert all(s.stopped for s in port.app_streams)


async def test_interval_cap_is_the_registrys():
    """The CONNECT's interval goes to the registry as sent; CONNACK echoes the registry's capped value; a
    DISCONNECT may set an interval when the CONNECT's was non-zero even if the registry capped it to 0
    [section 3.14.2.2.2 (no id) is about the CONNECT packet's], and the registry caps that one too."""
    port = FakePort(answer(present=False, sei=0, persistent=False))  # e.g. the cap setting is 0
    conn, transport, (connack,) = await connected(port, v5_connect(clean_start=True, sei=0xFFFFFFFF))
    assert port.requests[0].session_expiry_interval == 0xFFFFFFFF
    assert connack.properties.session_expiry_interval == 0
    assert not conn.m.device
    sent = await disconnect(conn, transport, Disconnect(reason_code=0,
                                                        properties=Properties(session_expiry_interval=50)))
    (info, graceful, expiry), = port.disconnects
    assert expiry == 50 and graceful
    assert not any(isinstance(p, Disconnect) for p in sent)   # no protocol error


# -- inbound QoS 2 state kept with a persistent session -----------------------------------------------------

@pytest.mark.parametrize("level", [4, 5])
async def test_resumed_qos2_ids_answer_a_resent_publish_with_pubrec_and_no_second_produce(level):
    """The registry hands back the ids awaiting PUBREL: the client's re-sent PUBLISH (DUP=1) is answered
    PUBREC without producing it again [MQTT-4.3.3-10]; its PUBREL gets PUBCOMP; a new id is produced; the id
    not released when the connection ends is reported for the next connection."""
    resp = answer(present=True, sei=600, persistent=True)
    resp.awaiting_pubrel.extend([7])
    connect = (v5_connect(clean_start=False, sei=600) if level == 5 else
               Connect(protocol_level=4, client_id="dev", clean_start=False, keep_alive=30))
    port = FakePort(resp)
    conn, transport, _ = await connected(port, connect)
    await until(lambda: bool(port.device.of("fetch")))
    port.device.answer("dev", [])
    conn.data_received(encode(Publish(topic="t", payload=b"again", qos=2, packet_id=7, dup=True), level)
                       + encode(PubRel(7), level)
                       + encode(Publish(topic="t", payload=b"new", qos=2, packet_id=8), level))
    await until(lambda: len(transport.data) >= 12)
    assert [m.payload for m, _t, _r in port.produced] == [b"new"]
    assert [(type(p), p.packet_id) for p in transport.packets(level)] == [(PubRec, 7), (PubComp, 7), (PubRec, 8)]
    conn.close("test")
    assert port.awaiting_pubrel == [[8]]   # 8 not released yet: reported for the next connection

