"""The fault matrix's traffic client (xds_server.testing.TrafficLoad): a connection reset before
any response byte is a failure, unless the load says resets are unaccepted connects (an Envoy
restart's closing listener), where it is retried and counted as refused."""
from __future__ import annotations

import asyncio
import socket
import struct

from xds_server.testing import TrafficLoad


async def _resetting_server() -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)  # the request reached the socket; no response byte goes back
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        writer.transport.abort()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _run(resets_as_refused: bool) -> tuple[int, int]:
    server, port = await _resetting_server()
    load = TrafficLoad(f"http://127.0.0.1:{port}", requests=1, streams=1, refused_retry_s=0.01,
                       resets_as_refused=resets_as_refused)
    try:
        await load.start()
        await asyncio.sleep(0.3)
    finally:
        await load.stop()
        server.close()
        await server.wait_closed()
    t = load.totals()
    return t.failed + t.cut, t.refused


async def test_a_reset_before_the_response_fails_unless_said_to_be_an_unaccepted_connect():
    failed, refused = await _run(False)
    assert failed > 0 and refused == 0
    failed, refused = await _run(True)
    assert failed == 0 and refused > 0
