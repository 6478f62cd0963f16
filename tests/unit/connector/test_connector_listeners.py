"""The connector's listeners: settings validation (connector.settings) and the WebSocket adapter
(connector.websocket.WebSocketAdapter) driven by a wsproto client over a fake transport."""

from __future__ import annotations

import asyncio

import pytest
from connector.settings import ConnectorSettings
from connector.websocket import WebSocketAdapter
from connector_fakes import FakeTransport
from tbmq_launcher.tls import ensure_dev_certs, revocation_list
from tbmq_platform.settings import SettingsError, load
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return ensure_dev_certs(tmp_path_factory.mktemp("tls"))


def tls_env(certs, **more) -> dict:
    return {"MQTT_TLS_CERT_FILE": str(certs.server_cert), "MQTT_TLS_KEY_FILE": str(certs.server_key), **more}


def names(s: ConnectorSettings) -> dict:
    return {li.name: (li.host, li.port) for li in s.listeners()}


# ------------------------------------------------------------------------------------------ settings
def test_without_a_certificate_tcp_and_ws_are_on_and_the_tls_ones_off():
    s = load(ConnectorSettings, {})
    assert names(s) == {"mqtt": ("0.0.0.0", 1883), "ws": ("0.0.0.0", 8083)}


def test_with_a_certificate_all_four_are_on_at_their_standard_ports(certs):
    s = load(ConnectorSettings, tls_env(certs))
    assert names(s) == {"mqtt": ("0.0.0.0", 1883), "mqtts": ("0.0.0.0", 8883), "ws": ("0.0.0.0", 8083),
                        "wss": ("0.0.0.0", 8084)}
    assert [(li.tls, li.websocket) for li in s.listeners()] == [(False, False), (True, False), (False, True),
                                                                (True, True)]


def test_listeners_are_switched_off_and_rebound(certs):
    s = load(ConnectorSettings, tls_env(certs, MQTT_PORT="0", MQTT_WS_PORT="", MQTT_TLS_PORT="18883",
                                        MQTT_BIND_HOST="127.0.0.1", MQTT_WSS_BIND_HOST="::1"))
    assert names(s) == {"mqtts": ("127.0.0.1", 18883), "wss": ("::1", 8084)}


def test_a_tls_listener_without_a_certificate_stops_start_up_with_one_message():
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, {"MQTT_TLS_PORT": "8883", "MQTT_WSS_PORT": "8084", "MQTT_TLS_CLIENT_AUTH": "required",
                                 "MQTT_WS_PORT": "1883"})
    text = str(e.value)
    for var in ("MQTT_TLS_PORT=8883", "MQTT_WSS_PORT=8084", "MQTT_TLS_CERT_FILE", "MQTT_TLS_KEY_FILE",
                "MQTT_TLS_CA_FILE", "MQTT_WS_PORT and MQTT_PORT both bind 0.0.0.0:1883"):
        assert var in text, var


def test_bad_tls_files_and_values_are_named(certs, tmp_path):
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, tls_env(certs, MQTT_TLS_CA_FILE=str(tmp_path / "nope.pem"),
                                        MQTT_TLS_CLIENT_AUTH="sometimes"))
    assert "MQTT_TLS_CLIENT_AUTH='sometimes'" in str(e.value)
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, tls_env(certs, MQTT_TLS_CA_FILE=str(tmp_path / "nope.pem")))
    assert "MQTT_TLS_CA_FILE=" in str(e.value) and "no such file" in str(e.value)
    with pytest.raises(SettingsError) as e:  # a key that does not belong to the certificate
        load(ConnectorSettings, tls_env(certs, MQTT_TLS_KEY_FILE=str(certs.ca_key)))
    assert "cannot be loaded" in str(e.value)
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, {"MQTT_PORT": "0", "MQTT_WS_PORT": "0", "MQTT_WS_PATH": "mqtt"})
    assert "every MQTT listener is off" in str(e.value) and "MQTT_WS_PATH" in str(e.value)


def test_client_certificates_setting_reaches_the_context(certs):
    import ssl

    s = load(ConnectorSettings, tls_env(certs, MQTT_TLS_CA_FILE=str(certs.ca), MQTT_TLS_CLIENT_AUTH="required"))
    assert s.server_ssl_context().verify_mode == ssl.CERT_REQUIRED
    s = load(ConnectorSettings, tls_env(certs, MQTT_TLS_CA_FILE=str(certs.ca), MQTT_TLS_CLIENT_AUTH="optional"))
    assert s.server_ssl_context().verify_mode == ssl.CERT_OPTIONAL
    assert load(ConnectorSettings, tls_env(certs)).server_ssl_context().verify_mode == ssl.CERT_NONE


