"""The connector's four listeners end to end, with clients nobody here wrote: paho-mqtt 3.1.1 and 5.0 over
TLS (verifying the launcher's development CA), WebSocket (path /mqtt) and WSS; mosquitto_pub/mosquitto_sub
with --cafile over TLS; client certificates required (refused at the TLS handshake without one, accepted
with one signed by the CA); a listener switched off; a bad TLS setting stopping start-up; renewed certificates,
revoked client certificates (MQTT_TLS_CRL_FILE) and removed CAs taking effect without a restart.

Two suites share the tests' Kafka: `ls` (session registry, router, one connector with every listener on and
MQTT_TLS_CLIENT_AUTH=optional) and `strict` (one more connector only, MQTT_TLS_CLIENT_AUTH=required, its TCP
and WS listeners off; its CONNECTs are answered by `ls`'s registry, through the shared Kafka).
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys

import pytest
from mqtt_clients import BOUND, Client, payloads, poll, routed, run, wait_until
from tbmq_launcher.launcher import Suite, new_tag
from tbmq_launcher.services import readyz
from tbmq_launcher.tls import ensure_dev_certs, issue_client_cert, revocation_list
from tbmq_mqtt import Connect, ReasonCode, encode

pytestmark = [pytest.mark.e2e]


def suite(kafka, run_dir, services, connector_env, **kw) -> Suite:
    return Suite(services=services, connectors=1, ports="free", log_format="json", id_tag=new_tag(),
                 run_dir=run_dir, redis_url="redis://127.0.0.1:1/0",
                 kafka=kafka if hasattr(kafka, "start") else kafka.bootstrap_servers,
                 service_env={"connector": connector_env}, **kw)


@pytest.fixture(scope="module")
async def ls(kafka, tmp_path_factory):
    async with suite(kafka, tmp_path_factory.mktemp("suite-listeners"), ["session-registry", "router", "connector"],
                     {"MQTT_TLS_CLIENT_AUTH": "optional"}) as s:
        yield s


@pytest.fixture(scope="module")
async def strict(ls, kafka, tmp_path_factory):
    async with suite(kafka, tmp_path_factory.mktemp("suite-strict"), ["connector"],
                     {"MQTT_TLS_CLIENT_AUTH": "required", "MQTT_PORT": "0", "MQTT_WS_PORT": "0"},
                     tls_dir=ls.tls.directory) as s:
        yield s


@pytest.fixture(scope="module")
def client_cert(ls, tmp_path_factory):
    cert, key = issue_client_cert(ls.tls, "device-1", tmp_path_factory.mktemp("client-cert"))
    return {"certfile": str(cert), "keyfile": str(key)}


def port_of(s: Suite, kind: str) -> int:
    return {"tcp": s.mqtt_ports, "tls": s.tls_ports, "ws": s.ws_ports, "wss": s.wss_ports}[kind][0]


def client(s: Suite, cid: str, kind: str, v5: bool, **tls_extra) -> Client:
    tls = {"ca_certs": str(s.tls.ca), **tls_extra} if kind in ("tls", "wss") else None
    return Client(cid, v5=v5, websocket=kind in ("ws", "wss"), tls=tls)


@pytest.mark.parametrize("v5", [False, True], ids=["311", "5"])
@pytest.mark.parametrize("kind", ["tls", "ws", "wss"])
async def test_paho_round_trip_over_each_listener(ls, unique, kind, v5):
    pub = client(ls, unique("pub"), kind, v5)
    sub = client(ls, unique("sub"), kind, v5)
    tcp = Client(unique("tcp"), v5=v5)
    topic = f"ls/{unique('t')}"
    await run(pub.connect, port_of(ls, kind))
    await run(sub.connect, port_of(ls, kind))
    await run(tcp.connect, port_of(ls, "tcp"))
    await run(sub.subscribe, topic, 1)
    await run(tcp.subscribe, topic, 1)
    await routed(pub, sub, topic, 1)
    for i in range(5):
        await run(pub.publish, topic, b"m%d" % i, 1)
    assert await run(sub.wait, lambda: len(payloads(sub, topic)) >= 5)
    assert payloads(sub, topic) == [b"m%d" % i for i in range(5)]
    assert await run(tcp.wait, lambda: len(payloads(tcp, topic)) >= 5)  # the same machine behind every listener
    assert payloads(tcp, topic) == [b"m%d" % i for i in range(5)]
    for c in (pub, sub, tcp):
        await run(c.close)


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto-clients not installed")
async def test_mosquitto_clients_over_tls_with_the_development_ca(ls, unique):
    u = unique("mo")
    topic = f"{u}/t"
    tls = ["-h", "localhost", "-p", str(ls.tls_ports[0]), "--cafile", str(ls.tls.ca)]
    sub = subprocess.Popen(["mosquitto_sub", *tls, "-t", topic, "-q", "1", "-C", "1", "-i", u + "s",
                            "-W", str(int(BOUND) + 10), "-F", "%t|%p"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        attempts = iter(range(1, 10_000))

        async def received() -> bool:  # publish until mosquitto_sub got one (-C 1) and exited
            await run(subprocess.run, ["mosquitto_pub", *tls, "-t", topic, "-m", "over-tls", "-q", "1",
                                       "-i", f"{u}p{next(attempts)}"], check=True, timeout=BOUND)
            return bool(await poll(lambda: sub.poll() is not None, 0.3))

        await wait_until(received, BOUND, "mosquitto_sub to receive over TLS", step=0)
        out, err = await run(sub.communicate, timeout=BOUND)
        assert sub.returncode == 0, err
        assert out.strip() == f"{topic}|over-tls"
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    # a client that does not trust the CA refuses the server's certificate
    bad = await run(subprocess.run, ["mosquitto_pub", "-h", "localhost", "-p", str(ls.tls_ports[0]),
                                     "--capath", "/nonexistent-dir", "-t", topic, "-m", "x", "-i", u + "x"],
                    capture_output=True, text=True, timeout=BOUND)
    assert bad.returncode != 0


async def test_optional_client_certificate_is_accepted_when_signed_by_the_ca(ls, unique, client_cert):
    c = client(ls, unique("cert"), "tls", True, **client_cert)
    await run(c.connect, ls.tls_ports[0])
    await run(c.close)


class Refused(Exception):
    """`tls_connect` failed: `stage` "handshake" (the TLS handshake itself) or "after" (reading the answer)."""

    def __init__(self, stage: str, exc: BaseException) -> None:
        super().__init__(f"{stage}: {exc!r}")
        self.stage, self.exc = stage, exc


def tls_connect(port: int, ca: str, maximum: ssl.TLSVersion, cert: dict | None = None) -> bytes:
    """A TLS connection that sends CONNECT and reads the answer; Refused when it fails."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.maximum_version = maximum
    if cert:
        ctx.load_cert_chain(cert["certfile"], cert["keyfile"])
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as raw:
        try:
            tls = ctx.wrap_socket(raw, server_hostname="localhost")  # the handshake
        except (ssl.SSLError, OSError) as exc:
            raise Refused("handshake", exc) from None
        with tls:
            try:
                tls.sendall(encode(Connect(protocol_level=4, client_id=f"raw-{new_tag()}", clean_start=True,
                                           keep_alive=30), 4))
                return tls.recv(4)
            except (ssl.SSLError, OSError) as exc:
                raise Refused("after", exc) from None


