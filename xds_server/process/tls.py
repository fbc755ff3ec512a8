"""gRPC credentials from PEM files, re-read when the files change: the one home of TLS for the
control plane's ADS port, its probe streams to the agents, the agent's server and the relay's feed.

No import from the rest of the project (node_probe and sentinel_relay use it too).

- :func:`server_credentials` -> ``grpc.ServerCredentials`` whose certificate (and client CA) are
  re-read when the files change: gRPC asks :class:`ServerCertFiles` at every new handshake, which
  compares the files' (inode, size, mtime) and loads them anew when they moved. A pair that does not
  load (half-written, key not matching the certificate) is refused, logged and counted; the last
  good one stays in use. Open connections keep the certificate they were opened with.
- :func:`dial` -> a ``grpc.aio.Channel`` to ``target``: plaintext when ``tls`` is None, else TLS
  (verifying the server against ``ClientTls.ca_file`` and ``server_name``), with a client
  certificate when ``cert_file`` is set (mutual TLS). The files are read at each dial when they
  changed, so a redial after rotation presents and trusts the new files.
- :func:`peer_identity` -> the typed identity a client's certificate proves (URI SANs such as
  SPIFFE ids, DNS SANs; the subject's common name only without SANs), from a call's
  ``auth_context()``; :func:`peer_identities` -> its typed names;
  :func:`peer_certificate_sha256` -> that certificate's SHA-256 fingerprint.
- :func:`listener_credentials` and :func:`add_port`: a listener's credentials for a mode, its bind.
- :func:`refused_client`: whether a client's certificate matches allowed patterns (the agent, the
  routing feed); :func:`node_allowed`: the ADS check of an Envoy node id. Both are the one typed
  matcher of :mod:`xds_server.process.identity` (``spiffe://`` matches URI SANs only, ``dns:``
  DNS SANs, ``cn:`` the CN of a certificate without SANs).
- :class:`ClientTls` and :func:`is_loopback` (whether a listen or dial host stays on this machine)
  are plain values from :mod:`xds_server.process.dialing`, re-exported here.
"""
from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import grpc
from prometheus_client.core import CounterMetricFamily

from xds_server.process.certs import refuse_expired
from xds_server.process.dialing import ClientTls, is_loopback
from xds_server.process.identity import PeerIdentity, node_allowed, refusal_reason
from xds_server.process.refusals import Refusals

__all__ = [
    "AllowRule",
    "ClientTls",
    "PeerIdentity",
    "ServerCertFiles",
    "add_port",
    "channel_credentials",
    "check_client",
    "dial",
    "is_loopback",
    "listener_credentials",
    "node_allow_authorizer",
    "node_allowed",
    "peer_certificate_sha256",
    "peer_identities",
    "peer_identity",
    "refused_client",
    "server_credentials",
]

log = logging.getLogger(__name__)

FileSig = tuple[tuple[int, int, int], ...]


def _signature(paths: Sequence[str | None]) -> FileSig:
    """(inode, size, mtime ns) of each path; (-1, -1, -1) for a missing file or None."""
    out = []
    for p in paths:
        if p is None:
            out.append((0, 0, 0))
            continue
        try:
            st = os.stat(p)
        except OSError:
            out.append((-1, -1, -1))
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _check_pair(cert_file: str, key_file: str, ca_file: str | None) -> None:
    """Raise ssl.SSLError/OSError unless the key matches the certificate, the certificate has not
    expired (:func:`~xds_server.process.certs.refuse_expired`) and the CA bundle loads."""
    try:
        refuse_expired(cert_file, time.time())
    except ValueError as e:
        raise OSError(str(e)) from e
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(cert_file, key_file)
    if ca_file:
        ctx.load_verify_locations(cafile=ca_file)



# -- server side -------------------------------------------------------------------------------


