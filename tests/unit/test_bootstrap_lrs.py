"""The rendered bootstrap's load reporting (cluster_manager.load_stats_config) and the 429 +
Retry-After mapper for requests dropped for overload; each rendering validated by the real Envoy."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from xds_server.config import ClusterConfig, NodeConfig
from xds_server.envoy.bootstrap import ControlPlaneGroup, find_envoy, render_bootstrap, write_bootstrap


def _validate(path: Path) -> None:
    r = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def _hcm(doc: dict) -> dict:
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_lrs_on_by_default_to_the_control_plane_and_off_on_request(tmp_path):
    doc = render_bootstrap(xds_port=18001, listener_port=10001, admin_port=9902, shed_retry_after_s=5)
    lsc = doc["cluster_manager"]["load_stats_config"]
    assert lsc["api_type"] == "GRPC" and lsc["grpc_services"][0]["envoy_grpc"]["cluster_name"] == "xds_cluster"
    mapper = _hcm(doc)["local_reply_config"]["mappers"][0]
    assert mapper["filter"]["response_flag_filter"]["flags"] == ["DO", "UDO", "UO"] and mapper["status_code"] == 429
    assert mapper["headers_to_add"][0]["header"] == {"key": "retry-after", "value": "5"}
    _validate(write_bootstrap(tmp_path / "on.yaml", doc))
    off = render_bootstrap(xds_port=18001, listener_port=10001, admin_port=9902, lrs=False)
    assert "load_stats_config" not in off.get("cluster_manager", {})
    _validate(write_bootstrap(tmp_path / "off.yaml", off))
    with pytest.raises(ValueError, match="shed_retry_after_s must be a whole number"):
        render_bootstrap(xds_port=1, listener_port=2, admin_port=3, shed_retry_after_s=-1)


def test_split_control_planes_report_to_the_first_group(tmp_path):
    c = ClusterConfig(name="a", nodes=[NodeConfig(id="n1", address="127.0.0.1:9001", probe_address="127.0.0.1:9101")])
    d = ClusterConfig(name="b", nodes=[NodeConfig(id="n2", address="127.0.0.1:9002", probe_address="127.0.0.1:9102")])
    doc = render_bootstrap(listener_port=10001, admin_port=9902, groups=[
        ControlPlaneGroup("one", ("127.0.0.1:18001",), (c,)), ControlPlaneGroup("two", ("127.0.0.1:18002",), (d,))])
    assert doc["cluster_manager"]["load_stats_config"]["grpc_services"][0]["envoy_grpc"]["cluster_name"] == "xds_one"
    _validate(write_bootstrap(tmp_path / "split.yaml", doc))
