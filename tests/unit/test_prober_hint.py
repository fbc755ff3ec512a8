"""A node that cannot warm, the agent's side: a probe answered 404/405 by something that is not an
inference engine says so in its detail ("/v1/models answered 404: is --engine-url an inference
engine?"), which the control plane shows as the node's last failure. Real HTTP on 127.0.0.1."""
from __future__ import annotations

import aiohttp
from aiohttp import web

from node_probe.config import AgentConfig
from node_probe.prober import Prober
from node_probe.proto import probe_pb2
from xds_server.testing import free_port


async def _serve(status_by_path: dict[str, int]) -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.Response:
        status = status_by_path.get(request.path, 404)
        if status == 200:
            return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "someone"}]})
        return web.Response(status=status, text="nope")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _probe(url: str, **kw) -> object:
    prober = Prober(AgentConfig(engine_url=url, listen="127.0.0.1:0", gpu_interval_s=0, **kw))
    async with aiohttp.ClientSession() as s:
        return await prober.probe(s, deep=False)


async def test_a_server_answering_404_everywhere_gets_the_not_an_engine_hint_on_model_discovery():
    runner, url = await _serve({})
    try:
        out = await _probe(url)
    finally:
        await runner.cleanup()
    assert not out.ok and out.failure == probe_pb2.FAILURE_KIND_HTTP_STATUS and out.http_status == 404
    assert out.detail.startswith("/v1/models answered 404: is --engine-url an inference engine? "
                                 f"(model discovery: GET {url}/v1/models: HTTP 404")


async def test_a_405_on_the_completion_path_with_a_configured_model_names_the_model():
    runner, url = await _serve({"/v1/completions": 405})
    try:
        out = await _probe(url, model="llama")
    finally:
        await runner.cleanup()
    assert not out.ok and out.http_status == 405
    assert out.detail.startswith("/v1/completions answered 405: is --engine-url an inference engine serving "
                                 "--model llama? ")


async def test_a_503_of_a_loading_engine_gets_no_hint():
    runner, url = await _serve({"/v1/models": 200, "/v1/completions": 503})
    try:
        out = await _probe(url)
    finally:
        await runner.cleanup()
    assert not out.ok and out.http_status == 503 and "is --engine-url" not in out.detail
