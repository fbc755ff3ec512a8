"""Switch-back replay edges: the agent's bounds, the control plane's checks of what
comes back (a hostile or confused agent over a real gRPC stream), and what an older agent does
with a ReplayRequest (the proto stubs from before the message, in a subprocess)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from node_probe.proto import probe_pb2, probe_pb2_grpc
from node_probe.replay import Replayer, ReplayLimits
from xds_server.probing.replay import ReplayExchange, check_result
from xds_server.process.counters import Counters

ROOT = Path(__file__).resolve().parents[2]


_SESSION = object()  # stands for the agent's HTTP session (never used: every case is refused first)


def _replayer(load=None, session=_SESSION) -> Replayer:
    async def model(_s):
        return "m"
    prober = SimpleNamespace(replay_model=model, adapter_kind="vllm")
    return Replayer("http://127.0.0.1:9", ReplayLimits(max_prompts=4, busy_max_waiting=2), "n1", lambda: session,
                    prober, lambda: load)


@pytest.mark.parametrize(("req", "load", "why"), [
    (probe_pb2.ReplayRequest(request_id="r", prompts=["a"] * 5), None, "too many prompts: 5 > 4"),
    (probe_pb2.ReplayRequest(request_id="", prompts=["a"]), None, "request_id must be 1..128 characters"),
    (probe_pb2.ReplayRequest(request_id="r", prompts=["a", ""]), None, "prompt 1 is empty"),
    (probe_pb2.ReplayRequest(request_id="r", prompts=["a"]),
     SimpleNamespace(requests_running=9.0, requests_waiting=3.0), "busy: engine queues 3 requests (> 2)"),
])
async def test_the_agent_refuses_a_replay_out_of_its_bounds(req, load, why):
    r = _replayer(load)
    res = await r.run(req)
    assert res.error.startswith(why) and not res.answers and res.node_id == "n1" and r.refused == 1


def test_check_result_names_what_is_wrong():
    req = probe_pb2.ReplayRequest(request_id="r1", prompts=["a", "b"], max_tokens=4)
    ok = probe_pb2.ReplayResult(request_id="r1", node_id="n1", answers=[probe_pb2.ReplayAnswer(token_ids=[1, 2])] * 2)
    assert check_result(ok, req, "n1", 100) == ""
    assert check_result(ok, req, "n2", 100) == "wrong_node"
    other = probe_pb2.ReplayResult(request_id="r0", node_id="n1")
    assert check_result(other, req, "n1", 100) == "unknown_request_id"
    more = probe_pb2.ReplayResult(request_id="r1", node_id="n1", answers=[probe_pb2.ReplayAnswer()] * 3)
    assert check_result(more, req, "n1", 100) == "larger_than_asked"
    ids = probe_pb2.ReplayResult(request_id="r1", node_id="n1", answers=[probe_pb2.ReplayAnswer(token_ids=[1] * 5)] * 2)
    assert check_result(ids, req, "n1", 100) == "larger_than_asked"
    text = probe_pb2.ReplayResult(request_id="r1", node_id="n1", answers=[probe_pb2.ReplayAnswer(text="x" * 101)] * 2)
    assert check_result(text, req, "n1", 100) == "larger_than_asked"
    refused = probe_pb2.ReplayResult(request_id="r1", node_id="n1", error="busy")
    assert check_result(refused, req, "n1", 100) == ""


class _Hostile(probe_pb2_grpc.NodeProbeServicer):
    """An agent that answers a replay with four wrong results, then (``honest``) the right one."""

    def __init__(self, honest: bool) -> None:
        self.honest = honest

    async def Watch(self, request_iterator, context):
        yield probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=1, node_id="n1", replay_max_prompts=4))
        async for msg in request_iterator:
            if msg.WhichOneof("msg") != "replay":
                continue
            req = msg.replay
            good = [probe_pb2.ReplayAnswer(token_ids=[1], text="a")] * len(req.prompts)
            for res in (probe_pb2.ReplayResult(request_id="stale", node_id="n1", answers=good),
                        probe_pb2.ReplayResult(request_id=req.request_id, node_id="n9", answers=good),
                        probe_pb2.ReplayResult(request_id=req.request_id, node_id="n1", answers=good * 2),
                        probe_pb2.ReplayResult(request_id=req.request_id, node_id="n1", answers=[
                            probe_pb2.ReplayAnswer(token_ids=[1] * 99)] * len(req.prompts))):
                yield probe_pb2.AgentMessage(replay_result=res)
            if self.honest:
                yield probe_pb2.AgentMessage(replay_result=probe_pb2.ReplayResult(
                    request_id=req.request_id, node_id="n1", answers=good))
            await asyncio.sleep(30)


@pytest.mark.parametrize("honest", [True, False])
async def test_wrong_replay_results_are_counted_and_ignored(honest):
    server = grpc.aio.server()
    probe_pb2_grpc.add_NodeProbeServicer_to_server(_Hostile(honest), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    counters = Counters()
    ex = ReplayExchange("n1", f"127.0.0.1:{port}", tls=None, counters=counters)
    try:
        assert await ex.open(2.0) == 4
        req = probe_pb2.ReplayRequest(request_id="r1", prompts=["p1", "p2"], max_tokens=8)
        loop = asyncio.get_running_loop()
        res = await ex.ask(req, 1000, loop.time() + 1.0)
    finally:
        await ex.close()
        await server.stop(None)
    assert {k: v for k, v in counters.bad_fields.items() if k[0] == "replay_result"} == {
        ("replay_result", "unknown_request_id"): 1, ("replay_result", "wrong_node"): 1,
        ("replay_result", "larger_than_asked"): 2}
    if honest:
        assert not isinstance(res, str) and len(res.answers) == 2 and res.node_id == "n1"
    else:
        assert res == "no replay result before the deadline"


def test_an_older_agent_ignores_a_replay_request():
    """The stubs from before ReplayRequest (git history) parse a new ControlMessage carrying one as
    a message with no known case (WhichOneof None, the bytes kept as an unknown field), which the
    agent's reader skips; and a new heartbeat parses on an old control plane with its fields intact."""
    old = subprocess.run(["git", "show", "6aa6418:node_probe/proto/probe_pb2.py"], cwd=ROOT,
                         capture_output=True, text=True)
    if old.returncode != 0:
        pytest.skip("git history not available")
    wire = probe_pb2.ControlMessage(replay=probe_pb2.ReplayRequest(request_id="r", prompts=["p"])).SerializeToString()
    hb = probe_pb2.AgentMessage(heartbeat=probe_pb2.Heartbeat(seq=7, node_id="n", replay_max_prompts=16))
    code = textwrap.dedent(f"""
        import sys, types
        src = {old.stdout!r}
        mod = types.ModuleType("old_probe_pb2")
        exec(compile(src, "old_probe_pb2.py", "exec"), mod.__dict__)
        m = mod.ControlMessage.FromString({wire!r})
        h = mod.AgentMessage.FromString({hb.SerializeToString()!r})
        print(m.WhichOneof("msg"), m.SerializeToString() == {wire!r}, h.WhichOneof("msg"), h.heartbeat.seq,
              h.heartbeat.node_id)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    which, kept, hkind, seq, node = out.stdout.split()
    assert which == "None" and kept == "True" and hkind == "heartbeat" and seq == "7" and node == "n"


async def test_an_engine_that_refuses_token_ids_is_replayed_by_text_and_tgi_is_not_advertised():
    from aiohttp import ClientSession, web

    from xds_server.testing import free_port

    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        if "return_token_ids" in body:
            return web.json_response({"error": "extra fields not permitted"}, status=400)
        return web.json_response({"choices": [{"text": " an answer", "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    async def model(_s):
        return None
    prober = SimpleNamespace(replay_model=model, adapter_kind="sglang")
    try:
        async with ClientSession() as session:
            r = Replayer(f"http://127.0.0.1:{port}", ReplayLimits(), "n1", lambda: session, prober, lambda: None)
            assert r.advertised == 16
            res = await r.run(probe_pb2.ReplayRequest(request_id="r", prompts=["a", "b"], max_tokens=4))
    finally:
        await runner.cleanup()
    assert not res.error and [a.text for a in res.answers] == [" an answer"] * 2
    assert all(not a.token_ids and a.finish_reason == "length" for a in res.answers)
    assert bodies[0]["temperature"] == 0 and bodies[0]["max_tokens"] == 4 and "model" not in bodies[0]
    assert 1 <= sum("return_token_ids" in b for b in bodies) <= 2  # (2 in flight) then text only
    prober.adapter_kind = "tgi"
    assert r.advertised == 0
