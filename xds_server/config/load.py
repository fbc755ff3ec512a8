"""``lrs:`` section: the Load Reporting Service (real-traffic outcomes reported by every Envoy)
and fleet-wide passive ejection from them. (Seed 002's queue thresholds are
``health.load.queue_warning`` / ``health.load.queue_critical``.)

Sources: Envoy's LRS protocol (envoy.service.load_stats.v3) as measured on Envoy 1.40
(docs/xds_protocol.md section 6), Envoy's outlier-detection defaults for the success-rate
comparison (docs/xds_protocol.md 2.8).
"""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import parse_hostport
from xds_server.config.duration import Duration, PositiveDuration, at_least, at_most
from xds_server.config.lrs_peers import PeerConfig
from xds_server.config.renames import Moves, _Renaming
from xds_server.config.shed import ShedConfig
from xds_server.config.tls import AgentTlsConfig
from xds_server.process.dialing import is_loopback

__all__ = ["LrsConfig", "TrafficEjectionConfig", "check_lrs", "lrs_notes", "lrs_plaintext_refusal"]


class TrafficEjectionConfig(_Renaming):
    """Fleet-wide passive ejection: a node whose real traffic, summed over every reporting Envoy,
    fails significantly more than its peers' is ejected through the health model (signal
    ``traffic``), under the cluster's ``max_ejection_percent`` cap and with the same half-open
    probation and ramp as every other signal; when most nodes fail alike, none is ejected and the
    cluster raises ``cluster_failure`` instead (:mod:`xds_server.policy.traffic_ejection`). Envoy's
    own outlier detection stays the second line."""

    WHERE: ClassVar[str] = "lrs.traffic_ejection"
    MOVED: ClassVar[Moves] = {
        "window_s": ("window", "s"),
    }

    #: Keys of the older ratio rules: accepted, ignored, named in a deprecation note.
    DEPRECATED: ClassVar[dict[str, str]] = {
        "stdev_factor": "confidence_p", "success_floor_ratio": "tolerance", "failure_ratio": "confidence_p",
        "min_hosts": "min_requests"}

    enabled: bool = Field(
        True, description="eject on real-traffic evidence; off: LRS figures are shown, never applied")
    window: Annotated[PositiveDuration, at_most("1h")] = Field(
        Duration.parse("10s"),
        description="sliding window the decision reads, s (Envoy's outlier-detection interval, 10 s)")
    min_requests: int = Field(
        10, ge=1,
        description="completed requests (succeeded + errored) a node needs in the window before it is "
        "judged at all, summed over every Envoy (a floor; significance decides). Ours: Envoy's "
        "consecutive_5xx needs 5 per Envoy and its success-rate detector 100 per Envoy and interval")
    confidence_p: float = Field(
        1e-4, gt=0, lt=0.5,
        description="eject only when the chance of seeing this many failures or more, from a node "
        "failing at its peers' pooled rate plus tolerance, is at most this (a one-sided binomial "
        "test on the counts, not on ratios: 1 failure in 10 is never evidence). Ours: measured over "
        "2,000 simulated nodes failing 1 % of 3,000 requests each, judged after every request: none "
        "ejected at 1e-4, one at 1e-3; a node failing 35 % is ejected after a median 11 requests "
        "(benchmarks/RESULTS.md, traffic significance)")
    tolerance: float = Field(
        0.02, ge=0, lt=1,
        description="failure rate (0..1) a node may exceed its peers' pooled rate by before it can "
        "be ejected: a node failing 1 % of its requests among peers at 0 % is never ejected, at any "
        "volume. Ours: LLM engines fail some user requests (bad prompts, 4xx counted as errors) "
        "unevenly")
    cluster_failure_share: float = Field(
        0.5, ge=0, lt=1,
        description="when more than this share (0..1) of the nodes with min_requests in a cluster "
        "(or one priority) each fail significantly above tolerance alone, the requests are failing, "
        "not the nodes: none is ejected for traffic and one cluster_failure event is raised (cleared "
        "when the share falls). Ours: 'most nodes' (a query of death, a bad model push)")
    stdev_factor: float | None = Field(None, description="deprecated and ignored: use confidence_p")
    success_floor_ratio: float | None = Field(None, description="deprecated and ignored: use tolerance")
    failure_ratio: float | None = Field(None, description="deprecated and ignored: use confidence_p")
    min_hosts: int | None = Field(None, description="deprecated and ignored: the test needs no host count")
    min_reporters: int = Field(
        1, ge=1, le=64,
        description="distinct reporters (Envoy node ids that passed tls.node_allow) that must each "
        "have seen a node's requests fail before its real traffic ejects it; the reason names them. "
        "1 keeps one-Envoy fleets working; 2 means no single reporter, forged or confused, ejects "
        "anything (as distinct as tls.node_allow makes the ids: one certificate allowed many ids "
        "counts once per id). Ours")


