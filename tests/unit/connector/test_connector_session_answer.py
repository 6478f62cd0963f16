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
from tbmq_mqtt import ConnAck, Connect, Disconnect, MqttDecoder, Properties, ReasonCode, Role
from test_connector_group_store import FakeService, FakeTransport, settle

pytestmark = pytest.mark.unit


class FakeSessions:
    """The registry: answers every CONNECTION_REQUEST with `answer`; records the DISCONNECTION_REQUESTs."""

    def __init__(self, answer: pb.SessionEventResponse) -> None:
        self.answer = answer
        self.requests: list[pb.SessionInfo] = []
        self.disconnects: list[tuple[pb.SessionInfo, int | None]] = []

    async def connect(self, session: pb.SessionInfo, timeout: float) -> pb.SessionEventResponse:
        self.requests.append(pb.SessionInfo.FromString(session.SerializeToString()))
        return self.answer

    async def disconnect(self, session: pb.SessionInfo, *, graceful: bool, session_expiry: int | None = None):
        self.disconnects.append((pb.SessionInfo.FromString(session.SerializeToString()), session_expiry))


class RegistryService(FakeService):
    def __init__(self, answer: pb.SessionEventResponse) -> None:
        super().__init__()
        self.sessions = FakeSessions(answer)
        self.wills = Wills(lambda client_id, will, level: None)

    async def subscriptions_of(self, client_id: str) -> dict:
        return {}


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
