"""Envoy bootstraps for one control plane with replicas, and for several control planes (one per
group of clusters), checked by the real Envoy's ``--mode validate`` and through the command line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import json_format

from xds_server.config import parse_config
from xds_server.envoy.bootstrap import ROUTE_HEADER, ControlPlaneGroup, find_envoy, render_bootstrap, write_bootstrap
from xds_server.xds.resources import build_cluster


def _cfg(listen: str, *clusters: str, **cluster_opts) -> dict:
    return {"xds": {"listen": listen}, "tls": {"mode": "plaintext", "agents": {"mode": "plaintext"}}, "clusters": [
        {"name": c, **cluster_opts, "nodes": [
            {"id": f"{c}-n{i}", "address": f"10.0.0.{i + 1}:8000", "probe_address": f"10.0.0.{i + 1}:50051"}
            for i in range(2)]} for c in clusters]}


def _validate(path: Path) -> None:
    r = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def _routes(doc: dict) -> list[tuple[str | None, str]]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [((r["match"].get("headers") or [{}])[0].get("string_match", {}).get("exact"), r["route"]["cluster"])
            for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]


def _endpoints(cluster: dict) -> list[str]:
    return [f"{e['endpoint']['address']['socket_address']['address']}:"
            f"{e['endpoint']['address']['socket_address']['port_value']}"
            for lle in cluster["load_assignment"]["endpoints"] for e in lle["lb_endpoints"]]


REDIAL = {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}}  # the template's xDS backoff


def test_two_groups_each_cluster_takes_its_eds_from_its_own_group(tmp_path: Path):
    a = ControlPlaneGroup("llama", ("10.1.0.1:18000", "10.1.0.2:18000"),
                          tuple(parse_config(_cfg("0.0.0.0:18000", "llama-70b", "llama-8b")).clusters))
    b = ControlPlaneGroup("qwen", ("10.2.0.1:18000",),
                          tuple(parse_config(_cfg("0.0.0.0:18000", "qwen-32b", lb_policy="ROUND_ROBIN")).clusters))
    doc = render_bootstrap(listener_port=10000, admin_port=9901, groups=[a, b], api_type="DELTA_GRPC")
    _validate(write_bootstrap(tmp_path / "envoy.yaml", doc))
    assert "dynamic_resources" not in doc  # no ADS, no CDS: each cluster's EDS from its group
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    assert set(clusters) == {"xds_llama", "xds_qwen", "llama-70b", "llama-8b", "qwen-32b"}
    assert _endpoints(clusters["xds_llama"]) == ["10.1.0.1:18000", "10.1.0.2:18000"]
    assert _endpoints(clusters["xds_qwen"]) == ["10.2.0.1:18000"]
    for name, group in (("llama-70b", "xds_llama"), ("llama-8b", "xds_llama"), ("qwen-32b", "xds_qwen")):
        src = clusters[name]["eds_cluster_config"]["eds_config"]["api_config_source"]
        # each EDS stream redials as the template's ADS stream does (within 1 s)
        assert src["grpc_services"] == [{"envoy_grpc": {"cluster_name": group, "retry_policy": REDIAL}}]
        assert src["api_type"] == "DELTA_GRPC"
    # the cluster's own settings are exactly what the group's CDS would say, but for eds_config
    for c in (*a.clusters, *b.clusters):
        rendered = json_format.ParseDict(clusters[c.name], cluster_pb2.Cluster())
        cds = build_cluster(c)
        assert rendered.eds_cluster_config.eds_config.HasField("api_config_source")
        rendered.ClearField("eds_cluster_config")
        cds.ClearField("eds_cluster_config")
        assert rendered == cds, c.name
    assert clusters["qwen-32b"].get("lb_policy", "ROUND_ROBIN") == "ROUND_ROBIN"
    assert clusters["llama-8b"]["lb_policy"] == "LEAST_REQUEST"
    assert "healthy_panic_threshold" in clusters["llama-8b"]["common_lb_config"]  # 0 %, not Envoy's 50 %
    assert _routes(doc) == [("llama-70b", "llama-70b"), ("llama-8b", "llama-8b"), ("qwen-32b", "qwen-32b"),
                            (None, "llama-70b")]


def test_one_control_plane_with_two_replicas_keeps_ads_and_lists_both(tmp_path: Path):
    doc = render_bootstrap(listener_port=10000, admin_port=9901, cluster="llm",
                           xds_replicas=["10.0.0.1:18000", "[fd00::2]:18000"])
    _validate(write_bootstrap(tmp_path / "envoy.yaml", doc))
    assert doc["dynamic_resources"]["ads_config"]["grpc_services"] == [
        {"envoy_grpc": {"cluster_name": "xds_cluster", "retry_policy": REDIAL}}]
    xds = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "xds_cluster")
    # a frozen replica (no FIN, no RST) is left when a 1 s PING goes unanswered for 1 s
    keepalive = xds["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
        "explicit_http_config"]["http2_protocol_options"]["connection_keepalive"]
    assert keepalive == {"interval": "1s", "timeout": "1s"}
    assert _endpoints(xds) == ["10.0.0.1:18000", "fd00::2:18000"]
    assert _routes(doc) == [(None, "llm")]


def test_bad_groups_are_refused_naming_the_problem():
    clusters = tuple(parse_config(_cfg("127.0.0.1:18000", "llm")).clusters)
    with pytest.raises(ValueError, match="owned by groups 'a' and 'b'"):
        render_bootstrap(listener_port=1, admin_port=2, groups=[ControlPlaneGroup("a", ("h:1",), clusters),
                                                                ControlPlaneGroup("b", ("h:2",), clusters)])
    with pytest.raises(ValueError, match="replica 'nohost'"):
        ControlPlaneGroup("a", ("nohost",), clusters)
    with pytest.raises(ValueError, match="at least one replica"):
        ControlPlaneGroup("a", (), clusters)
    with pytest.raises(ValueError, match="group name"):
        ControlPlaneGroup("a b", ("h:1",), clusters)
    group = ControlPlaneGroup("a", ("h:1",), clusters)
    with pytest.raises(ValueError, match="each group names its replicas and clusters"):
        render_bootstrap(listener_port=1, admin_port=2, groups=[group], xds_replicas=["10.0.0.1:18000"])
    with pytest.raises(ValueError, match="each group names its replicas and clusters"):
        render_bootstrap(listener_port=1, admin_port=2, groups=[group], cluster="llm")


def test_a_bad_replica_address_is_named():
    with pytest.raises(ValueError, match=r"control-plane replica '10\.0\.0\.2' of xds_cluster"):
        render_bootstrap(listener_port=1, admin_port=2, xds_replicas=["10.0.0.1:18000", "10.0.0.2"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xds_server.cli", *args], capture_output=True, text=True, timeout=60)


def test_cli_groups_from_config_files(tmp_path: Path):
    (tmp_path / "pool-a.yaml").write_text(yaml.safe_dump(_cfg("127.0.0.1:18001", "pool-a")))
    (tmp_path / "pool-b.yaml").write_text(yaml.safe_dump(_cfg("127.0.0.1:18002", "pool-b")))
    out = tmp_path / "envoy.yaml"
    r = _cli("envoy-bootstrap", "--group", f"{tmp_path / 'pool-a.yaml'}=10.0.0.1:18001,10.0.0.2:18001",
             "--group", str(tmp_path / "pool-b.yaml"), "--route-header", "x-model-pool", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "group pool-a: pool-a from 10.0.0.1:18001, 10.0.0.2:18001" in r.stdout
    doc = yaml.safe_load(out.read_text())
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    assert _endpoints(clusters["xds_pool-b"]) == ["127.0.0.1:18002"]  # default: the config's xds.listen
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][0]["match"]["headers"][0]["name"] == "x-model-pool"
    assert ROUTE_HEADER == "x-sentinel-cluster"
    r = _cli("envoy-bootstrap", "--group", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "missing.yaml" in r.stderr
    r = _cli("envoy-bootstrap", "--group", f"{tmp_path / 'pool-a.yaml'}=10.0.0.1")
    assert r.returncode == 2 and "replica '10.0.0.1'" in r.stderr


def _class_routes(doc: dict) -> list[tuple[dict[str, str], str]]:
    """(header name -> exact value, cluster) per route, in order."""
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [({h["name"]: h["string_match"]["exact"] for h in r["match"].get("headers", ())}, r["route"]["cluster"])
            for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]


def test_groups_route_request_classes_of_each_group_whose_config_enables_them(tmp_path: Path):
    on = parse_config({**_cfg("0.0.0.0:18000", "llama-70b", "llama-8b"),
                       "lrs": {"shed": {"enabled": True, "classes": {"enabled": True, "header": "x-prio"}}}})
    a = ControlPlaneGroup("llama", ("10.1.0.1:18000",), tuple(on.clusters), on.lrs.shed.classes)
    b = ControlPlaneGroup("qwen", ("10.2.0.1:18000",), tuple(parse_config(_cfg("0.0.0.0:18000", "qwen-32b")).clusters))
    doc = render_bootstrap(listener_port=10000, admin_port=9901, groups=[a, b])
    _validate(write_bootstrap(tmp_path / "envoy.yaml", doc))
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    # group A's class clusters beside their parents, from group A's stream; group B (classes off) has none
    assert set(clusters) == {"xds_llama", "xds_qwen", "llama-70b", "llama-70b~sheddable", "llama-70b~critical",
                             "llama-8b", "llama-8b~sheddable", "llama-8b~critical", "qwen-32b"}
    for name in ("llama-70b~sheddable", "llama-8b~critical"):
        src = clusters[name]["eds_cluster_config"]["eds_config"]["api_config_source"]
        assert src["grpc_services"][0]["envoy_grpc"]["cluster_name"] == "xds_llama"
        parent = dict(clusters[name.split("~")[0]], name=name)
        assert clusters[name] == parent  # the parent's settings, renamed, as the group's CDS publishes
    h = ROUTE_HEADER
    assert _class_routes(doc) == [
        ({h: "llama-70b", "x-prio": "sheddable"}, "llama-70b~sheddable"),
        ({h: "llama-70b", "x-prio": "critical"}, "llama-70b~critical"),
        ({h: "llama-70b"}, "llama-70b"),
        ({h: "llama-8b", "x-prio": "sheddable"}, "llama-8b~sheddable"),
        ({h: "llama-8b", "x-prio": "critical"}, "llama-8b~critical"),
        ({h: "llama-8b"}, "llama-8b"),
        ({h: "qwen-32b"}, "qwen-32b"),
        ({"x-prio": "sheddable"}, "llama-70b~sheddable"),  # no cluster header: the first cluster's classes
        ({"x-prio": "critical"}, "llama-70b~critical"),
        ({}, "llama-70b"),
    ]
    with pytest.raises(ValueError, match="each group's config says"):
        render_bootstrap(listener_port=1, admin_port=2, groups=[a], classes=on.lrs.shed.classes)


def test_cli_groups_take_classes_from_each_config_and_refuse_the_flag(tmp_path: Path):
    cfg = {**_cfg("127.0.0.1:18001", "pool-a"), "lrs": {"shed": {"enabled": True, "classes": {"enabled": True}}}}
    (tmp_path / "pool-a.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "envoy.yaml"
    r = _cli("envoy-bootstrap", "--group", str(tmp_path / "pool-a.yaml"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    names = {c["name"] for c in yaml.safe_load(out.read_text())["static_resources"]["clusters"]}
    assert {"pool-a", "pool-a~sheddable", "pool-a~critical"} <= names
    r = _cli("envoy-bootstrap", "--group", str(tmp_path / "pool-a.yaml"), "--classes")
    assert r.returncode == 2 and "--classes is for one control plane" in r.stderr
