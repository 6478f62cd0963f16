"""GRPC_TLS_* settings: all three files or none, each readable, a certificate matching its key, a CA file of
certificates; a bad combination stops start-up with one message naming every bad variable. Handshakes
themselves are tested against the running services (tests/e2e/operations/test_grpc_mtls.py)."""

from __future__ import annotations

import pytest
from tbmq_launcher.tls import ensure_dev_certs, issue_peer_cert
from tbmq_platform.grpc_tls import PLAINTEXT, GrpcTls, certificate_names, name_allowed
from tbmq_platform.settings import CommonSettings, SettingsError, load

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpc-tls")
    ca = ensure_dev_certs(d / "a", "internal A")
    cert, key = issue_peer_cert(ca, "svc-1")
    other_cert, other_key = issue_peer_cert(ensure_dev_certs(d / "b", "internal B"), "svc-2")
    return {"ca": str(ca.ca), "cert": str(cert), "key": str(key), "other_key": str(other_key),
            "other_cert": str(other_cert), "dir": d}


def test_off_by_default_and_on_with_the_three_files(certs):
    assert not PLAINTEXT.enabled and PLAINTEXT.problems() == []
    on = load(CommonSettings, {"GRPC_TLS_CERT_FILE": certs["cert"], "GRPC_TLS_KEY_FILE": certs["key"],
                               "GRPC_TLS_CA_FILE": certs["ca"]})
    assert on.grpc_tls == GrpcTls(certs["cert"], certs["key"], certs["ca"])
    assert on.grpc_tls.enabled and on.validate() == []
    assert load(CommonSettings, {}).grpc_tls == PLAINTEXT


def test_a_partial_set_names_what_is_missing(certs):
    problems = GrpcTls(cert_file=certs["cert"]).problems()
    assert len(problems) == 1 and "GRPC_TLS_KEY_FILE, GRPC_TLS_CA_FILE must be set" in problems[0]
    assert "GRPC_TLS_CERT_FILE must be set" in GrpcTls(key_file=certs["key"], ca_file=certs["ca"]).problems()[0]
    assert GrpcTls(server_name="dp").problems() == ["GRPC_TLS_SERVER_NAME is used with GRPC_TLS_CERT_FILE only"]


def test_unreadable_mismatched_and_empty_files_are_named(certs, tmp_path):
    missing = str(tmp_path / "nope.pem")
    assert GrpcTls(certs["cert"], missing, missing).problems() == [
        f"GRPC_TLS_KEY_FILE={missing!r}: not a readable file", f"GRPC_TLS_CA_FILE={missing!r}: not a readable file"]
    mismatched = GrpcTls(certs["cert"], certs["other_key"], certs["ca"]).problems()
    assert len(mismatched) == 1 and mismatched[0].startswith("GRPC_TLS_CERT_FILE / GRPC_TLS_KEY_FILE: not a PEM")
    not_a_ca = tmp_path / "ca.pem"
    not_a_ca.write_text("not a certificate\n")
    problems = GrpcTls(certs["cert"], certs["key"], str(not_a_ca)).problems()
    assert len(problems) == 1 and problems[0].startswith(f"GRPC_TLS_CA_FILE={str(not_a_ca)!r}: no PEM certificate")


def test_start_up_refuses_a_bad_set_with_one_message_naming_every_variable(certs, tmp_path):
    missing = str(tmp_path / "gone.pem")
    with pytest.raises(SettingsError) as refused:
        load(CommonSettings, {"GRPC_TLS_CERT_FILE": certs["cert"], "GRPC_TLS_KEY_FILE": certs["other_key"],
                              "GRPC_TLS_CA_FILE": missing, "KAFKA_SSL_CAFILE": missing})
    assert refused.value.problems == [
        f"GRPC_TLS_CA_FILE={missing!r}: not a readable file",
        "KAFKA_SSL_CAFILE is used by SSL and SASL_SSL only (KAFKA_SECURITY_PROTOCOL=PLAINTEXT)"]


def test_the_peer_certificate_serves_both_ways_and_names_the_extra_hosts(certs):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = ensure_dev_certs(certs["dir"] / "c", "internal C")
    cert, _ = issue_peer_cert(ca, "tbmq", hosts=("device-persistence", "app-delivery"))
    parsed = x509.load_pem_x509_certificate(cert.read_bytes())
    usages = parsed.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    names = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "device-persistence", "app-delivery"} <= set(names.get_values_for_type(x509.DNSName))


def test_peer_names_match_a_callers_cn_or_dns_names():
    """GRPC_TLS_PEER_NAMES: shell patterns against the names gRPC's auth context gives (CN, subjectAltNames);
    a caller with no certificate name is let in by no pattern."""
    context = {"x509_common_name": [b"router-1-ab12"], "x509_subject_alternative_name": [b"localhost", b"rt.lan"],
               "transport_security_type": [b"ssl"]}
    names = certificate_names(context)
    assert names == ["router-1-ab12", "localhost", "rt.lan"]
    assert name_allowed(names, ("connector-*", "router-*"))
    assert name_allowed(names, ("*.lan",))
    assert not name_allowed(names, ("connector-*", "Router-*"))  # case counts, as in a certificate
    assert not name_allowed(certificate_names({}), ("*",))
    assert not GrpcTls(peer_names=("router-*",)).server_interceptors()  # off without the files
    assert GrpcTls(peer_names=("router-*",)).problems() == ["GRPC_TLS_PEER_NAMES is used with GRPC_TLS_CERT_FILE only"]
