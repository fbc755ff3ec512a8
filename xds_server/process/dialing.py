"""What a TLS dial is and which hosts stay on this machine: plain values with no gRPC, so the
config models (:mod:`xds_server.config.tls`) can name them without loading a transport.
:mod:`xds_server.process.tls` turns a :class:`ClientTls` into credentials and re-exports both.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

__all__ = ["ClientTls", "is_loopback"]


@dataclass(frozen=True)
class ClientTls:
    """How a client dials over TLS: ``ca_file`` verifies the server's certificate; ``cert_file``
    and ``key_file`` (both or neither) are the client's own certificate (mutual TLS);
    ``server_name``: the name the server's certificate must carry (None: the target's host)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("ClientTls: cert_file and key_file go together")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1); False for anything else,
    wildcards (0.0.0.0, ::) and other host names included."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
