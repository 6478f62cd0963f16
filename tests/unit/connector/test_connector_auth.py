"""The connector's authentication glue: the anonymous default from its listeners, the names of a client
certificate, and the `tbmq` command line's record building (no Kafka)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from connector.connection import certificate_names
from connector.settings import ConnectorSettings
from tbmq_auth import Credential
from tbmq_platform.cli import CliError, credential_from_args, parser, read_password, rule_from_args
from tbmq_platform.settings import load

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


def test_cli_blocked_rule():
    args = parser().parse_args(["blocked", "add", "--client-id", "bad", "--expires-in", "60"])
    rule = rule_from_args(args, 1000)
    assert rule.key == "client_id:bad" and rule.expires_at_ms == 61_000
    with pytest.raises(CliError):
        rule_from_args(parser().parse_args(["blocked", "add", "--regex", "("]), 0)
    with pytest.raises(CliError):
        rule_from_args(SimpleNamespace(client_id="a", username="b", ip=None, regex=None, target="client_id",
                                       expires_in=None, reason=""), 0)