def test_a_crl_file_turns_revocation_checks_on_and_bad_ones_are_named(certs, tmp_path):
    import ssl

    crl = str(revocation_list(certs, (), tmp_path / "crl.pem"))
    required = {"MQTT_TLS_CA_FILE": str(certs.ca), "MQTT_TLS_CLIENT_AUTH": "required"}
    s = load(ConnectorSettings, tls_env(certs, **required, MQTT_TLS_CRL_FILE=crl))
    assert s.server_ssl_context().verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
    assert crl in s.tls_files()  # the reload watches it
    assert not load(ConnectorSettings, tls_env(certs, **required)).server_ssl_context().verify_flags & (
        ssl.VERIFY_CRL_CHECK_LEAF)
    with pytest.raises(SettingsError) as e:  # no client certificate is asked for: nothing to check
        load(ConnectorSettings, tls_env(certs, MQTT_TLS_CRL_FILE=crl))
    assert "MQTT_TLS_CRL_FILE is set but MQTT_TLS_CLIENT_AUTH=none" in str(e.value)
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, tls_env(certs, **required, MQTT_TLS_CRL_FILE=str(tmp_path / "nope.pem")))
    assert "MQTT_TLS_CRL_FILE=" in str(e.value) and "no such file" in str(e.value)
    for wrong in (certs.ca, certs.server_key):  # a certificate would become a trusted CA; a key is no list
        with pytest.raises(SettingsError) as e:
            load(ConnectorSettings, tls_env(certs, **required, MQTT_TLS_CRL_FILE=str(wrong)))
        assert "cannot be loaded" in str(e.value) and "certificate revocation lists" in str(e.value)


# ------------------------------------------------------------------------------------------ WebSocket adapter
class Recorder(asyncio.Protocol):
    """Stands in for connection.Connection: what the adapter hands it."""

    def __init__(self) -> None:
        self.transport = None
        self.data = b""
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc) -> None:
        self.lost = True


class Peer:
    """A wsproto client wired to an adapter over a FakeTransport."""

    def __init__(self, path="/mqtt", subprotocols=("mqtt",), timeout=10.0) -> None:
        self.conns: list[Recorder] = []
        self.adapter = WebSocketAdapter(self._new, "/mqtt", timeout)
        self.transport = FakeTransport()
        self.adapter.connection_made(self.transport)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.send(Request(host="localhost", target=path, subprotocols=list(subprotocols)))

    def _new(self) -> Recorder:
        self.conns.append(Recorder())
        return self.conns[-1]

    def send(self, event) -> None:
        self.adapter.data_received(self.ws.send(event))

    def events(self) -> list:
        data, self.transport.data = self.transport.data, b""
        self.ws.receive_data(data)
        return list(self.ws.events())


async def test_upgrade_then_bytes_both_ways_in_binary_messages():
    peer = Peer()
    (accept,) = peer.events()
    assert isinstance(accept, AcceptConnection) and accept.subprotocol == "mqtt"
    (conn,) = peer.conns
    peer.send(BytesMessage(data=b"\x10\x0c"))          # a packet split across two messages
    peer.send(BytesMessage(data=b"\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"))
    assert conn.data == b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"
    conn.transport.write(b"\x20\x02\x00\x00")
    (msg,) = peer.events()
    assert isinstance(msg, BytesMessage) and msg.data == b"\x20\x02\x00\x00"
    peer.send(Ping(payload=b"hi"))
    (pong,) = peer.events()
    assert isinstance(pong, Pong) and pong.payload == b"hi"
    conn.transport.close()                             # the machine closes: close frame, then TCP
    (close,) = peer.events()
    assert isinstance(close, CloseConnection) and close.code == 1000 and peer.transport.closed
    peer.adapter.connection_lost(None)
    assert conn.lost


async def test_client_close_is_answered_and_the_connection_ends():
    peer = Peer()
    peer.events()
    peer.send(CloseConnection(code=1000))
    (close,) = peer.events()
    assert isinstance(close, CloseConnection) and peer.transport.closed


async def test_wrong_path_or_no_mqtt_subprotocol_is_refused():
    peer = Peer(path="/other")
    reject = peer.events()[0]
    assert isinstance(reject, RejectConnection) and reject.status_code == 404 and peer.transport.closed
    assert peer.conns == []
    peer = Peer(subprotocols=("chat",))
    reject = peer.events()[0]
    assert isinstance(reject, RejectConnection) and reject.status_code == 400 and peer.conns == []
    peer = Peer(path="/mqtt?x=1", subprotocols=("mqttv3.1",))
    (accept,) = peer.events()
    assert isinstance(accept, AcceptConnection) and accept.subprotocol == "mqttv3.1"


async def test_text_message_closes_with_1003():
    peer = Peer()
    peer.events()
    peer.send(TextMessage(data="hello"))
    (close,) = peer.events()
    assert isinstance(close, CloseConnection) and close.code == 1003 and peer.transport.closed
    assert peer.conns[0].data == b""


async def test_no_upgrade_in_time_aborts():
    adapter = WebSocketAdapter(Recorder, "/mqtt", handshake_timeout_s=0.01)
    transport = FakeTransport()
    adapter.connection_made(transport)
    done = asyncio.get_running_loop().create_future()
    real_abort = transport.abort
    transport.abort = lambda: (real_abort(), done.set_result(None))
    await asyncio.wait_for(done, 5)
    assert transport.aborted


