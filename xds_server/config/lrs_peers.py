"""One peer replica's entry in ``lrs.peers``: where it is, and who it is when it forwards load
reports here (the rule a forwarded stream meets: :func:`xds_server.load.peers.peer_refused`)."""
from __future__ import annotations

from pydantic import Field, field_validator

from xds_server.config.base import _Model, parse_hostport
from xds_server.process.identity import check_pattern

__all__ = ["PeerConfig"]


class PeerConfig(_Model):
    """One other replica (``lrs.peers``): where its xDS port is, and who it is when it forwards
    reports here."""

    address: str = Field(..., description="HOST:PORT of the peer's xDS port (its xds.listen)")
    replica_id: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
        description="the peer's xds.replica_id: a forwarded stream is accepted only when its marker "
        "names a listed replica_id. Unset (the older form): reports are still forwarded to the peer, "
        "and a forwarded stream claiming it is refused")
    identity: str | None = Field(
        None, min_length=1,
        description="typed pattern over the peer's client certificate (as tls.node_allow's identity: "
        "'spiffe://...', 'uri:', 'dns:', 'cn:'); required when tls.mode is mtls: its forwarded "
        "stream must present a matching certificate. Without mtls the stream must come from the "
        "address's host instead")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        parse_hostport(v)
        return v

    @field_validator("identity")
    @classmethod
    def _typed(cls, v: str | None) -> str | None:
        why = None if v is None else check_pattern(v)
        if why:
            raise ValueError(why)
        return v

