"""``tls:`` section: TLS and mutual TLS on the ADS port and on the probe streams to the agents.

Plaintext needs saying: without ``tls.mode`` (or ``tls.agents.mode``) the control plane accepts
plaintext only on loopback (``xds.listen``, every ``probe_address`` on 127.0.0.0/8, ::1 or
localhost); anything else is refused by :func:`check_plaintext` with a message naming the field.
``mode: plaintext`` states it explicitly.

Files are PEM. They are re-read when they change (rotation without restart, see
:mod:`xds_server.process.tls`); changing a path or a mode needs a restart.
"""
from __future__ import annotations

import os
import time
from typing import Literal, TypedDict

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _Model, parse_hostport
from xds_server.process.certs import refuse_expired
from xds_server.process.dialing import ClientTls, is_loopback
from xds_server.process.identity import check_pattern

__all__ = [
    "AgentTlsConfig",
    "ListenerTls",
    "NodeAllowRule",
    "TlsConfig",
    "TlsMode",
    "check_patterns",
    "check_plaintext",
    "implicit_agent_plaintext",
]

TlsMode = Literal["plaintext", "tls", "mtls"]


def _readable(path: str | None, field: str) -> None:
    if path is not None and not os.access(path, os.R_OK):
        raise ValueError(f"{field}: cannot read {path!r} (missing or not readable)")


def _not_expired(path: str | None, field: str) -> None:
    """A certificate already past its notAfter is refused at load (ValueError naming ``field``)."""
    if path is not None:
        try:
            refuse_expired(path, time.time(), field)
        except OSError as e:
            raise ValueError(f"{field}: cannot read {path!r}: {e.strerror}") from e


def check_patterns(patterns: list[str], field: str) -> list[str]:
    """Validate identity allow-list patterns (typed: :mod:`xds_server.process.identity`)."""
    for i, p in enumerate(patterns):
        why = check_pattern(p)
        if why:
            raise ValueError(f"{field}.{i}: {why}")
    return patterns


class NodeAllowRule(_Model):
    """One allow-list entry: clients whose certificate carries ``identity`` may use these node ids."""

    identity: str = Field(
        ..., min_length=1,
        description="typed fnmatch pattern over the client certificate: 'spiffe://...' or "
        "'uri:PATTERN' match URI SANs only, 'dns:PATTERN' DNS SANs, 'cn:PATTERN' the subject's "
        "common name of a certificate without SANs; a pattern without a prefix matches DNS SANs "
        "(as dns:). A CN or DNS SAN that reads spiffe://... never matches a spiffe:// pattern",
    )
    node_ids: list[str] = Field(
        ..., min_length=1, description="fnmatch patterns of the Envoy node ids (node.id) it may use",
    )

    @field_validator("identity")
    @classmethod
    def _typed(cls, v: str) -> str:
        why = check_pattern(v)
        if why:
            raise ValueError(why)
        return v


class AgentTlsConfig(_Model):
    """The probe streams: the control plane dials each agent (``probe_address``) as a TLS client."""

    mode: TlsMode | None = Field(
        None, description="plaintext | tls (verify the agent's certificate) | mtls (and present "
        "ours). Unset: plaintext, allowed only when every probe_address is loopback",
    )
    ca_file: str | None = Field(None, description="CA bundle that signed the agents' server certificates (tls, mtls)")
    cert_file: str | None = Field(None, description="the control plane's client certificate (mtls)")
    key_file: str | None = Field(None, description="its private key (mtls)")
    server_name: str | None = Field(
        None, min_length=1,
        description="name the agent's certificate must carry; '{node_id}' is replaced by the node's "
        "id (e.g. '{node_id}.agents.internal'). Unset: the host of probe_address",
    )

    identity: str | None = Field(
        None, min_length=1,
        description="dial-in (agents without probe_address): the typed name an agent's client "
        "certificate must carry for the node it claims, '{node_id}' replaced by the id (e.g. "
        "'spiffe://cluster.local/ns/llm/sa/agent/{node_id}'); checked when the xDS port asks for "
        "client certificates (tls.mode mtls). Unset: a DNS SAN equal to the node id or starting "
        "'{node_id}.', or a URI SAN ending '/{node_id}'",
    )

    @field_validator("identity")
    @classmethod
    def _typed_identity(cls, v: str | None) -> str | None:
        why = None if v is None else check_pattern(v.replace("{node_id}", "x"))
        if why:
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _files(self) -> AgentTlsConfig:
        if self.mode in ("tls", "mtls") and not self.ca_file:
            raise ValueError(f"ca_file is required with mode {self.mode}")
        if self.mode == "mtls" and not (self.cert_file and self.key_file):
            raise ValueError("cert_file and key_file are required with mode mtls")
        if self.mode != "mtls" and (self.cert_file or self.key_file):
            raise ValueError(f"cert_file/key_file are used with mode mtls only (mode is {self.mode})")
        for name in ("ca_file", "cert_file", "key_file"):
            _readable(getattr(self, name), name)
        _not_expired(self.cert_file, "cert_file")
        return self

    def client(self, node_id: str) -> ClientTls | None:
        """How to dial the agent of ``node_id``: None for plaintext."""
        if self.mode in (None, "plaintext"):
            return None
        assert self.ca_file is not None
        name = self.server_name.replace("{node_id}", node_id) if self.server_name else None
        return ClientTls(self.ca_file, self.cert_file, self.key_file, name)


