"""Kafka SASL/TLS client settings (issue 14, internal surfaces): parsed and checked once (CommonSettings),
installed by configure_security, and carried by every client the platform's factories make (producer,
consumer, admin; the retention watch's clients and Faust's broker credentials too)."""

from __future__ import annotations

import ssl

import pytest
from tbmq_platform import kafka
from tbmq_platform.kafka import KafkaSecurity, configure_security, make_admin, make_consumer, make_producer
from tbmq_platform.settings import CommonSettings, SettingsError, load

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def plaintext_after():
    yield
    configure_security(KafkaSecurity())


def test_settings_parse_and_check_every_bad_variable(tmp_path):
    s = load(CommonSettings, {})
    assert s.kafka_security == KafkaSecurity() and s.kafka_security.client_config() == {}
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    s = load(CommonSettings, {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
                              "KAFKA_SASL_USERNAME": "tbmq", "KAFKA_SASL_PASSWORD": "secret",
                              "KAFKA_SSL_CAFILE": str(ca)})
    assert s.kafka_security == KafkaSecurity("SASL_SSL", "SCRAM-SHA-256", "tbmq", "secret", str(ca))
    with pytest.raises(SettingsError) as e:
        load(CommonSettings, {"KAFKA_SECURITY_PROTOCOL": "SASL", "KAFKA_SASL_MECHANISM": "GSSAPI"})
    assert "KAFKA_SECURITY_PROTOCOL" in str(e.value) and "KAFKA_SASL_MECHANISM" in str(e.value)
    with pytest.raises(SettingsError) as e:
        load(CommonSettings, {"KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SSL_CAFILE": str(ca)})
    assert "KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD" in str(e.value)
    assert "KAFKA_SSL_CAFILE is used by SSL and SASL_SSL only" in str(e.value)
    with pytest.raises(SettingsError) as e:
        load(CommonSettings, {"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": str(tmp_path / "nope")})
    assert "no such file" in str(e.value)


def _security_of(client) -> tuple:
    return (client._security_protocol, client._sasl_mechanism, client._sasl_plain_username,
            client._sasl_plain_password, isinstance(client._ssl_context, ssl.SSLContext))


async def test_every_factory_client_carries_the_installed_settings():
    configure_security(KafkaSecurity("SASL_SSL", "SCRAM-SHA-512", "tbmq", "secret"))
    producer = make_producer("h:1", client_id="p")
    consumer = make_consumer("h:1", group_id=None, client_id="c")
    admin = make_admin("h:1", client_id="a")
    try:
        expected = ("SASL_SSL", "SCRAM-SHA-512", "tbmq", "secret", True)
        assert _security_of(producer.client) == expected
        assert _security_of(consumer._client) == expected
        assert _security_of(admin._client) == expected
    finally:
        await producer.stop()
        await consumer.stop()
        await admin.close()


async def test_tls_only_and_plaintext():
    configure_security(KafkaSecurity("SSL"))
    cfg = kafka.client_config(client_id="x")
    assert set(cfg) == {"security_protocol", "ssl_context", "client_id"} and cfg["security_protocol"] == "SSL"
    consumer = make_consumer("h:1", group_id=None, client_id="c")
    try:
        assert consumer._client._security_protocol == "SSL"
        assert isinstance(consumer._client._ssl_context, ssl.SSLContext)
    finally:
        await consumer.stop()
    configure_security(KafkaSecurity())
    consumer = make_consumer("h:1", group_id=None, client_id="c")
    try:
        assert consumer._client._security_protocol == "PLAINTEXT" and consumer._client._ssl_context is None
    finally:
        await consumer.stop()


def test_faust_gets_the_same_credentials():
    from router.app import faust_credentials

    assert faust_credentials(KafkaSecurity()) == {}
    creds = faust_credentials(KafkaSecurity("SASL_SSL", "PLAIN", "tbmq", "secret"))["broker_credentials"]
    assert (creds.username, creds.password, creds.mechanism.value) == ("tbmq", "secret", "PLAIN")
    assert isinstance(creds.ssl_context, ssl.SSLContext)
    assert isinstance(faust_credentials(KafkaSecurity("SSL"))["broker_credentials"].context, ssl.SSLContext)


def test_the_topics_job_reads_the_same_settings():
    """compose's one-shot topics job (`python -m tbmq_launcher topics`) checks and installs them too."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}
    env.pop("KAFKA_SASL_USERNAME", None)
    done = subprocess.run([sys.executable, "-m", "tbmq_launcher", "topics", "--bootstrap-servers", "127.0.0.1:1",
                           "--timeout", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD" in done.stderr, done.stderr