class LrsConfig(_Renaming):
    """The LRS server on the xDS port (``StreamLoadStats``) and what is done with its reports."""

    WHERE: ClassVar[str] = "lrs"
    MOVED: ClassVar[Moves] = {
        "interval_s": ("interval", "s"),
        "retain_s": ("retain", "s"),
        "stale_after_s": ("stale_after", "s"),
        "peer_max_delay_s": ("peer_max_delay", "s"),
        "peer_backoff_max_s": ("peer_backoff_max", "s"),
        "peer_keepalive_s": ("peer_keepalive", "s"),
    }

    #: Protection limits that rarely need changing (marked advanced in docs/config.md).
    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "max_clusters_per_report", "max_endpoints_per_report", "max_localities_per_cluster",
        "max_requests_per_interval", "max_streams", "min_report_gap_ratio", "peer_backoff_max",
        "peer_keepalive", "peer_max_delay", "peer_max_envoys", "peer_queue"})

    enabled: bool = Field(
        True, description="serve StreamLoadStats; off: the service answers UNIMPLEMENTED and Envoys "
        "rendered with lrs enabled retry quietly")
    interval: Annotated[PositiveDuration, at_least("100ms"), at_most("5m")] = Field(
        Duration.parse("1s"),
        description="load_reporting_interval asked of every Envoy, s (a minimum: Envoy measures and "
        "reports the interval it really covered). Ours: 1 s, so a decision waits at most ~2 s for "
        "evidence")
    retain: Annotated[PositiveDuration, at_most("1h")] = Field(
        Duration.parse("1m"),
        description="how long per-interval reports are kept, s; the longest window that can be "
        "asked (bounds memory: nodes x reporting Envoys x retain / interval buckets)")
    stale_after: PositiveDuration = Field(
        Duration.parse("3s"),
        description="a reporting Envoy silent this long no longer counts (its in-progress gauge "
        "and its evidence are old), s; ours: 3 intervals")
    max_streams: int = Field(
        4096, ge=1, description="open StreamLoadStats streams at once; more are answered "
        "RESOURCE_EXHAUSTED (an Envoy holds one)")
    max_clusters_per_report: int = Field(
        1024, ge=1, description="cluster_stats entries in one report; a bigger report is refused whole")
    max_endpoints_per_report: int = Field(
        100_000, ge=1, description="endpoint entries (all clusters) in one report; a bigger report "
        "is refused whole")
    max_requests_per_interval: int = Field(
        10_000_000, ge=1,
        description="a count above this in one report is absurd (a real Envoy at 1 s does far less "
        "than 10 M requests per host and interval): that cluster's entry is refused and counted")
    min_report_gap_ratio: float = Field(
        0.5, ge=0, le=1,
        description="a report arriving sooner than this x interval_s after the previous one on the "
        "same stream is a flood: counted and not applied (Envoy reports on its timer only)")
    traffic_ejection: TrafficEjectionConfig = TrafficEjectionConfig()
    shed: ShedConfig = ShedConfig()
    max_localities_per_cluster: int = Field(
        256, ge=1, le=100_000,
        description="localities kept per cluster; a report naming more new ones is counted "
        "(too_many_localities) and those are not shown as localities, their endpoints still count for "
        "their nodes (bounds memory against a client inventing names). Ours: regions x zones x "
        "sub-zones of a real fleet are far fewer")
    peers: list[PeerConfig] = Field(
        default_factory=list, max_length=64,
        description="the other replicas ({address, replica_id, identity}): each report an Envoy "
        "sends here is forwarded to every peer's address (marked, never forwarded again), so every "
        "replica sums every Envoy once; a forwarded stream is accepted only from a listed peer "
        "(its replica_id in the marker, and its certificate identity under tls.mode mtls, else its "
        "address's host). A bare 'HOST:PORT' is the older form: reports are forwarded to it, "
        "forwarded reports from it are refused until its replica_id is given. Empty (the "
        "default): one replica. Read at start (a change needs a restart)")
    peer_max_envoys: int = Field(
        256, ge=1, le=100_000,
        description="distinct Envoys one peer stream may name; reports naming more are counted "
        "(peer_too_many_reporters) and not applied, so a peer cannot invent reporters. Ours: more "
        "gateways than one pool of Envoys runs")
    plaintext: bool = Field(
        False,
        description="accept load reports from unauthenticated clients when tls.mode is plaintext "
        "and xds.listen is not loopback (said explicitly, as feed.plaintext: anyone who reaches the "
        "port can then report failures and eject nodes); false: every load-report stream there is "
        "refused (PERMISSION_DENIED naming this key). Plaintext only")
    peer_tls: AgentTlsConfig = Field(
        AgentTlsConfig(), description="how this replica dials its peers (mode plaintext | tls | mtls, "
        "ca_file that signed the peers' server certificates, cert_file/key_file the client "
        "certificate a peer's tls.node_allow checks, server_name; '{node_id}' is the peer's HOST). "
        "Unset mode: plaintext, allowed only when every peer is loopback")
    peer_queue: int = Field(
        1024, ge=1, le=1_000_000,
        description="reports waiting per peer while its stream is slow or down; more are dropped "
        "and counted (sentinel_lrs_peer_dropped_total), never blocking an Envoy's stream. Ours: "
        "~17 s of 60 Envoys at 1 report/s")
    peer_max_delay: Annotated[PositiveDuration, at_most("1h")] = Field(
        Duration.parse("3s"),
        description="a report that waited longer than this for its peer (stream down or slow) is "
        "dropped and counted (stale), s: applied late it would count in the wrong window. Ours: "
        "lrs.stale_after's default; a peer back within it gets every report, exactly")
    peer_backoff_max: Annotated[PositiveDuration, at_most("5m")] = Field(
        Duration.parse("2s"),
        description="redial backoff towards a peer doubles from 0.1 s up to this (jittered), s. "
        "Ours: the bootstrap's xDS retry backoff caps at 1 s; a peer back within 2 s misses little")
    peer_keepalive: Annotated[PositiveDuration, at_least("500ms"), at_most("5m")] = Field(
        Duration.parse("1s"),
        description="HTTP/2 PING interval (and ack timeout) on a peer stream, s, so a frozen peer is "
        "found (as the bootstrap's xds_cluster keepalive: 1 s / 1 s; the server allows 0.5 s, "
        "xds.keepalive.min_client_ping_interval)")

    @field_validator("peers", mode="before")
    @classmethod
    def _peer_strings(cls, v: object) -> object:
        """A bare ``HOST:PORT`` entry is the older form of ``{address: HOST:PORT}``."""
        return [{"address": p} if isinstance(p, str) else p for p in v] if isinstance(v, list) else v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: list[PeerConfig]) -> list[PeerConfig]:
        if len({p.address for p in v}) != len(v):
            raise ValueError("peers: an address is listed twice (its reports would be sent twice)")
        ids = [p.replica_id for p in v if p.replica_id is not None]
        if len(set(ids)) != len(ids):
            raise ValueError("peers: a replica_id is listed twice (one id names one replica)")
        return v

    def peer_addresses(self) -> list[str]:
        """``HOST:PORT`` of every peer, in file order."""
        return [p.address for p in self.peers]

    @model_validator(mode="after")
    def _windows_kept(self) -> LrsConfig:
        """Every window read from the kept reports fits in ``retain``: a longer one would read only
        ``retain`` (xds_server.load.aggregate), less than it says."""
        for name, s in (("traffic_ejection.window", self.traffic_ejection.window.s),
                        ("2 x interval (a node's latest traffic, read for fail-static's serving check)",
                         2 * self.interval.s)):
            if s > self.retain.s:
                raise ValueError(f"retain ({self.retain.s:g} s) must be at least {name} ({s:g} s): reports "
                                 "older than retain are dropped, so a longer window would read less than it says")
        return self

    @model_validator(mode="after")
    def _peer_plaintext(self) -> LrsConfig:
        if self.peer_tls.mode is None:
            for i, p in enumerate(self.peer_addresses()):
                if not is_loopback(parse_hostport(p)[0]):
                    raise ValueError(f"peers.{i} {p} is not a loopback address: set peer_tls.mode to mtls "
                                     "or tls (or to plaintext to forward load reports unauthenticated)")
        return self


