"""The connector's authentication glue: the anonymous default from its listeners, the names of a client
certificate, and the `tbmq` command line's record building (no Kafka)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from connector.connection import certificate_names
from connector.settings import ConnectorSettings
from tbmq_auth import Credential
from tbmq_platform.cli import CliError, credential_from_args, main, parser, read_password, rule_from_args
from tbmq_mqtt import ReasonCode
from tbmq_platform.settings import SettingsError, load

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("environ, expected", [
    ({"MQTT_BIND_HOST": "127.0.0.1"}, True),
    ({"MQTT_BIND_HOST": "127.0.0.1", "MQTT_WS_BIND_HOST": "0.0.0.0"}, False),
    ({}, False),                                                    # 0.0.0.0 by default
    ({"MQTT_ALLOW_ANONYMOUS": "true"}, True),
    ({"MQTT_BIND_HOST": "::1", "MQTT_ALLOW_ANONYMOUS": "false"}, False),
])
def test_allow_anonymous_default_follows_the_listeners(environ, expected):
    assert load(ConnectorSettings, environ).allow_anonymous is expected


def test_auth_providers_setting():
    assert load(ConnectorSettings, {}).auth_providers == ("password", "x509", "anonymous")
    assert load(ConnectorSettings, {"MQTT_AUTH_PROVIDERS": "x509"}).auth_providers == ("x509",)


def test_jwt_provider_settings_need_one_good_key(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / "jwt.pem"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    private = tmp_path / "private.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    on = {"MQTT_AUTH_PROVIDERS": "password,jwt"}
    s = load(ConnectorSettings, {**on, "MQTT_AUTH_JWT_PUBLIC_KEY_FILE": str(public), "MQTT_AUTH_JWT_AUDIENCE": "a"})
    v = s.token_verifier()
    assert v.algorithms == ("ES256", "ES384", "ES512") and v.audience == "a"
    assert load(ConnectorSettings, {**on, "MQTT_AUTH_JWT_SECRET": "x" * 32}).token_verifier().algorithms[0] == "HS256"
    assert load(ConnectorSettings, {}).token_verifier() is None
    import json

    from jwt.algorithms import ECAlgorithm
    from tbmq_auth import PendingKeys

    key_set = tmp_path / "jwks.json"
    key_set.write_text(json.dumps({"keys": [{**json.loads(ECAlgorithm.to_jwk(key.public_key())), "kid": "k1"}]}))
    from_set = load(ConnectorSettings, {**on, "MQTT_AUTH_JWT_JWKS": str(key_set)}).token_verifier()
    assert set(from_set.keys) == {"k1"} and not s.jwks_url
    url = load(ConnectorSettings, {**on, "MQTT_AUTH_JWT_JWKS": "https://id.example/.well-known/jwks.json"})
    assert url.jwks_url and isinstance(url.token_verifier(), PendingKeys)  # fetched once the connector runs
    leaked = tmp_path / "leaked.json"
    leaked.write_text(json.dumps({"keys": [json.loads(ECAlgorithm.to_jwk(key))]}))
    for environ, text in [
        (on, "set one of MQTT_AUTH_JWT_SECRET, MQTT_AUTH_JWT_PUBLIC_KEY_FILE and MQTT_AUTH_JWT_JWKS"),
        ({**on, "MQTT_AUTH_JWT_SECRET": "x" * 32, "MQTT_AUTH_JWT_PUBLIC_KEY_FILE": str(public)}, "(not 2)"),
        ({**on, "MQTT_AUTH_JWT_SECRET": "x" * 32, "MQTT_AUTH_JWT_JWKS": str(key_set)}, "(not 2)"),
        ({**on, "MQTT_AUTH_JWT_JWKS": str(leaked)}, "MQTT_AUTH_JWT_JWKS: key 0: it holds a private key"),
        ({**on, "MQTT_AUTH_JWT_JWKS": str(tmp_path / "none.json")}, "MQTT_AUTH_JWT_JWKS: "),
        ({**on, "MQTT_AUTH_JWT_JWKS": str(key_set), "MQTT_AUTH_JWT_JWKS_REFRESH_S": "0"}, "MQTT_AUTH_JWT_JWKS_REFRESH_S"),
        ({**on, "MQTT_AUTH_JWT_SECRET": "short"}, "MQTT_AUTH_JWT_SECRET: an HMAC secret needs at least 32 bytes"),
        ({**on, "MQTT_AUTH_JWT_PUBLIC_KEY_FILE": str(tmp_path / "nope.pem")}, "MQTT_AUTH_JWT_PUBLIC_KEY_FILE: "),
        ({**on, "MQTT_AUTH_JWT_PUBLIC_KEY_FILE": str(private)}, "MQTT_AUTH_JWT_PUBLIC_KEY_FILE: "),
        ({"MQTT_AUTH_JWT_SECRET": "x" * 32}, "MQTT_AUTH_JWT_SECRET is set but MQTT_AUTH_PROVIDERS has no jwt"),
        ({**on, "MQTT_AUTH_JWT_JWKS": str(key_set), "MQTT_AUTH_JWT_JWKS_CA_FILE": str(public)},
         "MQTT_AUTH_JWT_JWKS_CA_FILE is set but MQTT_AUTH_JWT_JWKS is not an http(s) URL"),
        ({**on, "MQTT_AUTH_JWT_JWKS": "https://id.example/k", "MQTT_AUTH_JWT_JWKS_CA_FILE": str(public)},
         "MQTT_AUTH_JWT_JWKS_CA_FILE="),  # a public key, not a CA certificate
        ({"MQTT_AUTH_JWT_JWKS_CA_FILE": str(public)}, "MQTT_AUTH_JWT_JWKS_CA_FILE is set but MQTT_AUTH_PROVIDERS"),
    ]:
        with pytest.raises(SettingsError) as e:
            load(ConnectorSettings, environ)
        assert text in str(e.value), (environ, str(e.value))


def test_certificate_names_cn_then_sans():
    cert = {"subject": ((("countryName", "DE"),), (("commonName", "dev1"),)),
            "subjectAltName": (("DNS", "dev1.example"), ("DNS", "dev1"))}
    assert certificate_names(cert) == ("dev1", "dev1.example")
    assert certificate_names(None) == () and certificate_names({}) == ()


def test_cli_credential_record_has_only_the_hash():
    args = parser().parse_args(["credentials", "add", "--username", "u", "--password-stdin", "--pub", "a/%c/#",
                                "--sub", "#"])
    cred = credential_from_args(args, read_password(io.StringIO("s3cret\n")))
    assert cred.password_hash.startswith("$argon2id$") and b"s3cret" not in cred.to_json()
    assert Credential.from_json("u", cred.to_json()).pub == ("a/%c/#",)
    with pytest.raises(CliError):
        credential_from_args(parser().parse_args(["credentials", "add", "--username", "u", "--pub", "a/#/b",
                                                  "--password-stdin"]), "pw")
    with pytest.raises(CliError):  # neither a password nor a certificate
        credential_from_args(parser().parse_args(["credentials", "add", "--username", "u"]), None)


def test_cli_credential_hash_cost():
    args = parser().parse_args(["credentials", "add", "--username", "u", "--password-stdin", "--hash-cost", "low"])
    assert "$m=19456,t=2,p=1$" in credential_from_args(args, "pw").password_hash
    default = parser().parse_args(["credentials", "add", "--username", "u", "--password-stdin"])
    assert "$m=65536,t=3,p=4$" in credential_from_args(default, "pw").password_hash
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parser().parse_args(["credentials", "add", "--username", "u", "--hash-cost", "none"])


def test_cli_blocked_rule():
    args = parser().parse_args(["blocked", "add", "--client-id", "bad", "--expires-in", "60"])
    rule = rule_from_args(args, 1000)
    assert rule.key == "client_id:bad" and rule.expires_at_ms == 61_000
    with pytest.raises(CliError):
        rule_from_args(parser().parse_args(["blocked", "add", "--regex", "("]), 0)
    with pytest.raises(CliError):
        rule_from_args(SimpleNamespace(client_id="a", username="b", ip=None, regex=None, target="client_id",
                                       expires_in=None, reason=""), 0)


def test_cli_token_revocation_refuses_what_it_cannot_write(capsys):
    """`tbmq tokens revoke`: a token already expired writes nothing (refused anyway: no Kafka is reached here),
    a request without both jti and exp, or with both forms, is an error naming the options."""
    assert main(["tokens", "revoke", "--jti", "t-1", "--exp", "1000", "--bootstrap-servers", "nowhere:1"]) == 0
    assert "nothing written" in capsys.readouterr().out
    for argv in (["tokens", "revoke", "--jti", "t-1"], ["tokens", "revoke"],
                 ["tokens", "revoke", "--jti", "t-1", "--exp", "1", "--token-stdin"]):
        assert main([*argv, "--bootstrap-servers", "nowhere:1"]) == 2, argv
        assert "--jti with --exp" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the adapter
def _port_with(*creds: Credential):
    from connector_fakes import FakePort
    from tbmq_auth import AuthTables, Authorizer

    port = FakePort()
    tables = AuthTables()
    for c in creds:
        tables.apply_credential(c.name.encode(), c.to_json())
    port.auth = Authorizer(tables, verify=lambda stored, pw: stored == "hash:" + pw.decode())
    return port, tables


async def test_adapter_awaits_authentication_before_the_session_and_queues_acl_changes():
    from connector_fakes import connected, until
    from tbmq_mqtt import Connect, SubAck, Subscribe, Subscription, encode

    port, tables = _port_with(Credential("dev", password_hash="hash:pw", sub=("a/#", "b/#")))
    conn, transport, (connack,) = await connected(port, Connect(protocol_level=5, client_id="d1", clean_start=True,
                                                                username="dev", password=b"bad"))
    assert connack.reason_code == ReasonCode.BAD_USER_NAME_OR_PASSWORD and transport.closed
    assert port.by_session == {}                                       # the registry was never asked
    conn, transport, (connack,) = await connected(port, Connect(protocol_level=5, client_id="d1", clean_start=True,
                                                                username="dev", password=b"pw"))
    assert connack.reason_code == 0 and conn.credential == "dev"
    conn.data_received(encode(Subscribe(1, [Subscription("a/x", 1), Subscription("b/x", 1)]), 5))
    await until(lambda: bool(transport.data))
    assert transport.packets(5) == [SubAck(1, [1, 1])]
    tables.apply_credential(b"dev", Credential("dev", password_hash="hash:pw", sub=("b/#",)).to_json())
    conn.acl_changed()
    await until(lambda: set(conn.subs) == {("", "b/x")})
    assert [t.topic_filter for t in port.subscription_sets[-1]] == ["b/x"] and transport.data == b""


def test_http_provider_settings(tmp_path):
    on = {"MQTT_AUTH_PROVIDERS": "http,anonymous"}
    s = load(ConnectorSettings, {**on, "MQTT_AUTH_HTTP_URL": "https://auth.example/mqtt",
                                 "MQTT_AUTH_HTTP_AUTHORIZATION": "Bearer x", "MQTT_AUTH_HTTP_TIMEOUT_S": "2"})
    assert s.http_auth_url == "https://auth.example/mqtt" and s.http_auth_timeout_s == 2.0
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate\n")
    for environ, text in [
        (on, "MQTT_AUTH_PROVIDERS has http: MQTT_AUTH_HTTP_URL must be an http(s) URL"),
        ({**on, "MQTT_AUTH_HTTP_URL": "ftp://auth.example"}, "(not 'ftp://auth.example')"),
        ({**on, "MQTT_AUTH_HTTP_URL": "http://a", "MQTT_AUTH_HTTP_CA_FILE": str(bad_ca)}, "MQTT_AUTH_HTTP_CA_FILE="),
        ({**on, "MQTT_AUTH_HTTP_URL": "http://a", "MQTT_AUTH_HTTP_TIMEOUT_S": "0"}, "MQTT_AUTH_HTTP_TIMEOUT_S"),
        ({"MQTT_AUTH_HTTP_URL": "http://a"}, "MQTT_AUTH_HTTP_URL is set but MQTT_AUTH_PROVIDERS has no http"),
        ({"MQTT_AUTH_HTTP_CACHE_S": "30"}, "MQTT_AUTH_HTTP_CACHE_S is set but MQTT_AUTH_PROVIDERS has no http"),
        ({**on, "MQTT_AUTH_HTTP_URL": "http://a", "MQTT_AUTH_HTTP_CACHE_S": "-1"}, "MQTT_AUTH_HTTP_CACHE_S"),
    ]:
        with pytest.raises(SettingsError) as e:
            load(ConnectorSettings, environ)
        assert text in str(e.value), (environ, str(e.value))
