"""Typed client identities and the one allow-list matcher of every channel (ADS ``tls.node_allow``,
the routing feed's ``feed.allow_identities``, the agent's ``--tls-allow-client``).

Pure: no gRPC, no I/O. A client certificate proves names of three kinds, kept apart:

- ``uri``: URI SANs (SPIFFE ids such as ``spiffe://cluster.local/ns/llm/sa/envoy``),
- ``dns``: DNS SANs (compared in lower case: DNS names are case-insensitive),
- ``cn``: the subject's common name, only when the certificate has no SAN at all (a CN next to
  SANs is never consulted: certificate authorities commonly let the requester choose it).

An allow-list pattern says which kind it matches (fnmatch over the value; ``*`` also crosses
``.`` and ``/``):

==========================  ===========================================================
``spiffe://...``            URI SANs (the pattern includes the scheme)
``uri:PATTERN``             URI SANs (any scheme)
``dns:PATTERN``             DNS SANs
``cn:PATTERN``              the common name of a certificate without SANs
``PATTERN`` (no prefix)     DNS SANs, as ``dns:PATTERN`` (documented meaning of an untyped entry)
==========================  ===========================================================

So a certificate whose CN or DNS SAN *reads* ``spiffe://...`` never passes a ``spiffe://``
pattern. :func:`PeerIdentity.names` writes a certificate's names in the same syntax
(``spiffe://a/b``, ``uri:urn:x``, ``dns:gw.internal``, ``cn:envoy``), for logs, ``/xds/clients``
and :func:`PeerIdentity.from_names`.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PeerIdentity", "check_pattern", "identity_matches", "names_node", "node_allowed", "refusal_reason"]

_SPIFFE = "spiffe://"


def _text(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class PeerIdentity:
    """The typed names of a verified client certificate: ``uris`` (URI SANs), ``dns`` (DNS SANs,
    lower case), ``cn`` (the common name; None when absent), ``has_sans`` (any SAN at all, IP and
    e-mail included: then the CN is not an identity)."""

    uris: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    cn: str | None = None
    has_sans: bool = False

    @classmethod
    def from_auth_context(cls, auth: Mapping[str, Iterable[bytes]]) -> PeerIdentity:
        """From gRPC's ``auth_context()`` (``peer_uri``, ``peer_spiffe_id``, ``peer_dns``,
        ``x509_subject_alternative_name``, ``x509_common_name``); empty without a certificate."""
        raw = [*auth.get("peer_uri", ()), *auth.get("peer_spiffe_id", ())]  # gRPC fills both for a SPIFFE id
        uris = tuple(dict.fromkeys(_text(v) for v in raw if v))
        dns = tuple(dict.fromkeys(_text(v).lower() for v in auth.get("peer_dns", ()) if v))
        sans = bool(uris or dns or any(auth.get("x509_subject_alternative_name", ())))
        cns = [_text(v) for v in auth.get("x509_common_name", ()) if v]
        return cls(uris, dns, cns[0] if cns else None, sans)

    @classmethod
    def from_names(cls, names: Iterable[str]) -> PeerIdentity:
        """The inverse of :meth:`names` (names in another form are ignored)."""
        uris: list[str] = []
        dns: list[str] = []
        cn = None
        for n in names:
            if n.startswith(_SPIFFE):
                uris.append(n)
            elif n.startswith("uri:"):
                uris.append(n[4:])
            elif n.startswith("dns:"):
                dns.append(n[4:].lower())
            elif n.startswith("cn:"):
                cn = n[3:]
        return cls(tuple(uris), tuple(dns), cn, bool(uris or dns))

    def names(self) -> list[str]:
        """Every name that can be matched, typed: SPIFFE ids as themselves, other URIs ``uri:``,
        DNS SANs ``dns:``, the CN ``cn:`` (only without SANs)."""
        out = [u if u.startswith(_SPIFFE) else f"uri:{u}" for u in self.uris]
        out += [f"dns:{d}" for d in self.dns]
        if self.cn is not None and not self.has_sans:
            out.append(f"cn:{self.cn}")
        return out

    def describe(self) -> str:
        """One short text for a log line: the first names, or why there are none."""
        names = self.names()
        if names:
            return ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
        return "no identity (SANs of other kinds only)" if self.has_sans else "no client certificate"


def _split(pattern: str) -> tuple[str, str]:
    if pattern.startswith(_SPIFFE):
        return "uri", pattern
    for kind in ("uri", "dns", "cn"):
        if pattern.startswith(kind + ":"):
            value = pattern[len(kind) + 1:]
            return kind, value.lower() if kind == "dns" else value
    return "dns", pattern.lower()


def check_pattern(pattern: str) -> str | None:
    """Why ``pattern`` is not a usable allow-list entry (for a config error), else None."""
    kind, value = _split(pattern)
    if not value:
        return f"{pattern!r} has nothing to match after '{kind}:'"
    if kind == "dns" and "://" in value:
        return (f"{pattern!r} looks like a URI but would match DNS SANs: write it as uri:{value} "
                "(URI SANs) or spiffe://...")
    return None


def identity_matches(pattern: str, ident: PeerIdentity) -> bool:
    """Whether one allow-list ``pattern`` (typed as the module says) matches ``ident``."""
    kind, value = _split(pattern)
    if not value:
        return False
    if kind == "uri":
        return any(fnmatch.fnmatchcase(u, value) for u in ident.uris)
    if kind == "dns":
        return any(fnmatch.fnmatchcase(d, value) for d in ident.dns)
    return ident.cn is not None and not ident.has_sans and fnmatch.fnmatchcase(ident.cn, value)


def refusal_reason(patterns: Sequence[str], ident: PeerIdentity, field: str) -> str | None:
    """None when ``patterns`` is empty or one matches ``ident``; else the reason to refuse it,
    naming the allow-list ``field`` and the certificate's typed names."""
    if not patterns or any(identity_matches(p, ident) for p in patterns):
        return None
    return f"client identity {ident.describe()} is not in {field}"


