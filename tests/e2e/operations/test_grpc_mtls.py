"""Mutual TLS between the services' gRPC peers (GRPC_TLS_*, tbmq_platform.grpc_tls), end to end: the whole
suite started with `grpc_tls` (a development CA, one certificate per instance) serves paho-mqtt clients over
every gRPC surface — the router's Persist stream and device-persistence's Forward stream (a persistent DEVICE
subscriber live), its fetch (the same subscriber's offline backlog), app-delivery's stream (an APPLICATION
subscriber). The servers refuse plaintext, a TLS client without a certificate and one whose certificate comes
from another CA, answer only the services that call them (GRPC_TLS_PEER_NAMES: PERMISSION_DENIED for a
certificate of the same CA named otherwise), and take a CA added to their bundle at the next handshake, without
a restart."""

from __future__ import annotations

import os
import uuid

import grpc
import pytest
from mqtt_clients import Client, has_real, real, routed, run, wait_until
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.tls import ensure_dev_certs, issue_peer_cert
from tbmq_platform.grpc_tls import GrpcTls

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SERVERS = ("device-persistence", "app-delivery")
NO_SUCH_METHOD = {"device-persistence": "/tbmq.v1.DevicePersistence/NoSuchMethod",
                  "app-delivery": "/tbmq.v1.AppDelivery/NoSuchMethod"}


@pytest.fixture(scope="module")
async def mtls(kafka, tmp_path_factory):
    async with Suite(services=["session-registry", "device-persistence", "app-delivery", "router", "connector"],
                     ports="free", log_format="json", id_tag=new_tag(), grpc_tls=True,
                     run_dir=tmp_path_factory.mktemp("suite-grpc-tls"),
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"session-registry": {"TBMQ_APPLICATION_CLIENT_ID_PATTERNS": "app[a-f0-9]*"}},
                     start_timeout=90.0) as s:
        yield s