async def test_required_client_certificate_refuses_a_client_without_one_at_the_handshake(strict):
    port, ca = strict.tls_ports[0], str(strict.tls.ca)
    with pytest.raises(Refused) as e:  # TLS 1.2: the client's handshake fails (the server ends it)
        await run(tls_connect, port, ca, ssl.TLSVersion.TLSv1_2)
    assert e.value.stage == "handshake"
    # TLS 1.3: the client's side of the handshake is done before the server checks its certificate; the
    # server's handshake fails and it closes the connection: the CONNECT is never read, nothing is answered
    try:
        answer = await run(tls_connect, port, ca, ssl.TLSVersion.TLSv1_3)
    except Refused as exc:
        assert exc.stage == "after"
    else:
        assert answer == b""
    paho = client(strict, "no-cert", "wss", True)  # WSS is the same TLS context
    with pytest.raises((ssl.SSLError, OSError, AssertionError)):
        await run(paho.connect, strict.wss_ports[0], timeout=5)
    await run(paho.close)


async def test_required_client_certificate_accepts_one_signed_by_the_ca(strict, unique, client_cert):
    port, ca = strict.tls_ports[0], str(strict.tls.ca)
    assert await run(tls_connect, port, ca, ssl.TLSVersion.TLSv1_3, client_cert) == b"\x20\x02\x00\x00"
    for kind, v5 in (("tls", False), ("wss", True)):
        c = client(strict, unique(f"cert-{kind}"), kind, v5, **client_cert)
        await run(c.connect, port_of(strict, kind))
        await run(c.close)


