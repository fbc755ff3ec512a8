"""The control plane's /metrics: base units, ``_total`` counters, one connected-streams gauge,
per-node probe results and ejections, build info, and the promtool rules (``promtool check
metrics`` when installed, else :func:`xds_server.testing.lint_exposition`)."""
from __future__ import annotations

import platform
import shutil
import subprocess

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_control_core import all_healthy, config, in_memory

from xds_server.admin.metrics import ControlPlaneCollector, package_version
from xds_server.health import model as hm
from xds_server.testing import lint_exposition


def exposition(cp) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControlPlaneCollector(cp.view))
    return generate_latest(reg).decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def promtool_problems(text: str) -> list[str]:
    """``promtool check metrics`` output lines when promtool is installed, else the same rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return lint_exposition(text)
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    out = (r.stdout + r.stderr).decode().strip()
    return [] if r.returncode == 0 else (out.splitlines() or [f"promtool exit {r.returncode}"])


def test_lint_catches_each_rule_it_names():
    bad = ("# HELP x_latency_ms latency\n# TYPE x_latency_ms gauge\nx_latency_ms 1.0\n"
           "# HELP x_hits hits\n# TYPE x_hits counter\nx_hits 3.0\n"
           "# TYPE x_nohelp gauge\nx_nohelp 1.0\n"
           "# HELP x_up_total up\n# TYPE x_up_total gauge\nx_up_total 1.0\n"
           "# HELP x_up_total up\n")
    problems = "\n".join(lint_exposition(bad))
    assert "x_latency_ms: use base units" in problems
    assert "x_hits: counter metrics should have '_total' suffix" in problems
    assert "x_nohelp: no help text" in problems
    assert "x_up_total: non-counter metrics should not have '_total' suffix" in problems
    assert "x_up_total: HELP given twice" in problems
    good = "# HELP x_latency_seconds latency\n# TYPE x_latency_seconds gauge\nx_latency_seconds 0.001\n"
    assert lint_exposition(good) == []


def test_metrics_are_in_base_units_with_probe_results_ejections_and_build_info():
    cp, clock, probes = in_memory(config())
    all_healthy(cp, clock, probes)
    probes["n1"].ping(rtt_ms=40.0)
    for _ in range(2):  # 2 consecutive probe failures eject (seed 001)
        probes["n1"].probe(kind=hm.ProbeResultKind.TIMEOUT)
        clock.advance(0.1)
    assert cp.health["n1"].state is hm.NodeState.UNHEALTHY
    probes["n2"].probe(ttft_ms=300.0)  # slow: 200-800 ms (seed 001)
    probes["n2"].probe(ttft_ms=900.0)  # a token after the 800 ms deadline: a timeout
    text = exposition(cp)
    m = samples(text)
    n1 = (("cluster", "llm"), ("node", "n1"))

    def key(name: str, **labels: str) -> tuple:
        return name, tuple(sorted({"cluster": "llm", "node": "n1", **labels}.items()))

    assert m[key("sentinel_node_probe_results_total", kind="OK", outcome="good")] == 20.0
    assert m[key("sentinel_node_probe_results_total", kind="TIMEOUT", outcome="fail")] == 2.0
    assert m[key("sentinel_node_ejections_total", cause="probe")] == 1.0
    assert m[key("sentinel_node_probe_results_total", node="n2", kind="OK", outcome="slow")] == 1.0
    assert m[key("sentinel_node_probe_results_total", node="n2", kind="TIMEOUT", outcome="fail")] == 1.0
    failures = sum(v for (name, labels), v in m.items() if name == "sentinel_node_probe_results_total"
                   and dict(labels)["outcome"] not in ("good", "slow"))
    assert failures == 3.0
    assert not any(name == "sentinel_node_ejections_total" and ("node", "n0") in labels for name, labels in m)
    assert m[("sentinel_node_last_ttft_seconds", (("cluster", "llm"), ("node", "n0")))] == 0.02
    assert 0.0 < m[("sentinel_node_ewma_rtt_seconds", n1)] <= 0.04
    assert m[("sentinel_build_info", (("python", platform.python_version()), ("version", package_version())))] == 1.0
    assert m[("sentinel_xds_connected_streams", (("variant", "sotw"),))] == 0.0
    assert m[("sentinel_xds_connected_streams", (("variant", "delta"),))] == 0.0
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "sentinel_xds_streams" not in names  # one gauge for connected streams, by variant
    assert not [n for n in names if n.endswith(("_ms", "_percent"))]
    assert promtool_problems(text) == []


def test_probe_worker_restarts_and_live_workers_are_exported():
    """``sentinel_probe_worker_restarts_total{worker}``, ``sentinel_probe_workers_live`` and
    ``_configured`` come from the control plane's WorkerPool (here one not started: no process
    runs, so none is live; the fleet test tests/integration/test_probe_workers_fleet.py kills
    a real worker); without workers both gauges are 0 and no worker has a restart count."""
    from xds_server.probing.workers import WorkerPool

    cp, clock, _ = in_memory(config())
    m = samples(exposition(cp))
    assert m[("sentinel_probe_workers_live", ())] == 0.0 and m[("sentinel_probe_workers_configured", ())] == 0.0
    assert not any(n == "sentinel_probe_worker_restarts_total" for n, _ in m)
    cp.view.probe_pool = WorkerPool(2, lambda: cp.core, clock, cp.counters)
    cp.view.probe_pool.handles[1].restarts = 3
    text = exposition(cp)
    m = samples(text)
    assert m[("sentinel_probe_worker_restarts_total", (("worker", "0"),))] == 0.0
    assert m[("sentinel_probe_worker_restarts_total", (("worker", "1"),))] == 3.0
    assert m[("sentinel_probe_workers_live", ())] == 0.0
    assert m[("sentinel_probe_workers_configured", ())] == 2.0
    assert promtool_problems(text) == []