class ListenerTls(TypedDict):
    """:meth:`TlsConfig.listener`: the keyword arguments of
    :func:`xds_server.process.tls.listener_credentials`."""

    mode: TlsMode | None
    cert_file: str | None
    key_file: str | None
    client_ca_file: str | None


class TlsConfig(_Model):
    """The ADS port (also serving the routing feed) as a TLS server, and the probe streams."""

    mode: TlsMode | None = Field(
        None, description="plaintext | tls (server certificate) | mtls (clients must present a "
        "certificate signed by client_ca_file). Unset: plaintext, allowed only on a loopback xds.listen",
    )
    cert_file: str | None = Field(None, description="the ADS server's certificate (tls, mtls)")
    key_file: str | None = Field(None, description="its private key (tls, mtls)")
    client_ca_file: str | None = Field(None, description="CA bundle that signed the clients' certificates (mtls)")
    node_allow: list[NodeAllowRule] = Field(
        default_factory=list,
        description="mtls only: when not empty, an ADS stream whose node id no rule allows for its "
        "client's identity is refused (PERMISSION_DENIED, counted in "
        "sentinel_xds_streams_rejected_total{reason=\"permission_denied\"}); applied on reload",
    )
    agents: AgentTlsConfig = AgentTlsConfig()
    expiry_warning_days: float = Field(
        7.0, gt=0, le=3650,
        description="days: a certificate in use (ADS server, client CA, agents client, admin) "
        "within this many days of its notAfter logs a warning (at most hourly) and is named in "
        "/readyz's certificate_warnings (still 200: the old certificate still works); once expired "
        "/readyz answers 503 naming it (ours: a week covers a weekend and a renewal pipeline's "
        "retries; cert-manager renews 30 days before a 90-day certificate ends)",
    )

    def listener(self) -> ListenerTls:
        """The restart-only part (mode and files of the ADS port) as keyword arguments of
        :func:`xds_server.process.tls.listener_credentials`."""
        return ListenerTls(mode=self.mode, cert_file=self.cert_file, key_file=self.key_file,
                           client_ca_file=self.client_ca_file)

    @model_validator(mode="after")
    def _files(self) -> TlsConfig:
        if self.mode in ("tls", "mtls") and not (self.cert_file and self.key_file):
            raise ValueError(f"cert_file and key_file are required with mode {self.mode}")
        if self.mode == "mtls" and not self.client_ca_file:
            raise ValueError("client_ca_file is required with mode mtls")
        if self.mode != "mtls" and (self.client_ca_file or self.node_allow):
            raise ValueError(f"client_ca_file and node_allow are used with mode mtls only (mode is {self.mode})")
        if self.mode in (None, "plaintext") and (self.cert_file or self.key_file):
            raise ValueError(f"cert_file/key_file are used with mode tls or mtls only (mode is {self.mode})")
        for name in ("cert_file", "key_file", "client_ca_file"):
            _readable(getattr(self, name), name)
        _not_expired(self.cert_file, "cert_file")
        return self


def check_plaintext(tls: TlsConfig, xds_listen: str, probe_addresses: list[tuple[str, str]]) -> None:
    """Refuse implicit plaintext off loopback. ``probe_addresses``: (dotted field path, HOST:PORT).
    Raises ValueError naming the field when a mode is unset and an address is not loopback."""
    if tls.mode is None and not is_loopback(parse_hostport(xds_listen)[0]):
        raise ValueError(
            f"xds.listen {xds_listen} is not a loopback address: set tls.mode to mtls or tls "
            "(or to plaintext to accept unauthenticated ADS clients explicitly)")
    for field, addr in probe_addresses:
        problem = implicit_agent_plaintext(tls, addr)
        if problem:
            raise ValueError(f"{field} {problem}")


def implicit_agent_plaintext(tls: TlsConfig, probe_address: str) -> str | None:
    """Why dialling the agent at ``probe_address`` (HOST:PORT) would be implicit plaintext off
    loopback (``tls.agents.mode`` unset), as the end of a sentence naming the address; else None.
    The one rule for static nodes (:func:`check_plaintext`) and discovered ones."""
    if tls.agents.mode is None and not is_loopback(parse_hostport(probe_address)[0]):
        return (f"{probe_address} is not a loopback address: set tls.agents.mode to mtls or tls "
                "(or to plaintext to dial agents unauthenticated explicitly)")
    return None