class ServerCertFiles:
    """A server certificate, its key and (mutual TLS) the client CA bundle, as files watched for
    change. ``fetch()`` is gRPC's certificate-config fetcher: called on every new handshake (from a
    gRPC thread), it returns a new configuration when the files changed and load, else None (keep
    the current one). Counters: ``reloads`` (new files taken), ``reload_errors`` (refused),
    ``handshakes`` (fetch calls: gRPC asks once per new connection, before its handshake, so a
    handshake it refuses counts here too; ``port`` labels them).

    Raises OSError or ssl.SSLError from the constructor when the files do not load at start (an
    expired certificate included).
    """

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None = None, port: str = "xds") -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self.port = port
        self.handshakes = 0
        self.reloads = 0
        self.reload_errors = 0
        self.last_error = ""
        self._lock = threading.Lock()
        self._sig = _signature(self._paths())
        self.initial = self._load()

    def _paths(self) -> tuple[str | None, ...]:
        return (self.cert_file, self.key_file, self.client_ca_file)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        _check_pair(self.cert_file, self.key_file, self.client_ca_file)
        pair = (_read(self.key_file), _read(self.cert_file))
        ca = _read(self.client_ca_file) if self.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration when the files changed and load; None to keep the current one.
        Never raises (gRPC would fail the handshake)."""
        self.handshakes += 1  # one per connection (int += under the GIL: a lost count at worst)
        try:
            with self._lock:
                sig = _signature(self._paths())
                if sig == self._sig:
                    return None
                self._sig = sig
                try:
                    cfg = self._load()
                except (OSError, ssl.SSLError, ValueError) as e:
                    self.reload_errors += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.warning("TLS: new certificate files %s / %s not taken, the previous ones stay "
                                "in use: %s", self.cert_file, self.key_file, self.last_error)
                    return None
                if _signature(self._paths()) != sig:  # changed while loading: take it next time
                    self._sig = ()
                    return None
                self.reloads += 1
                log.info("TLS: certificate files %s reloaded; new connections use them", self.cert_file)
                return cfg
        except Exception:  # a fetcher that raises fails the handshake
            log.exception("TLS: certificate reload check failed")
            return None

    def metric_families(self, prefix: str = "sentinel") -> Iterator[CounterMetricFamily]:
        """``<prefix>_tls_certificate_reloads_total{result="ok"|"refused"}``: changed certificate
        files taken, or refused (the previous ones stayed in use)."""
        fam = CounterMetricFamily(f"{prefix}_tls_certificate_reloads", "changed TLS certificate files "
                                  "taken (ok) or refused, the previous ones kept (refused)", labels=["result"])
        fam.add_metric(["ok"], self.reloads)
        fam.add_metric(["refused"], self.reload_errors)
        yield fam
        hs = CounterMetricFamily(f"{prefix}_tls_handshakes", "TLS connections begun on this port (gRPC "
                                 "asks for the certificate once per connection, before the handshake); "
                                 "refused handshakes count here only: gRPC ends them before Python sees "
                                 "them", labels=["port"])
        hs.add_metric([self.port], self.handshakes)
        yield hs


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None
                       ) -> tuple[grpc.ServerCredentials, ServerCertFiles]:
    """TLS server credentials reloaded on file change; with ``client_ca_file`` clients must present
    a certificate it signed (mutual TLS). Returns the credentials and their watcher (counters).
    Raises OSError or ssl.SSLError when the files do not load."""
    files = ServerCertFiles(cert_file, key_file, client_ca_file)
    creds = grpc.dynamic_ssl_server_credentials(
        files.initial, files.fetch,  # type: ignore[arg-type]  # fetch's None: no change (grpc docs; stubs omit)
        require_client_authentication=client_ca_file is not None)
    return creds, files


def listener_credentials(mode: str | None, cert_file: str | None, key_file: str | None,
                         client_ca_file: str | None, fields: str = "tls."
                         ) -> tuple[grpc.ServerCredentials | None, ServerCertFiles | None]:
    """Credentials for a listener in ``mode`` (None or "plaintext": none; "tls"; "mtls": clients
    must present a certificate ``client_ca_file`` signed) and their watcher. Raises OSError naming
    the fields (``fields`` prefixes their names) when the files do not load."""
    if mode in (None, "plaintext"):
        return None, None
    assert cert_file is not None and key_file is not None
    try:
        return server_credentials(cert_file, key_file, client_ca_file if mode == "mtls" else None)
    except OSError as e:  # ssl.SSLError included
        raise OSError(f"cannot load the certificate ({fields}cert_file {cert_file}, {fields}key_file {key_file}, "
                      f"{fields}client_ca_file {client_ca_file}): {e}") from e


def add_port(server: grpc.aio.Server, address: str, creds: grpc.ServerCredentials | None) -> int:
    """Bind ``address`` on ``server``: plaintext when ``creds`` is None. Returns the port (0: not
    bound); grpc raises RuntimeError when the bind fails."""
    return server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)


# -- client side -------------------------------------------------------------------------------



_cache: dict[tuple[str | None, ...], tuple[FileSig, grpc.ChannelCredentials]] = {}
_cache_lock = threading.Lock()


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    """Channel credentials from ``tls``'s files, re-read when they changed since the last call.
    Raises OSError or ssl.SSLError when they do not load."""
    paths = (tls.ca_file, tls.cert_file, tls.key_file)
    sig = _signature(paths)
    with _cache_lock:
        hit = _cache.get(paths)
        if hit is not None and hit[0] == sig:
            return hit[1]
    if tls.cert_file and tls.key_file:
        _check_pair(tls.cert_file, tls.key_file, tls.ca_file)
        creds = grpc.ssl_channel_credentials(_read(tls.ca_file), _read(tls.key_file), _read(tls.cert_file))
    else:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=tls.ca_file)
        creds = grpc.ssl_channel_credentials(_read(tls.ca_file))
    with _cache_lock:
        _cache[paths] = (sig, creds)
    return creds


def dial(target: str, *, options: Sequence[tuple[str, object]] = (), tls: ClientTls | None = None
         ) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target`` (``HOST:PORT``): plaintext when ``tls`` is None, else TLS
    as :class:`ClientTls` says. Raises OSError or ssl.SSLError when the TLS files do not load."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    opts = list(options)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=opts)


# -- identities and the node allow-list ------------------------------------------------------


def peer_identity(auth_context: Mapping[str, Iterable[bytes]]) -> PeerIdentity:
    """The typed identity (:class:`~xds_server.process.identity.PeerIdentity`) of the peer's
    verified certificate; empty without one."""
    return PeerIdentity.from_auth_context(auth_context)


def peer_identities(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """The typed names the peer's verified certificate proves (:meth:`PeerIdentity.names`:
    ``spiffe://...``, ``uri:...``, ``dns:...``; ``cn:...`` only without SANs). Empty without a
    client certificate."""
    return peer_identity(auth_context).names()


def peer_certificate_sha256(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """Hex SHA-256 of the DER encoding of the peer's verified certificate (gRPC's
    ``x509_pem_cert``); None without a client certificate or when it does not decode."""
    for v in auth_context.get("x509_pem_cert", ()):
        try:
            pem = v.decode("ascii") if isinstance(v, bytes) else str(v)
            return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()
        except (ValueError, UnicodeDecodeError):
            return None
    return None


def refused_client(patterns: Sequence[str], auth_context: Mapping[str, Iterable[bytes]],
                   field: str = "the allowed clients") -> str | None:
    """None when ``patterns`` is empty or one matches the peer's certificate (typed:
    :mod:`xds_server.process.identity`); else the reason to refuse it, naming ``field``."""
    return refusal_reason(patterns, peer_identity(auth_context), field)


class _Call(Protocol):
    def peer(self) -> str: ...

    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...


def check_client(patterns: Sequence[str], context: _Call, field: str, record: Refusals,
                 port: str, reason: str) -> str | None:
    """:func:`refused_client` for a call's ``context``; a refusal is also counted and logged per
    identity in ``record`` (as ``port``/``reason``). Returns the reason, None when allowed."""
    auth = context.auth_context()
    why = refused_client(patterns, auth, field)
    if why is not None:
        record.refuse(port, reason, context.peer() or "?", ", ".join(peer_identities(auth)[:3]), why)
    return why


class AllowRule(Protocol):
    """One allow-list entry as :func:`node_allow_authorizer` reads it (``tls.node_allow``'s)."""

    @property
    def identity(self) -> str: ...

    @property
    def node_ids(self) -> Sequence[str]: ...


def node_allow_authorizer(rules: Callable[[], Sequence[AllowRule]]) -> Callable[[Sequence[str], str], str | None]:
    """An ADS ``authorize(names, node_id)`` (``names``: the client certificate's, as
    :func:`peer_identities` reads them) over the allow-list ``rules()`` returns when asked
    (objects with ``identity`` and ``node_ids``, as ``tls.node_allow``; empty: every node id)."""
    def authorize(names: Sequence[str], node_id: str) -> str | None:
        current = rules()
        if not current:
            return None
        return node_allowed([(r.identity, r.node_ids) for r in current], names, node_id)
    return authorize
