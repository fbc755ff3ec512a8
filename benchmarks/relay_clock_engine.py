"""A minimal vLLM-shaped SSE server for the relay cost benchmark: every chunk carries the
monotonic time it was written (``"t": ns``), so a client on the same host measures each chunk's
delivery latency. Run: ``python benchmarks/relay_clock_engine.py PORT INTERVAL_MS``."""
from __future__ import annotations

import asyncio
import sys
import time

from aiohttp import web


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens", 16))
    interval = request.app["interval_s"]
    resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                       "x-sentinel-upstream-host": request.host})
    await resp.prepare(request)
    base = ('{"id":"cmpl-bench","object":"text_completion","created":1,"model":"m","choices":'
            '[{"index":0,"text":" tok","logprobs":null,"finish_reason":%s,"stop_reason":null,'
            '"prompt_token_ids":null,"token_ids":[%d]}],"t":%d}')
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(n):
        # on a fixed schedule (no drift), like a decode loop
        delay = start + (i + 1) * interval - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        fin = '"length"' if i == n - 1 else "null"
        await resp.write(b"data: " + (base % (fin, 100 + i, time.monotonic_ns())).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def serve(port: int, interval_ms: float) -> None:
    app = web.Application()
    app["interval_s"] = interval_ms / 1000
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"clock engine listening on {port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    asyncio.run(serve(int(sys.argv[1]), float(sys.argv[2])))


if __name__ == "__main__":
    main()
