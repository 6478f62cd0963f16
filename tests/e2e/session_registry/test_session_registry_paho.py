"""paho-mqtt v5 clients against connector + router + session registry (the launcher's Suite): session
present, SEI 0, expiry, the DISCONNECT interval, takeover across two connectors. device-persistence is a
fake gRPC server in the test (every call answered, nothing stored)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import grpc
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from tbmq.v1 import services_pb2, services_pb2_grpc
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

pytestmark = [pytest.mark.e2e]
BOUND = 20.0


class EmptyDevicePersistence(services_pb2_grpc.DevicePersistenceServicer):
    def __init__(self):
        self.cleared: list[str] = []

    async def FetchUndelivered(self, request, context):
        return services_pb2.FetchUndeliveredResponse()

    async def Detach(self, request, context):
        return services_pb2.DetachResponse(detached=True)

    async def Acknowledge(self, request, context):
        return services_pb2.PacketResponse(found=False)

    async def MarkPubrec(self, request, context):
        return services_pb2.PacketResponse(found=False)

    async def Clear(self, request, context):
        self.cleared.append(request.client_id)
        return services_pb2.ClearResponse()


@pytest.fixture(scope="module")
async def stack(kafka, tmp_path_factory):
    dp = EmptyDevicePersistence()
    server = grpc.aio.server()
    services_pb2_grpc.add_DevicePersistenceServicer_to_server(dp, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    suite = Suite(services=["session-registry", "router", "connector"], connectors=2, ports="free",
                  log_format="json", id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("sr-e2e"),
                  redis_url="redis://127.0.0.1:1/0",
                  kafka=kafka if isinstance(kafka, KafkaBroker) else kafka.bootstrap_servers,
                  env={"DEVICE_PERSISTENCE_GRPC_TARGET": f"127.0.0.1:{port}"},
                  service_env={"session-registry": {"TBMQ_SESSION_EXPIRY_CHECK_INTERVAL_MS": "300"}})
    await suite.start()
    try:
        yield suite, dp
    finally:
        await suite.stop()
        await server.stop(0)


class V5:
    """A paho v5 client on its own network thread."""

    def __init__(self, client_id: str):
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.cond = threading.Condition()
        self.connack = None
        self.disconnect_reason = None
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.connack = (flags, reason_code, properties)
            self.cond.notify_all()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        with self.cond:
            self.disconnect_reason = reason_code
            self.cond.notify_all()

    def connect(self, port: int, *, clean_start: bool, sei: int | None):
        p = Properties(PacketTypes.CONNECT)
        if sei is not None:
            p.SessionExpiryInterval = sei
        self.c.connect("127.0.0.1", port, keepalive=30, clean_start=clean_start, properties=p)
        self.c.loop_start()
        with self.cond:
            assert self.cond.wait_for(lambda: self.connack is not None, BOUND), "no CONNACK"
        flags, rc, _ = self.connack
        assert not rc.is_failure, f"CONNACK {rc}"
        return flags.session_present

    def disconnect(self, sei: int | None = None):
        p = None
        if sei is not None:
            p = Properties(PacketTypes.DISCONNECT)
            p.SessionExpiryInterval = sei
        self.c.disconnect(properties=p)
        with self.cond:
            self.cond.wait_for(lambda: self.disconnect_reason is not None, BOUND)
        self.c.loop_stop()

    def wait_disconnected(self, timeout: float = BOUND):
        with self.cond:
            assert self.cond.wait_for(lambda: self.disconnect_reason is not None, timeout), "not disconnected"
        return self.disconnect_reason


def session(port: int, client_id: str, *, clean_start: bool, sei: int | None, disconnect_sei: int | None = None,
            hold: float = 0.0) -> bool:
    c = V5(client_id)
    present = c.connect(port, clean_start=clean_start, sei=sei)
    time.sleep(hold)
    c.disconnect(disconnect_sei)
    return present


def run(fn, *args, **kw):
    return asyncio.to_thread(fn, *args, **kw)


async def test_session_present_follows_the_spec(stack):
    suite, _ = stack
    port = suite.mqtt_ports[0]
    cid = f"p{uuid.uuid4().hex[:10]}"
    assert await run(session, port, cid, clean_start=True, sei=60) is False
    await asyncio.sleep(0.3)
    assert await run(session, port, cid, clean_start=False, sei=60) is True      # [MQTT-3.2.2-3]
    await asyncio.sleep(0.3)
    assert await run(session, port, cid, clean_start=True, sei=60) is False      # [MQTT-3.2.2-2]


async def test_sei_zero_ends_session_at_disconnect(stack):
    suite, _ = stack
    port = suite.mqtt_ports[0]
    cid = f"z{uuid.uuid4().hex[:10]}"
    assert await run(session, port, cid, clean_start=False, sei=0) is False
    await asyncio.sleep(0.3)
    assert await run(session, port, cid, clean_start=False, sei=0) is False      # no session kept


async def test_session_expires(stack):
    suite, _ = stack
    port = suite.mqtt_ports[0]
    cid = f"e{uuid.uuid4().hex[:10]}"
    await run(session, port, cid, clean_start=True, sei=1)
    await asyncio.sleep(3)
    assert await run(session, port, cid, clean_start=False, sei=1) is False      # expired after 1 s
    # the DISCONNECT may shorten the interval
    await run(session, port, cid, clean_start=True, sei=600, disconnect_sei=1)
    await asyncio.sleep(3)
    assert await run(session, port, cid, clean_start=False, sei=600) is False


async def test_takeover_across_connectors(stack):
    suite, _ = stack
    p1, p2 = suite.mqtt_ports[:2]
    cid = f"t{uuid.uuid4().hex[:10]}"
    first = V5(cid)
    assert await run(first.connect, p1, clean_start=True, sei=120) is False
    second = V5(cid)
    assert await run(second.connect, p2, clean_start=False, sei=120) is True
    reason = await run(first.wait_disconnected)
    assert reason.value == 0x8E                                                  # Session taken over
    first.c.loop_stop()
    await run(second.disconnect)
