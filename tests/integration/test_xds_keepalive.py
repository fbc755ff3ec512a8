"""Our keepalive on the xDS port (xds.keepalive.time / keepalive_timeout_ms): the stream of an
ADS client whose process freezes (SIGSTOP: no FIN, no RST, the kernel still ACKs) is closed by
the server when a ping goes unanswered, so /xds/clients and the stream gauges stop counting it."""
from __future__ import annotations

import sys
import textwrap
import time

import aiohttp

from xds_server.config import parse_config
from xds_server.server import ControlPlane
from xds_server.testing import ManagedProcess, wait_for

# A SotW ADS client in its own process (so it can be frozen): one CDS request, then it waits.
CLIENT = textwrap.dedent("""
    import asyncio, sys
    from xds_server.testing import ScriptedAdsClient
    from xds_server.xds.resources import CLUSTER_TYPE_URL

    async def main():
        c = ScriptedAdsClient(sys.argv[1])
        await c.open()
        await c.send(type_url=CLUSTER_TYPE_URL, node_id="frozen-envoy")
        print("subscribed", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def test_stream_of_a_frozen_ads_client_is_closed_by_our_keepalive(tmp_path):
    cp = ControlPlane(parse_config({
        "xds": {"listen": "127.0.0.1:0", "warmup_timeout_ms": 0, "keepalive_time_ms": 1000,
                "keepalive_timeout_ms": 1000},
        "admin": {"listen": "127.0.0.1:0"},
        "clusters": [{"name": "llm", "nodes": [{"id": "a", "address": "127.0.0.1:8001",
                                                 "probe_address": "127.0.0.1:1"}]}]}))
    await cp.start()
    client = ManagedProcess("ads-client", [sys.executable, "-c", CLIENT, f"127.0.0.1:{cp.xds_port}"],
                            tmp_path / "client.log", ready_pattern="subscribed")
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{cp.admin_port}") as http:
            async def clients() -> list[str]:
                async with http.get("/xds/clients") as r:
                    return [c["node_id"] for c in (await r.json())["clients"]]

            client.start()
            # the stream is listed as soon as it opens, its node id once the first request is read
            await wait_for(lambda: _only(clients, "frozen-envoy"), timeout_s=10.0)
            t0 = time.monotonic()
            client.freeze()
            await wait_for(lambda: _none(clients), timeout_s=10.0, step_s=0.05)
            closed_s = time.monotonic() - t0
    finally:
        client.stop()
        await cp.stop()
    # a ping within 1 s of the freeze, unanswered for 1 s (without grpc.http2.ping_timeout_ms:
    # open until the client wakes)
    assert closed_s <= 3.0, closed_s


async def _none(clients) -> bool:
    return await clients() == []


async def _only(clients, node_id: str) -> bool:
    return await clients() == [node_id]
