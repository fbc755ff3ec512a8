"""``lrs:`` section: the Load Reporting Service (real-traffic outcomes reported by every Envoy)
and fleet-wide passive ejection from them. (Seed 002's queue thresholds are
``health.load.queue_warning`` / ``health.load.queue_critical``.)

Sources: Envoy's LRS protocol (envoy.service.load_stats.v3) as measured on Envoy 1.40
(docs/xds_protocol.md section 6), Envoy's outlier-detection defaults for the success-rate
comparison (docs/xds_protocol.md 2.8).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _Model, parse_hostport
from xds_server.config.cluster import ClusterConfig
from xds_server.config.lrs_peers import PeerConfig
from xds_server.config.tls import AgentTlsConfig
from xds_server.process.dialing import is_loopback

__all__ = ["CLASS_SEPARATOR", "LrsConfig", "ShedClassesConfig", "ShedConfig", "TrafficEjectionConfig",
           "check_lrs", "class_clusters", "lrs_notes", "lrs_plaintext_refusal"]

CLASS_SEPARATOR = "~"
"""A class cluster is named ``<cluster>~<class>`` (``llm~sheddable``): a configured cluster name
is ``[A-Za-z0-9_.-]`` only, so no configured cluster can have that name."""
_CLASS = r"^[a-z0-9_-]{1,32}$"


class TrafficEjectionConfig(_Model):
    """Fleet-wide passive ejection: a node whose real traffic, summed over every reporting Envoy,
    fails significantly more than its peers' is ejected through the health model (signal
    ``traffic``), under the cluster's ``max_ejection_percent`` cap and with the same half-open
    probation and ramp as every other signal; when most nodes fail alike, none is ejected and the
    cluster raises ``cluster_failure`` instead (:mod:`xds_server.policy.traffic_ejection`). Envoy's
    own outlier detection stays the second line."""

    #: Keys of the older ratio rules: accepted, ignored, named in a deprecation note.
    DEPRECATED: ClassVar[dict[str, str]] = {
        "stdev_factor": "confidence_p", "success_floor_ratio": "tolerance", "failure_ratio": "confidence_p",
        "min_hosts": "min_requests"}

    enabled: bool = Field(
        True, description="eject on real-traffic evidence; off: LRS figures are shown, never applied")
    window_s: float = Field(
        10.0, gt=0, le=3600,
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


class ShedClassesConfig(_Model):
    """Request classes (``lrs.shed.classes``): the request header ``header`` names the class of a
    request; the bootstrap (``xds-server envoy-bootstrap --classes``) routes ``sheddable`` to the
    cluster ``<cluster>~<sheddable>``, ``critical`` to ``<cluster>~<critical>`` and every other
    request (``standard``, no header, an unknown value) to the cluster itself. The control plane
    publishes the class clusters (CDS + EDS) with the parent's endpoints, weights and health,
    each with its own drop, and sheds the lower classes first (:mod:`xds_server.policy.request_classes`).
    Off by default: nothing extra is published."""

    enabled: bool = Field(False, description="publish the class clusters and shed per class; off: one "
                          "drop per cluster for every request")
    header: str = Field("x-sentinel-priority", pattern=r"^[a-z0-9][a-z0-9-]{0,63}$",
                        description="request header naming the class (lower case)")
    sheddable: str = Field("sheddable", pattern=_CLASS, description="header value of batch traffic, shed first")
    standard: str = Field("standard", pattern=_CLASS, description="header value of ordinary traffic (also "
                          "no header, an unknown value): shed once sheddable demand is all shed")
    critical: str = Field("critical", pattern=_CLASS, description="header value shed last, only when the "
                          "other classes cannot cover the excess")
    sheddable_max_percent: float = Field(100.0, ge=0, le=100, description="most of the sheddable class "
                                         "dropped, % (100: Envoy answers UDO)")
    standard_max_percent: float = Field(100.0, ge=0, le=100, description="most of the standard class dropped, %")
    critical_max_percent: float = Field(100.0, ge=0, le=100, description="most of the critical class dropped, "
                                        "% (the cluster's total stays under lrs.shed.max_percent)")

    @model_validator(mode="after")
    def _distinct(self) -> ShedClassesConfig:
        names = [self.sheddable, self.standard, self.critical]
        if len(set(names)) != 3:
            raise ValueError(f"sheddable, standard and critical must differ, got {names}")
        return self

    def lower_first(self, cluster: str) -> list[tuple[str, str, float]]:
        """``(class, Envoy cluster, max percent)`` from the class shed first to the one shed last;
        the standard class is ``cluster`` itself."""
        sep = CLASS_SEPARATOR
        return [(self.sheddable, f"{cluster}{sep}{self.sheddable}", self.sheddable_max_percent),
                (self.standard, cluster, self.standard_max_percent),
                (self.critical, f"{cluster}{sep}{self.critical}", self.critical_max_percent)]


def class_clusters(clusters: Sequence[ClusterConfig], classes: ShedClassesConfig) -> dict[str, ClusterConfig]:
    """Envoy cluster name -> the configured cluster it serves: each cluster by its own name and,
    with ``classes.enabled``, its sheddable and critical class clusters (a copy renamed)."""
    out = {c.name: c for c in clusters}
    if classes.enabled:
        for c in clusters:
            for _, name, _ in classes.lower_first(c.name):
                if name != c.name:
                    out[name] = c.model_copy(update={"name": name})
    return out


class ShedConfig(_Model):
    """Overload protection (``lrs.shed``): when the routable nodes' queues say they are over
    their safe load, publish ``ClusterLoadAssignment.policy.drop_overloads`` (one category,
    ``overload``) with the excess share, so Envoy answers that share at once (429 + Retry-After,
    the bootstrap's local_reply_config) instead of queueing it everywhere. Thresholds: seed 002
    (``health.load.queue_warning`` 50, ``health.load.queue_critical`` 100 waiting)."""

    enabled: bool = Field(
        False, description="shed load; off (the default): weights are lowered, nothing is refused")
    window_s: float = Field(
        3.0, gt=0, le=60, description="window of the LRS demand (issued + dropped) and completion rates, s")
    headroom_ratio: float = Field(
        0.1, ge=0, lt=1,
        description="share of the measured completion rate kept free while shedding, so queues drain "
        "(0..1); the drop is 1 - completed x (1 - headroom) / offered. Ours")
    off_ratio: float = Field(
        0.5, gt=0, le=1,
        description="hysteresis: shedding starts when the routable nodes' mean waiting exceeds "
        "health.load.queue_warning and stops once it stays at or below off_ratio x queue_warning for "
        "lift_after_s. Ours")
    lift_after_s: float = Field(3.0, ge=0, description="how long queues must stay low before the drop is lifted, s")
    step_percent: float = Field(
        5.0, gt=0, le=50, description="drop changes in steps of this many percent (no EDS churn on noise)")
    max_percent: float = Field(
        90.0, gt=0, le=100, description="never drop more than this share, % (Envoy's drop_overload_limit "
        "runtime key caps it too)")
    stale_after_s: float = Field(
        2.0, gt=0,
        description="fail open: a routable node whose last heartbeat (queue telemetry) is older than "
        "this, or no Envoy reporting load, lifts any drop, s (stale data never sheds)")
    kv_saturated_ratio: float = Field(
        0.95, gt=0, le=1,
        description="a routable node whose engine reports KV-cache usage (0..1) above this counts as a "
        "queue of health.load.queue_warning + 1 in the mean: saturated like a queue over the warning. vLLM "
        "preempts running requests when its KV cache is full (vllm:kv_cache_usage_perc 1.0, "
        "vllm:num_preemptions grows); 0.95 leaves a step of headroom before that. The Gateway API "
        "Inference Extension's saturation detector uses 0.8. A node without KV telemetry adds nothing")
    queue_wait_budget_s: float | None = Field(
        0.5, gt=0, le=60,
        description="the relative trigger: shed when a routable node's expected queue wait (its waiting "
        "over its share of the cluster's measured completion rate, s) exceeds this, with at least "
        "min_waiting waiting; while over it and the queues do not shrink, the drop follows the measured "
        "excess. null: only the seed's absolute thresholds (health.load.queue_warning, queue_critical). Ours: "
        "0.5 s of wait keeps the admitted TTFT near the unloaded one (benchmarks/RESULTS.md)")
    min_waiting: float = Field(
        2.0, ge=0, description="the relative trigger needs at least this many waiting on the node (noise of one "
        "request arriving just before a slot frees is no overload)")
    ttft_budget_ratio: float | None = Field(
        1.0, gt=0, le=100,
        description="with capacity_source engines: the queue-wait budget is at most this many times "
        "the cluster's unloaded TTFT p99 (its successful probes while not shedding and no node had "
        "min_waiting waiting: the last 512 in 10 min, from 20 on; at least 50 ms), so admitted "
        "requests keep their TTFT p99 within (1 + this) x the unloaded one, 2x at 1.0; "
        "queue_wait_budget_s stays the cap. null: queue_wait_budget_s alone. Ours")
    capacity_source: Literal["lrs", "engines"] = Field(
        "engines",
        description="where the load the routable nodes can take comes from. engines (the default): "
        "each engine's finished-request counter (vllm:request_success_total, TGI's "
        "tgi_request_duration_count) gives its slots (the most running) and the time a request runs "
        "(Little's law); the drop lets in the rate at which the pool of those slots keeps the queue "
        "wait over the budget (queue_wait_budget_s, or the smaller one ttft_budget_ratio learns) to "
        "1 % of admitted requests (Erlang C, exponential service: conservative for LLM lengths), "
        "following the offered load; a queue drains at slots over run time; easing keeps a margin "
        "of two Poisson standard errors; the headroom starts at 0 and grows by 0.05 per report over "
        "the budget. Measured: admitted TTFT p99 0.8-2.0x the unloaded one on 2-, 8- and 16-slot "
        "engines, 15-30 points more shed than the bare excess (benchmarks/RESULTS.md). A "
        "cluster with a routable node whose engine does not count (SGLang, or no metrics) uses lrs "
        "meanwhile. lrs: completions measured from LRS (issued to the routable nodes minus the "
        "growth of their in-flight requests), the most seen while a queue stood over "
        "queue_wait_budget_s, less headroom_ratio (5.7-7.0x on 16 slots)")
    classes: ShedClassesConfig = ShedClassesConfig()

    @model_validator(mode="after")
    def _engines_need_a_budget(self) -> ShedConfig:
        if "capacity_source" in self.model_fields_set and self.capacity_source == "engines" and (
                self.queue_wait_budget_s is None):
            raise ValueError("capacity_source: engines needs queue_wait_budget_s (the queue wait it keeps "
                             "admitted requests under), not null (null alone: the seed's thresholds)")
        return self


class LrsConfig(_Model):
    """The LRS server on the xDS port (``StreamLoadStats``) and what is done with its reports."""

    #: Protection limits that rarely need changing (marked advanced in docs/config.md).
    ADVANCED: ClassVar[frozenset[str]] = frozenset({
        "max_clusters_per_report", "max_endpoints_per_report", "max_localities_per_cluster",
        "max_requests_per_interval", "max_streams", "min_report_gap_ratio", "peer_backoff_max_s",
        "peer_keepalive_s", "peer_max_delay_s", "peer_max_envoys", "peer_queue"})

    enabled: bool = Field(
        True, description="serve StreamLoadStats; off: the service answers UNIMPLEMENTED and Envoys "
        "rendered with lrs enabled retry quietly")
    interval_s: float = Field(
        1.0, ge=0.1, le=300,
        description="load_reporting_interval asked of every Envoy, s (a minimum: Envoy measures and "
        "reports the interval it really covered). Ours: 1 s, so a decision waits at most ~2 s for "
        "evidence")
    retain_s: float = Field(
        60.0, gt=0, le=3600,
        description="how long per-interval reports are kept, s; the longest window that can be "
        "asked (bounds memory: nodes x reporting Envoys x retain_s / interval_s buckets)")
    stale_after_s: float = Field(
        3.0, gt=0,
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
    peer_max_delay_s: float = Field(
        3.0, gt=0, le=3600,
        description="a report that waited longer than this for its peer (stream down or slow) is "
        "dropped and counted (stale), s: applied late it would count in the wrong window. Ours: "
        "lrs.stale_after_s's default; a peer back within it gets every report, exactly")
    peer_backoff_max_s: float = Field(
        2.0, gt=0, le=300,
        description="redial backoff towards a peer doubles from 0.1 s up to this (jittered), s. "
        "Ours: the bootstrap's xDS retry backoff caps at 1 s; a peer back within 2 s misses little")
    peer_keepalive_s: float = Field(
        1.0, ge=0.5, le=300,
        description="HTTP/2 PING interval (and ack timeout) on a peer stream, s, so a frozen peer is "
        "found (as the bootstrap's xds_cluster keepalive: 1 s / 1 s; the server allows 0.5 s, "
        "xds.min_client_ping_interval_ms)")

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