async def test_garbage_instead_of_an_upgrade_is_answered_400():
    adapter = WebSocketAdapter(Recorder, "/mqtt")
    transport = FakeTransport()
    adapter.connection_made(transport)
    adapter.data_received(b"\x10\x0c\x00\x04MQTT\r\n\r\n")
    assert transport.closed and transport.data.startswith(b"HTTP/1.1 400")


def test_a_revocation_list_names_certificates_by_issuer_and_serial(certs, tmp_path):
    """connector.tls: what a CRL reload closes. Two CAs' lists in one file; a certificate is listed only by
    its own issuer's list."""
    import ssl

    from connector.tls import certificate_key, revoked_certificates
    from tbmq_launcher.tls import issue_client_cert

    other = ensure_dev_certs(tmp_path / "other", "another CA")
    a, b = (issue_client_cert(certs, n, tmp_path / "clients") for n in ("crl-a", "crl-b"))
    c = issue_client_cert(other, "crl-c", tmp_path / "clients")

    def key(cert):
        return certificate_key(ssl.PEM_cert_to_DER_cert(cert[0].read_text()))

    lists = (revocation_list(certs, [a[0]], tmp_path / "l1.pem").read_bytes()
             + revocation_list(other, [], tmp_path / "l2.pem").read_bytes())
    revoked = revoked_certificates(lists)
    assert key(a) in revoked and key(b) not in revoked and key(c) not in revoked
    assert revoked_certificates(revocation_list(other, [c[0]], tmp_path / "l3.pem").read_bytes()) == {key(c)}
    assert certificate_key(None) is None and revoked_certificates(b"") == set()


def test_a_ca_bundle_names_the_issuers_of_the_certificates_its_cas_signed(certs, tmp_path):
    """connector.tls.ca_names: what a CA removed from MQTT_TLS_CA_FILE closes (a client certificate's issuer,
    as certificate_key gives it)."""
    import ssl

    from connector.tls import ca_names, certificate_key
    from tbmq_launcher.tls import issue_client_cert

    other = ensure_dev_certs(tmp_path / "other", "another CA")
    a, c = issue_client_cert(certs, "ca-a", tmp_path / "clients"), issue_client_cert(other, "ca-c", tmp_path / "c")
    issuer = {name: certificate_key(ssl.PEM_cert_to_DER_cert(cert[0].read_text()))[0]
              for name, cert in (("a", a), ("c", c))}
    both = ca_names(certs.ca.read_bytes() + b"\n" + other.ca.read_bytes())
    assert both == {issuer["a"], issuer["c"]} and issuer["a"] != issuer["c"]
    assert both - ca_names(certs.ca.read_bytes()) == {issuer["c"]}  # what removing `other` closes
    assert ca_names(b"") == set()


def test_proxy_protocol_setting_names_listeners_that_are_on(certs):
    s = load(ConnectorSettings, tls_env(certs, MQTT_PROXY_PROTOCOL="mqtt, MQTTS"))
    assert s.proxy_protocol == ("mqtt", "mqtts")
    assert load(ConnectorSettings, {}).proxy_protocol == ()
    with pytest.raises(SettingsError) as e:
        load(ConnectorSettings, {"MQTT_PROXY_PROTOCOL": "mqtt,tcp"})
    assert "MQTT_PROXY_PROTOCOL" in str(e.value) and "a comma list of mqtt, mqtts, ws, wss" in str(e.value)
    with pytest.raises(SettingsError) as e:  # no certificate: the TLS listeners are off
        load(ConnectorSettings, {"MQTT_PROXY_PROTOCOL": "mqtt,wss"})
    assert "MQTT_PROXY_PROTOCOL names listeners that are off: wss" in str(e.value)


def test_an_intermediate_ca_is_trusted_while_its_root_is_in_the_bundle():
    """connector.tls.ca_names with root → intermediate: the intermediate's name counts while its root is in
    the bundle and it verifies against it; removing the root takes it away too (its clients are closed), as does
    a certificate that only claims the root as issuer."""
    import datetime

    from connector.tls import ca_names
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def ca(name: str, signer=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = (subject, key) if signer is None else signer
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now)
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(issuer_key, hashes.SHA256()))
        return cert, key

    root, root_key = ca("root")
    inter, inter_key = ca("intermediate", (root.subject, root_key))
    _, stranger_key = ca("root")  # another key under the same name
    forged, _ = ca("claims root", (root.subject, stranger_key))
    pem = {c: c.public_bytes(serialization.Encoding.PEM) for c in (root, inter, forged)}
    name = {c: c.subject.public_bytes() for c in (root, inter, forged)}
    assert ca_names(pem[root] + pem[inter]) == {name[root], name[inter]}
    assert ca_names(pem[inter]) == set()  # its root removed: the intermediate's clients go too
    assert ca_names(pem[root] + pem[forged]) == {name[root]}  # not signed by the root it names
