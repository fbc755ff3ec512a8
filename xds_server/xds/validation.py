"""What would make Envoy NACK a resource, checked before it is cached (checklist 1.9 item 17):
a bad assignment is held back instead of being NACKed by every Envoy.

Envoy's limits (docs/xds_protocol.md, checked on Envoy 1.40): ``load_balancing_weight`` >= 1, the
weights of one locality sum to at most 2^32-1, priorities contiguous from 0 and at most 128, a
locality once per priority, at most one ``drop_overloads`` category.

Shape: ``validate_cla(name, message) -> ["problem", ...]`` ([] = valid); ``validate_cluster`` alike.
"""
from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import Message

__all__ = ["MAX_LOCALITY_WEIGHT_SUM", "MAX_PRIORITY", "validate_cla", "validate_cluster"]

MAX_LOCALITY_WEIGHT_SUM = 2**32 - 1
MAX_PRIORITY = 128


def validate_cla(name: str, cla: Message) -> list[str]:
    """Problems that would make Envoy NACK this assignment, as readable strings ([] = valid).

    Checks: ``cluster_name`` equals the resource ``name`` (Envoy: "Unexpected EDS cluster");
    every ``load_balancing_weight`` >= 1 when set; each locality's weight sum <= 2^32-1;
    priorities contiguous from 0 and <= 128; a locality at most once per priority; at most one
    ``drop_overloads`` entry; ``overprovisioning_factor`` > 0 and ``endpoint_stale_after`` > 0
    when set.
    """
    problems: list[str] = []
    if not isinstance(cla, endpoint_pb2.ClusterLoadAssignment):
        return [f"expected ClusterLoadAssignment, got {type(cla).__name__}"]
    if cla.cluster_name != name:
        problems.append(f"cluster_name {cla.cluster_name!r} != resource name {name!r}")
    prios: set[int] = set()
    seen_localities: set[tuple[int, str, str, str]] = set()
    for i, lle in enumerate(cla.endpoints):
        if lle.priority > MAX_PRIORITY:
            problems.append(f"endpoints[{i}].priority {lle.priority} > {MAX_PRIORITY}")
        prios.add(lle.priority)
        loc = (lle.priority, lle.locality.region, lle.locality.zone, lle.locality.sub_zone)
        if loc in seen_localities:
            problems.append(f"endpoints[{i}]: locality {loc[1:]} twice at priority {lle.priority}")
        seen_localities.add(loc)
        if lle.HasField("load_balancing_weight") and lle.load_balancing_weight.value < 1:
            problems.append(f"endpoints[{i}].load_balancing_weight must be >= 1")
        total = 0
        for j, e in enumerate(lle.lb_endpoints):
            w = e.load_balancing_weight.value if e.HasField("load_balancing_weight") else 1
            if w < 1:
                problems.append(f"endpoints[{i}].lb_endpoints[{j}].load_balancing_weight {w} < 1")
            total += w
        if total > MAX_LOCALITY_WEIGHT_SUM:
            problems.append(f"endpoints[{i}]: weight sum {total} > {MAX_LOCALITY_WEIGHT_SUM}")
    if prios and sorted(prios) != list(range(len(prios))):
        problems.append(f"priorities must be contiguous from 0, got {sorted(prios)}")
    pol = cla.policy
    if len(pol.drop_overloads) > 1:
        problems.append(f"{len(pol.drop_overloads)} drop_overloads categories; Envoy supports one")
    if pol.HasField("overprovisioning_factor") and pol.overprovisioning_factor.value < 1:
        problems.append("policy.overprovisioning_factor must be > 0")
    if pol.HasField("endpoint_stale_after") and pol.endpoint_stale_after.ToNanoseconds() <= 0:
        problems.append("policy.endpoint_stale_after must be > 0")
    return problems


def validate_cluster(name: str, cluster: Message) -> list[str]:
    """Problems that would make Envoy NACK this Cluster ([] = valid): name mismatch,
    non-positive ``connect_timeout``, a healthy_panic_threshold outside 0..100."""
    if not isinstance(cluster, cluster_pb2.Cluster):
        return [f"expected Cluster, got {type(cluster).__name__}"]
    problems: list[str] = []
    if cluster.name != name:
        problems.append(f"name {cluster.name!r} != resource name {name!r}")
    if cluster.HasField("connect_timeout") and cluster.connect_timeout.ToNanoseconds() <= 0:
        problems.append("connect_timeout must be > 0")
    hpt = cluster.common_lb_config.healthy_panic_threshold
    if not 0.0 <= hpt.value <= 100.0:
        problems.append("healthy_panic_threshold must be within 0..100")
    return problems
