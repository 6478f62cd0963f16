"""The connector applies the session registry's answer and decides nothing about the session itself
(session_registry.logic is the one home of the rules): a Connection driven through CONNECT and DISCONNECT with a
fake service, registry and transport (no Kafka, no gRPC).

The case of issue 13: a v5 client resumes its session with clean start 0 and no Session Expiry Interval. The
registry answers session present, interval 0, persistent; the connector must then fetch the stored messages
(before this change it recomputed "persistent" from the interval, got false, and delivered nothing)."""

from __future__ import annotations

import asyncio

import pytest
from connector.connection import CLOSED, CONNECTED, Connection
from connector.wills import Wills
from tbmq.v1 import messages_pb2 as pb
from tbmq_mqtt import (ConnAck, Connect, Disconnect, MqttDecoder, Properties, PubComp, Publish, PubRec, PubRel,
                       ReasonCode, Role)
from test_connector_group_store import FakeService, FakeTransport, settle

pytestmark = pytest.mark.unit


class FakeSessions:
    """The registry: answers every CONNECTION_REQUEST with `answer`; records the DISCONNECTION_REQUESTs."""

    def __init__(self, answer: pb.SessionEventResponse) -> None:
        self.answer = answer
        self.requests: list[pb.SessionInfo] = []
        self.disconnects: list[tuple[pb.SessionInfo, int | None]] = []
        self.awaiting_pubrel: list[list[int]] = []

    async def connect(self, session: pb.SessionInfo, timeout: float) -> pb.SessionEventResponse:
        self.requests.append(pb.SessionInfo.FromString(session.SerializeToString()))
        return self.answer

    async def disconnect(self, session: pb.SessionInfo, *, graceful: bool, session_expiry: int | None = None,
                         awaiting_pubrel=()):
        self.disconnects.append((pb.SessionInfo.FromString(session.SerializeToString()), session_expiry))
        self.awaiting_pubrel.append(sorted(awaiting_pubrel))


class RegistryService(FakeService):
    def __init__(self, answer: pb.SessionEventResponse) -> None:
        super().__init__()
        self.sessions = FakeSessions(answer)
        self.wills = Wills(lambda client_id, will, level: None)

    async def subscriptions_of(self, client_id: str) -> dict:
        return {}

    spans = False

    async def produce_publish(self, msg, topic, retain, headers=None):
        """Kafka: every PUBLISH produced is recorded; its acknowledgement is the future in `acks` (by payload)."""
        fut = asyncio.get_running_loop().create_future()
        self.produced = getattr(self, "produced", []) + [msg.payload]
        self.acks = {**getattr(self, "acks", {}), msg.payload: fut}
        return fut, None


def answer(*, present: bool, sei: int, persistent: bool,
           client_type: int = pb.CLIENT_TYPE_DEVICE) -> pb.SessionEventResponse:
    return pb.SessionEventResponse(success=True, session_present=present, session_expiry_interval=sei,
                                   persistent=persistent, client_type=client_type)


async def connected(resp: pb.SessionEventResponse, connect: Connect) -> tuple[RegistryService, Connection, ConnAck]:
    svc = RegistryService(resp)
    conn = Connection(svc)
    conn.transport = FakeTransport()
    conn.app_streams_opened = 0

    def open_app_stream() -> None:  # the real one opens a gRPC stream to app-delivery
        conn.app_streams_opened += 1

    conn._open_app_stream = open_app_stream
    await conn._on_connect(connect)
    packets = MqttDecoder(connect.protocol_level, role=Role.CLIENT).feed(conn.transport.data)
    assert packets and isinstance(packets[0], ConnAck), packets
    return svc, conn, packets[0]


def v5_connect(*, clean_start: bool, sei: int | None) -> Connect:
    props = Properties(session_expiry_interval=sei) if sei is not None else Properties()
    return Connect(protocol_level=5, client_id="dev", clean_start=clean_start, keep_alive=30, properties=props)


async def test_resumed_session_with_interval_zero_fetches_its_stored_messages():
    resp = answer(present=True, sei=0, persistent=True)
    svc, conn, connack = await connected(resp, v5_connect(clean_start=False, sei=None))
    # the request carries the interval as sent and leaves persistence to the registry
    req = svc.sessions.requests[0]
    assert req.session_expiry_interval == 0 and not req.persistent and not req.clean_start
    assert connack.session_present and connack.reason_code == 0
    assert connack.properties.session_expiry_interval is None   # the answer's 0 is what the client asked for
    assert conn.state == CONNECTED and conn.persistent and conn.device
    await asyncio.sleep(0)
    assert svc.device.of("fetch") == [("dev", conn.session_id)]   # its queued messages are fetched
    svc.device.answer("dev", [])
    await settle(svc)
    # the connection ends: the session (interval 0) ends with it; a DISCONNECT may not give it one
    conn._on_disconnect(Disconnect(reason_code=0, properties=Properties(session_expiry_interval=60)))
    assert conn.state == CLOSED
    sent = MqttDecoder(5, role=Role.CLIENT).feed(conn.transport.data)
    assert isinstance(sent[-1], Disconnect) and sent[-1].reason_code == ReasonCode.PROTOCOL_ERROR
    await settle(svc)
    (info, expiry), = svc.sessions.disconnects
    assert expiry is None and info.persistent and info.session_expiry_interval == 0


