"""A development CA and the certificates the connector's TLS and WSS listeners need (`make run`, tests).

    certs = ensure_dev_certs(Path(".run/tls"))   # ca.pem, ca-key.pem, server.pem, server-key.pem
    cert, key = issue_client_cert(certs, "device-1")   # a client certificate signed by that CA
    cert, key = issue_peer_cert(certs, "tbmq-grpc")     # a service's certificate for gRPC mutual TLS
    crl = revocation_list(certs, [cert])               # a CRL of that CA listing it (MQTT_TLS_CRL_FILE)

Made with the `openssl` command line (P-256 keys; the server certificate names localhost, 127.0.0.1 and ::1).
Existing files are kept, so clients that trust `ca.pem` keep working across runs. For development and tests
only: the CA's key lies next to it, unencrypted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DAYS = "825"
SERVER_NAMES = ("DNS:localhost", "IP:127.0.0.1", "IP:::1")


class CertError(RuntimeError):
    pass


@dataclass(frozen=True)
class DevCerts:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca-key.pem"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server-key.pem"


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise CertError("openssl not found on PATH (apt-get install openssl)")
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise CertError(f"openssl {' '.join(args[:2])} failed: {done.stderr.strip()[-500:]}")


def _key(path: Path, cwd: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path), cwd=cwd)
    path.chmod(0o600)


def _signed(certs: DevCerts, out: Path, key: Path, subject: str, extensions: str) -> None:
    d = certs.directory
    csr = out.with_suffix(".csr")
    ext = out.with_suffix(".ext")
    ext.write_text(extensions)
    try:
        _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=d)
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(certs.ca), "-CAkey", str(certs.ca_key),
                 "-CAcreateserial", "-days", DAYS, "-sha256", "-extfile", str(ext), "-out", str(out), cwd=d)
    finally:
        csr.unlink(missing_ok=True)
        ext.unlink(missing_ok=True)


def ensure_dev_certs(directory: Path, ca_name: str = "tbmq-py development CA") -> DevCerts:
    """The development CA (CN `ca_name`: CAs side by side need names of their own, since a certificate names
    its issuer) and server certificate in `directory`, made when missing."""
    certs = DevCerts(Path(directory).resolve())
    d = certs.directory
    d.mkdir(parents=True, exist_ok=True)
    if not (certs.ca.exists() and certs.ca_key.exists()):
        _key(certs.ca_key, d)
        _openssl("req", "-x509", "-new", "-key", str(certs.ca_key), "-subj", f"/CN={ca_name}",
                 "-days", DAYS, "-sha256", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", str(certs.ca), cwd=d)
        certs.server_cert.unlink(missing_ok=True)  # signed by a CA that is gone
    if not (certs.server_cert.exists() and certs.server_key.exists()):
        _key(certs.server_key, d)
        _signed(certs, certs.server_cert, certs.server_key, "/CN=localhost",
                f"subjectAltName={','.join(SERVER_NAMES)}\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    return certs


def issue_client_cert(certs: DevCerts, name: str, directory: Path | None = None) -> tuple[Path, Path]:
    """(certificate, key) of a client certificate with CN `name`, signed by the development CA."""
    d = Path(directory or certs.directory)
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / f"client-{name}.pem", d / f"client-{name}-key.pem"
    _key(key, d)
    _signed(certs, cert, key, f"/CN={name}",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n")
    return cert, key


def issue_peer_cert(certs: DevCerts, name: str, directory: Path | None = None,
                    hosts: Iterable[str] = ()) -> tuple[Path, Path]:
    """(certificate, key) of a service instance on the gRPC surfaces between services (GRPC_TLS_CERT_FILE,
    GRPC_TLS_KEY_FILE; tbmq_platform.grpc_tls): CN `name`, the server names of the development certificate and
    the DNS names `hosts`, both serverAuth and clientAuth (each instance presents it as server and as client).
    Kept when present."""
    d = Path(directory or certs.directory)
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / f"peer-{name}.pem", d / f"peer-{name}-key.pem"
    if not (cert.exists() and key.exists()):
        _key(key, d)
        names = ",".join((*SERVER_NAMES, *(f"DNS:{h}" for h in hosts)))
        _signed(certs, cert, key, f"/CN={name}",
                f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    return cert, key


CA_CONFIG = """[ ca ]
default_ca = dev
[ dev ]
database = index.txt
crlnumber = crlnumber
default_md = sha256
default_crl_days = 30
"""


def revocation_list(certs: DevCerts, revoked: Iterable[Path] = (), out: Path | None = None) -> Path:
    """A CRL signed by the development CA listing the certificates `revoked` (PEM files it signed), valid 30 days,
    written in one step (a rename) to `out` (default <directory>/crl.pem). Its number is the time in ms."""
    out = Path(out or certs.directory / "crl.pem")
    with tempfile.TemporaryDirectory(prefix="crl-") as tmp:
        d = Path(tmp)
        (d / "ca.cnf").write_text(CA_CONFIG)
        (d / "index.txt").write_text("")
        number = format(time.time_ns() // 1_000_000, "X")
        (d / "crlnumber").write_text(number.rjust(len(number) + len(number) % 2, "0") + "\n")
        signer = ("-config", "ca.cnf", "-cert", str(certs.ca), "-keyfile", str(certs.ca_key))
        for cert in revoked:
            _openssl("ca", *signer, "-revoke", str(Path(cert).resolve()), cwd=d)
        _openssl("ca", *signer, "-gencrl", "-out", "crl.pem", cwd=d)
        os.replace(d / "crl.pem", out)
    return out


__all__ = ["CertError", "DevCerts", "ensure_dev_certs", "issue_client_cert", "issue_peer_cert", "revocation_list"]
