"""The agent's own /metrics (``--metrics-listen``): probe results and TTFT, engine scrapes and
their errors, the stall flag and engine state, GPU readings from (fake) NVML telemetry; the
exposition passes the promtool rules. Real agent, real HTTP, fake engine and fake NVML."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from test_agent import FakeGpuCollector, engine, make_agent  # noqa: F401 - fixtures
from test_metrics_exposition import promtool_problems

from node_probe.agent import AgentConfig
from xds_server.testing import free_port, wait_for


async def scrape(port: int) -> tuple[str, dict]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    smps = [smp for f in text_string_to_metric_families(text) for smp in f.samples]
    # every series names its node (dashboards join on it); no _created samples
    assert {smp.labels.get("node") for smp in smps} == {"node-a"}
    assert not [smp.name for smp in smps if smp.name.endswith("_created")]
    return text, {(smp.name, tuple(sorted((k, v) for k, v in smp.labels.items() if k != "node"))): smp.value
                  for smp in smps}


async def test_agent_serves_probe_scrape_stall_and_gpu_metrics(engine, make_agent):  # noqa: F811 - fixtures imported above
    agent, _ = await make_agent(engine.url, gpu=FakeGpuCollector(), metrics_listen="127.0.0.1:0",
                                probe_idle_interval_s=0.1, probe_interval_s=0.2)
    assert agent.metrics_port
    ok = ("node_probe_probes_total", (("result", "ok"),))

    async def probed():
        text, m = await scrape(agent.metrics_port)
        return (text, m) if m.get(ok, 0) >= 2 and ("node_probe_gpu_memory_used_bytes", (("gpu", "0"),)) in m \
            else None

    text, m = await wait_for(probed, timeout_s=10, step_s=0.1, what="2 probes and a GPU reading")
    assert m[("node_probe_probe_ttft_seconds_count", ())] == m[ok]
    assert 0 < m[("node_probe_probe_ttft_seconds_sum", ())] < 0.8 * m[ok]
    assert m[("node_probe_probes_total", (("result", "TIMEOUT"),))] == 0
    assert m[("node_probe_metrics_scrapes_total", ())] >= 1
    assert m[("node_probe_metrics_scrape_errors_total", ())] == 0
    assert m[("node_probe_engine_stalled", ())] == 0
    assert m[("node_probe_engine_state", (("state", "READY"),))] == 1
    assert m[("node_probe_engine_state", (("state", "COLD"),))] == 0
    assert m[("node_probe_gpu_memory_total_bytes", (("gpu", "0"),))] == 100
    assert m[("node_probe_gpu_memory_used_bytes", (("gpu", "0"),))] == 40
    assert m[("node_probe_nvml_state", (("state", "OK"),))] == 1
    assert any(name == "node_probe_build_info" for name, _ in m)
    assert promtool_problems(text) == []

    engine.mode = "fatal"  # the next probe is an ENGINE_FATAL failure, counted by kind
    fatal = ("node_probe_probes_total", (("result", "ENGINE_FATAL"),))
    await wait_for(lambda: _value(agent.metrics_port, fatal), timeout_s=10, step_s=0.1, what="ENGINE_FATAL counted")


async def test_agent_counts_engine_metrics_scrape_errors(engine, make_agent):  # noqa: F811 - fixtures imported above
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    agent, _ = await make_agent(engine.url, metrics_url=dead, metrics_listen="127.0.0.1:0")
    errors = ("node_probe_metrics_scrape_errors_total", ())
    n = await wait_for(lambda: _value(agent.metrics_port, errors, at_least=3), timeout_s=10, step_s=0.1,
                       what="scrape errors counted")
    _, m = await scrape(agent.metrics_port)
    assert m[("node_probe_metrics_scrapes_total", ())] >= n >= 3


async def test_metrics_listen_off_by_default_and_validated(engine, make_agent):  # noqa: F811 - fixtures imported above
    agent, _ = await make_agent(engine.url)
    assert agent.metrics_port is None
    import pytest
    with pytest.raises(ValueError, match="metrics_listen"):
        AgentConfig(engine_url=engine.url, metrics_listen="nowhere")


async def _value(port: int, key: tuple, at_least: float = 1) -> float | None:
    _, m = await scrape(port)
    v = m.get(key, 0)
    return v if v >= at_least else None


async def test_agent_healthz_answers_while_the_engine_is_down(make_agent):  # noqa: F811 - fixtures imported above
    """The containers' liveness URL (Dockerfile HEALTHCHECK, deploy/kubernetes) is the agent's
    own: it answers 200 although its engine cannot be reached (the agent reports that state)."""
    dead = f"http://127.0.0.1:{free_port()}"
    agent, _ = await make_agent(dead, metrics_listen="127.0.0.1:0", engine_kind="vllm")
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{agent.metrics_port}/healthz") as r:
        assert r.status == 200
        assert await r.json() == {"status": "ok"}