@pytest.mark.parametrize("client_type", [pb.CLIENT_TYPE_DEVICE, pb.CLIENT_TYPE_APPLICATION])
@pytest.mark.parametrize("persistent", [True, False])
async def test_stored_messages_follow_the_answer_not_the_interval(client_type, persistent):
    """Same CONNECT (interval 0), two answers: the connector fetches (DEVICE) / opens the stream (APPLICATION)
    exactly when the registry says persistent."""
    resp = answer(present=persistent, sei=0, persistent=persistent, client_type=client_type)
    svc, conn, connack = await connected(resp, v5_connect(clean_start=False, sei=None))
    await asyncio.sleep(0)
    assert connack.session_present is persistent
    device = persistent and client_type == pb.CLIENT_TYPE_DEVICE
    assert conn.device is device and bool(svc.device.of("fetch")) is device
    assert conn.app_streams_opened == int(persistent and client_type == pb.CLIENT_TYPE_APPLICATION)
    conn.close("test")
    if device:
        svc.device.answer("dev", [])
    await settle(svc)


async def test_interval_cap_is_the_registrys():
    """The CONNECT's interval goes to the registry as sent; CONNACK echoes the registry's capped value; a
    DISCONNECT may set an interval when the CONNECT's was non-zero even if the registry capped it to 0
    [section 3.14.2.2.2 (no id) is about the CONNECT packet's], and the registry caps that one too."""
    resp = answer(present=False, sei=0, persistent=False)     # e.g. MQTT_CLIENT_SESSION_EXPIRY_MAX_..._INTERVAL=0
    svc, conn, connack = await connected(resp, v5_connect(clean_start=True, sei=0xFFFFFFFF))
    assert svc.sessions.requests[0].session_expiry_interval == 0xFFFFFFFF
    assert connack.properties.session_expiry_interval == 0
    assert not conn.device
    conn._on_disconnect(Disconnect(reason_code=0, properties=Properties(session_expiry_interval=50)))
    await settle(svc)
    (info, expiry), = svc.sessions.disconnects
    assert expiry == 50
    sent = MqttDecoder(5, role=Role.CLIENT).feed(conn.transport.data)
    assert not any(isinstance(p, Disconnect) for p in sent)   # no protocol error


# -- inbound QoS 2 state kept with a persistent session -----------------------------------------------------

@pytest.mark.parametrize("level", [4, 5])
async def test_resumed_qos2_ids_answer_a_resent_publish_with_pubrec_and_no_second_produce(level):
    """The registry hands back the ids awaiting PUBREL: the client's re-sent PUBLISH (DUP=1) is answered
    PUBREC without producing it again [MQTT-4.3.3-10]; its PUBREL gets PUBCOMP; a new id is produced."""
    resp = answer(present=True, sei=600, persistent=True)
    resp.awaiting_pubrel.extend([7])
    connect = (v5_connect(clean_start=False, sei=600) if level == 5 else
               Connect(protocol_level=4, client_id="dev", clean_start=False, keep_alive=30))
    svc, conn, _ = await connected(resp, connect)
    await asyncio.sleep(0)
    svc.device.answer("dev", [])
    await settle(svc)
    conn.transport.data = b""
    await conn._on_publish(Publish(topic="t", payload=b"again", qos=2, packet_id=7, dup=True))
    conn._on_pubrel(PubRel(7))
    await conn._on_publish(Publish(topic="t", payload=b"new", qos=2, packet_id=8))
    assert getattr(svc, "produced", []) == [b"new"]
    svc.acks[b"new"].set_result(None)
    await settle(svc)
    sent = MqttDecoder(level, role=Role.CLIENT).feed(conn.transport.data)
    assert [(type(p), p.packet_id) for p in sent] == [(PubRec, 7), (PubComp, 7), (PubRec, 8)]
    conn.close("test")
    await settle(svc)
    assert svc.sessions.awaiting_pubrel == [[8]]   # 8 not released yet: reported for the next connection


async def test_only_ids_kafka_acknowledged_are_reported_at_the_end():
    """An id whose PUBLISH Kafka has not acknowledged (PUBREC not sent) or refused is not reported: the client
    re-sends it and it is produced again (at worst a duplicate, never a loss)."""
    svc, conn, _ = await connected(answer(present=False, sei=600, persistent=True), v5_connect(clean_start=True,
                                                                                                sei=600))
    await asyncio.sleep(0)
    svc.device.answer("dev", [])
    await settle(svc)
    for pid, payload in ((1, b"a"), (2, b"b"), (3, b"c")):
        await conn._on_publish(Publish(topic="t", payload=payload, qos=2, packet_id=pid))
    svc.acks[b"a"].set_result(None)
    svc.acks[b"c"].set_result(None)    # acknowledged, but queued behind b's PUBREC (not written yet)
    await settle(svc)
    conn.close("test")
    await settle(svc)
    assert svc.sessions.awaiting_pubrel == [[1, 3]]
    svc.acks[b"b"].set_exception(RuntimeError("not accepted"))
    await settle(svc)
