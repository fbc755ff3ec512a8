"""Switch-back validation with real agents, real simulated engines (processes:
an engine restarts with another model) and the control plane; no Envoy (the claim is the health
model's verdict, what /nodes and /events show; routing of UNHEALTHY nodes is covered elsewhere).

One fleet, four nodes of one cluster: n1 and n2 come up first (each other's only candidate peer,
so they are validated by probes alone and say so); n3 (candidate) and n4 (an agent that does not
replay: what an older agent advertises) come up once n1 and n2 are HEALTHY. n3 answers like its
peers and passes; n4 passes on probes and says so; then n3's engine restarts serving another model
(``--model-seed``): its probes succeed, the replay diverges from token 0, it is sent back to
UNHEALTHY with the evidence, and /nodes shows the peers' noise (they agree to the last token).
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest

from node_probe.agent import AgentConfig, ProbeAgent
from node_probe.replay import ReplayLimits
from xds_server.config import parse_config
from xds_server.process.tls import dial
from xds_server.proto import routing_pb2, routing_pb2_grpc
from xds_server.server import ControlPlane
from xds_server.testing import ManagedProcess, free_port, wait_for

MAX_TOKENS = 16


def _engine(workdir: Path, name: str, port: int, seed: int) -> ManagedProcess:
    return ManagedProcess(f"engine-{name}", [sys.executable, "-m", "node_probe.cli", "sim-engine", "--port", str(port),
                                             "--replica-id", name, "--token-interval-ms", "1",
                                             "--model-seed", str(seed)],
                          workdir / f"engine-{name}-{seed}.log", ready_pattern="listening")


@pytest.fixture
async def rig(tmp_path):
    workdir = tmp_path
    ports = {n: free_port() for n in ("n1", "n2", "n3", "n4")}
    engines: dict[str, ManagedProcess] = {}
    agents: dict[str, ProbeAgent] = {}
    cp = None
    http = None
    try:
        for nid, e in zip(("n1", "n2"), await asyncio.gather(
                *(asyncio.to_thread(_engine(workdir, n, ports[n], 0).start) for n in ("n1", "n2"))), strict=True):
            engines[nid] = e
        nodes = []
        for nid, port in ports.items():
            agent = ProbeAgent(AgentConfig(
                engine_url=f"http://127.0.0.1:{port}", listen="127.0.0.1:0", node_id=nid, gpu_interval_s=0,
                probe_interval_s=0.3, probe_idle_interval_s=0.2, min_probe_now_interval_ms=100, probe_timeout_ms=3000,
                replay=ReplayLimits(max_prompts=0 if nid == "n4" else 16)))
            aport = await agent.start()
            nodes.append({"id": nid, "address": f"127.0.0.1:{port}", "probe_address": f"127.0.0.1:{aport}"})
            agents[nid] = agent
        cp = ControlPlane(parse_config({
            "xds": {"listen": "127.0.0.1:0"}, "admin": {"listen": "127.0.0.1:0"},
            "health": {"ping_interval_ms": 200, "ramp_step_percent": 50, "ramp_step_s": 0.2, "probation_clean_s": 1.0,
                       "probation_min_probes": 2, "ttft_healthy_ms": 1000, "ttft_timeout_ms": 3000,  # (CI load)
                       "validation": {"enabled": True, "max_tokens": MAX_TOKENS, "check_interval_s": 0.1,
                                      "retry_s": 0.5, "timeout_s": 5.0, "live_prompts": {"enabled": True}}},
            "clusters": [{"name": "llm", "nodes": nodes}]}))
        await cp.start()
        http = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{cp.admin_port}")
        yield cp, http, engines, ports, workdir
    finally:
        if http is not None:
            await http.close()
        if cp is not None:
            await cp.stop()
        for a in agents.values():
            await a.stop()
        for e in engines.values():
            e.stop()


async def _node(http: aiohttp.ClientSession, nid: str) -> dict:
    async with http.get("/nodes") as r:
        return next(n for n in (await r.json())["nodes"] if n["id"] == nid)


async def _gone(http: aiohttp.ClientSession, nid: str) -> bool:
    return (await _node(http, nid))["health_state"] != "HEALTHY"


async def test_switchback_keeps_out_a_node_that_answers_unlike_its_peers(rig):
    cp, http, engines, ports, workdir = rig

    async def healthy(nid: str):
        n = await _node(http, nid)
        return n if n["health_state"] == "HEALTHY" else None

    # n1 and n2 return together: neither has two healthy peers, so probes alone decide (said).
    n1 = await wait_for(lambda: healthy("n1"), 15, what="n1 HEALTHY")
    await wait_for(lambda: healthy("n2"), 5, what="n2 HEALTHY")
    assert n1["validation"]["verdict"] == "probes only"
    assert "healthy peer(s) in cluster llm that replay, 2 needed: validated by probes alone" in n1["reason"]

    # n3 (answers like its peers) and n4 (its agent does not replay) come up now.
    # (process starts and stops off the event loop: a blocked loop would look like lost heartbeats)
    engines["n3"], engines["n4"] = await asyncio.gather(
        *(asyncio.to_thread(_engine(workdir, n, ports[n], 0).start) for n in ("n3", "n4")))
    n3 = await wait_for(lambda: healthy("n3"), 15, what="n3 HEALTHY")
    assert n3["validation"]["verdict"] == "passed", n3["validation"]
    assert "switch-back validated: answers like its peers on 8 of 8 prompts" in n3["reason"]
    last = n3["validation"]["last"]
    assert sorted(last["peers"]) == ["n1", "n2"] and last["within"] == 8
    assert last["peers_noise"] == {"agreement_tokens": MAX_TOKENS, "similarity": 1.0, "cosine": None}
    n4 = await wait_for(lambda: healthy("n4"), 15, what="n4 HEALTHY")
    assert n4["validation"]["verdict"] == "probes only"
    assert "its agent does not replay (replay_max_prompts 0" in n4["reason"]

    # A relay submits live prompts (health.validation.live_prompts): half of the next replay's
    # 8 prompts are drawn from them; only their count is shown, never their text.
    async with dial(f"127.0.0.1:{cp.xds_port}") as ch:
        ack = await routing_pb2_grpc.RoutingFeedStub(ch).SubmitPrompts(routing_pb2.PromptSample(
            subscriber_id="relay", prompts=[routing_pb2.SampledPrompt(cluster="llm", prompt=f"live-secret {i}:")
                                            for i in range(4)]))
    assert (ack.accepted, ack.refused) == (4, 0)

    # n3's engine restarts serving another model: probes still succeed, the replay diverges. The
    # new one starts once the control plane has seen the old one gone, as a real engine loading a
    # model takes seconds to (docs/switchback.md: a replacement faster than the agent's heartbeat
    # can go unseen).
    await asyncio.to_thread(engines["n3"].stop)
    await wait_for(lambda: _gone(http, "n3"), 20, what="n3 out once its engine stopped")
    engines["n3"] = await asyncio.to_thread(_engine(workdir, "n3", ports["n3"], 7).start)

    async def kept_out():
        n = await _node(http, "n3")
        v = n["validation"] or {}
        return n if n["health_state"] == "UNHEALTHY" and v.get("verdict") == "failed" else None

    n3 = await wait_for(kept_out, 20, what="n3 failed switch-back validation")
    assert n3["reason"].startswith(f"switch-back: diverges from peers at token 0 of {MAX_TOKENS} on 8 of 8 prompts")
    assert f"peers agree to token {MAX_TOKENS} of {MAX_TOKENS}, similarity 1.00" in n3["reason"]
    assert "similarity 1.00; 4 of 8 prompts sampled live; failed in PROBATION" in n3["reason"]
    assert n3["validation"]["last"]["live_prompts"] == 4
    assert n3["last_probe"] == "OK" and n3["engine_state"] == "READY"  # probes succeed; the answers differ
    last = n3["validation"]["last"]
    assert last["within"] == 0 and last["candidate_vs_peers"]["agreement_tokens"] == 0
    assert last["peers_noise"]["agreement_tokens"] == MAX_TOKENS and last["peers_noise"]["similarity"] == 1.0
    assert n3["eds_health_status"] != "HEALTHY" and cp.core.routing["n3"].health_status != "HEALTHY"
    assert cp.counters.ejections[("n3", "validation")] == 1
    async with http.get("/events", params={"limit": "200"}) as r:
        events = (await r.json())["events"]
    verdicts = [e["reason"].split(":")[0] for e in events if e["kind"] == "switchback_validation"
                and e["node"] == "n3" and not e["reason"].startswith("switch-back validation could not run")]
    assert verdicts[-2:] == ["passed", "failed"]
    async with http.get("/nodes") as r:
        assert "live-secret" not in await r.text() and "live-secret" not in str(events)
    # the peers were never disturbed
    assert (await _node(http, "n1"))["health_state"] == "HEALTHY"
    assert (await _node(http, "n2"))["health_state"] == "HEALTHY"
