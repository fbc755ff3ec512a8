"""What a TLS dial is and which hosts stay on this machine: plain values with no gRPC, so the
config models (:mod:`xds_server.config.tls`) can name them without loading a transport.
:mod:`xds_server.process.tls` turns a :class:`ClientTls` into credentials and re-exports both.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ClientTls", "is_loopback", "resolved_addresses"]


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


def is_loopback(host: str, resolve: Callable[[str], list[str]] | None = None) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1); a ``*.localhost`` name only
    when it resolves, and only to loopback addresses (RFC 6761 asks resolvers to, but an
    /etc/hosts line or a DNS search domain can send one elsewhere). False for anything else,
    wildcards (0.0.0.0, ::) and other host names included. ``resolve``: name -> addresses
    (default :func:`resolved_addresses`)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost":
        return True
    if host.endswith(".localhost"):
        addrs = (resolve or resolved_addresses)(host)
        return bool(addrs) and all(_loopback_ip(a) for a in addrs)
    return _loopback_ip(host)


def _loopback_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def resolved_addresses(host: str) -> list[str]:
    """Every address ``host`` resolves to here (getaddrinfo); empty when it does not resolve."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
    except (OSError, UnicodeError):
        return []
