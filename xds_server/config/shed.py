"""``lrs.shed:`` overload shedding: the drop Envoy applies (``drop_overloads``) when the routable
nodes cannot carry the demand, and request classes (``lrs.shed.classes``) that are shed in order.
Seed 002's queue thresholds are ``health.load.queue_warning`` / ``health.load.queue_critical``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from xds_server.config.base import _Model
from xds_server.config.cluster import ClusterConfig
from xds_server.config.duration import Duration, NonNegativeDuration, PositiveDuration, at_most
from xds_server.config.renames import Moves, _Renaming

__all__ = ["CLASS_SEPARATOR", "ShedAdmissionConfig", "ShedClassesConfig", "ShedConfig", "class_clusters"]



CLASS_SEPARATOR = "~"
"""A class cluster is named ``<cluster>~<class>`` (``llm~sheddable``): a configured cluster name
is ``[A-Za-z0-9_.-]`` only, so no configured cluster can have that name."""
_CLASS = r"^[a-z0-9_-]{1,32}$"


class ShedAdmissionConfig(_Model):
    """Admission by free slots (``lrs.shed.admission``, :mod:`xds_server.policy.slot_admission`):
    while shedding, with every routable node's slots known from its engine, Envoy admits by
    concurrency (the Cluster's circuit breaker ``max_requests``: the slots plus the queue the
    wait budget drains, shared among the Envoys reporting load) instead of a random drop; the
    excess gets 429 + Retry-After the moment no slot is free."""

    slots: bool = Field(
        True, description="admit by slots while shedding (off: the random drop alone). Measured on two "
        "16-slot survivors at 110, 130 and 200 % of their capacity: 9.1, 6.5 and 1.9 points shed over "
        "the bare excess (the random drop: 18-37), admitted TTFT p99 1.3x, 1.5x and 1.7x the "
        "unloaded one (benchmarks/RESULTS.md)")
    queue_budget_ratio: float = Field(
        0.0, ge=0, le=1, description="admit also the requests the nodes finish within this share of "
        "the queue-wait budget (queue_wait_budget, or the learned one), queued at the engines; 0: "
        "only the slots. Measured at 130 % on 16-slot engines whose requests all run 0.8 s: 1.0 "
        "(4 queued over 32 slots) shed 27 % instead of 31 % but took the admitted TTFT p99 from "
        "1.7x to 4.6x the unloaded one (completions come in bursts). Engines with mixed lengths "
        "may take more", )
    choice_count: int = Field(
        10, ge=2, le=100, description="while admitting by slots, Envoy's least-request balancer "
        "sends each request to the least loaded of this many hosts drawn at random "
        "(least_request_lb_config.choice_count). Envoy's 2 often sends a request to a full node while "
        "another has a free slot; measured at 130 % on two 16-slot survivors: admitted TTFT p99 3.0x "
        "the unloaded one with 2, 2.0x with 10 (benchmarks/RESULTS.md)")
    explore: Annotated[PositiveDuration, at_most("10m")] = Field(
        Duration.parse("4s"), description="for this long after the cap came or the slots last grew, "
        "one spare place a node over its slots, so a node read low (not quite full when shedding "
        "started) shows one more running request and its slots grow. Ours, measured at 110 %: 29 of "
        "32 slots read at first, all 32 within 3 s; a spare kept for good took the admitted TTFT p99 "
        "to 2.2-3.4x, and its end replaces the Cluster (fresh counts: a burst), so it ends early")
    release_below: float = Field(
        0.8, gt=0, lt=1, description="the cap is lifted once the routable nodes run fewer than this "
        "share of their slots for release_after (ours: an arrival stream 20 % under the capacity "
        "rarely finds the slots full: an Erlang loss system at 80 % load with 32 slots loses ~1 %)")
    release_after: Annotated[PositiveDuration, at_most("10m")] = Field(
        Duration.parse("10s"), description="how long occupancy stays under release_below before the "
        "cap is lifted (ours: five 2 s load reports; a lull between bursts keeps the cap)")


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


class ShedConfig(_Renaming):
    """Overload protection (``lrs.shed``): when the routable nodes' queues say they are over
    their safe load, publish ``ClusterLoadAssignment.policy.drop_overloads`` (one category,
    ``overload``) with the excess share, so Envoy answers that share at once (429 + Retry-After,
    the bootstrap's local_reply_config) instead of queueing it everywhere. Thresholds: seed 002
    (``health.load.queue_warning`` 50, ``health.load.queue_critical`` 100 waiting)."""

    WHERE: ClassVar[str] = "lrs.shed"
    MOVED: ClassVar[Moves] = {
        "window_s": ("window", "s"),
        "lift_after_s": ("lift_after", "s"),
        "stale_after_s": ("stale_after", "s"),
        "queue_wait_budget_s": ("queue_wait_budget", "s"),
    }

    enabled: bool = Field(
        False, description="shed load; off (the default): weights are lowered, nothing is refused")
    window: Annotated[PositiveDuration, at_most("1m")] = Field(
        Duration.parse("3s"), description="window of the LRS demand (issued + dropped) and completion rates, s")
    headroom_ratio: float = Field(
        0.1, ge=0, lt=1,
        description="share of the measured completion rate kept free while shedding, so queues drain "
        "(0..1); the drop is 1 - completed x (1 - headroom) / offered. Ours")
    off_ratio: float = Field(
        0.5, gt=0, le=1,
        description="hysteresis: shedding starts when the routable nodes' mean waiting exceeds "
        "health.load.queue_warning and stops once it stays at or below off_ratio x queue_warning for "
        "lift_after. Ours")
    lift_after: NonNegativeDuration = Field(
        Duration.parse("3s"), description="how long queues must stay low before the drop is lifted, s")
    step_percent: float = Field(
        5.0, gt=0, le=50, description="drop changes in steps of this many percent (no EDS churn on noise)")
    max_percent: float = Field(
        90.0, gt=0, le=100, description="never drop more than this share, % (Envoy's drop_overload_limit "
        "runtime key caps it too)")
    stale_after: PositiveDuration = Field(
        Duration.parse("2s"),
        description="fail open: a routable node whose last heartbeat (queue telemetry) is older than "
        "this, or no Envoy reporting load, lifts any drop, s (stale data never sheds)")
    kv_saturated_ratio: float = Field(
        0.95, gt=0, le=1,
        description="a routable node whose engine reports KV-cache usage (0..1) above this counts as a "
        "queue of health.load.queue_warning + 1 in the mean: saturated like a queue over the warning. vLLM "
        "preempts running requests when its KV cache is full (vllm:kv_cache_usage_perc 1.0, "
        "vllm:num_preemptions grows); 0.95 leaves a step of headroom before that. The Gateway API "
        "Inference Extension's saturation detector uses 0.8. A node without KV telemetry adds nothing")
    queue_wait_budget: Annotated[PositiveDuration | None, at_most("1m")] = Field(
        Duration.parse("500ms"),
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
        "queue_wait_budget stays the cap. null: queue_wait_budget alone. Ours")
    capacity_source: Literal["lrs", "engines"] = Field(
        "engines",
        description="where the load the routable nodes can take comes from. engines (the default): "
        "each engine's finished-request counter (vllm:request_success_total, TGI's "
        "tgi_request_duration_count) gives its slots (the most running) and the time a request runs "
        "(Little's law); the drop lets in the rate at which the pool of those slots keeps the queue "
        "wait over the budget (queue_wait_budget, or the smaller one ttft_budget_ratio learns) to "
        "1 % of admitted requests (Erlang C, exponential service: conservative for LLM lengths), "
        "following the offered load; a queue drains at slots over run time; easing keeps a margin "
        "of two Poisson standard errors; the headroom starts at 0 and grows by 0.05 per report over "
        "the budget. Measured: admitted TTFT p99 0.8-2.0x the unloaded one on 2-, 8- and 16-slot "
        "engines, 15-30 points more shed than the bare excess (benchmarks/RESULTS.md). A "
        "cluster with a routable node whose engine does not count (SGLang, or no metrics) uses lrs "
        "meanwhile. lrs: completions measured from LRS (issued to the routable nodes minus the "
        "growth of their in-flight requests), the most seen while a queue stood over "
        "queue_wait_budget, less headroom_ratio (5.7-7.0x on 16 slots)")
    classes: ShedClassesConfig = ShedClassesConfig()
    admission: ShedAdmissionConfig = Field(default_factory=ShedAdmissionConfig,
                                           description="admission by free slots while shedding")

    @model_validator(mode="after")
    def _engines_need_a_budget(self) -> ShedConfig:
        if "capacity_source" in self.model_fields_set and self.capacity_source == "engines" and (
                self.queue_wait_budget is None):
            raise ValueError("capacity_source: engines needs queue_wait_budget (the queue wait it keeps "
                             "admitted requests under), not null (null alone: the seed's thresholds)")
        return self
