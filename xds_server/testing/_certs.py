"""Test certificates: a private CA issuing server and client certificates as PEM files.

Uses the ``cryptography`` package (the ``dev`` extra): EC P-256 keys, SHA-256 signatures, a
validity of one day from an hour ago (so clock skew between processes does not matter). Shape::

    ca = TestCA(tmp_path, "ca")                       # writes ca.pem
    pair = ca.issue("xds", dns=["localhost"], ips=["127.0.0.1"])   # xds.pem, xds.key
    pair = ca.issue("envoy", uris=["spiffe://cluster.local/ns/x/sa/envoy"], client=True)
    pair.cert, pair.key, ca.cert                      # paths (str)

``cryptography`` is imported when a CA is made (so importing this module needs only the runtime
dependencies); :class:`TestCA` raises ImportError when it is not installed.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CertPair", "TestCA"]


@dataclass(frozen=True)
class CertPair:
    """Paths of one issued certificate (PEM, with no chain) and its private key (PEM, unencrypted)."""

    cert: str
    key: str


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestCA:
    """A self-signed CA whose certificate is written to ``<dir>/<name>.pem`` (``cert``)."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: str | Path, name: str = "ca") -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(_name(f"{name} test CA")).issuer_name(_name(f"{name} test CA"))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = str(self.dir / f"{name}.pem")
        Path(self.cert).write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, common_name: str | None = None, dns: list[str] | tuple[str, ...] = (),
              ips: list[str] | tuple[str, ...] = (), uris: list[str] | tuple[str, ...] = (),
              client: bool = False, directory: str | Path | None = None,
              valid_from_s: float = -3600.0, valid_for_s: float = 90000.0) -> CertPair:
        """Issue a leaf certificate and write ``<name>.pem`` and ``<name>.key`` (into ``directory``,
        default the CA's). ``client``: extended key usage clientAuth (else serverAuth and
        clientAuth). Validity: from now + ``valid_from_s`` for ``valid_for_s`` (s; default an
        hour ago to a day from now; negative sums make an expired certificate). Returns the paths."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        sans: list[Any] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                   ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder().subject_name(_name(common_name or name)).issuer_name(self._cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + dt.timedelta(seconds=valid_from_s))
            .not_valid_after(now + dt.timedelta(seconds=valid_from_s + valid_for_s))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        out = Path(directory) if directory is not None else self.dir
        out.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
        # Key first, then the certificate, each replaced atomically: a reader polling the
        # certificate's content never sees a new certificate with the old key for long.
        _atomic_write(key_path, _key_pem(key))
        _atomic_write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return CertPair(str(cert_path), str(key_path))


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
