"""Refused clients on the record: counted by (port, reason) and logged with the peer address and
the certificate's identity, rate-limited per identity (a second refused identity inside the
interval is still named; the same one refusing in a loop is one line per interval).

One :class:`Refusals` per process: the control plane's counts every refusal its ports make
(``port``: ``xds`` for ADS and the routing feed, ``admin``), the agent's its gRPC port's
(``port``: ``agent``). Metric: ``<prefix>_access_refused_total{port,reason}``; reasons come from a
bounded set the callers name (:data:`REASONS`), never from client text.

What is not here because Python never sees it: a TLS handshake gRPC refuses (plaintext on a TLS
port, no client certificate, another CA, expired or not yet valid) ends inside gRPC's C core
before any Python code runs (measured: no servicer, interceptor or auth-context call; gRPC logs
"Handshake failed" without the peer's address). What Python does see is gRPC asking for the
server certificate once per connection before its handshake:
``<prefix>_tls_handshakes_total{port}`` (:class:`~xds_server.process.tls.ServerCertFiles`)
counts those, refused ones included.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily

from xds_server.process.untrusted import RateLimitedLog, for_log

__all__ = ["REASONS", "Refusals"]

REASONS: dict[str, tuple[str, ...]] = {
    "xds": ("node_allow", "feed_allow", "lrs_peer", "lrs_plaintext", "agent_identity", "agent_claim"),
    "admin": ("token_missing", "token_wrong"),
    "agent": ("allow_client",),
}
"""Known (port, reason) pairs, listed at 0 before the first refusal: ``node_allow`` (an ADS stream
whose identity or node id ``tls.node_allow`` does not allow), ``feed_allow`` (a routing-feed
subscriber not in ``feed.allow_identities``), ``lrs_peer`` (a load-report stream claiming to be a
peer replica it is not, ``lrs.peers``), ``agent_identity`` / ``agent_claim`` (an agent
dialling in whose certificate does not name the node it claims or may not register, or whose
claim the config contradicts), ``lrs_plaintext`` (load reports on a plaintext port off
loopback without ``lrs.plaintext``), ``token_missing`` / ``token_wrong`` (an admin POST
without or with a wrong bearer token), ``allow_client`` (a stream to the agent from a client
``--tls-allow-client`` does not allow)."""

#: One log line per (port, reason, identity) per this many seconds (ours: a client retrying in a
#: loop every 100 ms is one line per 10 s; a new identity is logged at once).
LOG_INTERVAL_S = 10.0
#: Identities whose last line is remembered for the rate limit (the oldest is forgotten past it).
LOG_KEYS_MAX = 1024


class Refusals:
    """Counts (``counts[(port, reason)]``) and per-identity rate-limited warning lines; ``ports``:
    whose known reasons are listed at 0 (the control plane's: xds, admin; the agent's: agent);
    ``labels``: constant labels of every sample (the agent's ``node``)."""

    def __init__(self, logger: logging.Logger, *, prefix: str = "sentinel", ports: tuple[str, ...] = ("xds", "admin"),
                 labels: dict[str, str] | None = None, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix, self.ports, self.labels = prefix, ports, dict(labels or {})
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._log = RateLimitedLog(logger, interval_s, max_keys=LOG_KEYS_MAX)
        self._clock = clock

    def refuse(self, port: str, reason: str, peer: str, identity: str, detail: str) -> None:
        """Count one refusal and log it (``peer``: the client's address as gRPC or aiohttp gives
        it; ``identity``: the certificate's typed names; empty: the line is rate-limited per peer
        host instead, e.g. an admin token guess)."""
        self.counts[(port, reason)] += 1
        who = for_log(identity or "-", 200)
        key = who if identity else for_log(peer.rpartition(":")[0] if peer.count(":") == 2 else peer, 80)
        self._log.warning(self._clock(), f"{port}|{reason}|{key}",
                          "refused on the %s port (%s): peer %s, identity %s: %s", port, reason,
                          for_log(peer or "?", 80), who, for_log(detail, 300),
                          extra={"port": port, "reason": reason, "peer": peer or "?", "identity": identity})

    def metric_families(self) -> Iterator[CounterMetricFamily]:
        """``<prefix>_access_refused_total{port,reason}`` (known pairs at 0 until they happen)."""
        names = list(self.labels)
        fam = CounterMetricFamily(f"{self.prefix}_access_refused", "clients refused after the TLS "
                                  "handshake or by the admin token, by port and reason",
                                  labels=[*names, "port", "reason"])
        keys = {(p, r) for p in self.ports for r in REASONS.get(p, ())} | set(self.counts)
        for p, r in sorted(keys):
            fam.add_metric([*(self.labels[n] for n in names), p, r], self.counts.get((p, r), 0))
        yield fam