async def test_switched_off_listeners_are_not_listening(strict):
    p = strict.instance("connector")
    details = await readyz(p.health_port)
    assert details["mqtt_port"] == 0 and "ws_port" not in details
    assert details["mqtts_port"] == strict.tls_ports[0] and details["wss_port"] == strict.wss_ports[0]
    assert strict.mqtt_ports == [None] and strict.ws_ports == [None]
    assert [kind for kind, _ in strict.listeners()] == ["MQTT/TLS", "WSS"]
    # and the process has no other listening TCP socket than its TLS, WSS and health ones
    assert listening_ports(p.pid) == {strict.tls_ports[0], strict.wss_ports[0], p.health_port}


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process `pid` listens on (/proc: its socket inodes in state LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


async def test_a_bad_tls_setting_stops_start_up_with_one_message(tmp_path):
    env = {**os.environ, "MQTT_TLS_PORT": "18883", "MQTT_TLS_CLIENT_AUTH": "required",
           "MQTT_WSS_PORT": "18084", "MQTT_TLS_KEY_FILE": str(tmp_path / "missing-key.pem")}
    env.pop("MQTT_TLS_CERT_FILE", None)
    env.pop("MQTT_TLS_CA_FILE", None)
    done = await run(subprocess.run, [sys.executable, "-m", "connector"], env=env, capture_output=True,
                     text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for text in ("MQTT_TLS_PORT=18883", "MQTT_WSS_PORT=18084", "MQTT_TLS_CERT_FILE", "MQTT_TLS_KEY_FILE=",
                 "no such file", "MQTT_TLS_CA_FILE"):
        assert text in lines[0], text


def presented_cert(port: int, ca: str) -> bytes:
    """The DER certificate the TLS listener on `port` presents to a client that trusts `ca`."""
    ctx = ssl.create_default_context(cafile=ca)
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            return tls.getpeercert(binary_form=True)


def der(pem_file) -> bytes:
    return ssl.PEM_cert_to_DER_cert(open(pem_file).read())


async def test_a_renewed_certificate_is_loaded_without_a_restart(kafka, tmp_path_factory, tmp_path):
    """MQTT_TLS_RELOAD_INTERVAL_S: the connector checks its TLS files and loads changed ones for new handshakes
    (TLS and WSS). A certificate that does not match its key (a renewal half written) is refused and the old
    one kept; once the key follows, the new certificate is presented, with no restart."""
    async with suite(kafka, tmp_path_factory.mktemp("suite-reload"), ["connector"],
                     {"MQTT_TLS_RELOAD_INTERVAL_S": "0.2", "MQTT_PORT": "0", "MQTT_WS_PORT": "0"},
                     tls_dir=tmp_path_factory.mktemp("tls-reload")) as s:
        certs, port, health = s.tls, s.tls_ports[0], s.instance("connector").health_port
        old = der(certs.server_cert)
        assert await run(presented_cert, port, str(certs.ca)) == old
        # a renewal by the same CA, made next to the live files
        renewal = tmp_path / "renewal"
        renewal.mkdir()
        for f in (certs.ca, certs.ca_key):
            shutil.copy(f, renewal / f.name)
        new = ensure_dev_certs(renewal)
        assert der(new.server_cert) != old

        os.replace(new.server_cert, certs.server_cert)       # the certificate first: its key is not there yet
        await wait_until(lambda: _detail(health, "tls_reload_failures"), BOUND, "the half-written pair refused")
        assert await run(presented_cert, port, str(certs.ca)) == old
        assert await run(presented_cert, s.wss_ports[0], str(certs.ca)) == old
        os.replace(new.server_key, certs.server_key)
        await wait_until(lambda: _detail(health, "tls_reloads"), BOUND, "the renewed certificate loaded")
        for p in (port, s.wss_ports[0]):
            assert await run(presented_cert, p, str(certs.ca)) == der(certs.server_cert) != old


async def _detail(health_port: int, key: str) -> int:
    return (await readyz(health_port)).get(key, 0)


def accepted(port: int, ca: str, cert: tuple) -> bool:
    """Whether a TLS 1.2 handshake with the client certificate `cert` (certificate, key) succeeds (TLS 1.2: the
    server checks the client's certificate inside the handshake; asyncio closes a refused one without an
    alert, so the client cannot tell why)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(*map(str, cert))
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost"):
                return True
        except (ssl.SSLError, OSError):
            return False


async def test_revoked_certificates_and_removed_cas_are_refused_without_a_restart(kafka, tmp_path_factory,
                                                                                   tmp_path):
    """MQTT_TLS_CRL_FILE: a client certificate its lists name is refused at the handshake. With
    MQTT_TLS_RELOAD_INTERVAL_S, a new list and a CA removed from MQTT_TLS_CA_FILE apply to the next handshake
    on TLS and WSS, with no restart; the other clients' certificates are still accepted. A client connected
    with a certificate the new list names, or one the removed CA issued, is disconnected (v5 DISCONNECT 0x98);
    the others stay."""
    tls_dir = tmp_path_factory.mktemp("tls-crl")
    certs, other = ensure_dev_certs(tls_dir), ensure_dev_certs(tmp_path / "other-ca", "another CA")
    a, b = (issue_client_cert(certs, n, tmp_path / "clients") for n in ("a", "b"))
    c = issue_client_cert(other, "c", tmp_path / "clients")
    cas, crls = tmp_path / "cas.pem", tmp_path / "crls.pem"

    def replace(path, text: str) -> None:  # as a deployment tool would: a new file renamed over the old one
        (tmp_path / "new").write_text(text)
        os.replace(tmp_path / "new", path)

    def write_crls(*revoked) -> None:  # every CA that signs client certificates needs its list
        replace(crls, "".join(revocation_list(ca, [r[0] for r in revoked if r is not c or ca is other],
                                              tmp_path / f"crl-{i}.pem").read_text()
                              for i, ca in enumerate((certs, other))))

    replace(cas, certs.ca.read_text() + other.ca.read_text())
    write_crls()
    async with suite(kafka, tmp_path_factory.mktemp("suite-crl"), ["session-registry", "connector"],
                     {"MQTT_TLS_RELOAD_INTERVAL_S": "0.2", "MQTT_PORT": "0", "MQTT_WS_PORT": "0",
                      "MQTT_TLS_CLIENT_AUTH": "required", "MQTT_TLS_CA_FILE": str(cas),
                      "MQTT_TLS_CRL_FILE": str(crls)}, tls_dir=tls_dir) as s:
        ports, ca, health = (s.tls_ports[0], s.wss_ports[0]), str(certs.ca), s.instance("connector").health_port

        async def handshakes() -> list:  # a, b, c on TLS, then on WSS
            return [await run(accepted, p, ca, cert) for p in ports for cert in (a, b, c)]

        async def reloaded(n: int) -> bool:
            return await _detail(health, "tls_reloads") >= n

        assert await handshakes() == [True] * 6
        online = {}  # paho clients connected with a's, b's and c's certificates, over TLS and WSS
        for (name, cert), (kind, port) in zip((("a", a), ("b", b), ("a", a), ("c", c)),
                                              (("tls", ports[0]), ("tls", ports[0]), ("wss", ports[1]),
                                               ("wss", ports[1])), strict=True):
            paho = client(s, f"crl-{name}-{kind}-{new_tag()}", kind, True, certfile=str(cert[0]), keyfile=str(cert[1]))
            await run(paho.connect, port)
            online[(name, kind)] = paho
        write_crls(a)  # device a's certificate revoked
        await wait_until(lambda: reloaded(1), BOUND, "the new revocation list loaded")
        assert await handshakes() == [False, True, True] * 2
        for (name, kind), paho in online.items():
            if name == "a":
                assert await run(paho.wait, lambda p=paho: p.disconnects, BOUND), (name, kind)
                assert paho.disconnects[0].value == ReasonCode.ADMINISTRATIVE_ACTION
        assert online[("b", "tls")].disconnects == online[("c", "wss")].disconnects == []
        replace(cas, certs.ca.read_text())  # the second CA no longer trusted
        await wait_until(lambda: reloaded(2), BOUND, "the CA file without the second CA loaded")
        assert await handshakes() == [False, True, False] * 2
        gone = online[("c", "wss")]
        assert await run(gone.wait, lambda: gone.disconnects, BOUND)
        assert gone.disconnects[0].value == ReasonCode.ADMINISTRATIVE_ACTION
        assert online[("b", "tls")].disconnects == []
        assert await _detail(health, "tls_reload_failures") == 0
        assert await _detail(health, "connections_certificate_revoked") == 2
        assert await _detail(health, "connections_ca_removed") == 1
        for paho in online.values():
            await run(paho.close)
