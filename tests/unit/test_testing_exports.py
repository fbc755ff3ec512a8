"""The public surface of ``xds_server.testing``: exactly the curated names, nothing leaked from
the private modules, nothing dropped by accident (as httpx's tests/test_exported_members.py)."""
from __future__ import annotations

import xds_server.testing as testing

#: The names users' tests may import. Adding one is a decision; removing one breaks users.
PUBLIC = {
    "CertPair", "EnvoyHost", "Fleet", "InMemoryProbeSource", "InMemoryProbes", "LoadGenerator", "LoadStats",
    "ManagedProcess", "ManualClock", "NodeProcs",
    "ScriptedAdsClient", "ScriptedDeltaAdsClient", "StandaloneEnvoy", "TestCA", "fetch_envoy_hosts",
    "free_port", "lint_exposition", "parse_envoy_clusters", "parse_envoy_stats", "restart_control_plane", "wait_for",
    # the fault matrix: its rig, rows, traffic and one coroutine per fault
    "FaultRig", "FaultRow", "TrafficLoad", "TrafficStats", "ads_stream_churn", "agent_kill_restart",
    "cp_kill_restart", "cp_sigstop", "engine_kill_restart", "envoy_restart", "format_table", "slow_ads_reader",
    # dial-in rows: CPU burners, a hung agent loop, a control-plane replica killed
    "agent_loop_block", "cpu_burners", "replica_kill",
    # CPU time from /proc, for benchmarks and rigs
    "ProcCpu", "process_cpu_s", "threads_cpu_s",
}


def test_all_is_exactly_the_public_surface():
    assert testing.__all__ == sorted(testing.__all__)
    assert set(testing.__all__) == PUBLIC


def test_nothing_else_leaks():
    public_vars = {name for name in vars(testing) if not name.startswith("_")}
    assert public_vars == PUBLIC


#: Seams whose one home is the control plane; the testing package only re-exports them.
REEXPORTED = {"InMemoryProbeSource": "xds_server.probing.memory", "InMemoryProbes": "xds_server.probing.memory",
              "ManualClock": "xds_server.process.clock"}


def test_each_name_lives_in_a_private_module_or_is_a_named_reexport():
    for name in PUBLIC:
        module = getattr(testing, name).__module__
        if name in REEXPORTED:
            assert module == REEXPORTED[name], (name, module)
        else:
            assert module.startswith("xds_server.testing._"), (name, module)
