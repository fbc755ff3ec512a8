"""The fault matrix's parts that run without processes: a fleet's replica configs (Fleet.replicas),
the blockable agent's arguments and block file, and FleetWatch's record of what it saw."""
from __future__ import annotations

from pathlib import Path

from xds_server.config import parse_config
from xds_server.testing import Fleet, NodeProcs
from xds_server.testing._blockable_agent import DEFAULT_BLOCK_S, _split, block_seconds
from xds_server.testing._fleet_watch import FleetWatch


def test_each_replica_has_its_own_id_ports_and_state_file_and_the_same_nodes(tmp_path: Path):
    fleet = Fleet(replicas=2, agents="dial-in", config_options={"state": {"path": str(tmp_path / "state.json")}})
    fleet.xds_ports, fleet.admin_ports = [20001, 20002], [20011, 20012]   # as start() picks them
    c0, c1 = fleet.config_dict(0), fleet.config_dict(1)
    assert (c0["xds"], c1["xds"]) == ({"listen": "127.0.0.1:20001", "replica_id": "cp-0"},
                                      {"listen": "127.0.0.1:20002", "replica_id": "cp-1"})
    assert (c0["admin"]["listen"], c1["admin"]["listen"]) == ("127.0.0.1:20011", "127.0.0.1:20012")
    assert c0["state"]["path"] == str(tmp_path / "state.json")
    assert c1["state"]["path"] == str(tmp_path / "state-cp-1.json")
    assert c0["clusters"] == c1["clusters"]
    assert c0["health"]["score"] == {"rtt_weight": 0}   # docs/replicas.md: RTT differs per replica
    parse_config(c1)
    assert fleet._meeting(NodeProcs("gpu-a", 1, 2)) == ["--control-plane", "127.0.0.1:20001,127.0.0.1:20002"]


def test_one_replica_keeps_the_config_it_always_had():
    fleet = Fleet(health={"score": {"rtt_weight": 0.5}})
    fleet.xds_ports, fleet.admin_ports = [20001], [20011]
    cfg = fleet.config_dict()
    assert cfg["xds"] == {"listen": "127.0.0.1:20001"}
    assert cfg["health"]["score"] == {"rtt_weight": 0.5}


def test_the_blockable_agent_takes_its_block_file_from_anywhere_and_passes_the_rest(tmp_path: Path):
    f = tmp_path / "block"
    assert _split(["--engine-url", "http://x", "--block-file", str(f), "--node-id", "a"]) == (
        f, ["--engine-url", "http://x", "--node-id", "a"])
    assert _split(["--node-id", "a"]) == (None, ["--node-id", "a"])
    assert block_seconds(None) == block_seconds(f) == DEFAULT_BLOCK_S   # absent: the default
    f.write_text("0.5\n")
    assert block_seconds(f) == 0.5
    f.write_text("soon")
    assert block_seconds(f) == DEFAULT_BLOCK_S


def test_fleet_watch_keeps_changes_and_answers_what_was_shown_when():
    w = FleetWatch(Fleet(), None, [])  # type: ignore[arg-type]  # no polling here
    for t, v in ((1.0, "HEALTHY"), (2.0, "HEALTHY"), (3.0, "UNHEALTHY"), (5.0, "HEALTHY")):
        w._saw("envoy", "gpu-a", v, t)
    w._saw("envoy", "gpu-b", "PROBATION", 1.0)
    w._saw("envoy", "gpu-b", "HEALTHY", 2.0)
    assert w.seen("envoy") == {"gpu-a": ["HEALTHY", "UNHEALTHY", "HEALTHY"], "gpu-b": ["PROBATION", "HEALTHY"]}
    assert w.left("envoy", "HEALTHY") == ["gpu-a"]       # gpu-b only came up: it never left
    assert w.first("envoy", "gpu-a", lambda s: s != "HEALTHY") == 3.0
    assert w.first("envoy", "gpu-a", lambda s: s == "HEALTHY", 3.0) == 5.0
    assert w.during("envoy", 3.5, 4.5) == {"gpu-a": ["UNHEALTHY"], "gpu-b": ["HEALTHY"]}
    assert w.during("envoy", 0.0, 2.5)["gpu-a"] == ["HEALTHY"]
