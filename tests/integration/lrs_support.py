"""What the LRS tests send: a short closed-loop load through each Envoy, counted per node."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

from xds_server.testing import LoadGenerator


async def send_counted(urls: Iterable[str], seconds: float = 1.5) -> dict[str, int]:
    """Run 2 clients of 2-token requests through each Envoy URL for ``seconds``; return the
    requests answered 200 per node (``x-served-by``), summed over the URLs. AssertionError when
    any request failed or a URL got no answer."""
    gens = [LoadGenerator(u, concurrency=2, max_tokens=2) for u in urls]
    for g in gens:
        await g.start()
    await asyncio.sleep(seconds)
    for g in gens:
        await g.stop()
    sent: dict[str, int] = {}
    for g in gens:
        t = g.totals()
        assert t.failed == 0, dict(t.failures)
        assert t.ok > 0
        for node, n in t.ok_by_node.items():
            sent[node] = sent.get(node, 0) + n
    return sent