def check_lrs(lrs: LrsConfig, tls_mode: str | None) -> None:
    """Refuse ``lrs`` settings that do not apply to ``tls_mode`` (ValueError naming the field):
    ``plaintext`` outside plaintext, a peer with a replica_id but no identity under mtls."""
    if lrs.plaintext and tls_mode != "plaintext":
        raise ValueError(f"lrs.plaintext is used with tls.mode plaintext only (mode is {tls_mode})")
    if tls_mode == "mtls":
        for i, p in enumerate(lrs.peers):
            if p.replica_id is not None and p.identity is None:
                raise ValueError(f"lrs.peers.{i}.identity: required with tls.mode mtls (the typed identity of "
                                 f"the certificate replica {p.replica_id} presents when it forwards reports)")


def lrs_plaintext_refusal(lrs: LrsConfig, tls_mode: str | None, xds_listen: str) -> str | None:
    """Why every load-report stream is refused: plaintext off loopback not said in
    ``lrs.plaintext`` (the PERMISSION_DENIED details); None when reports may be accepted."""
    if tls_mode in (None, "plaintext") and not lrs.plaintext and not is_loopback(parse_hostport(xds_listen)[0]):
        return (f"load reports refused: xds.listen {xds_listen} is not loopback and tls.mode is plaintext; "
                "set lrs.plaintext: true to accept load reports (which eject nodes) from unauthenticated "
                "clients explicitly, or use tls.mode mtls")
    return None


def lrs_notes(lrs: LrsConfig, tls_mode: str | None, xds_listen: str) -> list[str]:
    """What an operator should know about ``lrs`` as configured (one line each, for
    ``check-config`` and the server's start): older peer entries, load reports refused."""
    out = [f"lrs.peers.{i} ({p.address}) has no replica_id: reports are forwarded to it, but its forwarded "
           f"reports are refused; write it as {{address: {p.address}, replica_id: <its xds.replica_id>"
           f"{', identity: <its certificate>' if tls_mode == 'mtls' else ''}}}"
           for i, p in enumerate(lrs.peers) if p.replica_id is None]
    te = lrs.traffic_ejection
    out += [f"lrs.traffic_ejection.{k} is deprecated and ignored (the ratio rules became one significance test): "
            f"see lrs.traffic_ejection.{te.DEPRECATED[k]}" for k in sorted(te.model_fields_set & te.DEPRECATED.keys())]
    refused = lrs.enabled and lrs_plaintext_refusal(lrs, tls_mode, xds_listen)
    if refused:
        out.append(refused)
    return out
