"""What we put in resources before any stream sees them (checklist 1.9 item 17 and the
localities/priorities part): LocalityLbEndpoints per (priority, locality) from config,
overprovisioning_factor from config, at most one drop_overloads category and only while capacity
is lost, and validation that holds back anything Envoy would NACK."""
from __future__ import annotations

import pytest
from envoy.type.v3 import percent_pb2

from xds_server.config import ConfigError, parse_config
from xds_server.health.model import Routing
from xds_server.xds.resources import build_cla, routable_capacity_ratio
from xds_server.xds.validation import validate_cla


def cluster(**extra):
    nodes = [
        {"id": "a", "address": "127.0.0.1:8001", "probe_address": "127.0.0.1:1",
         "locality": {"region": "eu", "zone": "eu-1"}},
        {"id": "b", "address": "127.0.0.1:8002", "probe_address": "127.0.0.1:2",
         "locality": {"region": "eu", "zone": "eu-2"}},
        {"id": "c", "address": "127.0.0.1:8003", "probe_address": "127.0.0.1:3",
         "locality": {"region": "us", "zone": "us-1"}, "priority": 1, "capacity": 2},
    ]
    return parse_config({"clusters": [{"name": "llm", "nodes": nodes, **extra}]}).clusters[0]


ALL_UP = {"a": Routing(100, "HEALTHY"), "b": Routing(100, "HEALTHY"), "c": Routing(200, "HEALTHY")}


def test_localities_grouped_per_priority_with_overprovisioning_factor_from_config():
    cla = build_cla(cluster(overprovisioning_factor=100), ALL_UP)
    assert [(e.priority, e.locality.region, e.locality.zone) for e in cla.endpoints] == [
        (0, "eu", "eu-1"), (0, "eu", "eu-2"), (1, "us", "us-1")]
    assert cla.policy.overprovisioning_factor.value == 100
    assert build_cla(cluster(), ALL_UP).policy.overprovisioning_factor.value == 140  # Envoy's default
    assert validate_cla("llm", cla) == []


def test_drop_overload_applies_only_while_routable_capacity_is_below_threshold():
    c = cluster(drop_overloads=[{"category": "lost", "drop_percent": 25, "below_routable_capacity_ratio": 0.6}])
    assert routable_capacity_ratio(c, ALL_UP) == 1.0
    assert not build_cla(c, ALL_UP).policy.drop_overloads
    down = dict(ALL_UP, c=Routing(200, "UNHEALTHY"))  # half the capacity gone
    assert routable_capacity_ratio(c, down) == 0.5
    cla = build_cla(c, down)
    (d,) = cla.policy.drop_overloads
    assert d.category == "lost" and d.drop_percentage.numerator == 250_000
    assert d.drop_percentage.denominator == percent_pb2.FractionalPercent.MILLION
    assert validate_cla("llm", cla) == []


def test_two_drop_categories_are_refused_by_config_and_by_validation():
    with pytest.raises(ConfigError, match="drop_overloads"):
        cluster(drop_overloads=[{"drop_percent": 1}, {"category": "b", "drop_percent": 2}])
    cla = build_cla(cluster(), ALL_UP)
    cla.policy.drop_overloads.add(category="x")
    cla.policy.drop_overloads.add(category="y")
    assert any("drop_overloads" in p for p in validate_cla("llm", cla))


def test_validation_catches_what_envoy_nacks():
    base = build_cla(cluster(), ALL_UP)
    cases = []
    m = type(base)()
    m.CopyFrom(base)
    m.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 0
    cases.append((m, "< 1"))
    m = type(base)()
    m.CopyFrom(base)
    m.endpoints[2].priority = 129
    cases.append((m, "> 128"))
    m = type(base)()
    m.CopyFrom(base)
    m.endpoints[1].locality.zone = "eu-1"
    cases.append((m, "twice"))
    m = type(base)()
    m.CopyFrom(base)
    m.endpoints[0].load_balancing_weight.value = 0
    cases.append((m, "endpoints\\[0\\].load_balancing_weight"))
    m = type(base)()
    m.CopyFrom(base)
    m.policy.overprovisioning_factor.value = 0
    cases.append((m, "overprovisioning_factor"))
    m = type(base)()
    m.CopyFrom(base)
    m.cluster_name = "other"
    cases.append((m, "cluster_name"))
    import re
    for msg, why in cases:
        problems = validate_cla("llm", msg)
        assert any(re.search(why, p) for p in problems), (why, problems)
