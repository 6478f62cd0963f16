"""MQTT_PROXY_PROTOCOL end to end: a real HAProxy (mode tcp) in front of the connector, sending PROXY v1 to its
TCP listener and PROXY v2 to its TLS listener (TLS passed through to the connector), with paho-mqtt 3.1.1 and
5.0 clients connecting to HAProxy from different loopback addresses (127.0.0.5, 127.0.0.6). The connector
must see those addresses, not HAProxy's: a blocked rule on 127.0.0.5 closes that client's connection and
refuses its next CONNECT, while 127.0.0.6 carries on. A client that skips the balancer and talks MQTT at once
to a PROXY listener is closed, and so is one from an address outside MQTT_PROXY_PROTOCOL_FROM (HAProxy
connects from 127.0.0.1) even with a well-formed header claiming another address.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from connector_helpers import recv_until_closed
from mqtt_clients import BOUND, Client, routed, run, wait_until
from tbmq_command import tbmq
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.redis import find_free_port
from tbmq_launcher.services import readyz
from tbmq_mqtt import Connect, encode
from tbmq_mqtt import ReasonCode as RC

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not (shutil.which("haproxy") or Path("/usr/sbin/haproxy").exists()), reason="haproxy not installed")]

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


@pytest.fixture(scope="module")
async def px(kafka, tmp_path_factory):
    async with Suite(services=["session-registry", "router", "connector"], ports="free", log_format="json",
                     id_tag=new_tag(), run_dir=tmp_path_factory.mktemp("suite-proxy"),
                     redis_url="redis://127.0.0.1:1/0",
                     kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                     service_env={"connector": {"MQTT_PROXY_PROTOCOL": "mqtt,mqtts", "MQTT_WS_PORT": "0",
                                                "MQTT_WSS_PORT": "0", "MQTT_PROXY_PROTOCOL_FROM": "127.0.0.1",
                                                "MQTT_MAX_CONNECTIONS": "8"}}) as s:
        yield s


@pytest.fixture(scope="module")
async def haproxy(px, tmp_path_factory):
    """HAProxy on two free ports: v1 -> the connector's TCP listener, v2 -> its TLS listener."""
    v1, v2 = find_free_port(), find_free_port()
    cfg = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    cfg.write_text(f"""global
    maxconn 1000
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend mqtt_v1
    bind 127.0.0.1:{v1}
    default_backend connector_tcp
backend connector_tcp
    server c1 127.0.0.1:{px.mqtt_ports[0]} send-proxy
frontend mqtts_v2
    bind 127.0.0.1:{v2}
    default_backend connector_tls
backend connector_tls
    server c1 127.0.0.1:{px.tls_ports[0]} send-proxy-v2
""")
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        for port in (v1, v2):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
        return True

    try:
        await wait_until(lambda: run(listening), BOUND, "haproxy listening")
        yield {"v1": v1, "v2": v2}
    finally:
        proc.terminate()
        proc.wait(10)


def client(s, cid: str, v5: bool, kind: str) -> Client:
    return Client(cid, v5=v5, tls={"ca_certs": str(s.tls.ca)} if kind == "v2" else None)


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
async def test_the_connector_sees_the_client_address_the_balancer_sends(px, haproxy, unique, v5):
    blocked_ip, other_ip = "127.0.0.5", "127.0.0.6"
    pub, sub = client(px, unique("pub"), v5, "v1"), client(px, unique("sub"), v5, "v2")
    await run(pub.connect, haproxy["v1"], bind_address=blocked_ip)
    await run(sub.connect, haproxy["v2"], bind_address=other_ip)
    topic = f"px/{unique('t')}"
    await run(sub.subscribe, topic, 1)
    await routed(pub, sub, topic, 1)  # MQTT flows through HAProxy, over TCP (v1) and TLS (v2)
    tbmq(px, "blocked", "add", "--ip", blocked_ip, "--expires-in", "3600")
    try:
        # the rule matches the address in the PROXY header (HAProxy itself connects from 127.0.0.1)
        assert await run(pub.wait, lambda: pub.disconnects, BOUND), "the blocked address stayed connected"
        for kind in ("v1", "v2"):
            again = client(px, unique("again"), v5, kind)
            connack = await run(again.connect, haproxy[kind], bind_address=blocked_ip, expect_ok=False)
            assert connack is not None and connack[1].is_failure
            if v5:
                assert connack[1].value == RC.BANNED
            await run(again.close)
        assert sub.disconnects == []
        info = await run(sub.publish, topic, b"still here", 1, check=False)
        assert await run(sub.wait, lambda: info.mid in sub.pubacks) and sub.pubacks[info.mid].value == 0
    finally:
        tbmq(px, "blocked", "delete", f"ip:{blocked_ip}")
        for c in (pub, sub):
            await run(c.close)


async def test_a_client_without_the_header_is_closed(px, haproxy, unique):
    health = px.instance("connector").health_port
    before = (await readyz(health)).get("refused_proxy_header", 0)
    direct = Client(unique("direct"), v5=True)
    connack = await run(direct.connect, px.mqtt_ports[0], expect_ok=False, timeout=15)
    assert connack is None  # closed without an answer: the listener expects a header first
    await run(direct.close)

    async def counted() -> bool:
        return (await readyz(health)).get("refused_proxy_header", 0) > before

    await wait_until(counted, BOUND, "the connection without a header counted")


def spoofed_connect(port: int, source: str) -> bytes:
    """A client that reached the PROXY listener past the balancer, from `source`, with a header of its own
    claiming another address, then a CONNECT: what it reads back before the connector closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND, source_address=(source, 0)) as sock:
        sock.sendall(b"PROXY TCP4 203.0.113.50 127.0.0.1 40000 1883\r\n"
                     + encode(Connect(protocol_level=4, client_id=f"spoof-{new_tag()}", clean_start=True,
                                      keep_alive=30), 4))
        return recv_until_closed(sock)


async def test_only_the_balancer_may_send_a_header(px, haproxy):
    health = px.instance("connector").health_port
    before = (await readyz(health)).get("refused_proxy_source", 0)
    assert await run(spoofed_connect, px.mqtt_ports[0], "127.0.0.9") == b""

    async def counted() -> bool:
        return (await readyz(health)).get("refused_proxy_source", 0) > before

    await wait_until(counted, BOUND, "the connection from outside MQTT_PROXY_PROTOCOL_FROM counted")


async def test_sockets_waiting_for_their_header_count_against_the_connection_limit(px, haproxy):
    """MQTT_MAX_CONNECTIONS=8: sockets that never send their header are held until MQTT_CONNECT_TIMEOUT_S, so
    they count as connections; beyond the limit the listener closes new ones at once."""
    health = px.instance("connector").health_port
    before = (await readyz(health)).get("refused_max_connections", 0)
    idle = [socket.create_connection(("127.0.0.1", px.mqtt_ports[0]), timeout=BOUND) for _ in range(12)]
    try:
        async def refused() -> bool:
            return (await readyz(health)).get("refused_max_connections", 0) - before >= 4

        await wait_until(refused, BOUND, "sockets beyond MQTT_MAX_CONNECTIONS closed")
    finally:
        for sock in idle:
            sock.close()
