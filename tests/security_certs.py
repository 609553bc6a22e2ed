"""Test certificates made on the fly with ``cryptography``: a CA and certificates it signs, valid for
``127.0.0.1`` and ``localhost``. Nothing here is committed as a file; tests write them to tmp folders.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stageserve.security.tls import TlsFiles


@dataclass(frozen=True)
class Authority:
    """A CA: its key and self-signed certificate."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str) -> "Authority":
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (_builder(subject, subject, key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    def issue(self, folder: Path, name: str) -> TlsFiles:
        """A certificate for ``name`` (server and client use, SANs 127.0.0.1 and localhost), written
        to ``folder`` with its key and this CA's certificate; returned as the services' TLS files."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (_builder(subject, self.cert.subject, key.public_key())
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        folder.mkdir(parents=True, exist_ok=True)
        paths = TlsFiles(folder / f"{name}.crt", folder / f"{name}.key", folder / "ca.crt")
        paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        paths.ca.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return paths


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