async def handshake(target: str, method: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status of a call to a method no server has: UNIMPLEMENTED once the server let the call in (the
    handshake passed), UNAVAILABLE when the connection was refused."""
    options = [("grpc.use_local_subchannel_pool", 1)]  # a fresh connection, not one shared with earlier calls
    channel = (grpc.aio.secure_channel(target, credentials, options=options) if credentials is not None
               else grpc.aio.insecure_channel(target, options=options))
    try:
        await channel.unary_unary(method)(b"", timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()
    raise AssertionError(f"{method} answered")


def peer(tls: GrpcTls) -> grpc.ChannelCredentials:
    return tls.channel_credentials()


def suite_tls(suite: Suite) -> GrpcTls:
    cert, key = suite.grpc_peer_cert(suite.service_id("connector"))
    return GrpcTls(str(cert), str(key), str(suite.grpc_tls.ca))


async def test_persistent_device_and_application_subscribers_over_mutual_tls(mtls):
    port = mtls.mqtt_ports[0]
    tag = uuid.uuid4().hex[:8]
    pub = Client(f"pub{tag}")
    await run(pub.connect, port)
    # a persistent DEVICE subscriber: live over the Persist and Forward streams, then its backlog by fetch
    dev = Client(f"dev{tag}", clean=False, session_expiry=3600)
    await run(dev.connect, port)
    await run(dev.subscribe, f"d/{tag}", 1)
    await routed(pub, dev, f"d/{tag}", qos=1)
    await run(dev.close, wait=True)
    for n in range(3):
        await run(pub.publish, f"d/{tag}", b"stored-%d" % n, 1)
    back = Client(f"dev{tag}", clean=False, session_expiry=3600)
    flags, _, _ = await run(back.connect, port)
    assert flags.session_present
    assert await run(back.wait, lambda: has_real(back.messages, 3)), [m.payload for m in back.snapshot()]
    assert [m.payload for m in real(back.snapshot())] == [b"stored-0", b"stored-1", b"stored-2"]
    # an APPLICATION subscriber: app-delivery's stream
    app = Client(f"app{tag}", clean=False, session_expiry=3600)
    await run(app.connect, port)
    await run(app.subscribe, f"a/{tag}", 1)
    await routed(pub, app, f"a/{tag}", qos=1, timeout=60.0, probe_wait=1.0)
    for c in (pub, back, app):
        await run(c.close)


async def test_servers_refuse_plaintext_no_certificate_and_another_ca(mtls, tmp_path):
    tls = suite_tls(mtls)
    other = ensure_dev_certs(tmp_path / "other", "another internal CA")
    cert, key = issue_peer_cert(other, "intruder")
    intruder = GrpcTls(str(cert), str(key), tls.ca_file)  # trusts the suite's servers, signed by another CA
    no_cert = grpc.ssl_channel_credentials(open(tls.ca_file, "rb").read())
    for name in SERVERS:
        target, method = mtls.grpc_target(name), NO_SUCH_METHOD[name]
        assert await handshake(target, method, peer(tls)) == grpc.StatusCode.UNIMPLEMENTED, name
        assert await handshake(target, method, None) == grpc.StatusCode.UNAVAILABLE, name
        assert await handshake(target, method, no_cert) == grpc.StatusCode.UNAVAILABLE, name
        assert await handshake(target, method, peer(intruder)) == grpc.StatusCode.UNAVAILABLE, name


async def test_servers_answer_only_the_services_that_call_them(mtls):
    """GRPC_TLS_PEER_NAMES, which the launcher sets from who calls whom: a certificate of the suite's own CA
    whose name is not a caller's (an admin's, the router's on app-delivery) gets PERMISSION_DENIED on a real
    method and on a missing one; a caller's gets in (the first test: every stream works)."""
    cert, key = issue_peer_cert(mtls.grpc_tls, f"admin-1-{new_tag()}")
    admin = GrpcTls(str(cert), str(key), str(mtls.grpc_tls.ca))
    router_cert, router_key = mtls.grpc_peer_cert(mtls.service_id("router"))
    router = GrpcTls(str(router_cert), str(router_key), str(mtls.grpc_tls.ca))
    real_method = {"device-persistence": "/tbmq.v1.DevicePersistence/FetchUndelivered",
                   "app-delivery": "/tbmq.v1.AppDelivery/Deliver"}
    for name in SERVERS:
        target = mtls.grpc_target(name)
        for method in (real_method[name], NO_SUCH_METHOD[name]):
            assert await handshake(target, method, peer(admin)) == grpc.StatusCode.PERMISSION_DENIED, (name, method)
    target = mtls.grpc_target("app-delivery")
    assert await handshake(target, NO_SUCH_METHOD["app-delivery"], peer(router)) == grpc.StatusCode.PERMISSION_DENIED
    target = mtls.grpc_target("device-persistence")
    assert await handshake(target, NO_SUCH_METHOD["device-persistence"], peer(router)) == grpc.StatusCode.UNIMPLEMENTED


async def test_a_ca_added_to_the_bundle_is_trusted_at_the_next_handshake(mtls, tmp_path):
    tls = suite_tls(mtls)
    newer = ensure_dev_certs(tmp_path / "next", "next internal CA")
    cert, key = issue_peer_cert(newer, f"connector-9-{new_tag()}")  # a caller's name, from the next CA
    renewed = GrpcTls(str(cert), str(key), tls.ca_file)
    target, method = mtls.grpc_target("device-persistence"), NO_SUCH_METHOD["device-persistence"]
    assert await handshake(target, method, peer(renewed)) == grpc.StatusCode.UNAVAILABLE
    bundle = mtls.grpc_tls.ca
    staged = bundle.with_suffix(".next")
    staged.write_bytes(bundle.read_bytes() + newer.ca.read_bytes())
    os.replace(staged, bundle)  # every server's CA file: the suite's own certificates still chain to it

    async def trusted() -> bool:
        return await handshake(target, method, peer(renewed)) == grpc.StatusCode.UNIMPLEMENTED

    await wait_until(trusted, 20.0, "device-persistence trusting the added CA")
    # the services' own connections, opened before, still work: a message crosses every stream again
    tag = uuid.uuid4().hex[:8]
    pub, sub = Client(f"pub{tag}"), Client(f"dev{tag}", clean=False, session_expiry=60)
    for c in (pub, sub):
        await run(c.connect, mtls.mqtt_ports[0])
    await run(sub.subscribe, f"after/{tag}", 1)
    await routed(pub, sub, f"after/{tag}", qos=1)
    for c in (pub, sub):
        await run(c.close)
