"""The TLS / WSS listeners' files while the connector runs: a changed file set replaces the listeners' context
for new handshakes (`ListenerTls`), and a new revocation list (MQTT_TLS_CRL_FILE) also ends the open
connections whose client certificate it lists (`revoked_certificates`, `certificate_key`), as does a CA removed
from MQTT_TLS_CA_FILE for the connections whose certificate it issued (`ca_names`).

A certificate is known by its issuer's name (DER) and serial number, as a CRL lists it (RFC 5280 5.3.3: a CRL
names certificates of its issuer by serial number).
"""

from __future__ import annotations

import re
import ssl

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from tbmq_platform.watch import file_stamps

CertificateKey = tuple[bytes, int]  # (issuer name, DER; serial number)
CRL_BEGIN, CERT_BEGIN = "-----BEGIN X509 CRL-----", "-----BEGIN CERTIFICATE-----"  # PEM block markers
_CRL_BLOCK = re.compile(CRL_BEGIN.encode() + rb".+?-----END X509 CRL-----", re.S)
_CERT_BLOCK = re.compile(CERT_BEGIN.encode() + rb".+?-----END CERTIFICATE-----", re.S)


def certificate_key(der: bytes | None) -> CertificateKey | None:
    """The (issuer, serial) of a client certificate (DER, as ssl's getpeercert(True) gives it); None without."""
    if not der:
        return None
    cert = x509.load_der_x509_certificate(der)
    return cert.issuer.public_bytes(), cert.serial_number


def revoked_certificates(pem: bytes) -> set[CertificateKey]:
    """Every certificate the PEM revocation lists in `pem` name, as `certificate_key` gives it. Raises
    ValueError on a list that does not parse."""
    out: set[CertificateKey] = set()
    for block in _CRL_BLOCK.findall(pem):
        crl = x509.load_pem_x509_crl(block)
        issuer = crl.issuer.public_bytes()
        out.update((issuer, r.serial_number) for r in crl)
    return out


def ca_names(pem: bytes) -> set[bytes]:
    """The subject names (DER) of the CAs of a PEM CA bundle that are trusted: a self-signed one, or one whose
    issuer is in the bundle, signed it and is trusted (OpenSSL takes a chain only up to a self-signed anchor).
    They are the issuers, as `certificate_key` names them, of the client certificates the bundle lets in
    (one an intermediate CA the client sends itself signed has that intermediate as issuer); so the root of
    an intermediate in the bundle removed, the intermediate's name is gone too. Raises ValueError on a
    certificate that does not parse."""
    certs = [x509.load_pem_x509_certificate(block) for block in _CERT_BLOCK.findall(pem)]
    by_subject: dict[bytes, list[x509.Certificate]] = {}
    for cert in certs:
        by_subject.setdefault(cert.subject.public_bytes(), []).append(cert)

    def anchored(cert: x509.Certificate, below: frozenset[bytes]) -> bool:
        if cert.issuer == cert.subject:
            return True
        name = cert.subject.public_bytes()
        for parent in by_subject.get(cert.issuer.public_bytes(), ()):
            if parent.subject.public_bytes() in below:  # a loop of cross-signed names
                continue
            try:
                cert.verify_directly_issued_by(parent)
            except (ValueError, TypeError, InvalidSignature):
                continue
            if anchored(parent, below | {name}):
                return True
        return False

    return {cert.subject.public_bytes() for cert in certs if anchored(cert, frozenset())}


class ListenerTls:
    """The TLS / WSS listeners' current context. A server keeps the context it was made with, so a reloaded one
    is put in place per handshake: the listening context's SNI callback (OpenSSL's servername callback, called
    for every ClientHello, with or without a server name) moves the connection to `current` (SSL_set_SSL_CTX):
    its certificate and key, and the CAs and CRLs that verify the client's certificate. The verify mode and
    flags stay the listening context's, which the same settings made."""

    def __init__(self, listening: ssl.SSLContext) -> None:
        self.listening = self.current = listening
        listening.sni_callback = self._select

    def _select(self, conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        if self.current is not self.listening:
            conn.context = self.current


__all__ = ["CERT_BEGIN", "CRL_BEGIN", "CertificateKey", "ListenerTls", "ca_names", "certificate_key", "file_stamps",
           "revoked_certificates"]