def node_allowed(rules: Iterable[tuple[str, Sequence[str]]], ident: PeerIdentity | Sequence[str],
                 node_id: str) -> str | None:
    """The ADS allow-list check. ``rules``: (identity pattern, node id patterns) pairs; node id
    patterns are fnmatch, case-sensitive. ``ident``: the certificate's identity, or its typed
    names (:meth:`PeerIdentity.names`). A node id is allowed when a rule whose identity pattern
    matches has a node id pattern matching it. Returns None when allowed, else the reason (for the
    PERMISSION_DENIED status)."""
    if not isinstance(ident, PeerIdentity):
        ident = PeerIdentity.from_names(ident)
    if not node_id:
        return "the stream's first request carries no node id"
    if not ident.names():
        return f"{ident.describe()}: tls.node_allow needs a URI or DNS SAN (or cn: for a certificate without SANs)"
    matched = False
    for ident_pat, node_pats in rules:
        if identity_matches(ident_pat, ident):
            matched = True
            if any(fnmatch.fnmatchcase(node_id, p) for p in node_pats):
                return None
    if not matched:
        return f"client identity {ident.describe()} is not in tls.node_allow"
    return f"client identity {ident.describe()} may not use node id {node_id!r}"


def names_node(ident: PeerIdentity, node_id: str, template: str | None) -> str | None:
    """The dial-in check: does an agent's certificate name the node it claims? ``template``: a
    typed pattern with ``{node_id}`` (``tls.agents.identity``); None: a DNS SAN equal to the id or
    starting ``{id}.``, or a URI SAN ending ``/{id}``. Node ids hold no glob characters
    (``NODE_ID_PATTERN``), so the id is matched literally. Returns None when it does, else the
    reason (for the PERMISSION_DENIED status)."""
    if template is not None:
        ok = identity_matches(template.replace("{node_id}", node_id), ident)
    else:
        low = node_id.lower()
        ok = (any(d == low or d.startswith(low + ".") for d in ident.dns)
              or any(u.endswith("/" + node_id) for u in ident.uris))
    if ok:
        return None
    want = template or f"dns:{node_id}, dns:{node_id}.* or a URI ending /{node_id}"
    return f"client identity {ident.describe()} does not name node {node_id!r} (tls.agents.identity: {want})"
