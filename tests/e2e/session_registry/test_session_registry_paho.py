"""paho-mqtt v5 clients against connector + router + session registry (the launcher's Suite): session
present, SEI 0, expiry, the DISCONNECT interval, takeover across two connectors. device-persistence is a
fake gRPC server in the test (every call answered, nothing stored)."""

from __future__ import annotations

import uuid

import grpc
import pytest
from kafka_views import SessionTable
from mqtt_clients import BOUND, Client, run, wait_until
from tbmq.v1 import services_pb2, services_pb2_grpc
from tbmq_launcher.kafka import KafkaBroker
from tbmq_launcher.launcher import Suite, new_tag

pytestmark = [pytest.mark.e2e]


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


def connected(port: int, client_id: str, *, clean_start: bool, sei: int | None) -> tuple[Client, bool]:
    """A v5 client connected (keep alive 30 s) and whether its CONNACK says session present."""
    c = Client(client_id, clean=clean_start, session_expiry=sei)
    flags, _, _ = c.connect(port, keepalive=30)
    return c, flags.session_present


def session(port: int, client_id: str, *, clean_start: bool, sei: int | None, disconnect_sei: int | None = None
            ) -> bool:
    c, present = connected(port, client_id, clean_start=clean_start, sei=sei)
    c.close(disconnect_sei, wait=True)
    return present


@pytest.fixture(scope="module")
async def table(kafka):
    """tbmq.client.session as the registry writes it: tests wait for its records, not for time."""
    async with SessionTable(kafka.bootstrap_servers) as t:
        yield t


async def offline(table: SessionTable, cid: str, since: int) -> None:
    """Wait until the registry recorded the disconnect of `cid` (its record changed since `since`, the
    number of records seen before, and says offline or removed)."""
    await wait_until(lambda: table.updates.get(cid, 0) > since and table.offline(cid), BOUND,
                     f"the registry to record the disconnect of {cid}")


async def test_session_present_follows_the_spec(stack, table):
    suite, _ = stack
    port = suite.mqtt_ports[0]
    cid = f"p{uuid.uuid4().hex[:10]}"
    n = table.updates.get(cid, 0)
    assert await run(session, port, cid, clean_start=True, sei=60) is False
    await offline(table, cid, n + 1)  # connected, then disconnected
    n = table.updates[cid]
    assert await run(session, port, cid, clean_start=False, sei=60) is True      # [MQTT-3.2.2-3]
    await offline(table, cid, n + 1)
    assert await run(session, port, cid, clean_start=True, sei=60) is False      # [MQTT-3.2.2-2]


async def test_sei_zero_ends_session_at_disconnect(stack, table):
    suite, _ = stack
    port = suite.mqtt_ports[0]
    cid = f"z{uuid.uuid4().hex[:10]}"
    assert await run(session, port, cid, clean_start=False, sei=0) is False
    await wait_until(lambda: table.removed(cid), BOUND, "the session removed at the disconnect")
    assert await run(session, port, cid, clean_start=False, sei=0) is False      # no session kept


async def test_session_expires(stack, table):
    suite, _ = stack
    port = suite.mqtt_ports[0]
    cid = f"e{uuid.uuid4().hex[:10]}"
    await run(session, port, cid, clean_start=True, sei=1)
    # the registry's expiry scan (every 300 ms here) removes it once the 1 s passed
    await wait_until(lambda: table.removed(cid), BOUND, "the session expired")
    assert await run(session, port, cid, clean_start=False, sei=1) is False      # expired after 1 s
    # the DISCONNECT may shorten the interval
    n = table.updates[cid]
    await run(session, port, cid, clean_start=True, sei=600, disconnect_sei=1)
    await wait_until(lambda: table.updates[cid] > n + 1 and table.removed(cid), BOUND,
                     "the session expired after the DISCONNECT's interval")
    assert await run(session, port, cid, clean_start=False, sei=600) is False


async def test_takeover_across_connectors(stack):
    suite, _ = stack
    p1, p2 = suite.mqtt_ports[:2]
    cid = f"t{uuid.uuid4().hex[:10]}"
    first, present = await run(connected, p1, cid, clean_start=True, sei=120)
    assert present is False
    second, present = await run(connected, p2, cid, clean_start=False, sei=120)
    assert present is True
    assert await run(first.wait, lambda: first.disconnected is not None), "not disconnected"
    assert first.disconnected.value == 0x8E                                      # Session taken over
    first.stop_loop()
    await run(second.close, wait=True)
