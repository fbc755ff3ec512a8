"""Certificates watched: when each certificate in use expires, as metrics, a warning and a reason.

- :func:`validity` (pure): (notBefore, notAfter) of one DER certificate, unix s, read from its
  ASN.1 without a crypto library (the ``cryptography`` package is a test dependency only).
- :func:`pem_not_after`: the earliest notAfter of the certificates in a PEM bundle (a chain or a
  CA bundle expires with its first member); :func:`refuse_expired` raises for one already past
  it (used where certificates are loaded: :mod:`xds_server.process.tls`).
- :class:`~xds_server.process.certwatch.CertWatch` (metrics, warnings, ``/readyz`` reasons) is
  built on these; this module imports no metrics library (the config models use it).
"""
from __future__ import annotations

import datetime as dt
import re
import ssl

__all__ = ["iso_utc", "pem_not_after", "refuse_expired", "validity"]

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def _tlv(buf: bytes, i: int) -> tuple[int, int, int]:
    """(tag, content start, content end) of the DER element at ``i``; ValueError when cut short."""
    if i + 2 > len(buf):
        raise ValueError("DER element cut short")
    tag, n = buf[i], buf[i + 1]
    i += 2
    if n & 0x80:
        k = n & 0x7F
        if k == 0 or k > 4 or i + k > len(buf):
            raise ValueError("DER length malformed")
        n = int.from_bytes(buf[i:i + k], "big")
        i += k
    if i + n > len(buf):
        raise ValueError("DER element longer than its container")
    return tag, i, i + n


def _time(tag: int, raw: bytes) -> float:
    text = raw.decode("ascii")
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ (RFC 5280: YY >= 50 is 19YY)
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError(f"not a certificate time (tag {tag:#x})")
    when = dt.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=dt.UTC)
    return when.timestamp()


def validity(der: bytes) -> tuple[float, float]:
    """(notBefore, notAfter) of a DER X.509 certificate, unix s. Pure; ValueError when it is not
    one (RFC 5280: Certificate -> tbsCertificate -> [version], serial, signature, issuer, validity)."""
    try:
        tag, start, _ = _tlv(der, 0)
        tag2, i, _ = _tlv(der, start)
        if tag != 0x30 or tag2 != 0x30:
            raise ValueError("not a certificate (no SEQUENCE)")
        t, _, end = _tlv(der, i)
        if t == 0xA0:  # explicit version
            i = end
        for _field in ("serial", "signature", "issuer"):
            _, _, i = _tlv(der, i)
        t, s, _ = _tlv(der, i)
        if t != 0x30:
            raise ValueError("no validity SEQUENCE")
        t1, a, b = _tlv(der, s)
        t2, c, d = _tlv(der, b)
        return _time(t1, der[a:b]), _time(t2, der[c:d])
    except (UnicodeDecodeError, IndexError) as e:
        raise ValueError(f"certificate does not decode: {e}") from e


def pem_not_after(data: bytes) -> float:
    """The earliest notAfter (unix s) of the PEM certificates in ``data``; ValueError without one."""
    blocks = _PEM.findall(data)
    if not blocks:
        raise ValueError("no PEM certificate found")
    return min(validity(ssl.PEM_cert_to_DER_cert(b.decode("ascii")))[1] for b in blocks)


def iso_utc(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refuse_expired(path: str, now_s: float, field: str = "") -> float:
    """notAfter of the certificate file at ``path`` (unix s); ValueError naming ``field`` and the
    date when it is already past at ``now_s`` or does not decode. OSError when unreadable."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        not_after = pem_not_after(data)
    except ValueError as e:
        raise ValueError(f"{field or path}: {path}: {e}") from e
    if not_after <= now_s:
        raise ValueError(f"{field or path}: certificate {path} expired at {iso_utc(not_after)}; "
                         "renew it (an expired certificate is refused at load)")
    return not_after
